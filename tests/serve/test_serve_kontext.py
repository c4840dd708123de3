"""POST /v1/images/edits on an editing model (issue 42, acceptance 2): the openai client's `images.edit` on a tiny
FLUX.1 Kontext folder gives the library's `Pipeline(folder)(prompt, image=picture, seed=)` image bit for bit; the
picture is the reference (no resize notice, no strength); a mask, a strength, or a text-only request to the
editing model is a one-line 400."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
httpx = pytest.importorskip("httpx")

from test_serve import assert_clean_error  # noqa: E402
from test_serve_edits import edit_matches_the_library, editing_server, openai_mask, png  # noqa: E402

pytestmark = pytest.mark.slow

KW = {"steps": 3, "seed": 5, "guidance": 2.5}


@pytest.fixture(scope="module")
def server(tiny_kontext_onnx):
    yield from editing_server("kontext", tiny_kontext_onnx, "40x24,32x32")


def test_openai_client_edit_matches_the_library(server, tiny_kontext_onnx):
    from tiny_kontext import picture

    resp = edit_matches_the_library(server, tiny_kontext_onnx, "kontext", picture(70, 100, seed=1), 24, 40, **KW)
    settings = resp.model_extra["settings"]
    assert settings["edit"] == "reference" and settings["strength"] is None and settings["image_size"] == "100x70"
    assert "notices" not in resp.model_extra  # the picture is a reference: its family sizes it, no resize notice


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
