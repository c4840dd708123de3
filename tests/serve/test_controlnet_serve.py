"""POST /v1/images/edits with a ControlNet (extension fields `controlnet` = NAME[:SCALE[:START:END]] and a
`control` file): the image equals the library's `Pipeline(...)(prompt, image=, strength=, seed=, controlnets=)`;
a bad name or a half-given pair is a 400 in OpenAI's error shape."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
pytest.importorskip("httpx")

from test_serve import Server, assert_clean_error, decode_png  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "a red circle on the left"


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def folder(tiny_onnx, tiny_diffusers, tmp_path_factory):
    from controlnet_helpers import build_tiny_controlnet

    from onnxdiffusion.export.controlnet import add_controlnet

    root = tmp_path_factory.mktemp("serve_cn")
    net = build_tiny_controlnet(tiny_diffusers, root / "net")
    add_controlnet(tiny_onnx, net, "edges", out=root / "model")
    return root / "model"


@pytest.fixture(scope="module")
def server(folder):
    srv = Server({"cn": folder}, "--buckets", "32x32", "--workers", "1", "--timeout", "120")
    yield srv
    srv.stop()


def test_edit_with_controlnet_is_the_library_image(server, folder):
    from controlnet_helpers import control_image

    from onnxdiffusion.runtime import Pipeline

    picture, control = control_image(32, 20), control_image(32, 21)
    data = {"prompt": PROMPT, "steps": "4", "seed": "5", "strength": "0.8", "controlnet": "edges:0.9:0:0.8",
            "response_format": "b64_json"}
    files = {"image": ("in.png", _png(picture), "image/png"), "control": ("c.png", _png(control), "image/png")}
    resp = server.client.post("/v1/images/edits", data=data, files=files)
    assert resp.status_code == 200, resp.text
    got = decode_png(base64.b64decode(resp.json()["data"][0]["b64_json"]))
    pipe = Pipeline.from_folder(folder)
    kw = dict(image=picture, strength=0.8, seed=5, steps=4, height=32, width=32)
    want = pipe(PROMPT, controlnets=[("edges", control, 0.9, 0.0, 0.8)], **kw).images[0]
    assert np.array_equal(got, want)
    assert not np.array_equal(got, pipe(PROMPT, **kw).images[0])  # the net was used


@pytest.mark.parametrize("data,files,param", [
    ({"controlnet": "nope"}, ("control",), "controlnet"),
    ({"controlnet": "edges"}, (), "controlnet"),
    ({}, ("control",), "controlnet"),
    ({"controlnet": "edges:1:0.9:0.1"}, ("control",), "controlnet"),
])
def test_bad_controlnet_fields_are_400(server, data, files, param):
    from controlnet_helpers import control_image

    pic = _png(control_image(32, 22))
    sent = {"image": ("in.png", pic, "image/png"), **{k: ("c.png", pic, "image/png") for k in files}}
    resp = server.client.post("/v1/images/edits", data={"prompt": PROMPT, "steps": "2", **data}, files=sent)
    assert_clean_error(resp, 400, param)
