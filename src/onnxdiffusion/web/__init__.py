"""The browser: `export-web` writes a static page running a model folder's whole pipeline on onnxruntime-web."""

__all__ = ["export_web"]


def __getattr__(name):  # lazy: `python -m onnxdiffusion.web.npm` (make web-deps) imports nothing else
    if name == "export_web":
        from .export import export_web

        return export_web
    raise AttributeError(name)
