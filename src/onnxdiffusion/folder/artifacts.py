"""The model folder: manifest, component files, hashes, and atomic writes.

Layout (also loadable by optimum's ONNX Runtime diffusion pipeline):
  manifest.json, model_index.json, scheduler/, tokenizer/,
  text_encoder/model.onnx, <backbone>/model.onnx, vae_decoder/model.onnx, vae_encoder/model.onnx
(the backbone's folder is named by the model family: families/). `derive` writes one folder from another.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import interrupts
from . import tempfiles
from ..errors import UserError
from .manifest import FORMAT_VERSION, Component, Manifest, as_dict, check_relative, confined, manifest_bytes, typed

__all__ = ["FORMAT_VERSION", "MANIFEST", "atomic_dir", "atomic_write_bytes", "check_output_folder", "confined",
           "hash_tree", "read_manifest", "sha256_file", "verify_folder", "write_json", "write_manifest"]

MANIFEST = "manifest.json"
# files the run-time side opens besides the components; verified like them
SIDE_FILES = ("tokenizer/tokenizer.json", "scheduler/scheduler_config.json")


def _read_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_UMASK = _read_umask()  # read once: os.umask is process-wide, so toggling it later would race other threads


def _umask() -> int:
    return _UMASK


FILE_MODE = 0o644
DIR_MODE = 0o755


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path, skip=frozenset()) -> dict[str, str]:
    """sha256 of every file under root except the manifest (and the relative paths in `skip`), keyed by
    posix relative path."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and p.name != MANIFEST and rel not in skip:
            out[rel] = sha256_file(p)
    return out


def _is_model_folder(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).is_file()


def check_output_folder(final: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> None:
    """Refuse an OUT that would destroy something: an input (or a folder holding or inside one),
    a non-empty folder without --overwrite, or anything but a model folder with it."""
    final = Path(final)
    parent = final.parent
    if not parent.is_dir():
        raise UserError(f"output directory's parent does not exist: {parent}")
    target = final.resolve()
    for src in inputs:
        s = Path(src).resolve()
        if target == s or target in s.parents or s in target.parents:
            raise UserError(f"output {final} overlaps the input {src} (OUT must not be, contain or be inside it)")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"output directory is not writable: {parent}")
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise UserError(f"output {final} exists and is not a folder")
    if final.exists() and any(final.iterdir()):
        if not overwrite:
            raise UserError(f"output {final} already exists (pass --overwrite to replace it)")
        if not _is_model_folder(final):
            raise UserError(f"--overwrite replaces only a model folder written by onnxdiffusion; {final} has no {MANIFEST}")


def _fix_modes(root: Path) -> None:
    """mkdtemp/mkstemp create 0700/0600; outputs get the usual 0755/0644 (less the umask)."""
    mask = _umask()
    os.chmod(root, DIR_MODE & ~mask)
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), DIR_MODE & ~mask)
        for f in filenames:
            p = os.path.join(dirpath, f)
            if not os.path.islink(p) and os.stat(p).st_nlink == 1:  # hard links share the source's inode
                os.chmod(p, FILE_MODE & ~mask)


