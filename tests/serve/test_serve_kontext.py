"""POST /v1/images/edits on an editing model (issue 42, acceptance 2): the openai client's `images.edit` on a tiny
FLUX.1 Kontext folder gives the library's `Pipeline(folder)(prompt, image=picture, seed=)` image bit for bit; the
picture is the reference (no resize notice, no strength); a mask, a strength, or a text-only request to the
editing model is a one-line 400."""

from __future__ import annotations

import base64

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import Server, assert_clean_error, decode_png  # noqa: E402
from test_serve_edits import openai_mask, png  # noqa: E402

pytestmark = pytest.mark.slow

KW = {"steps": 3, "seed": 5, "guidance": 2.5}


@pytest.fixture(scope="module")
def server(tiny_kontext_onnx):
    srv = Server({"kontext": tiny_kontext_onnx}, "--buckets", "40x24,32x32", "--workers", "1", "--max-queue", "4",
                 "--timeout", "300")
    yield srv
    srv.stop()


def test_openai_client_edit_matches_the_library(server, tiny_kontext_onnx):
    openai = pytest.importorskip("openai")
    from tiny_kontext import picture

    from onnxdiffusion.runtime import Pipeline

    rgb = picture(70, 100, seed=1)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)
    resp = client.images.edit(image=("in.png", png(rgb), "image/png"), prompt="make the circle blue", model="kontext",
                              size="40x24", response_format="b64_json", extra_body=KW)
    settings = resp.model_extra["settings"]
    assert settings["edit"] == "reference" and settings["strength"] is None and settings["image_size"] == "100x70"
    assert "notices" not in resp.model_extra  # the picture is a reference: its family sizes it, no resize notice
    want = Pipeline.from_folder(tiny_kontext_onnx, threads=1)("make the circle blue", image=rgb, width=40, height=24,
                                                               **KW).images
    np.testing.assert_array_equal(decode_png(base64.b64decode(resp.data[0].b64_json)), want[0])


def test_mask_strength_and_text_only_are_400(server):
    from tiny_kontext import picture

    rgb = picture(24, 40)
    rgba, _ = openai_mask(24, 40)
    cases = [
        ({"image": ("in.png", png(rgb), "image/png"), "mask": ("m.png", png(rgba), "image/png")}, {}, "mask"),
        ({"image": ("in.png", png(rgb), "image/png")}, {"strength": "0.5"}, "strength"),
    ]
    for files, extra, param in cases:
        r = server.client.post("/v1/images/edits", files=files, data={"prompt": "make it blue", "model": "kontext",
                                                                      **extra})
        assert_clean_error(r, 400, param)
    r = server.client.post("/v1/images/generations", json={"prompt": "a red circle", "model": "kontext"})
    assert_clean_error(r, 400, "model")
    assert "edits pictures by instruction" in r.json()["error"]["message"]
