"""`--arch sd15`: Stable Diffusion v1.5-sized components (random weights) for the speed/memory/size columns.

The model is built and exported by `bench/sd15_fullsize.py` (its `build` and `export` phases, each a
subprocess with one thread), into a work folder that is reused when it already holds both the
diffusers folder and the export.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from ..errors import UserError
from .variants import repo_root


def fullsize_script() -> Path:
    return repo_root() / "bench" / "sd15_fullsize.py"


def prepare_sd15(work: Path, threads: int = 1, progress: bool = True) -> tuple[Path, Path]:
    """(exported model folder, diffusers folder) of the SD1.5-sized model under `work`, building it if needed."""
    work = Path(work).resolve()
    onnx_dir, diff_dir = work / "onnx", work / "diffusers"
    ready = (onnx_dir / "manifest.json").is_file() and (diff_dir / "model_index.json").is_file()
    if ready:
        return onnx_dir, diff_dir
    script = fullsize_script()
    if not script.is_file():
        raise UserError(f"--arch sd15 needs {script} to build the full-size model (or a ready model in {work})")
    try:
        import diffusers  # noqa: F401
        import torch  # noqa: F401
    except ImportError:
        raise UserError("--arch sd15 builds the model with torch and diffusers: install the export extra") from None
    for phase in ("build", "export"):
        if phase == "build" and (diff_dir / "model_index.json").is_file():
            continue
        cmd = [sys.executable, str(script), "--phase", phase, "--work", str(work), "--threads", str(threads)]
        print(f"bench: building the SD1.5-sized model: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, env={**os.environ})
        if proc.returncode != 0:
            raise UserError(f"--arch sd15: `{script.name} --phase {phase}` failed (exit {proc.returncode})")
    if not (onnx_dir / "manifest.json").is_file():
        raise UserError(f"--arch sd15: no exported model at {onnx_dir} after the build")
    return onnx_dir, diff_dir