def link_or_copy(src: str | Path, dst: str | Path) -> None:
    """A hard link where the file system allows one (same bytes, no copy), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def link_files(folder: Path, out: Path, rels) -> None:
    """The files `rels` (manifest-relative) of `folder` into `out`, linked or copied. Both ends are confined:
    a hostile key like "../x" neither reads nor writes outside the folders."""
    for rel in rels:
        src, dst = confined(folder, rel, "file"), confined(out, rel, "file")
        dst.parent.mkdir(parents=True, exist_ok=True)
        link_or_copy(src, dst)


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False, inputs: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary sibling folder; rename it to `final` only if the block succeeds."""
    final = Path(final)
    check_output_folder(final, overwrite, inputs)
    # tracked from the instant it exists: a signal anywhere below leaves no staging folder (tempfiles)
    tmp = tempfiles.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        yield tmp
        _fix_modes(tmp)
        with tempfiles.deferred_signals():  # the swap and the registry change as one step
            interrupts.check()  # a Ctrl-C that a library caught during the block still publishes nothing
            if final.exists():
                # move the old folder aside first, so an interruption never leaves neither
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
                os.replace(final, old / "x")
                os.replace(tmp, final)
                tempfiles.untrack(tmp)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
                tempfiles.untrack(tmp)
    except BaseException:
        tempfiles.remove(tmp)
        raise


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    if not path.parent.is_dir():
        raise UserError(f"output directory does not exist: {path.parent}")
    try:
        with tempfiles.deferred_signals():
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            tempfiles.track(tmp)
    except PermissionError:
        raise UserError(f"output directory is not writable: {path.parent}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, FILE_MODE & ~_umask())
        with tempfiles.deferred_signals():
            interrupts.check()
            os.replace(tmp, path)
            tempfiles.untrack(tmp)
    except BaseException:
        tempfiles.remove(tmp)
        raise


def write_json(path: Path, obj: Any, work: str | Path | None = None) -> None:
    """`work`: a folder whose (resolved) path is written as $WORK (committed results name no machine path)."""
    text = json.dumps(obj, indent=2, sort_keys=False) + "\n"
    if work:
        text = text.replace(str(Path(work).resolve()), "$WORK")
    atomic_write_bytes(path, text.encode())


def write_manifest(folder: Path, manifest: Manifest | dict) -> None:
    """The one writer of manifest.json (every verb that makes or rewrites a folder): atomic (a temporary name,
    then a rename) and in the one encoding (manifest.manifest_bytes), so the same content is the same bytes."""
    atomic_write_bytes(Path(folder) / MANIFEST, manifest_bytes(manifest))


def read_json_object(path: Path) -> dict:
    """A config file of an (untrusted) source folder: a JSON object, else a one-line UserError."""
    try:
        obj = json.loads(Path(path).read_bytes().decode("utf-8"))
    except (ValueError, RecursionError) as e:  # JSON and Unicode errors
        raise UserError(f"{path} is not valid JSON: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} must hold a JSON object")
    return obj


def read_manifest(folder: Path, required: tuple[str, ...] = ()) -> Manifest:
    """The folder's manifest, validated against the schema (manifest/checks.py) and typed (manifest/model.py);
    one UserError naming the bad field."""
    folder = Path(folder)
    if not folder.exists():
        raise UserError(f"model folder not found: {folder}")
    if not folder.is_dir():
        raise UserError(f"model path is not a folder: {folder}")
    path = folder / MANIFEST
    if not path.is_file():
        raise UserError(f"{folder} is not an onnxdiffusion model folder (no {MANIFEST}; run `onnxdiffusion export` first)")
    confined(folder, MANIFEST, "manifest")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise UserError(f"{path} is not valid JSON: {str(e).splitlines()[0][:200]}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    return Manifest.parse(manifest, str(path), required)


def component_path(folder: Path, manifest: Manifest | dict, name: str) -> Path:
    """The resolved path of a component's ONNX file, confined to the folder."""
    entry = typed(manifest, str(folder)).component(name)
    if entry is None:
        raise UserError(f"{folder}: manifest has no '{name}' component")
    return confined(folder, entry.path, f"component '{name}'")


def verify_folder(folder: Path, manifest: Manifest | dict, components: tuple[str, ...] | None = None) -> None:
    """Fail loudly on a missing component or a file whose hash differs from the manifest.

    `components`: those that must be there; default: what the folder's model family requires."""
    folder = Path(folder)
    manifest = typed(manifest, str(folder))
    if components is None:
        from ..families import get_family

        family = get_family(manifest.family)
        family.check_folder(str(folder), manifest)
        components = family.required_components(manifest.pipeline)
    files = manifest.files
    for name in components:
        path = component_path(folder, manifest, name)
        if not path.is_file():
            raise UserError(f"{folder}: component '{name}' is missing ({manifest.components[name].path})")
    for name, entry in manifest.components.items():
        for rel in entry.files:
            if rel not in files and (name in components or (folder / rel).exists()):
                raise UserError(f"{folder}: {rel} (component '{name}') is not in the manifest's hash list")
    for rel in SIDE_FILES:
        if (folder / rel).exists() and rel not in files:
            raise UserError(f"{folder}: {rel} is not in the manifest's hash list")
    for rel, digest in files.items():
        p = confined(folder, rel, "file")
        if not p.is_file():
            raise UserError(f"{folder}: file listed in manifest is missing: {rel}")
        if sha256_file(p) != digest:
            raise UserError(f"{folder}: {rel} does not match its sha256 in {MANIFEST} (corrupt or modified)")


def load_component(folder: Path, manifest: Manifest | dict, name: str):
    """onnx.load of a component after checking its path and its external data stay inside the folder."""
    import onnx

    from ..onnxio import fp16_storage
    from ..onnxio.files import check_ir_version
    from ..runtime.session import check_external_data

    path = component_path(folder, manifest, name)
    check_external_data(path)
    try:
        model = onnx.load(str(path))
    except Exception as e:  # protobuf and onnx raise several types
        raise UserError(f"cannot load {path}: {type(e).__name__}") from None
    check_ir_version(model, path)
    return fp16_storage.expand(model, str(path))


def check_external_paths(folder: Path, manifest: Manifest) -> None:
    """Every component's ONNX external-data locations stay inside the folder (reads graphs, not weights)."""
    from ..runtime.session import check_external_data

    for name in manifest.components:
        path = component_path(folder, manifest, name)
        if path.is_file():
            check_external_data(path)


# --- deriving one folder from another -------------------------------------------------------

class Derivation:
    """The folder being derived: `tmp` (its files so far), `draft` (a copy of the source's manifest as a dict:
    the writer edits it, write_manifest writes it when the block ends).

    Components put here replace the source's; files not replaced or dropped were linked from it."""

    def __init__(self, source: Path, draft: dict, tmp: Path, linked=frozenset()):
        self.source, self.tmp, self.draft, self.linked = source, tmp, draft, set(linked)

    @property
    def components(self) -> dict:
        """The draft's components (dicts the writer edits)."""
        return self.draft["components"]

    def path(self, rel: str | Path) -> Path:
        """A path inside the new folder (confined), its folder created; a file linked there from the
        source is unlinked first, so writing it never changes the source's bytes."""
        rel = Path(rel).as_posix()
        p = confined(self.tmp, rel, "file")
        p.parent.mkdir(parents=True, exist_ok=True)
        if rel in self.linked:
            self.linked.discard(rel)  # hashed as a new file
            p.unlink(missing_ok=True)
        return p

    def stored_bytes(self, draft: dict) -> int:
        """The bytes of a draft entry's files (its path and external data, as just written)."""
        return sum(confined(self.tmp, rel, "file").stat().st_size for rel in _component_files(draft))

    def save_component(self, name: str, model, external_from: int | None, rel: str | None = None) -> dict:
        """`model` saved as component `name` (at `rel`, default its current path), weights in a file beside
        it from `external_from` bytes of tensors; the entry's path, external_data and bytes set. The
        model's large tensors are left pointing at the written file (not read back)."""
        from ..onnxio.files import save

        draft = self.components.setdefault(name, {})
        rel = Path(rel or draft["path"]).as_posix()
        draft["path"] = rel
        data = save(model, self.path(rel), keep=False, external_from=external_from)
        draft["external_data"] = [(Path(rel).parent / f).as_posix() for f in data]
        draft["bytes"] = self.stored_bytes(draft)
        return draft

    def link_component(self, name: str, src: Component, folder: str) -> dict:
        """The source's component files (entry `src`) linked into `folder` as component `name`."""
        draft = src.to_dict()
        new = [f"{folder}/{Path(rel).name}" for rel in src.files]
        for a, b in zip(src.files, new):
            link_or_copy(confined(self.source, a, "file"), self.path(b))
        draft["path"], draft["external_data"] = new[0], new[1:]
        draft["bytes"] = self.stored_bytes(draft)
        self.components[name] = draft
        return draft


def _component_files(draft: dict) -> list[str]:
    """A draft entry's files: the writer set both keys (save_component, link_component)."""
    return [draft["path"], *draft.get("external_data", [])]


@contextlib.contextmanager
def derive(source: Path, out: Path, manifest: Manifest | dict, replace=(), drop=(), drop_kinds=(),
           overwrite: bool = False, in_place: bool = False) -> Iterator[Derivation]:
    """Write `out` from `source` (whose verified manifest is `manifest`): every listed file linked (or
    copied) except those of the components in `replace` (the caller puts new ones) and `drop` or of a
    kind in `drop_kinds` (removed with their whole folder); the caller's new files hashed (linked ones
    keep their verified hashes) and the folder committed atomically when the block succeeds.
    `in_place`: out is source, replaced atomically; its unlisted files are kept (and stay unlisted)."""
    source, out = Path(source), Path(out)
    manifest = typed(manifest, str(source))
    comps = manifest.components
    dropped = [n for n in comps if n in drop or comps[n].kind in drop_kinds]
    skip = {rel for n in [*replace, *dropped] if n in comps for rel in comps[n].files}
    skip_dirs = {comps[n].path.split("/")[0] for n in dropped}
    present = manifest.files
    if in_place:  # what a user put beside the listed files stays, but not beside a replaced component
        listed = set(present)
        replaced_dirs = {comps[n].path.split("/")[0] for n in replace if n in comps}
        present = [rel for rel in (p.relative_to(source).as_posix() for p in sorted(source.rglob("*"))
                                   if p.is_file() and p.name != MANIFEST)
                   if rel in listed or rel.split("/")[0] not in replaced_dirs]
    keep = [rel for rel in present if rel not in skip and rel.split("/")[0] not in skip_dirs]
    with atomic_dir(out, overwrite=overwrite or in_place, inputs=() if in_place else (source,)) as tmp:
        link_files(source, tmp, keep)
        draft = manifest.to_dict()
        for n in dropped:
            del draft["components"][n]
        d = Derivation(source, draft, tmp, keep)
        yield d
        linked = {rel for rel in d.linked if (tmp / rel).is_file()}  # less any the caller unlinked
        written = hash_tree(tmp, skip=linked)
        draft["files"] = dict(sorted({**{rel: manifest.files[rel] for rel in linked if rel in manifest.files},
                                    **written}.items()))
        write_manifest(tmp, draft)
