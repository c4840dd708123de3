import gc
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


@pytest.fixture(scope="session")
def tiny_diffusers(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny", build_tiny_pipeline)


@pytest.fixture(scope="session")
def tiny_onnx(tiny_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_onnx", lambda root: export_plain(tiny_diffusers, root / "model"))


@pytest.fixture(scope="session")
def tiny_v_diffusers(tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_v", lambda root: build_tiny_pipeline(
        root, prediction_type="v_prediction", spacing="trailing"))


@pytest.fixture(scope="session")
def tiny_v_onnx(tiny_v_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_v_onnx",
                         lambda root: export_plain(tiny_v_diffusers, root / "model"))


# -- other model families (tests/helpers/family_pipelines.py builds them) -------------------------------

@pytest.fixture(scope="session")
def tiny_sdxl_diffusers(tmp_path_factory) -> Path:
    from family_pipelines import build_tiny_sdxl

    return shared_folder(tmp_path_factory, "tiny_sdxl", build_tiny_sdxl)


@pytest.fixture(scope="session")
def tiny_sdxl_onnx(tiny_sdxl_diffusers, tmp_path_factory) -> Path:
    """Exported with the CLI verb, as a user would."""
    from cli_helpers import run_cli

    def build(root: Path) -> Path:
        proc = run_cli("export", tiny_sdxl_diffusers, root / "model")
        assert proc.returncode == 0, proc.stderr[-2000:]
        return root / "model"

    return shared_folder(tmp_path_factory, "tiny_sdxl_onnx", build)


@pytest.fixture(scope="session")
def tiny_sd3_diffusers(tmp_path_factory) -> Path:
    from family_pipelines import build_tiny_sd3

    return shared_folder(tmp_path_factory, "tiny_sd3", build_tiny_sd3)


@pytest.fixture(scope="session")
def tiny_sd3_onnx(tiny_sd3_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_sd3_onnx",
                         lambda root: export_plain(tiny_sd3_diffusers, root / "model"))


# -- Flux and Qwen-Image (tests/helpers/tiny_families.py builds them) -----------------------------------

@pytest.fixture(scope="session")
def tiny_flux_diffusers(tmp_path_factory) -> Path:
    from tiny_families import build_tiny_flux

    return shared_folder(tmp_path_factory, "tiny_flux", build_tiny_flux)


@pytest.fixture(scope="session")
def tiny_qwenimage_diffusers(tmp_path_factory) -> Path:
    from tiny_families import build_tiny_qwenimage

    return shared_folder(tmp_path_factory, "tiny_qwenimage", build_tiny_qwenimage)


@pytest.fixture(scope="session")
def tiny_zimage_diffusers(tmp_path_factory) -> Path:
    from tiny_families import build_tiny_zimage

    return shared_folder(tmp_path_factory, "tiny_zimage", build_tiny_zimage)


def export_family(src: Path, out: Path) -> Path:
    """Export the components generate needs (the VAE encoder is left out to keep tests fast), with a
    32x32 default size (the pipelines' own default is 128 latent patches a side)."""
    import json

    from onnxdiffusion.export import ExportOptions, export_pipeline
    from onnxdiffusion.families import family_for_pipeline

    family = family_for_pipeline(json.loads((src / "model_index.json").read_text())["_class_name"])
    names = (*(s.name for s in family.text_encoders), family.backbone, "vae_decoder")
    export_pipeline(src, out, ExportOptions(components=names, default_size=32), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_flux_onnx(tiny_flux_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_flux_onnx", lambda root: export_family(tiny_flux_diffusers, root / "model"))


@pytest.fixture(scope="session")
def tiny_qwenimage_onnx(tiny_qwenimage_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_qwenimage_onnx",
                         lambda root: export_family(tiny_qwenimage_diffusers, root / "model"))


@pytest.fixture(scope="session")
def tiny_zimage_onnx(tiny_zimage_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_zimage_onnx",
                         lambda root: export_family(tiny_zimage_diffusers, root / "model"))


# -- FLUX.2 (tests/helpers/tiny_flux2.py builds them) ------------------------------------------------------

@pytest.fixture(scope="session")
def tiny_flux2_klein_diffusers(tmp_path_factory) -> Path:
    from tiny_flux2 import build_tiny_flux2_klein

    return shared_folder(tmp_path_factory, "tiny_flux2_klein", build_tiny_flux2_klein)


@pytest.fixture(scope="session")
def tiny_flux2_dev_diffusers(tmp_path_factory) -> Path:
    from tiny_flux2 import build_tiny_flux2_dev

    return shared_folder(tmp_path_factory, "tiny_flux2_dev", build_tiny_flux2_dev)


def _export_with_encoder(src: Path, out: Path) -> Path:
    """Every component (the VAE encoder too: FLUX.2 takes reference pictures), a 32x32 default size."""
    from onnxdiffusion.export import ExportOptions, export_pipeline

    export_pipeline(src, out, ExportOptions(default_size=32), progress=False)
    return out


@pytest.fixture(scope="session")
def tiny_flux2_klein_onnx(tiny_flux2_klein_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_flux2_klein_onnx",
                         lambda root: _export_with_encoder(tiny_flux2_klein_diffusers, root / "model"))


@pytest.fixture(scope="session")
def tiny_flux2_dev_onnx(tiny_flux2_dev_diffusers, tmp_path_factory) -> Path:
    return shared_folder(tmp_path_factory, "tiny_flux2_dev_onnx",
                         lambda root: _export_with_encoder(tiny_flux2_dev_diffusers, root / "model"))


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
    "static_folder", "tiny_flux_diffusers", "tiny_flux_onnx", "tiny_loops", "tiny_qwenimage_diffusers",
    "tiny_qwenimage_onnx", "tiny_sd3_onnx", "tiny_sdxl_onnx", "tiny_zimage_diffusers", "tiny_zimage_onnx",
    "tiny_flux2_klein_diffusers", "tiny_flux2_dev_diffusers", "tiny_flux2_klein_onnx", "tiny_flux2_dev_onnx", "flux2_loops"
}


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if item.get_closest_marker("slow") is None
                and SLOW_ONLY_FIXTURES.intersection(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError("tests that build a slow fixture must be marked slow (pytest.mark.slow):\n  "
                                + "\n  ".join(unmarked))


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
@pytest.fixture(scope="session")
def tiny_kontext_diffusers(tmp_path_factory) -> Path:
    from tiny_kontext import build_tiny_kontext

    return shared_folder(tmp_path_factory, "tiny_kontext", build_tiny_kontext)


@pytest.fixture(scope="session")
def tiny_kontext_onnx(tiny_kontext_diffusers, tmp_path_factory) -> Path:
    """Every component, the VAE encoder included (an editing model encodes its reference picture)."""
    from onnxdiffusion.export import ExportOptions, export_pipeline

    def build(root: Path) -> Path:
        export_pipeline(tiny_kontext_diffusers, root / "model", ExportOptions(default_size=32), progress=False)
        return root / "model"

    return shared_folder(tmp_path_factory, "tiny_kontext_onnx", build)


SLOW_ONLY_FIXTURES |= {"tiny_kontext_diffusers", "tiny_kontext_onnx"}
