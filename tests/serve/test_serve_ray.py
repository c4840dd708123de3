"""`serve --ray --replicas 2`: the same app on Ray Serve answers over real HTTP with the same images.

Runs only where the `ray` extra is installed (CI does not install it: large, and its local cluster
takes ~30-60 s to start on two cores); skipped with that reason otherwise.
"""

from __future__ import annotations

import importlib.util
import os
import time

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
from test_serve import Server, b64_image, reference, serve_models  # noqa: E402,F401  (fixtures shared)

pytestmark = [pytest.mark.skipif(
    importlib.util.find_spec("ray") is None or not os.environ.get("ONNXDIFFUSION_TEST_RAY"),
    reason="Ray tests are opt-in (ONNXDIFFUSION_TEST_RAY=1 with the `ray` extra installed): they start a local Ray "
           "cluster, ~30-60 s, which times out on an overloaded machine; CI does not install ray"), pytest.mark.slow]


def test_ray_serve_two_replicas(serve_models, reference):
    srv = Server({"fp32": serve_models["fp32"], "int8": serve_models["int8"]}, "--ray", "--replicas", "2",
                 "--buckets", "64x64,128x128", ready_timeout=900)
    try:
        c = srv.client
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["int8"]["status"] == "ok" and models["int8"]["batch_invariant"] is False
        r = c.post("/v1/images/generations", json={"prompt": "a large green triangle", "steps": 4, "seed": 9,
                                                   "model": "fp32", "n": 2})
        assert r.status_code == 200, r.text
        assert r.json()["settings"]["seed"] == 9
        want = reference("a large green triangle", 9, 4, n=2)
        for item, ref in zip(r.json()["data"], want):
            np.testing.assert_array_equal(b64_image(item), ref)
        job = c.post("/v1/jobs", json={"prompt": "a red circle", "steps": 3, "seed": 1}).json()
        deadline = time.monotonic() + 120
        while c.get(f"/v1/jobs/{job['id']}").json()["status"] != "succeeded":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        bad = c.post("/v1/images/generations", json={"prompt": "x", "model": "nope"})
        assert bad.status_code == 400 and "unknown model" in bad.json()["error"]["message"]
    finally:
        srv.stop(timeout=120)
