"""How a hardware profile meets a model folder: which backbone file runs, with which providers.

A folder whose backbone needs a provider (a TensorRT-only NVFP4 / FP8 backbone installed by
`fixup-trt` or built in the TensorRT form) keeps its previous backbone as a declared fallback;
that one runs when the profile itself fell back (for example tensorrt-nvfp4 -> cpu-fp32 on a
machine without TensorRT). Everything else is a one-line error, never a silent switch.
"""

from __future__ import annotations

import warnings

from ..errors import UserError
from ..folder.manifest import Component, Manifest, PipelineInfo


def resolve_for_folder(spec, manifest: Manifest):
    """The profile to run (its fallback where this machine cannot run it), checked against the folder."""
    from ..profiles import precision_family, resolve

    resolved = resolve(spec)
    from ..families import get_family

    unet = manifest.components[get_family(manifest.family).backbone]
    if resolved.note and not (resolved.fell_back and unet.requires_provider and unet.fallback):
        warnings.warn(resolved.note, stacklevel=3)  # else one line says it all, with the fallback backbone (below)
    have = precision_family(unet.precision)
    want = resolved.profile.precision
    if not resolved.fell_back and want not in ("any", have):
        hint = ""
        if resolved.profile.recipe:
            opts = " ".join(f"-O {k}={','.join(v) if isinstance(v, list) else v}"
                            for k, v in resolved.profile.recipe.items() if k != "name")
            hint = f" (make one: onnxdiffusion quantize FP32_FOLDER OUT --recipe {resolved.profile.recipe['name']}{' ' + opts if opts else ''})"
        raise UserError(f"profile {resolved.profile.name} runs the {want} backbone; this folder's is {have}{hint}")
    return resolved


def backbone_entry(folder, unet: Component, provider: str, resolved) -> Component:
    """The manifest entry of the backbone file to load: the backbone, or its declared fallback."""
    needs = unet.requires_provider
    if not needs or needs == provider:
        return unet
    fallback = unet.fallback
    if resolved is not None and resolved.fell_back and fallback:
        note = f"{resolved.note}; " if resolved.note else ""
        warnings.warn(f"{note}the {unet.precision} backbone needs {needs}: running the folder's "
                      f"{fallback.precision} fallback backbone on {provider}", stacklevel=3)
        return fallback.with_session_options({})
    profile = {"nvfp4": "tensorrt-nvfp4", "fp8": "tensorrt-fp8"}.get(str(unet.precision), f"a {needs} profile")
    extra = " (it falls back to the fp32 backbone kept in this folder)" if fallback else ""
    raise UserError(f"this folder's backbone is {unet.precision} for {needs}; it cannot run on {provider}: "
                    f"use --profile {profile}{extra}")


def session_providers(resolved, unet: Component, info: PipelineInfo, threads: int | None = None) -> dict:
    """{"backbone": providers, "other": providers}, or Nones (make_session's default) without a profile."""
    if resolved is None:
        return {"backbone": None, "other": None}
    from ..profiles.providers import providers

    p = resolved.profile
    return {"backbone": providers(p, unet, info, backbone=True, threads=threads),
            "other": providers(p, threads=threads)}


def foreign_ops_note(foreign_ops, provider: str) -> str | None:
    """One line when an OpenVINO backbone holds ONNX Runtime's own operators that are not written out at load
    (`foreign_ops`: op type -> count, onnxio.session.GraphIO.foreign_ops): OpenVINO cannot run them, so the
    provider splits the graph around each (ORT's fused attention: 4.2x slower at SD1.5 size, experiments/amx)."""
    if provider != "openvino" or not foreign_ops:
        return None
    return (f"the backbone holds {sum(foreign_ops.values())} ONNX Runtime operators ({', '.join(sorted(foreign_ops))}) "
            "that OpenVINO cannot run: each runs on the CPU provider between OpenVINO subgraphs (the fused attention is "
            "written out at load only in a graph that holds its weights); quantize (again) with -O stored=qdq, which "
            "writes the attention out (int8), or export with --no-fuse-attention (fp32) for a graph OpenVINO takes whole")
