import gc
import importlib
import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TQDM_DISABLE", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _worker_threads() -> int | None:
    """Under pytest-xdist: the cores this process may use, shared out among the workers (`make test`: 2 workers on
    2 cores, one thread each); None otherwise (`-n 0` keeps the libraries' defaults)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)  # set by xdist before conftest is imported
    if workers < 1:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // workers)


def limit_worker_threads(threads: int) -> None:
    """ONNX Runtime starts one intra-op thread per physical core for a session that names no count, torch one OpenMP
    thread per core: with a worker per core that is twice as many busy (and spinning) threads as cores. Measured
    single process (experiments/house/test_time.md, "Threads"): the same tests took 1.9x the CPU seconds at the
    libraries' defaults that they took at one thread each (same bytes out: ort_threads_bitcheck.py). A session or a command that names its thread count
    keeps it; CLI subprocesses inherit the OpenMP variables (their ORT sessions keep the default)."""
    import onnxruntime as ort

    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, str(threads))
    init = ort.InferenceSession.__init__

    def session_init(self, path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs):
        if sess_options is None:
            sess_options = ort.SessionOptions()
        if sess_options.intra_op_num_threads == 0:  # 0: ORT's default, one per physical core
            sess_options.intra_op_num_threads = threads
        init(self, path_or_bytes, sess_options, providers, provider_options, **kwargs)

    ort.InferenceSession.__init__ = session_init


if _worker_threads():
    limit_worker_threads(_worker_threads())
sys.path.insert(0, str(ROOT / "models" / "training"))
# the shared helpers (`from cli_helpers import run_cli`), and the test folders: a few tests import another's
# toy models (`from test_loop_graph import toy_backbone`)
sys.path.insert(0, str(ROOT / "tests" / "helpers"))
sys.path += sorted(str(d) for d in (ROOT / "tests").iterdir() if d.is_dir() and any(d.glob("test_*.py")))


def build_tiny_pipeline(folder: Path, prediction_type: str = "epsilon", spacing: str = "leading") -> Path:
    """A real Stable Diffusion pipeline, shrunk: every block type SD uses, random weights."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from tokenizer_build import build_tokenizer_files
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

    from onnxdiffusion.evaluate import scenes

    torch.manual_seed(0)
    build_tokenizer_files(scenes.vocabulary(), folder / "_tok", 16)
    tokenizer = CLIPTokenizer.from_pretrained(folder / "_tok")
    text_encoder = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=16,
            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
    )
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
    )
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 16, 16),
        down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
        layers_per_block=1, norm_num_groups=8, sample_size=32,
    )
    scheduler = DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False,
        set_alpha_to_one=False, steps_offset=1, prediction_type=prediction_type, timestep_spacing=spacing,
    )
    pipe = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipe.save_pretrained(folder / "diffusers", safe_serialization=True)
    return folder / "diffusers"


