"""Our export folder, loaded by Hugging Face Optimum's ORTStableDiffusionPipeline, gives our images.

Optimum lives in its own venv (`.venv-optimum`, never the project's): the test exports the tiny
fixture with our exporter, generates with `onnxdiffusion.runtime.Pipeline`, then runs
`bench/optimum_interop.py` with the optimum venv's Python on the same folder and latents and
compares the uint8 images.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxdiffusion.evaluate.metrics import psnr
from onnxdiffusion.runtime import Pipeline

pytestmark = pytest.mark.peers  # make test-fast leaves the peers out (make test runs them)

ROOT = Path(__file__).resolve().parents[2]
OPTIMUM_PYTHON = ROOT / ".venv-optimum" / "bin" / "python"
SCRIPT = ROOT / "bench" / "optimum_interop.py"


def _optimum_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TQDM_DISABLE="1", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    return env


@pytest.fixture(scope="module")
def optimum_python() -> Path:
    if not OPTIMUM_PYTHON.exists():
        pytest.skip(f"no optimum venv at {OPTIMUM_PYTHON} (create it with optimum-onnx[onnxruntime] to run this test)")
    probe = subprocess.run(
        [str(OPTIMUM_PYTHON), "-c", "import importlib.util as u, sys; sys.exit(u.find_spec('optimum.onnxruntime') is None)"],
        capture_output=True, text=True, env=_optimum_env(), timeout=60,
    )
    if probe.returncode != 0:
        pytest.skip(f"{OPTIMUM_PYTHON} cannot import optimum.onnxruntime: {probe.stderr.strip()[-300:]}")
    return OPTIMUM_PYTHON


CASES = {
    # epsilon, "leading" spacing, classifier-free guidance with a negative prompt, batch 2
    "epsilon-cfg": ("tiny_onnx", dict(prompt="a red circle on the left", negative_prompt="a green ring",
                                      steps=8, guidance=5.0, seed=3, batch=2)),
    # v-prediction, "trailing" spacing, no guidance (UNet batch 1), batch 1
    "v-nocfg": ("tiny_v_onnx", dict(prompt="a blue star", negative_prompt=None, steps=6, guidance=1.0, seed=1, batch=1)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_optimum_pipeline_loads_our_folder_and_matches(case, optimum_python, request, tmp_path):
    fixture, s = CASES[case]
    folder = request.getfixturevalue(fixture)

    ours = Pipeline.from_folder(folder)(
        s["prompt"], negative_prompt=s["negative_prompt"], steps=s["steps"], sampler="ddim",
        guidance=s["guidance"], seed=s["seed"], batch=s["batch"],
    )
    latents = tmp_path / "latents.npy"
    out = tmp_path / "optimum.npy"
    np.save(latents, ours.init_latents)

    cmd = [str(optimum_python), str(SCRIPT), str(folder), str(latents), str(out),
           "--prompt", s["prompt"], "--steps", str(s["steps"]), "--guidance", str(s["guidance"])]
    if s["negative_prompt"] is not None:
        cmd += ["--negative-prompt", s["negative_prompt"]]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_optimum_env(), cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, f"optimum run failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"

    theirs = np.load(out)
    assert theirs.dtype == np.uint8
    assert theirs.shape == ours.images.shape
    value = psnr(ours.images, theirs)
    print(f"{case}: PSNR ours vs optimum = {value} dB", file=sys.stderr)
    assert value >= 40.0
