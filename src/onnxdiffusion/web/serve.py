"""The page folder at `/web` of `onnxdiffusion serve --web DIR`: static files, cross-origin isolated (COOP/COEP
headers), so onnxruntime-web may use threads there."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

ISOLATION = {"Cross-Origin-Opener-Policy": "same-origin", "Cross-Origin-Embedder-Policy": "require-corp"}


def check_page_folder(folder: str | Path) -> Path:
    from .export import _is_page_folder

    path = Path(folder)
    if not path.is_dir() or not _is_page_folder(path):
        raise UserError(f"--web {folder}: not a page folder written by `onnxdiffusion export-web`")
    return path


def mount_web(app, folder: str | Path) -> None:
    """Serve `folder` at /web/ (and redirect /web there: the page's URLs are relative to it)."""
    from starlette.responses import RedirectResponse
    from starlette.staticfiles import StaticFiles

    path = check_page_folder(folder)

    class IsolatedFiles(StaticFiles):
        def file_response(self, *args, **kwargs):
            response = super().file_response(*args, **kwargs)
            response.headers.update(ISOLATION)
            return response

    @app.get("/web", include_in_schema=False)
    async def web_root():
        return RedirectResponse("/web/")

    app.mount("/web/", IsolatedFiles(directory=str(path), html=True), name="web")