def shared_folder(tmp_path_factory, name: str, build) -> Path:
    """`build(root)` run once per test run, its result shared: under pytest-xdist every worker would otherwise
    build the same session artefact (exports, quantizations) again. The first worker to take the lock builds into
    a folder of the run's common temporary root; the others wait and reuse it. The artefacts are read-only to
    the tests (they copy before they change anything), as within one worker already."""
    import fcntl
    import shutil

    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is .../pytest-N/popen-gwK: its parent is the run's
        base = base.parent
    root, done = base / f"shared-{name}", base / f"shared-{name}.done"
    with open(base / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or the worker dies
        if not done.exists():
            shutil.rmtree(root, ignore_errors=True)  # a worker that failed half-way left this
            root.mkdir()
            done.write_text(str(Path(build(root)).relative_to(root)))
        return root / done.read_text()


@pytest.fixture(scope="session", autouse=True)
def _derived_folder_cache(tmp_path_factory):
    """Folders the library derives and caches (adapters/folder.with_points) go under the run's temporary root,
    never the user's cache; CLI subprocesses and served models inherit it."""
    os.environ.setdefault("ONNXDIFFUSION_CACHE", str(tmp_path_factory.getbasetemp() / "derived-cache"))


def export_plain(src: Path, out: Path) -> Path:
    from onnxdiffusion.export import export_pipeline

    export_pipeline(src, out, progress=False)
    return out


def export_every(size: int):
    """export(src, out): every component (the VAE encoder too: editing models and reference pictures use it) at a
    `size` x `size` default size."""
    def export(src: Path, out: Path) -> Path:
        from onnxdiffusion.export import ExportOptions, export_pipeline

        export_pipeline(src, out, ExportOptions(default_size=size), progress=False)
        return out
    return export


def built(name: str, module: str, builder: str, **kwargs):
    """A session fixture: tests/helpers/`module`.`builder`(root, **kwargs), built once per run (shared_folder)."""
    @pytest.fixture(scope="session")
    def fixture(tmp_path_factory) -> Path:
        build = getattr(importlib.import_module(module), builder)
        return shared_folder(tmp_path_factory, name, lambda root: build(root, **kwargs))
    return fixture


def exported(name: str, source: str, export):
    """A session fixture: the `source` fixture's pipeline through `export(src, root / "model")`, once per run."""
    @pytest.fixture(scope="session")
    def fixture(request, tmp_path_factory) -> Path:
        src = request.getfixturevalue(source)
        return shared_folder(tmp_path_factory, name, lambda root: export(src, root / "model"))
    return fixture


@pytest.fixture(scope="session")
def tiny_diffusers(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny", build_tiny_pipeline)


tiny_onnx = exported("tiny_onnx", "tiny_diffusers", export_plain)



@pytest.fixture(scope="session")
def tiny_int8_timestep(tiny_onnx, tmp_path_factory) -> Path:
    """tiny_onnx quantized by int8-timestep (2 groups; 4 calibration prompts x 4 steps), once per run: the bytes
    test and the step caches on grouped backbones read the same folder."""
    def build(root: Path) -> Path:
        from onnxdiffusion.quantize import CalibrationConfig, Int8TimestepRecipe, QuantizeConfig, quantize

        quantize(tiny_onnx, root / "model", QuantizeConfig(recipe=Int8TimestepRecipe(groups=2),
                                                           calibration=CalibrationConfig(count=4, steps=4, batch=4),
                                                           latency_runs=2, measure_memory=False))
        return root / "model"
    return shared_folder(tmp_path_factory, "tiny_int8_timestep", build)

@pytest.fixture(scope="session")
def tiny_int8_static(tiny_onnx, tmp_path_factory) -> Path:
    """tiny_onnx quantized by int8-static (4 calibration prompts x 3 DDIM steps), once per run: the step caches and
    the ControlNet on an int8 UNet read the same folder (each quantized its own); read-only, as every shared one."""
    def build(root: Path) -> Path:
        from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize

        quantize(tiny_onnx, root / "model", QuantizeConfig(recipe=Int8StaticRecipe(), latency_runs=1, measure_memory=False,
                                                           calibration=CalibrationConfig(count=4, steps=3, batch=4,
                                                                                         sampler="ddim")))
        return root / "model"
    return shared_folder(tmp_path_factory, "tiny_int8_static", build)


@pytest.fixture(scope="session")
def tiny_sd3_int8_static(tiny_sd3_onnx, tmp_path_factory) -> Path:
    """tiny_sd3_onnx quantized by int8-static (4 calibration prompts x 3 flow_euler steps, quality measured), once
    per run: test_cache_int8's MMDiT folder and test_family_quantize's plain int8-static case on tiny SD3 each made
    this same call; read-only (quantize_report.json beside it is the report)."""
    def build(root: Path) -> Path:
        from onnxdiffusion.quantize import CalibrationConfig, Int8StaticRecipe, QuantizeConfig, quantize

        quantize(tiny_sd3_onnx, root / "model", QuantizeConfig(recipe=Int8StaticRecipe(), latency_runs=1,
                                                               measure_memory=False,
                                                               calibration=CalibrationConfig(count=4, steps=3, batch=4,
                                                                                             sampler="flow_euler")))
        return root / "model"
    return shared_folder(tmp_path_factory, "tiny_sd3_int8_static", build)


@pytest.fixture(scope="session")
def tiny_v_diffusers(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_v", lambda root: build_tiny_pipeline(
        root, prediction_type="v_prediction", spacing="trailing"))


tiny_v_onnx = exported("tiny_v_onnx", "tiny_v_diffusers", export_plain)


# -- other model families (tests/helpers/family_pipelines.py builds them) -------------------------------

tiny_sdxl_diffusers = built("tiny_sdxl", "family_pipelines", "build_tiny_sdxl")


@pytest.fixture(scope="session")
def tiny_sdxl_onnx(tiny_sdxl_diffusers, tmp_path_factory) -> Path:
    """Exported with the CLI verb, as a user would (in-process: the verb without an interpreter start)."""
    from cli_helpers import run_cli_here

    def build(root: Path) -> Path:
        proc = run_cli_here("export", tiny_sdxl_diffusers, root / "model")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return root / "model"

    return shared_folder(tmp_path_factory, "tiny_sdxl_onnx", build)


tiny_sd3_diffusers = built("tiny_sd3", "family_pipelines", "build_tiny_sd3")
tiny_sd3_onnx = exported("tiny_sd3_onnx", "tiny_sd3_diffusers", export_plain)


# -- Flux and Qwen-Image (tests/helpers/tiny_families.py builds them) -----------------------------------

tiny_flux_diffusers = built("tiny_flux", "tiny_families", "build_tiny_flux")
tiny_qwenimage_diffusers = built("tiny_qwenimage", "tiny_families", "build_tiny_qwenimage")
tiny_zimage_diffusers = built("tiny_zimage", "tiny_families", "build_tiny_zimage")


def export_family(src: Path, out: Path, **options) -> Path:
    """Export the components generate needs (the VAE encoder is left out to keep tests fast), with a
    32x32 default size (the pipelines' own default is 128 latent patches a side); `options`: more ExportOptions."""
    import json

    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.families import family_for_pipeline

    family = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"])
    names = (*(s.name for s in family.text_encoders), family.backbone, "vae_decoder")
    export_pipeline(src, out, ExportOptions(components=names, default_size=32, **options), progress=False)
    return out


tiny_flux_onnx = exported("tiny_flux_onnx", "tiny_flux_diffusers", export_family)
tiny_qwenimage_onnx = exported("tiny_qwenimage_onnx", "tiny_qwenimage_diffusers", export_family)
tiny_zimage_onnx = exported("tiny_zimage_onnx", "tiny_zimage_diffusers", export_family)


def export_family_streamed(src: Path, out: Path) -> Path:
    """export_family with every weight streamed from the shards (stream_weights "on"; "auto" keeps a tiny model
    whole): test_streamed_float and test_llm_streamed each exported the Z-Image one in a test."""
    return export_family(src, out, stream_weights="on")


tiny_zimage_streamed_onnx = exported("tiny_zimage_streamed_onnx", "tiny_zimage_diffusers", export_family_streamed)
tiny_qwenimage_streamed_onnx = exported("tiny_qwenimage_streamed_onnx", "tiny_qwenimage_diffusers",
                                        export_family_streamed)


def export_family_encoder(src: Path, out: Path) -> Path:
    """export_family's components and the VAE encoder (img2img, inpainting and ControlNet encode a picture)."""
    from onnxdiffusion.export import ExportOptions, export_pipeline

    names = ("text_encoder", "transformer", "vae_decoder", "vae_encoder")
    export_pipeline(src, out, ExportOptions(components=names, default_size=32), progress=False)
    return out


# one export shared by the img2img, inpainting and ControlNet tests (it was one per test module)
tiny_qwenimage_enc_onnx = exported("tiny_qwenimage_enc_onnx", "tiny_qwenimage_diffusers", export_family_encoder)


# -- FLUX.2 (tests/helpers/tiny_flux2.py builds them) ------------------------------------------------------

tiny_flux2_klein_diffusers = built("tiny_flux2_klein", "tiny_flux2", "build_tiny_flux2_klein")
tiny_flux2_dev_diffusers = built("tiny_flux2_dev", "tiny_flux2", "build_tiny_flux2_dev")
# every component (FLUX.2 takes reference pictures: the VAE encoder too), a 32x32 default size
tiny_flux2_klein_onnx = exported("tiny_flux2_klein_onnx", "tiny_flux2_klein_diffusers", export_every(32))
tiny_flux2_dev_onnx = exported("tiny_flux2_dev_onnx", "tiny_flux2_dev_diffusers", export_every(32))


@pytest.fixture(scope="module")  # per module: some tests hard-link its data file, which onnx.load then refuses
def external_onnx(tiny_onnx, tmp_path_factory):
    """The tiny pipeline with its UNet's weights in one external-data file, as export writes a > 2 GB one."""
    import json
    import shutil

    import onnx

    from onnxdiffusion.folder.artifacts import hash_tree

    out = tmp_path_factory.mktemp("ext") / "model"
    shutil.copytree(tiny_onnx, out)
    path = out / "unet" / "model.onnx"
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx_data", size_threshold=1024)
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["components"]["unet"]["external_data"] = ["unet/model.onnx_data"]
    manifest["files"] = hash_tree(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


# -- test tiers ------------------------------------------------------------------------------------
# `make test-fast` deselects the `slow` marker (and `browser`, `peers`), set in each test file: `pytestmark =
# pytest.mark.slow` or `@pytest.mark.slow` on the test (issue 41: a renamed file keeps its tier). Slowness is the
# cost of what a test builds: a quantized, loop-compiled or family-exported folder, a running service, a bench run,
# a CLI in a subprocess. The fixtures below build such folders: a test that uses one and is not marked slow fails
# at collection, so the fast tier never builds one by accident (measured under a load average of ~20:
# `static_folder`'s setup alone took 315 s).
SLOW_ONLY_FIXTURES = {
    "bench_models", "bench_run", "calib", "flux", "flux_pair", "peer_bench", "quantized", "qwen", "qwen_pair",
    "rendered", "scheduled", "sd3_loops", "sd3_without_t5", "sdxl_loops", "serve_models", "server",
    "static_folder", "tiny_int8_static", "tiny_sd3_int8_static", "tiny_flux_diffusers", "tiny_flux_onnx", "tiny_loops", "tiny_qwenimage_diffusers",
    "tiny_qwenimage_onnx", "tiny_qwenimage_enc_onnx", "tiny_sd3_onnx", "tiny_sdxl_onnx", "tiny_zimage_diffusers",
    "tiny_zimage_onnx", "tiny_zimage_streamed_onnx", "tiny_qwenimage_streamed_onnx",
    "tiny_flux2_klein_diffusers", "tiny_flux2_dev_diffusers", "tiny_flux2_klein_onnx", "tiny_flux2_dev_onnx", "flux2_loops"
}


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if item.get_closest_marker("slow") is None
                and SLOW_ONLY_FIXTURES.intersection(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError("tests that build a slow fixture must be marked slow (pytest.mark.slow):\n  "
                                + "\n  ".join(unmarked))
    first = {name: rank for rank, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::")[0], len(first)))  # stable: the rest keep their order


# Modules of long single tests (a quantization, a bench or tune run, a browser, peer venvs), run first: `make test`'s
# two workers each take half the tests in this order and steal from the other's tail, so a long test there would
# run last on one worker while the other idles (collected by path, tests/web and tests/tune came last).
RUN_FIRST = ("tests/web/test_web.py", "tests/tune/test_tune.py", "tests/bench/test_peers.py", "tests/bench/test_bench.py",
             "tests/models/test_mmdit_model.py", "tests/models/test_embedded_model.py",
             "tests/quantize/test_family_quantize.py", "tests/serve/test_serve_page.py")


_FROZEN_AT: list = [None]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    """At each test module's first test, collect and then freeze what survives out of later collections.

    A worker holds the suite's modules, torch, diffusers, transformers, ORT and the session's fixtures: 1-2 M
    tracked objects, and each automatic full collection walked all of them (measured with gc.callbacks over
    `make test`: 129 + 339 full collections took 75 + 200 s of the two workers' 1,080 CPU s). Freezing moves the
    survivors to the permanent generation, which collections skip. The previous module's fixtures are already torn
    down here (pytest finalizes them with the last test before the boundary), so what is frozen lives on anyway;
    objects the tests create are collected as before."""
    if item.path != _FROZEN_AT[0]:
        _FROZEN_AT[0] = item.path
        gc.collect()
        gc.freeze()


# -- FLUX.1 Kontext (editing by instruction): tests/helpers/tiny_kontext.py ------------------------------------
tiny_kontext_diffusers = built("tiny_kontext", "tiny_kontext", "build_tiny_kontext")
# every component, the VAE encoder included (an editing model encodes its reference picture)
tiny_kontext_onnx = exported("tiny_kontext_onnx", "tiny_kontext_diffusers", export_every(32))


SLOW_ONLY_FIXTURES |= {"tiny_kontext_diffusers", "tiny_kontext_onnx"}


# -- Qwen-Image-Edit and -Edit-Plus (editing by instruction): tests/helpers/tiny_qwenedit.py ----------------------
tiny_qwenedit_diffusers = built("tiny_qwenedit", "tiny_qwenedit", "build_tiny_qwenedit")
tiny_qwenedit_plus_diffusers = built("tiny_qwenedit_plus", "tiny_qwenedit", "build_tiny_qwenedit", plus=True)
# every component (an editing model encodes its reference picture), a 64 x 64 default size
tiny_qwenedit_onnx = exported("tiny_qwenedit_onnx", "tiny_qwenedit_diffusers", export_every(64))
tiny_qwenedit_plus_onnx = exported("tiny_qwenedit_plus_onnx", "tiny_qwenedit_plus_diffusers", export_every(64))


SLOW_ONLY_FIXTURES |= {"tiny_qwenedit_diffusers", "tiny_qwenedit_plus_diffusers", "tiny_qwenedit_onnx",
                       "tiny_qwenedit_plus_onnx"}
