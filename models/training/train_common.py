"""What the training scripts share: the learning-rate schedule, the draw from the VAE posterior, and writing
checkpoints and model folders so that a run killed mid-write leaves the previous file or folder, never half of one."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import torch


def lr_at(step: int, total: int, base: float, warmup: int) -> float:
    """Linear warm-up over `warmup` steps, then a cosine decay to zero at `total`."""
    if step < warmup:
        return base * (step + 1) / warmup
    return base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def posterior_sample(mu: torch.Tensor, sd: torch.Tensor, scale: float, shift: float = 0.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """A draw from the VAE's diagonal Gaussian posterior, normalised as diffusers' pipelines do: (z - shift) * scale.
    Without a generator the noise comes from torch's global one (`randn_like`, as the scripts always drew it)."""
    eps = torch.randn_like(mu) if generator is None else torch.randn(mu.shape, generator=generator)
    return (mu + sd * eps - shift) * scale


def save_state(state: dict, path: Path) -> None:
    """torch.save to PATH with .tmp as its suffix, then renamed over PATH."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.replace(path)


def save_arrays(path: Path, **arrays) -> None:
    """np.savez to PATH (.npz) with .tmp.npz as its suffix, then renamed over PATH."""
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **arrays)
    tmp.replace(path)


def save_folder(model, out: Path, keep: tuple[str, ...] = ()) -> None:
    """model.save_pretrained (safetensors) into OUT.tmp, then in place of OUT; the files `keep` names (a
    hand-written card, say) are carried over from the old OUT."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in keep:
        if (out / name).exists():
            shutil.copy(out / name, tmp / name)
    if out.exists():
        shutil.rmtree(out)
    tmp.replace(out)
