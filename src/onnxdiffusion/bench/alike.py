"""What keeps a bench's rows alike (issue 43): one sampler and one decoder for every row, peers included.

A peer is told the bench's sampler in its own terms (`peer_sampler`) or the row says, in one line, why it cannot
run it (`peer_sampler_skip`); with --decoder tiny each row decodes with the tiny autoencoder (TAESD) or says why
not (`tiny_skip`). Never a row that quietly runs something else.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..folder.artifacts import read_manifest
from ..folder.paths import shown_path

TINY_VAE_DIR = "vae_tiny"  # the diffusers source's AutoencoderTiny (TAESD) folder, for torch and the OpenVINO peer

# The samplers each peer can run, by our sampler name -> the peer's own: the diffusers-based peers swap in the
# scheduler class diffusers reproduces that sampler with (samplers/config.SAMPLER_CLASS); stable-diffusion.cpp
# has its own sample methods, and runs DDIM with trailing timesteps only (same update rule and backbone calls).
_DIFFUSERS_PEER_SAMPLERS = ("ddim", "euler", "euler_a", "dpmpp_2m", "pndm", "unipc", "lcm", "tcd")
# flow_euler: sd.cpp's euler on a flow-matching model (Z-Image, FLUX.2) is the flow-match Euler step
SDCPP_SAMPLERS = {"ddim": "ddim_trailing", "euler": "euler", "flow_euler": "euler", "euler_a": "euler_a", "dpmpp_2m": "dpm++2m",
                  "lcm": "lcm", "tcd": "tcd"}


def peer_sampler(peer: str, sampler: str) -> str | None:
    """What the peer is told to run for our `sampler` (a diffusers scheduler class, or an sd.cpp sample method);
    None where it cannot run it."""
    if peer == "sdcpp":
        return SDCPP_SAMPLERS.get(sampler)
    if sampler in _DIFFUSERS_PEER_SAMPLERS:
        from ..samplers.config import SAMPLER_CLASS

        return SAMPLER_CLASS[sampler]
    return None


def peer_sampler_skip(peer: str, sampler: str) -> str | None:
    """One line when a peer cannot run the bench's sampler (a row never runs another sampler than the others)."""
    if peer_sampler(peer, sampler) is not None:
        return None
    can = sorted(SDCPP_SAMPLERS if peer == "sdcpp" else _DIFFUSERS_PEER_SAMPLERS)
    return (f"the {peer} peer cannot run the {sampler} sampler the other rows run (it runs {', '.join(can)}): "
            f"pass --sampler with one of those")


def tiny_skip(spec) -> str | None:
    """Why a row (a VariantSpec) cannot decode with the tiny autoencoder, or None."""
    from ..families.tiny_vae import DECODER

    if spec.kind == "ort" and spec.folder is not None:
        try:
            has = DECODER in read_manifest(spec.folder).components
        except UserError as e:
            return str(e)
        return None if has else f"no {DECODER} in {shown_path(spec.folder)} (export it with --tiny-vae)"
    if spec.kind == "peer" and spec.peer != "openvino":
        return f"the {spec.peer} peer runs the VAE only (--decoder tiny: OpenVINO and ours)"
    if spec.folder is not None and not (Path(spec.folder) / TINY_VAE_DIR).is_dir():
        return f"no AutoencoderTiny folder {TINY_VAE_DIR}/ in the diffusers source {shown_path(spec.folder)}"
    return None
