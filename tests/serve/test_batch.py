"""`onnxdiffusion batch`: offline rendering of a prompt file, resumable; `--ray` gives the same images.

The Ray test runs only where the `ray` extra is installed (CI does not install it: it is large and
its local cluster takes ~30 s to start on two cores); it is skipped with that reason otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_cli_here

ROOT = Path(__file__).resolve().parents[2]


def _cli(*args, timeout=600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "onnxdiffusion.cli", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def _prompts(path: Path, count: int) -> Path:
    lines = []
    for i in range(count):
        item = {"id": f"p{i:03d}", "prompt": f"a {['red', 'blue', 'green'][i % 3]} circle", "seed": i, "steps": 3}
        if i % 4 == 1:
            item["size"] = "128x64"
        if i % 3 == 2:
            item["sampler"] = "euler_a"
        lines.append(json.dumps(item))
    path.write_text("\n".join(lines) + "\n")
    return path


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path))


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    prompts = _prompts(root / "prompts.jsonl", 7)
    out = root / "out"
    proc = run_cli_here("batch", prompts, out, "--batch-size", 3)  # in-process: test_faults runs batch's process
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "7 rendered, 0 already done" in proc.stdout
    return prompts, out


@pytest.mark.slow
def test_batch_matches_generate_and_resumes(rendered):
    from onnxdiffusion.runtime import Pipeline

    prompts, out = rendered
    pipe = Pipeline.from_folder(threads=1)
    for i in (0, 1, 2):  # plain, 128x64, euler_a (ancestral noise drawn per item, as `generate` draws it)
        size = {"width": 128, "height": 64} if i % 4 == 1 else {}
        sampler = "euler_a" if i % 3 == 2 else "ddim"
        want = pipe(f"a {['red', 'blue', 'green'][i % 3]} circle", seed=i, steps=3, sampler=sampler, **size).images[0]
        np.testing.assert_array_equal(_pixels(out / f"p{i:03d}.png"), want)
    results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in results] == [f"p{i:03d}" for i in range(7)]
    before = {p.name: p.read_bytes() for p in out.glob("*.png")}
    (out / "p004.png").unlink()
    proc = run_cli_here("batch", prompts, out, "--quiet")
    assert proc.returncode == 0 and "1 rendered, 6 already done" in proc.stdout, proc.stdout + proc.stderr
    assert {p.name: p.read_bytes() for p in out.glob("*.png")} == before


@pytest.mark.parametrize("content, message", [
    ('{"prompt": "x"}\nnot json\n', ":2: not valid JSON"),
    ('{"text": "x"}\n', "string 'prompt'"),
    ('{"prompt": "x", "id": "../evil"}\n', "plain file name"),
    ('{"prompt": "x", "id": "a"}\n{"prompt": "y", "id": "a"}\n', "duplicate id"),
    ('{"prompt": "x", "colour": 1}\n', "unknown field"),
    ('{"prompt": "x", "sampler": "magic"}\n', "unknown sampler"),
    ('{"prompt": "x", "size": "65x64"}\n', "multiple of 16"),
])
def test_batch_bad_input(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    proc = run_cli_here("batch", path, tmp_path / "out", "--quiet")  # in-process: no interpreter start per case
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not list((tmp_path / "out").glob("*.png")) if (tmp_path / "out").exists() else True


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("ray") is None or not os.environ.get("ONNXDIFFUSION_TEST_RAY"),
                    reason="Ray tests are opt-in (ONNXDIFFUSION_TEST_RAY=1 with the `ray` extra installed): they start "
                           "a local Ray cluster, ~30-60 s, which times out on an overloaded machine; CI does not install ray")
def test_batch_on_ray_gives_the_same_images(rendered, tmp_path):
    prompts, out = rendered
    ray_out = tmp_path / "ray"
    proc = _cli("batch", prompts, ray_out, "--ray", "--actors", 2, "--batch-size", 2, "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "7 rendered" in proc.stdout
    for png in out.glob("*.png"):
        np.testing.assert_array_equal(_pixels(ray_out / png.name), _pixels(png))
