"""Table-driven hostile input: every verb and the Python API. Each case: input, exit code, message fragment.

Every case runs in-process (onnxdiffusion.cli.run) under a timeout and must give exactly one `error:`
line, no traceback, the expected exit status and no output file. Cases that need a broken model folder
mutate a fresh copy of the tiny exported model.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
import pytest

from cli_helpers import invoke

from onnxdiffusion.folder.artifacts import hash_tree, write_json
from onnxdiffusion.errors import UserError


# --- the case context ----------------------------------------------------------------------------------------
@dataclass
class Ctx:
    tiny: Path
    tmp: Path
    diffusers: Path
    _model: Path | None = None
    notes: dict = field(default_factory=dict)

    @property
    def model(self) -> Path:
        """A private copy of the tiny model, made on first use (for cases that break it)."""
        if self._model is None:
            self._model = self.tmp / "model"
            shutil.copytree(self.tiny, self._model)
        return self._model

    @property
    def png(self) -> Path:
        return self.tmp / "x.png"

    def manifest(self) -> dict:
        return json.loads((self.model / "manifest.json").read_text())

    def write_manifest(self, m) -> None:
        (self.model / "manifest.json").write_text(json.dumps(m))

    def rehash(self) -> None:
        m = self.manifest()
        m["files"] = hash_tree(self.model)
        self.write_manifest(m)


def edit(fn: Callable[[dict], None], rehash: bool = False) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        if rehash:
            ctx.rehash()
        m = ctx.manifest()
        fn(m)
        ctx.write_manifest(m)
    return setup


def set_path(path: str, value) -> Callable[[dict], None]:
    keys = path.split(".")

    def fn(m):
        d = m
        for k in keys[:-1]:
            d = d[k]
        if value is DELETE:
            del d[keys[-1]]
        else:
            d[keys[-1]] = value
    return fn


DELETE = object()


def edit_file(rel: str, text: str | bytes, rehash: bool = True) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        p = ctx.model / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        if rehash:
            ctx.rehash()
    return setup


def edit_sched(key: str, value) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        p = ctx.model / "scheduler" / "scheduler_config.json"
        cfg = json.loads(p.read_text())
        if value is DELETE:
            cfg.pop(key, None)
        else:
            cfg[key] = value
        p.write_text(json.dumps(cfg))
        ctx.rehash()
    return setup


def edit_onnx(rel: str, fn: Callable[[onnx.ModelProto, Ctx], None]) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        p = ctx.model / rel
        m = onnx.load(str(p))
        fn(m, ctx)
        onnx.save(m, str(p))
        ctx.rehash()
    return setup


def external_to(location: str, sparse: bool = False):
    """Point the first initializer (or a new sparse initializer) at external data `location`."""
    def fn(m: onnx.ModelProto, ctx: Ctx) -> None:
        if sparse:
            sp = m.graph.sparse_initializer.add()
            sp.dims.extend([4])
            t, i = sp.values, sp.indices
            t.name, t.data_type, i.name, i.data_type = "hostile_sparse", onnx.TensorProto.FLOAT, "hostile_idx", 7
            t.dims.extend([1])
            i.dims.extend([1])
            i.int64_data.extend([0])
        else:
            t = m.graph.initializer[0]
            t.ClearField("raw_data")
            t.ClearField("float_data")
        t.data_location = onnx.TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", "4")):
            e = t.external_data.add()
            e.key, e.value = k, v
    return fn


def nan_weights(m: onnx.ModelProto, ctx: Ctx) -> None:
    for t in m.graph.initializer:  # float16 too: weights kept in float16 storage (relayout --storage fp16)
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            a = onnx.numpy_helper.to_array(t).copy()
            a[...] = np.nan
            t.CopyFrom(onnx.numpy_helper.from_array(a, t.name))


def swap_component(role: str, other: str) -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        shutil.copy(ctx.model / other / "model.onnx", ctx.model / role / "model.onnx")
        ctx.rehash()
    return setup


def symlink_out(rel: str) -> Callable[[Ctx], None]:
    """Replace a listed file by a symlink to an identical copy outside the folder (hash still matches)."""
    def setup(ctx: Ctx) -> None:
        outside = ctx.tmp / "outside" / Path(rel).name
        outside.parent.mkdir(exist_ok=True)
        shutil.copy(ctx.model / rel, outside)
        (ctx.model / rel).unlink()
        (ctx.model / rel).symlink_to(outside)
    return setup


def make_dir(name: str) -> Callable[[Ctx], None]:
    return lambda ctx: (ctx.tmp / name).mkdir(parents=True, exist_ok=True)


def make_file(name: str, text: str = "x") -> Callable[[Ctx], None]:
    def setup(ctx: Ctx) -> None:
        (ctx.tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx.tmp / name).write_text(text)
    return setup


def nothing(ctx: Ctx) -> None:
    pass


# --- generate ------------------------------------------------------------------------------------------------
def gen(*extra, model="tiny"):
    """argv for generate on the shared model (model="tiny") or the private copy (model="copy")."""
    def argv(ctx: Ctx):
        m = ctx.tiny if model == "tiny" else ctx.model
        return ["generate", m, "a red circle", "-o", ctx.png, "--steps", "2", *extra]
    return argv


GENERATE_ARGS = [
    ("seed-negative", ["--seed", "-1"], "seed"),
    ("seed-huge", ["--seed", str(2**64)], "seed"),
    ("seed-text", ["--seed", "abc"], "--seed"),
    ("steps-zero", ["--steps", "0"], "[1, 1000]"),
    ("steps-over", ["--steps", "1001"], "[1, 1000]"),
    ("steps-negative", ["--steps", "-5"], "[1, 1000]"),
    ("steps-float", ["--steps", "1.5"], "--steps"),
    ("guidance-negative", ["--guidance", "-1"], "guidance"),
    ("guidance-nan", ["--guidance", "nan"], "guidance"),
    ("guidance-inf", ["--guidance", "inf"], "guidance"),
    ("guidance-huge", ["--guidance", "1e9"], "guidance"),
    ("guidance-101", ["--guidance", "101"], "guidance"),
    ("guidance-text", ["--guidance", "lots"], "--guidance"),
    ("sampler-unknown", ["--sampler", "heun"], "unknown sampler"),
    ("sampler-empty", ["--sampler", ""], "unknown sampler"),
    ("spacing-unknown", ["--spacing", "cubic"], "spacing"),
    ("provider-unknown", ["--provider", "quantum"], "unknown provider"),
    ("provider-missing", ["--provider", "cuda"], "not available"),
    ("height-zero", ["--height", "0"], "multiple of"),
    ("height-negative", ["--height", "-16"], "multiple of"),
    ("height-not-multiple", ["--height", "36"], "multiple of"),
    ("width-not-multiple", ["--width", "20"], "multiple of"),
    ("height-huge", ["--height", "100000"], "at most"),
    ("both-huge", ["--height", "100000", "--width", "100000"], "at most"),
    ("memory", ["--height", "16384", "--width", "16384"], "GiB"),
    ("batch-zero", ["--batch", "0"], "batch"),
    ("batch-negative", ["--batch", "-3"], "batch"),
    ("batch-huge", ["--batch", "100000"], "batch"),
    ("batch-text", ["--batch", "many"], "--batch"),
    ("loop-unknown", ["--loop", "spiral"], "loop form"),
    ("loop-missing-graph", ["--loop", "loop"], "compile-loop"),
    ("unrolled-missing-graph", ["--loop", "unrolled"], "compile-loop"),
    ("unknown-option", ["--colour", "red"], "--colour"),
]


def gen_case(name, extra, fragment):
    return (f"generate-{name}", nothing, gen(*extra), 2, fragment)


CASES: list[tuple] = [gen_case(*c) for c in GENERATE_ARGS]

CASES += [
    ("generate-output-suffix", nothing, lambda c: ["generate", c.tiny, "a", "-o", c.tmp / "x.txt"], 2, "must end in"),
    ("generate-output-no-dir", nothing, lambda c: ["generate", c.tiny, "a", "-o", c.tmp / "no" / "x.png"], 2,
     "does not exist"),
    ("generate-output-exists", make_file("x.png"), lambda c: ["generate", c.tiny, "a", "-o", c.png], 2, "already exists"),
    ("generate-output-is-dir", make_dir("x.png"), lambda c: ["generate", c.tiny, "a", "-o", c.png], 2, "directory"),
    ("generate-batch-name-exists", make_file("x-1.png"),
     lambda c: ["generate", c.tiny, "a", "-o", c.png, "--batch", "2"], 2, "x-1.png already exists"),
    ("generate-too-many-args", nothing, lambda c: ["generate", c.tiny, "a", "b", "-o", c.png], 2, "[MODEL] PROMPT"),
    ("generate-no-prompt", nothing, lambda c: ["generate"], 2, "Missing"),
    ("generate-prompt-not-utf8", nothing, lambda c: ["generate", c.tiny, "a \udcff circle", "-o", c.png], 2, "UTF-8"),
    ("generate-negative-not-utf8", nothing, lambda c: ["generate", c.tiny, "a", "-n", "\udcfe", "-o", c.png], 2, "UTF-8"),
    ("generate-prompt-nul", nothing, lambda c: ["generate", c.tiny, "a\x00b", "-o", c.png], 2, "NUL"),
    ("generate-model-missing", nothing, lambda c: ["generate", c.tmp / "nope", "a", "-o", c.png], 2, "not found"),
    ("generate-model-is-file", make_file("m.txt"), lambda c: ["generate", c.tmp / "m.txt", "a", "-o", c.png], 2,
     "not a folder"),
    ("generate-model-no-manifest", make_dir("empty"), lambda c: ["generate", c.tmp / "empty", "a", "-o", c.png], 2,
     "no manifest.json"),
]

# manifest and folder mutations, run through generate on the private copy
def backbone_manifest_cases(b: str) -> list:
    """The manifest and folder mutations that name the backbone component `b` (unet; the MMDiT's transformer)."""
    return [
        (f"{b}-missing", edit(set_path(f"components.{b}", DELETE)), b),
        (f"{b}-not-object", edit(set_path(f"components.{b}", f"{b}/model.onnx")), f"components.{b}"),
        (f"{b}-path-absolute", edit(set_path(f"components.{b}.path", "/etc/passwd")), "inside the model folder"),
        (f"{b}-path-dotdot", edit(set_path(f"components.{b}.path", "../x/model.onnx")), "inside the model folder"),
        (f"{b}-path-number", edit(set_path(f"components.{b}.path", 7)), f"components.{b}.path"),
        (f"{b}-path-nul", edit(set_path(f"components.{b}.path", f"{b}/\x00.onnx")), f"components.{b}.path"),
        (f"{b}-path-backslash", edit(set_path(f"components.{b}.path", "..\\..\\x")), f"components.{b}.path"),
        (f"{b}-path-empty", edit(set_path(f"components.{b}.path", "")), f"components.{b}.path"),
        ("external-not-list", edit(set_path(f"components.{b}.external_data", "x")), "external_data"),
        ("external-dotdot", edit(set_path(f"components.{b}.external_data", ["../secret"])), "external_data"),
        ("session-options-list", edit(set_path(f"components.{b}.session_options", [])), "session_options"),
        ("files-digest-short", edit(lambda m: m["files"].__setitem__(f"{b}/model.onnx", "abc")), "sha256"),
        ("files-digest-number", edit(lambda m: m["files"].__setitem__(f"{b}/model.onnx", 5)), "sha256"),
        ("files-digest-wrong", edit(lambda m: m["files"].__setitem__(f"{b}/model.onnx", "0" * 64)), "sha256"),
        ("component-unlisted", edit(lambda m: m["files"].pop(f"{b}/model.onnx")), "hash list"),
        ("hash-mismatch", edit_file(f"{b}/model.onnx", b"changed", rehash=False), "sha256"),
        ("component-file-gone", lambda c: (c.model / b / "model.onnx").unlink(), "missing"),
        (f"{b}-symlink-outside", symlink_out(f"{b}/model.onnx"), "outside the model folder"),
        (f"{b}-swapped-for-text-encoder", swap_component(b, "text_encoder"), "swapped"),
        (f"vae-swapped-for-{b}", swap_component("vae_decoder", b), "swapped"),
        ("onnx-garbage", edit_file(f"{b}/model.onnx", b"\x08\x07garbage"), "cannot load"),
        ("external-data-dotdot", edit_onnx(f"{b}/model.onnx", external_to("../../secret.bin")), "outside"),
        ("external-data-absolute", edit_onnx(f"{b}/model.onnx", external_to("/etc/passwd")), "outside"),
        (f"{b}-nan-weights", edit_onnx(f"{b}/model.onnx", nan_weights), "non-finite values after sampling"),
    ]


MANIFEST_CASES = [
    ("list", lambda c: c.write_manifest([1, 2]), "JSON object"),
    ("string", lambda c: c.write_manifest("hello"), "JSON object"),
    ("null", lambda c: c.write_manifest(None), "JSON object"),
    ("invalid-json", edit_file("manifest.json", "{", rehash=False), "not valid JSON"),
    ("not-utf8", edit_file("manifest.json", b"\xff\xfe{}", rehash=False), "not valid JSON"),
    ("deep-nesting", edit_file("manifest.json", "[" * 100000 + "]" * 100000, rehash=False), "manifest"),
    ("format-version-2", edit(set_path("format_version", 2)), "format_version"),
    ("format-version-string", edit(set_path("format_version", "1")), "format_version"),
    ("format-version-missing", edit(set_path("format_version", DELETE)), "format_version"),
    ("format-version-bool", edit(set_path("format_version", True)), "format_version"),
    ("family-number", edit(set_path("family", 3)), "'family'"),
    ("family-empty", edit(set_path("family", "")), "'family'"),
    ("pipeline-missing", edit(set_path("pipeline", DELETE)), "'pipeline'"),
    ("pipeline-list", edit(set_path("pipeline", [])), "'pipeline'"),
    ("vae-scaling-zero", edit(set_path("pipeline.vae_scaling_factor", 0)), "vae_scaling_factor"),
    ("vae-scaling-negative", edit(set_path("pipeline.vae_scaling_factor", -1.0)), "vae_scaling_factor"),
    ("vae-scaling-string", edit(set_path("pipeline.vae_scaling_factor", "0.18")), "vae_scaling_factor"),
    ("vae-scaling-missing", edit(set_path("pipeline.vae_scaling_factor", DELETE)), "vae_scaling_factor"),
    ("vae-scaling-huge", edit(set_path("pipeline.vae_scaling_factor", 1e300)), "vae_scaling_factor"),
    ("size-multiple-zero", edit(set_path("pipeline.size_multiple", 0)), "size_multiple"),
    ("size-multiple-negative", edit(set_path("pipeline.size_multiple", -16)), "size_multiple"),
    ("size-multiple-float", edit(set_path("pipeline.size_multiple", 16.0)), "size_multiple"),
    ("size-multiple-odd", edit(set_path("pipeline.size_multiple", 6)), "size_multiple"),
    ("vae-scale-factor-zero", edit(set_path("pipeline.vae_scale_factor", 0)), "vae_scale_factor"),
    ("latent-channels-zero", edit(set_path("pipeline.latent_channels", 0)), "latent_channels"),
    ("latent-channels-wrong", edit(set_path("pipeline.latent_channels", 5)), "latent_channels"),
    ("default-height-zero", edit(set_path("pipeline.default_height", 0)), "default_height"),
    ("default-height-odd", edit(set_path("pipeline.default_height", 33)), "default_height"),
    ("default-width-string", edit(set_path("pipeline.default_width", "64")), "default_width"),
    ("train-timesteps-zero", edit(set_path("pipeline.num_train_timesteps", 0)), "num_train_timesteps"),
    ("max-length-null", edit(set_path("pipeline.model_max_length", None)), "model_max_length"),
    ("prediction-type-number", edit(set_path("pipeline.prediction_type", 1)), "prediction_type"),
    ("prediction-type-disagrees", edit(set_path("pipeline.prediction_type", "v_prediction")), "prediction_type"),
    ("components-missing", edit(set_path("components", DELETE)), "components"),
    ("components-list", edit(set_path("components", [])), "components"),
    ("files-missing", edit(set_path("files", DELETE)), "'files'"),
    ("files-empty", edit(set_path("files", {})), "'files'"),
    ("files-list", edit(set_path("files", ["unet/model.onnx"])), "'files'"),
    ("files-key-dotdot", edit(lambda m: m["files"].__setitem__("../payload.txt", "0" * 64)), "inside the model folder"),
    ("files-key-absolute", edit(lambda m: m["files"].__setitem__("/etc/passwd", "0" * 64)), "inside the model folder"),
    ("files-listed-missing", edit(lambda m: m["files"].__setitem__("extra/gone.bin", "0" * 64)), "missing"),
    ("tokenizer-unlisted", edit(lambda m: m["files"].pop("tokenizer/tokenizer.json")), "hash list"),
    ("recommended-list", edit(set_path("recommended", [])), "recommended"),
    ("recommended-guidance", edit(set_path("recommended", {"guidance": -1})), "recommended.guidance"),
    ("recommended-steps", edit(set_path("recommended", {"steps": 0})), "recommended.steps"),
    ("recommended-sampler-type", edit(set_path("recommended", {"sampler": 3})), "recommended.sampler"),
    ("recommended-sampler-unknown", edit(set_path("recommended", {"sampler": "heun"})), "unknown sampler"),
    ("quantization-list", edit(set_path("quantization", [1])), "quantization"),
    ("tokenizer-symlink-outside", symlink_out("tokenizer/tokenizer.json"), "outside the model folder"),
    ("scheduler-symlink-outside", symlink_out("scheduler/scheduler_config.json"), "outside the model folder"),
    ("onnx-empty", edit_file("vae_decoder/model.onnx", b""), "cannot load"),
    ("external-data-sparse", edit_onnx("text_encoder/model.onnx", external_to("../x.bin", sparse=True)), "outside"),
    ("vae-nan-weights", edit_onnx("vae_decoder/model.onnx", nan_weights), "non-finite values after VAE"),
    ("text-encoder-nan-weights", edit_onnx("text_encoder/model.onnx", nan_weights), "non-finite values after text"),
    ("sched-not-json", edit_file("scheduler/scheduler_config.json", "{oops"), "scheduler_config.json"),
    ("sched-list", edit_file("scheduler/scheduler_config.json", "[]"), "JSON object"),
    ("sched-missing", lambda c: ((c.model / "scheduler" / "scheduler_config.json").unlink(), c.rehash()),
     "scheduler_config.json"),
    ("sched-timesteps-zero", edit_sched("num_train_timesteps", 0), "num_train_timesteps"),
    ("sched-timesteps-string", edit_sched("num_train_timesteps", "1000"), "num_train_timesteps"),
    ("sched-timesteps-huge", edit_sched("num_train_timesteps", 10**9), "num_train_timesteps"),
    ("sched-beta-start-negative", edit_sched("beta_start", -0.1), "beta_start"),
    ("sched-beta-end-over-one", edit_sched("beta_end", 1.5), "beta_end"),
    ("sched-beta-string", edit_sched("beta_end", "0.012"), "beta_end"),
    ("sched-schedule-unknown", edit_sched("beta_schedule", "cubic"), "beta_schedule"),
    ("sched-prediction-unknown", edit_sched("prediction_type", "sample"), "prediction_type"),
    ("sched-spacing-unknown", edit_sched("timestep_spacing", "random"), "spacing"),
    ("sched-offset-negative", edit_sched("steps_offset", -1), "steps_offset"),
    ("sched-alpha-one-string", edit_sched("set_alpha_to_one", "yes"), "set_alpha_to_one"),
    ("sched-trained-betas", edit_sched("trained_betas", [0.1, 0.2]), "trained_betas"),
    ("tokenizer-garbage", edit_file("tokenizer/tokenizer.json", "not a tokenizer"), "tokenizer"),
    ("tokenizer-missing", lambda c: ((c.model / "tokenizer" / "tokenizer.json").unlink(), c.rehash()), "tokenizer"),
    ("tokenizer-config-garbage", edit_file("tokenizer/tokenizer_config.json", "{"), "tokenizer_config.json"),
    ("tokenizer-config-bos", edit_file("tokenizer/tokenizer_config.json", '{"bos_token": "<nope>"}'), "bos_token"),
    ("tokenizer-config-eos-type", edit_file("tokenizer/tokenizer_config.json", '{"eos_token": 5}'), "eos_token"),
    *backbone_manifest_cases("unet"),
]
CASES += [(f"manifest-{n}", setup, gen(model="copy"), 2, frag) for n, setup, frag in MANIFEST_CASES]


# --- export --------------------------------------------------------------------------------------------------
def copy_src(ctx: Ctx) -> Path:
    src = ctx.tmp / "src"
    if not src.exists():
        shutil.copytree(ctx.diffusers, src)
    return src


def src_index(edit_fn) -> Callable[[Ctx], None]:
    def setup(ctx):
        p = copy_src(ctx) / "model_index.json"
        mi = json.loads(p.read_text())
        p.write_text(json.dumps(edit_fn(mi)))
    return setup


def exp(*extra, out="out"):
    return lambda c: ["export", c.tmp / "src", c.tmp / out, *extra]


def with_src(setup):
    return lambda c: (copy_src(c), setup(c))


CASES += [
    ("export-src-missing", nothing, lambda c: ["export", c.tmp / "nope", c.tmp / "out"], 2, "not found"),
    ("export-src-file", make_file("src"), exp(), 2, "not a diffusers pipeline"),
    ("export-no-index", make_dir("src"), exp(), 2, "not a diffusers pipeline"),
    ("export-index-invalid", lambda c: (copy_src(c) / "model_index.json").write_text("{"), exp(), 2, "not valid JSON"),
    ("export-index-list", lambda c: (copy_src(c) / "model_index.json").write_text("[]"), exp(), 2, "JSON object"),
    ("export-index-not-utf8", lambda c: (copy_src(c) / "model_index.json").write_bytes(b"\xff"), exp(), 2,
     "not valid JSON"),
    ("export-class-unsupported", src_index(lambda mi: {**mi, "_class_name": "KandinskyV22Pipeline"}), exp(), 2, "KandinskyV22Pipeline"),
    ("export-component-class", src_index(lambda mi: {**mi, "unet": ["diffusers", "Nope"]}), exp(), 2, "'unet'"),
    ("export-component-folder", lambda c: shutil.rmtree(copy_src(c) / "vae"), exp(), 2, "'vae'"),
    ("export-opset-low", with_src(nothing), exp("--opset", "5"), 2, "--opset"),
    ("export-opset-high", with_src(nothing), exp("--opset", "99"), 2, "--opset"),
    ("export-opset-text", with_src(nothing), exp("--opset", "new"), 2, "--opset"),
    ("export-out-exists", with_src(make_file("out/keep.txt")), exp(), 2, "already exists"),
    ("export-out-not-model-overwrite", with_src(make_file("out/keep.txt")), exp("--overwrite"), 2,
     "only a model folder"),
    ("export-out-is-src", with_src(nothing), exp("--overwrite", out="src"), 2, "overlaps the input"),
    ("export-out-contains-src", with_src(nothing), lambda c: ["export", c.tmp / "src", c.tmp, "--overwrite"], 2,
     "overlaps the input"),
    ("export-out-inside-src", with_src(nothing), exp("--overwrite", out="src/unet/sub"), 2, "overlaps the input"),
    ("export-out-parent-missing", with_src(nothing), exp(out="no/out"), 2, "does not exist"),
    ("export-out-is-file", with_src(make_file("out")), exp(), 2, "not a folder"),
    ("export-sched-bad", lambda c: (copy_src(c) / "scheduler" / "scheduler_config.json").write_text(
        json.dumps({"beta_schedule": "cubic"})), exp("--no-validate"), 2, "beta_schedule"),
]


# --- quantize ------------------------------------------------------------------------------------------------
def quant(*extra, model="tiny", out="q"):
    def argv(c):
        m = c.tiny if model == "tiny" else c.model
        return ["quantize", m, c.tmp / out, *extra]
    return argv


Q = ("--recipe", "int8-dynamic")
CASES += [
    ("quantize-recipe-unknown", nothing, quant("--recipe", "int3"), 2, "int3"),
    ("quantize-recipe-missing", nothing, quant(), 2, "--recipe"),
    ("quantize-option-malformed", nothing, quant(*Q, "-O", "groups"), 2, "KEY=VALUE"),
    ("quantize-option-unknown", nothing, quant(*Q, "-O", "colour=red"), 2, "colour"),
    ("quantize-calib-count-zero", nothing, quant("--recipe", "int8-static", "--calib-count", "0"), 2, "calibration"),
    ("quantize-calib-steps-zero", nothing, quant("--recipe", "int8-static", "--calib-steps", "0"), 2, "steps"),
    ("quantize-calib-guidance", nothing, quant("--recipe", "int8-static", "--calib-guidance", "-2"), 2, "guidance"),
    ("quantize-calib-prompts-missing", nothing,
     lambda c: ["quantize", c.tiny, c.tmp / "q", *Q, "--calib-prompts", c.tmp / "none.txt"], 2, "not found"),
    ("quantize-provider", nothing, quant(*Q, "--provider", "quantum"), 2, "provider"),
    ("quantize-model-missing", nothing, lambda c: ["quantize", c.tmp / "nope", c.tmp / "q", *Q], 2, "not found"),
    ("quantize-out-is-model", nothing, lambda c: ["quantize", c.model, c.model, *Q, "--overwrite"], 2, "MODEL itself"),
    ("quantize-out-contains-model", nothing, lambda c: ["quantize", c.model, c.tmp, *Q, "--overwrite"], 2,
     "overlaps the input"),
    ("quantize-out-inside-model", nothing, lambda c: ["quantize", c.model, c.model / "unet", *Q, "--overwrite"], 2,
     "overlaps the input"),
    ("quantize-out-exists", make_file("q/keep.txt"), quant(*Q), 2, "already exists"),
    ("quantize-out-not-model", make_file("q/keep.txt"), quant(*Q, "--overwrite"), 2, "only a model folder"),
    ("quantize-out-parent-missing", nothing, quant(*Q, out="a/b/q"), 2, "does not exist"),
    ("quantize-files-escape", edit(lambda m: m["files"].__setitem__("../m/payload.txt", "0" * 64)),
     quant(*Q, model="copy"), 2, "inside the model folder"),
    ("quantize-no-hash-list", edit(set_path("files", DELETE)), quant(*Q, model="copy"), 2, "'files'"),
    ("quantize-unet-outside", edit(set_path("components.unet.path", "/etc/passwd")), quant(*Q, model="copy"), 2,
     "inside the model folder"),
]


# --- compile-loop ---------------------------------------------------------------------------------------------
def loop(*extra, model="tiny", out="l"):
    def argv(c):
        m = c.tiny if model == "tiny" else c.model
        return ["compile-loop", m, c.tmp / out, *extra]
    return argv


CASES += [
    ("loop-form-unknown", nothing, loop("--form", "spiral"), 2, "unknown loop form"),
    ("loop-unrolled-no-steps", nothing, loop("--form", "unrolled"), 2, "--steps"),
    ("loop-unrolled-zero", nothing, loop("--form", "unrolled", "--steps", "0"), 2, "--steps"),
    ("loop-unrolled-huge", nothing, loop("--form", "unrolled", "--steps", "5000"), 2, "--steps"),
    ("loop-steps-with-loop", nothing, loop("--steps", "4"), 2, "--steps"),
    ("loop-cache-unknown", nothing, loop("--cache", "teacache:2"), 2, "unknown cache method"),
    ("loop-cache-bad-interval", nothing, loop("--cache", "deepcache:0"), 2, "INTERVAL"),
    ("loop-cache-bad-layer", nothing, loop("--cache", "deepcache:2:L0"), 2, "L<N>"),
    ("loop-cache-layer-too-deep", nothing, loop("--cache", "deepcache:2:L99"), 2, "needs 1 <= L <"),
    ("loop-cache-unrolled", nothing, loop("--form", "unrolled", "--steps", "2", "--cache", "deepcache"), 2, "--form loop"),
    ("loop-cache-wrong-backbone", nothing, loop("--cache", "first_block"), 2, "UNet"),
    ("loop-model-missing", nothing, lambda c: ["compile-loop", c.tmp / "nope", c.tmp / "l"], 2, "not found"),
    ("loop-out-exists", make_file("l/keep.txt"), loop(), 2, "already exists"),
    ("loop-out-not-model", make_file("l/keep.txt"), loop("--overwrite"), 2, "only a model folder"),
    ("loop-out-contains-model", nothing, lambda c: ["compile-loop", c.model, c.tmp, "--overwrite"], 2,
     "overlaps the input"),
    ("loop-out-inside-model", nothing, lambda c: ["compile-loop", c.model, c.model / "unet", "--overwrite"], 2,
     "overlaps the input"),
    ("loop-bad-manifest", edit(set_path("pipeline.latent_channels", -1)), loop(model="copy"), 2, "latent_channels"),
    ("loop-no-hash-list", edit(set_path("files", DELETE)), loop(model="copy"), 2, "'files'"),
    ("loop-unet-dotdot", edit(set_path("components.unet.path", "../unet/model.onnx")), loop(model="copy"), 2,
     "inside the model folder"),
]


# --- evaluate --------------------------------------------------------------------------------------------------
def ev(*extra):
    return lambda c: ["evaluate", c.tiny, "--count", "2", "--batch", "2", "--steps", "2", *extra]


CASES += [
    ("evaluate-batch-zero", nothing, ev("--batch", "0"), 2, "batch"),
    ("evaluate-count-zero", nothing, ev("--count", "0"), 2, "count"),
    ("evaluate-count-negative", nothing, ev("--count", "-4"), 2, "count"),
    ("evaluate-steps-zero", nothing, ev("--steps", "0"), 2, "steps"),
    ("evaluate-guidance-negative", nothing, ev("--guidance", "-1"), 2, "guidance"),
    ("evaluate-guidance-nan", nothing, ev("--guidance", "nan"), 2, "guidance"),
    ("evaluate-sampler", nothing, ev("--sampler", "heun"), 2, "unknown sampler"),
    ("evaluate-provider", nothing, ev("--provider", "quantum"), 2, "unknown provider"),
    ("evaluate-output-dir", make_dir("r.json"), lambda c: [*ev()(c), "-o", c.tmp / "r.json"], 2, "directory"),
    ("evaluate-output-no-dir", nothing, lambda c: [*ev()(c), "-o", c.tmp / "no" / "r.json"], 2, "does not exist"),
    ("evaluate-output-exists", make_file("r.json"), lambda c: [*ev()(c), "-o", c.tmp / "r.json"], 2, "already exists"),
    ("evaluate-grid-suffix", nothing, lambda c: [*ev()(c), "--grid", c.tmp / "g.txt"], 2, "must end in"),
    ("evaluate-model-missing", nothing, lambda c: ["evaluate", c.tmp / "nope", "--count", "2"], 2, "not found"),
]


# --- bench ------------------------------------------------------------------------------------------------------
def bench(*extra):
    return lambda c: ["bench", c.tiny, "--out", c.tmp / "b", "--quiet", "--rss", "off", *extra]


CASES += [
    ("bench-variant-unknown", nothing, bench("--variants", "warp-drive"), 2, "warp-drive"),
    ("bench-repeats-zero", nothing, bench("--repeats", "0"), 2, "repeats"),
    ("bench-steps-zero", nothing, bench("--steps", "0"), 2, "steps"),
    ("bench-guidance-negative", nothing, bench("--guidance", "-1"), 2, "guidance"),
    ("bench-size-odd", nothing, bench("--size", "37"), 2, "size"),
    ("bench-rss-unknown", nothing, bench("--rss", "maybe"), 2, "rss"),
    ("bench-arch-unknown", nothing, bench("--arch", "sd99"), 2, "arch"),
    ("bench-out-is-file", make_file("b"), bench(), 2, "b"),
    ("bench-model-missing", nothing, lambda c: ["bench", c.tmp / "nope", "--out", c.tmp / "b", "--rss", "off"], 2,
     "not found"),
    ("bench-variants-dir-missing", nothing, bench("--variants-dir", "/nonexistent/dir"), 2, "variants-dir"),
    ("bench-batch-zero", nothing, bench("--batch", "0"), 2, "batch"),
]


@pytest.fixture()
def ctx(tmp_path, tiny_onnx, tiny_diffusers) -> Ctx:
    return Ctx(tiny=tiny_onnx, tmp=tmp_path, diffusers=tiny_diffusers)


def snapshot(root: Path) -> dict[str, tuple]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        out[p.relative_to(root).as_posix()] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out


@pytest.mark.parametrize("name, setup, argv, code, fragment", CASES, ids=[c[0] for c in CASES])
def test_cli_bad_input(ctx, name, setup, argv, code, fragment):
    setup(ctx)
    args = argv(ctx)
    before = snapshot(ctx.tmp)
    tiny_before = snapshot(ctx.tiny)
    res = invoke(*args, timeout=120)
    assert "Traceback" not in res.stderr, res.stderr
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, res.stderr
    assert res.returncode == code, res.stderr
    assert fragment in errors[0], errors[0]
    assert "internal error" not in errors[0]
    # nothing written, nothing left behind, inputs untouched
    assert snapshot(ctx.tmp) == before
    assert snapshot(ctx.tiny) == tiny_before


# --- the Python API ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def pipe(tiny_onnx):
    from onnxdiffusion.runtime import Pipeline

    return Pipeline.from_folder(tiny_onnx)


def _shape(pipe):
    return pipe.latent_shape_for(1)


API_GENERATE = [
    ("prompt-none", dict(prompt=None), "prompt"),
    ("prompt-int", dict(prompt=123), "prompt"),
    ("prompt-list-of-int", dict(prompt=[1]), "prompt"),
    ("prompt-count", dict(prompt=["a", "b"], batch=1), "prompts for batch"),
    ("prompt-surrogate", dict(prompt="\udcff"), "UTF-8"),
    ("negative-count", dict(negative_prompt=["a", "b"]), "negative prompts"),
    ("negative-int", dict(negative_prompt=5), "negative prompt"),
    ("steps-float", dict(steps=1.5), "steps"),
    ("steps-string", dict(steps="3"), "steps"),
    ("steps-zero", dict(steps=0), "[1, 1000]"),
    ("guidance-string", dict(guidance="x"), "guidance"),
    ("guidance-nan", dict(guidance=float("nan")), "guidance"),
    ("guidance-bool", dict(guidance=True), "guidance"),
    ("seed-negative", dict(seed=-1), "seed"),
    ("seed-float", dict(seed=1.5), "seed"),
    ("batch-zero", dict(batch=0), "batch"),
    ("batch-float", dict(batch=2.0), "batch"),
    ("height-float", dict(height=64.0), "height"),
    ("width-string", dict(width="64"), "width"),
    ("sampler-none-type", dict(sampler=3), "sampler"),
    ("spacing-number", dict(spacing=3), "spacing"),
    ("loop-unknown", dict(loop="spiral"), "loop form"),
    ("kwarg-unknown", dict(colour="red"), "colour"),
    ("latents-shape", dict(latents=np.zeros((1, 4, 3, 3), np.float32)), "latents must have shape"),
    ("latents-complex", dict(latents="complex"), "latents"),
    ("latents-strings", dict(latents="strings"), "latents"),
    ("latents-nan", dict(latents="nan"), "NaN"),
    ("latents-inf", dict(latents="inf"), "NaN"),
    ("noise-shape", dict(sampler="euler_a", noise=np.zeros((2, 2), np.float32)), "noise must have shape"),
    ("noise-nan", dict(sampler="euler_a", steps=2, noise="nan"), "NaN"),
]


@pytest.mark.parametrize("name, kwargs, fragment", API_GENERATE, ids=[c[0] for c in API_GENERATE])
def test_api_generate_bad_input(pipe, name, kwargs, fragment):
    kwargs = dict(kwargs)
    shape = _shape(pipe)
    special = {"complex": np.zeros(shape, np.complex64), "strings": np.full(shape, "a"),
               "nan": np.full(shape, np.nan, np.float32), "inf": np.full(shape, np.inf, np.float32)}
    if isinstance(kwargs.get("latents"), str):
        kwargs["latents"] = special[kwargs["latents"]]
    if isinstance(kwargs.get("noise"), str):
        kwargs["noise"] = np.full((2, *shape), np.nan, np.float32)
    prompt = kwargs.pop("prompt", "a red circle")
    kwargs.setdefault("steps", 2)
    with pytest.raises(UserError) as e:
        pipe(prompt, **kwargs)
    assert fragment in str(e.value)
    assert "\n" not in str(e.value)


def test_api_samplers_listed(pipe):
    # noise cases above need an ancestral sampler; make sure the name is real so they test the noise
    from onnxdiffusion.samplers import SAMPLERS

    assert "euler_a" in SAMPLERS


API_OTHER = [
    ("read-manifest-file", lambda t: __import__("onnxdiffusion.folder.artifacts", fromlist=["x"]).read_manifest(t / "f"),
     "not a folder"),
    ("from-folder-missing", lambda t: __import__("onnxdiffusion.runtime", fromlist=["x"]).Pipeline.from_folder(t / "n"),
     "not found"),
    ("export-opset", lambda t: _export(t, opset=3), "--opset"),
    ("export-opset-bool", lambda t: _export(t, opset=True), "--opset"),
    ("compile-loop-form", lambda t: _compile(t, form="spiral"), "unknown loop form"),
    ("compile-loop-steps", lambda t: _compile(t, form="unrolled", steps=-1), "--steps"),
    ("evaluate-batch", lambda t: _evaluate(batch=0), "batch"),
    ("evaluate-count", lambda t: _evaluate(count=0), "count"),
    ("evaluate-guidance", lambda t: _evaluate(guidance=math.inf), "guidance"),
    ("evaluate-seed-offset", lambda t: _evaluate(seed_offset=-1), "seed_offset"),
    ("quantize-out-is-model", lambda t: _quantize(t, same=True), "MODEL itself"),
    ("quantize-recipe", lambda t: __import__("onnxdiffusion.quantize", fromlist=["x"]).recipe_class("nope"), "nope"),
]


def _export(t: Path, **kw):
    from onnxdiffusion.export import ExportOptions, export_pipeline

    return export_pipeline(t / "src", t / "out", ExportOptions(**kw), progress=False)


def _compile(t: Path, **kw):
    from onnxdiffusion.loopgraph.compile import compile_loop

    return compile_loop(t / "m", t / "out", **kw)


def _evaluate(**kw):
    from onnxdiffusion.evaluate.run import EvaluateOptions, evaluate_model

    return evaluate_model(None, EvaluateOptions(**kw), progress=False)


def _quantize(t: Path, same: bool):
    from onnxdiffusion.quantize import QuantizeConfig, quantize, recipe_class

    return quantize(t, t, QuantizeConfig(recipe=recipe_class("int8-dynamic")()))


@pytest.mark.parametrize("name, call, fragment", API_OTHER, ids=[c[0] for c in API_OTHER])
def test_api_other_bad_input(tmp_path, name, call, fragment):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as e:
        call(tmp_path)
    assert fragment in str(e.value)


def test_case_count():
    """Acceptance: at least 150 hostile inputs across every verb and the API."""
    total = len(CASES) + len(API_GENERATE) + len(API_OTHER)
    verbs = {c[0].split("-")[0] for c in CASES}
    assert {"generate", "manifest", "export", "quantize", "loop", "evaluate", "bench"} <= verbs
    assert total >= 150, total
