"""The shipped ControlNet's diffusers weights, rebuilt from the shipped ONNX folder's copy of the same net.

    python models/training/controlnet_weights.py [ONNX_MODEL [NET_DIR]]
    (defaults: models/shapes-sd-onnx and models/controlnets/shapes-sd-position; `make controlnet-weights`)

The tree carried the trained net twice: NET_DIR/diffusion_pytorch_model.safetensors (float16, what training wrote)
and ONNX_MODEL/controlnets/position/model.onnx (`add-controlnet` of it). The ONNX copy is the one the run time
needs (torch-free, its hash in the folder's manifest), and it keeps every parameter exactly: export stores
exact-float16 weights as float16 (onnxio/fp16_storage.py) and constant folding only reshapes or transposes them.
So only the ONNX copy is tracked; this writes the diffusers file back, byte for byte the one training wrote:
its sha256 is NET_DIR/weights.sha256, checked before the file is put in place (a mismatch writes nothing).

Where each parameter is in the graph (torch's exporter names what it folds after the node that consumes it):
  `model.NAME` / `model.NAME__fp16`             the parameter itself (a few biases kept in float32: exact fp16)
  a Mul / Add constant of `/model/PATH/Mul|Add`  GroupNorm PATH.weight / PATH.bias, reshaped to [C, 1, 1]
  a MatMul constant of `/model/PATH/MatMul`      Linear PATH.weight (no bias), transposed
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
ONNX_MODEL = ROOT / "models" / "shapes-sd-onnx"
NET_DIR = ROOT / "models" / "controlnets" / "shapes-sd-position"
NET_NAME = "position"
WEIGHTS = "diffusion_pytorch_model.safetensors"
FOLDED = {"Mul": "weight", "Add": "bias", "MatMul": "weight"}


def parameters(onnx_path: Path) -> dict[str, np.ndarray]:
    """The net's float16 state dict, read from its ONNX graph."""
    import onnx
    from onnx import numpy_helper

    graph = onnx.load(str(onnx_path)).graph
    # fp16 storage puts a Cast between a stored tensor and its consumer: follow it
    cast = {n.input[0]: n.output[0] for n in graph.node if n.op_type == "Cast"}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    out: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        value = numpy_helper.to_array(init)
        if init.name.startswith("model."):
            key = init.name.removeprefix("model.").removesuffix("__fp16")
        else:
            users = consumers.get(cast.get(init.name, init.name), [])
            if len(users) != 1 or users[0].op_type not in FOLDED or not users[0].name.startswith("/model/"):
                raise ValueError(f"{onnx_path}: constant {init.name} is not a folded parameter")
            node = users[0]
            key = ".".join(node.name.removeprefix("/model/").split("/")[:-1]) + "." + FOLDED[node.op_type]
            value = value.T if node.op_type == "MatMul" else value.reshape(-1)
        half = value.astype(np.float16)
        if not np.array_equal(half.astype(value.dtype), value):
            raise ValueError(f"{onnx_path}: {init.name} is not exact in float16")
        if key in out:
            raise ValueError(f"{onnx_path}: {key} found twice")
        out[key] = np.ascontiguousarray(half)
    return out


def weights_bytes(onnx_model: Path = ONNX_MODEL, net_dir: Path = NET_DIR, name: str = NET_NAME) -> bytes:
    """The safetensors file's bytes, checked against net_dir/weights.sha256."""
    from safetensors.numpy import save

    data = save(parameters(onnx_model / "controlnets" / name / "model.onnx"), metadata={"format": "pt"})
    want = (net_dir / "weights.sha256").read_text().split()[0]
    got = hashlib.sha256(data).hexdigest()
    if got != want:
        raise ValueError(f"rebuilt {WEIGHTS} has sha256 {got}, {net_dir / 'weights.sha256'} says {want}")
    return data


def write_weights(onnx_model: Path = ONNX_MODEL, net_dir: Path = NET_DIR, out: Path | None = None) -> Path:
    """Write the diffusers folder's weights into `out` (default: net_dir itself) beside a copy of its config;
    returns the folder (a complete diffusers ControlNetModel folder)."""
    import shutil

    from onnxdiffusion.folder.artifacts import atomic_write_bytes

    out = Path(out or net_dir)
    out.mkdir(parents=True, exist_ok=True)
    if out.resolve() != Path(net_dir).resolve():
        shutil.copy2(net_dir / "config.json", out / "config.json")
    atomic_write_bytes(out / WEIGHTS, weights_bytes(onnx_model, net_dir))
    return out


def main() -> None:
    args = [Path(a) for a in sys.argv[1:]]
    if len(args) > 2:
        sys.exit("usage: controlnet_weights.py [ONNX_MODEL [NET_DIR]]")
    try:
        print(f"wrote {write_weights(*args) / WEIGHTS}")
    except (OSError, ValueError) as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
