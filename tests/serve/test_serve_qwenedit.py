"""POST /v1/images/edits on Qwen-Image-Edit (issue 42, acceptance 2): the openai client's `images.edit` on the tiny
Qwen-Image-Edit folder gives the library's `Pipeline(folder)(prompt, image=picture, seed=)` image bit for bit (the
picture through the VL text encoder's vision tower and as reference latents)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import Server, decode_png  # noqa: E402
from test_serve_edits import png  # noqa: E402

pytestmark = pytest.mark.slow

KW = {"steps": 2, "seed": 5, "guidance": 4.0}


@pytest.fixture(scope="module")
def server(tiny_qwenedit_onnx):
    srv = Server({"qwenedit": tiny_qwenedit_onnx}, "--buckets", "160x96,64x64", "--workers", "1", "--max-queue", "4",
                 "--timeout", "300")
    yield srv
    srv.stop()


def test_openai_client_edit_matches_the_library(server, tiny_qwenedit_onnx):
    openai = pytest.importorskip("openai")
    from onnxdiffusion.runtime import Pipeline

    rgb = np.random.default_rng(1).integers(0, 256, (48, 80, 3), dtype=np.uint8)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    resp = client.images.edit(image=("in.png", png(rgb), "image/png"), prompt="make the circle blue",
                              model="qwenedit", size="160x96", response_format="b64_json", extra_body=KW)
    assert resp.model_extra["settings"]["edit"] == "reference"
    want = Pipeline.from_folder(tiny_qwenedit_onnx, threads=1)("make the circle blue", image=rgb, width=160, height=96,
                                                                **KW).images
    np.testing.assert_array_equal(decode_png(base64.b64decode(resp.data[0].b64_json)), want[0])
