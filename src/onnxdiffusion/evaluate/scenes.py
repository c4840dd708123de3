"""The project's own captioned image world: 64x64 scenes of one or two named objects.

Everything here is deterministic in its seed and uses numpy and Pillow only, so evaluation
can draw "real" images at run time without torch. The embedded model is trained on it and
the judge learns to read it back.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageDraw

IMAGE_SIZE = 64
SHAPES = ("circle", "square", "triangle", "star", "ring")
COLOURS = {
    "red": (225, 35, 35),
    "green": (40, 185, 60),
    "blue": (45, 90, 235),
    "yellow": (240, 220, 40),
    "purple": (160, 60, 210),
    "white": (245, 245, 245),
}
COLOUR_NAMES = tuple(COLOURS)
# Slot centres double as the judge's output layout: one prediction head per slot.
POSITIONS = {
    "left": (16, 32),
    "right": (48, 32),
    "top": (32, 16),
    "bottom": (32, 48),
    "centre": (32, 32),
}
POSITION_NAMES = tuple(POSITIONS)
SIZES = {"small": 7.0, "large": 11.0}
SIZE_NAMES = tuple(SIZES)
LAYOUTS = {"horizontal": ("left", "right"), "vertical": ("top", "bottom")}
# Dark, low-saturation backgrounds so that every object colour stays legible.
BACKGROUNDS = (
    (20, 20, 24),
    (48, 48, 52),
    (24, 30, 58),
    (58, 38, 28),
    (26, 52, 40),
    (80, 80, 86),
)

_POS_PHRASES = {
    "left": ("on the left", "at the left", "to the left"),
    "right": ("on the right", "at the right", "to the right"),
    "top": ("at the top", "near the top", "up top"),
    "bottom": ("at the bottom", "near the bottom", "down below"),
    "centre": ("in the centre", "in the middle", "at the center"),
}
_RELATIONS = {
    "horizontal": (("left of", False), ("right of", True)),
    "vertical": (("above", False), ("below", True)),
}

SPLITS = ("train", "heldout", "calib")


@dataclass(frozen=True)
class SceneObject:
    shape: str
    colour: str
    position: str
    size: str


@dataclass(frozen=True)
class Scene:
    objects: tuple[SceneObject, ...]
    background: tuple[int, int, int]
    background2: tuple[int, int, int] | None = None  # two-tone when set
    split_vertical: bool = False
    jitter: tuple[tuple[int, int], ...] = field(default=())
    caption: str = ""
    size_in_caption: bool = True

    @property
    def composition(self) -> str:
        return composition_key(self.objects)


def composition_key(objects: tuple[SceneObject, ...] | list[SceneObject]) -> str:
    """The identity that splits are made on: shapes, colours and positions, not size or seed."""
    return "|".join(f"{o.colour}-{o.shape}-{o.position}" for o in objects)


def composition_split(key: str) -> str:
    """Fixed, seed-independent assignment of each composition to train / heldout / calib."""
    h = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % 100
    if h < 15:
        return "heldout"
    if h < 25:
        return "calib"
    return "train"


def _objects_for(rng: np.random.Generator, split: str) -> tuple[SceneObject, ...]:
    while True:
        if rng.random() < 0.5:
            objs = (
                SceneObject(
                    SHAPES[rng.integers(len(SHAPES))],
                    COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))],
                    POSITION_NAMES[rng.integers(len(POSITION_NAMES))],
                    SIZE_NAMES[rng.integers(len(SIZE_NAMES))],
                ),
            )
        else:
            layout = ("horizontal", "vertical")[rng.integers(2)]
            objs = tuple(
                SceneObject(
                    SHAPES[rng.integers(len(SHAPES))],
                    COLOUR_NAMES[rng.integers(len(COLOUR_NAMES))],
                    pos,
                    SIZE_NAMES[rng.integers(len(SIZE_NAMES))],
                )
                for pos in LAYOUTS[layout]
            )
            if (objs[0].shape, objs[0].colour) == (objs[1].shape, objs[1].colour):
                continue
        if composition_split(composition_key(objs)) == split:
            return objs


def caption_for(objects: tuple[SceneObject, ...], rng: np.random.Generator, with_size: bool) -> str:
    def noun(o: SceneObject, size: bool) -> str:
        return f"{o.size} {o.colour} {o.shape}" if size else f"{o.colour} {o.shape}"

    if len(objects) == 1:
        o = objects[0]
        phrase = _POS_PHRASES[o.position][rng.integers(3)]
        template = rng.integers(3)
        if template == 0:
            return f"a {noun(o, with_size)} {phrase}"
        if template == 1:
            return f"{phrase}, a {noun(o, with_size)}"
        return f"one {noun(o, with_size)} {phrase}"
    a, b = objects
    layout = "horizontal" if a.position == "left" else "vertical"
    (rel, swapped) = _RELATIONS[layout][rng.integers(2)]
    first, second = (b, a) if swapped else (a, b)
    return f"a {noun(first, with_size)} {rel} a {noun(second, with_size)}"


def caption_without_position(scene: Scene) -> str:
    """The scene's caption with every position and relation word left out.

    Two objects are listed in shape/colour order, not left-to-right, so word order says nothing
    about place either; size words stay exactly when the scene's own caption has them. Only
    words of vocabulary() (and a comma) are used, since the tokenizer knows nothing else.
    """
    def noun(o: SceneObject) -> str:
        return f"{o.size} {o.colour} {o.shape}" if scene.size_in_caption else f"{o.colour} {o.shape}"

    objs = sorted(scene.objects, key=lambda o: (o.shape, o.colour, o.size))
    return ", ".join(f"a {noun(o)}" for o in objs)


def sample_scene(seed: int, split: str = "train") -> Scene:
    """One scene of the given split, fully determined by its seed."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    objects = _objects_for(rng, split)
    bg = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    bg2 = None
    if rng.random() < 0.4:
        bg2 = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
        if bg2 == bg:
            bg2 = None
    jitter = tuple((int(rng.integers(-3, 4)), int(rng.integers(-3, 4))) for _ in objects)
    with_size = bool(rng.random() < 0.6)
    return Scene(
        objects=objects,
        background=bg,
        background2=bg2,
        split_vertical=bool(rng.random() < 0.5),
        jitter=jitter,
        caption=caption_for(objects, rng, with_size),
        size_in_caption=with_size,
    )


