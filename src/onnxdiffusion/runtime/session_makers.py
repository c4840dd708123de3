"""The session makers of a Pipeline: every ONNX Runtime session it (or a technique, quantize, a sampling graph)
makes of the folder's files, with the pipeline's provider chain per role, threads and memory options.

A mixin of runtime/pipeline.Pipeline, kept apart so the Pipeline's module holds its core (loading the sessions,
conditioning, the sampler table, the generation entry points).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from ..folder.artifacts import component_path
from ..folder.manifest import Component, confined
from .loading import backbone_session as _backbone_session, disabled as _disabled
from .session import make_session


class SessionMakers:
    """Needs from the host: folder, manifest, provider, memory, _threads, _chain (role -> providers),
    _backbone_info (the backbone's manifest entry as run here)."""

    @property
    def threads(self) -> int | None:  # intra-op threads of every session this pipeline makes (None: ORT's)
        return self._threads

    def providers_for(self, role: str) -> list | None:  # "backbone" | "other"; None: make_session's default
        return self._chain.get(role)

    def session_maker(self, role: str, entry: Component | None = None):
        """make(path, **make_session's options) -> a session of one of the folder's files with this pipeline's
        provider chain for `role` ("backbone" | "other"), threads and memory options; the backbone's through
        loading.backbone_session (the entry's optimizers left off, dead attention queries dropped), another
        component's leaving off what its manifest `entry` (if given) asks to."""
        if role == "backbone":
            return partial(_backbone_session, entry=entry or self._backbone_info, provider=self.provider,
                           threads=self._threads, providers=self._chain["backbone"], memory=self.memory, checked=True)
        off = {"disabled_optimizers": _disabled(entry)} if entry is not None else {}
        return partial(make_session, provider=self.provider, threads=self._threads, providers=self._chain[role],
                       memory=self.memory, **off)

    def component_session(self, name: str, **options):  # a non-backbone component's; options: make_session's
        return self.session_maker("other")(component_path(self.folder, self.manifest, name), **options)

    @property
    def backbone_path(self) -> Path:
        """The backbone's ONNX file (inside the folder)."""
        return confined(self.folder, self._backbone_info.path, "backbone")

    def backbone_session_maker(self, disabled_optimizers: bool = False):
        """make(bytes | path) -> a session of a backbone piece (a cut, a residual-taking copy) with the backbone's
        threads, memory options and providers; `disabled_optimizers`: also the passes its component turns off."""
        import onnxruntime as ort

        from .session import resolve_provider, session_options

        opts = session_options(self._threads, self.memory)
        chain = self._chain.get("backbone") or resolve_provider(self.provider)
        extra = {"disabled_optimizers": off} if disabled_optimizers and (off := _disabled(self._backbone_info)) else {}
        return lambda model: ort.InferenceSession(model, sess_options=opts, providers=chain, **extra)
