"""POST /v1/images/edits on Qwen-Image-Edit (issue 42, acceptance 2): the openai client's `images.edit` on the tiny
Qwen-Image-Edit folder gives the library's `Pipeline(folder)(prompt, image=picture, seed=)` image bit for bit (the
picture through the VL text encoder's vision tower and as reference latents)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve_edits import edit_matches_the_library, editing_server  # noqa: E402

pytestmark = pytest.mark.slow

KW = {"steps": 2, "seed": 5, "guidance": 4.0}


@pytest.fixture(scope="module")
def server(tiny_qwenedit_onnx):
    yield from editing_server("qwenedit", tiny_qwenedit_onnx, "160x96,64x64")


def test_openai_client_edit_matches_the_library(server, tiny_qwenedit_onnx):
    rgb = np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    resp = edit_matches_the_library(server, tiny_qwenedit_onnx, "qwenedit", rgb, 96, 160, **KW)
    assert resp.model_extra["settings"]["edit"] == "reference"