def _star(cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    pts = []
    for k in range(10):
        ang = -np.pi / 2 + k * np.pi / 5
        rr = r if k % 2 == 0 else r * 0.45
        pts.append((cx + rr * np.cos(ang), cy + rr * np.sin(ang)))
    return pts


def _object_mask(obj: SceneObject, jitter: tuple[int, int], s: int) -> Image.Image:
    """The object's silhouette, 255 inside, at `s` times the image size (a ring keeps its hole)."""
    n = IMAGE_SIZE * s
    cx, cy = POSITIONS[obj.position]
    cx, cy, r = (cx + jitter[0]) * s, (cy + jitter[1]) * s, SIZES[obj.size] * s
    mask = Image.new("L", (n, n), 0)
    m = ImageDraw.Draw(mask)
    if obj.shape == "circle":
        m.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
    elif obj.shape == "square":
        h = r * 0.85
        m.rectangle((cx - h, cy - h, cx + h, cy + h), fill=255)
    elif obj.shape == "triangle":
        m.polygon(
            [(cx, cy - r), (cx + r * 0.95, cy + r * 0.75), (cx - r * 0.95, cy + r * 0.75)],
            fill=255,
        )
    elif obj.shape == "star":
        m.polygon(_star(cx, cy, r * 1.1), fill=255)
    elif obj.shape == "ring":
        m.ellipse((cx - r, cy - r, cx + r, cy + r), fill=255)
        ri = r * 0.5
        m.ellipse((cx - ri, cy - ri, cx + ri, cy + ri), fill=0)
    else:  # pragma: no cover - guarded by SHAPES
        raise ValueError(f"unknown shape {obj.shape!r}")
    return mask


def _jitters(scene: Scene) -> tuple[tuple[int, int], ...]:
    return scene.jitter or ((0, 0),) * len(scene.objects)


def render(scene: Scene, supersample: int = 4) -> np.ndarray:
    """HxWx3 uint8 image of a scene (drawn large and downsampled for anti-aliasing)."""
    s = supersample
    n = IMAGE_SIZE * s
    img = Image.new("RGB", (n, n), scene.background)
    draw = ImageDraw.Draw(img)
    if scene.background2 is not None:
        box = (n // 2, 0, n, n) if scene.split_vertical else (0, n // 2, n, n)
        draw.rectangle(box, fill=scene.background2)
    for obj, jit in zip(scene.objects, _jitters(scene)):
        # Paste through the mask so a ring's hole shows whatever background lies beneath it.
        img.paste(COLOURS[obj.colour], (0, 0, n, n), _object_mask(obj, jit, s))
    img = img.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.uint8)


def render_condition(scene: Scene, supersample: int = 4) -> np.ndarray:
    """HxWx3 uint8 ControlNet condition: every object's silhouette in white on black.

    It fixes where each object sits, its size and its shape, and leaves colour and background to
    the prompt; the same anti-aliased masks as render(), so condition and picture line up.
    """
    n = IMAGE_SIZE * supersample
    canvas = Image.new("L", (n, n), 0)
    for obj, jit in zip(scene.objects, _jitters(scene)):
        canvas.paste(255, (0, 0, n, n), _object_mask(obj, jit, supersample))
    canvas = canvas.resize((IMAGE_SIZE, IMAGE_SIZE), Image.Resampling.BOX)
    return np.repeat(np.asarray(canvas, dtype=np.uint8)[:, :, None], 3, axis=2)


def slot_labels(scene: Scene) -> dict[str, np.ndarray]:
    """Per-slot class targets for the judge: 0 = empty, k+1 = the k-th name."""
    shape = np.zeros(len(POSITION_NAMES), np.int64)
    colour = np.zeros(len(POSITION_NAMES), np.int64)
    size = np.zeros(len(POSITION_NAMES), np.int64)
    for o in scene.objects:
        j = POSITION_NAMES.index(o.position)
        shape[j] = SHAPES.index(o.shape) + 1
        colour[j] = COLOUR_NAMES.index(o.colour) + 1
        size[j] = SIZE_NAMES.index(o.size) + 1
    return {"shape": shape, "colour": colour, "size": size}


def scenes(split: str, count: int, start: int = 0) -> list[Scene]:
    return [sample_scene(start + i, split) for i in range(count)]


def vocabulary() -> list[str]:
    """Every word a caption can contain (the tokenizer gives each one token)."""
    words: set[str] = {"a", "one"}
    words.update(SHAPES, COLOUR_NAMES, SIZE_NAMES)
    for phrases in _POS_PHRASES.values():
        for p in phrases:
            words.update(p.split())
    for rels in _RELATIONS.values():
        for rel, _ in rels:
            words.update(rel.split())
    return sorted(words)
