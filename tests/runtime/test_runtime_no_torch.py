"""The run-time side never imports torch (nor diffusers / transformers)."""

import subprocess
import sys

CODE = """
import sys
from onnxdiffusion.runtime import Pipeline
pipe = Pipeline.from_folder(sys.argv[1])
result = pipe("a red circle on the left", steps=2, sampler="dpmpp_2m")
assert result.images.dtype.name == "uint8"
import onnxdiffusion.cli, onnxdiffusion.samplers, onnxdiffusion.evaluate.metrics
import onnxdiffusion.serve, onnxdiffusion.serve.manager, onnxdiffusion.serve.batch, onnxdiffusion.serve.jobs
heavy = sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules)
print("HEAVY", heavy)
# the service's frameworks load only when a server or Ray is started
print("SERVING", sorted(m for m in ("fastapi", "uvicorn", "ray", "starlette", "prometheus_client") if m in sys.modules))
"""


def test_generate_without_torch(tiny_onnx):
    proc = subprocess.run([sys.executable, "-c", CODE, str(tiny_onnx)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "HEAVY []" in proc.stdout
    assert "SERVING []" in proc.stdout
