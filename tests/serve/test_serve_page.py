"""The service's page at `/`, driven in headless Chromium (onnxdiffusion.web.browser) against a `serve` subprocess:
txt2img, img2img from an upload, inpainting with a mask painted by pointer strokes on a history image, a LoRA from
the picker, a ControlNet, cancel mid-run. Each image the page shows is compared with the API's image for the same
settings (bit for bit: one pipeline behind both), so a page that drops or mangles a setting fails.

Tests do not lean on each other's jobs (under `--dist worksteal` each xdist worker has its own server and browser).
Screenshots go to $ONNXDIFFUSION_PAGE_SHOTS when set (docs/images holds the ones docs/verbs/serve.md shows), else
to a temporary folder.
"""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) is not installed")
pytest.importorskip("selenium.webdriver", reason="selenium is not installed")

from test_serve import CHROMEDRIVER, CHROMIUM, EMBEDDED, Server, decode_png  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.browser, pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="/usr/bin/chromium or chromedriver not installed (bash bench/install_chromium.sh)")]

VIOLET = EMBEDDED.parent / "loras" / "shapes-sd-violet.safetensors"


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def from_data_url(url: str) -> bytes:
    assert url.startswith("data:image/png;base64,"), url[:40]
    return base64.b64decode(url.split(",", 1)[1])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from onnxdiffusion.adapters.folder import add_points

    points = tmp_path_factory.mktemp("page") / "sd-lora"
    add_points(EMBEDDED, points)  # run-time LoRA insertion points (the ControlNet comes along)
    srv = Server({"sd": points}, "--buckets", "64x64,128x128", "--workers", "1", "--max-batch", "1",
                 "--lora", f"violet={VIOLET}", "--timeout", "300")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def shots(tmp_path_factory) -> Path:
    folder = Path(os.environ.get("ONNXDIFFUSION_PAGE_SHOTS") or tmp_path_factory.mktemp("shots"))
    folder.mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture(scope="module")
def page(server, shots):
    from onnxdiffusion.web.browser import chrome
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver = chrome()
    driver.set_window_size(1100, 1150)
    wait = WebDriverWait(driver, 240, poll_frequency=0.05)
    driver.get(server.url + "/")
    wait.until(lambda d: "ready" == d.find_element(By.ID, "ready").text)
    yield Page(driver, wait, server, shots, By, Select)
    driver.quit()


class Page:
    """The form's fields, its submit, and the newest job card."""

    def __init__(self, driver, wait, server, shots, by, select):
        self.d, self.wait, self.server, self.shots, self.By, self.Select = driver, wait, server, shots, by, select

    def el(self, id_: str):
        return self.d.find_element(self.By.ID, id_)

    def fill(self, **values) -> None:
        for name, value in values.items():
            el = self.el(name)
            if el.tag_name == "select":
                self.Select(el).select_by_value(str(value))
            else:
                el.clear()
                if value != "":
                    el.send_keys(str(value))

    def submit(self):
        before = len(self.d.find_elements(self.By.CSS_SELECTOR, ".job"))
        self.el("submit").click()
        self.wait.until(lambda d: len(d.find_elements(self.By.CSS_SELECTOR, ".job")) == before + 1
                        or self.el("message").text)
        assert not self.el("message").text, self.el("message").text
        return self.d.find_elements(self.By.CSS_SELECTOR, ".job")[0]

    def finish(self, card, status: str = "succeeded"):
        self.wait.until(lambda d: card.get_attribute("data-status") in ("succeeded", "failed", "cancelled", "timeout"))
        assert card.get_attribute("data-status") == status, card.text
        if status != "succeeded":
            return None
        img = self.wait.until(lambda d: card.find_elements(self.By.CSS_SELECTOR, "img.result"))[0]
        return decode_png(from_data_url(img.get_attribute("src")))

    def job_id(self, card) -> str:
        return card.get_attribute("id")[len("job-"):]

    def shot(self, name: str) -> Path:
        """A small PNG of the window (palette, 0.6 scale): tens of KB, fit for the tracked tree."""
        from PIL import Image

        img = Image.open(io.BytesIO(self.d.get_screenshot_as_png())).convert("RGB")
        img = img.resize((int(img.width * 0.6), int(img.height * 0.6)), Image.Resampling.LANCZOS)
        path = self.shots / f"{name}.png"
        img.quantize(colors=64, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(path, optimize=True)
        return path


def api_image(server, **body) -> np.ndarray:
    r = server.client.post("/v1/images/generations", json=body)
    assert r.status_code == 200, r.text
    return decode_png(base64.b64decode(r.json()["data"][0]["b64_json"]))


def api_edit(server, files: dict, **fields) -> np.ndarray:
    r = server.client.post("/v1/images/edits", files={k: (f"{k}.png", v, "image/png") for k, v in files.items()},
                           data={k: str(v) for k, v in fields.items()})
    assert r.status_code == 200, r.text
    return decode_png(base64.b64decode(r.json()["data"][0]["b64_json"]))


def test_models_route_says_what_the_page_offers(server):
    body = server.client.get("/v1/page/models").json()
    (m,) = body["data"]
    assert m["id"] == "sd" and m["buckets"] == ["64x64", "128x128"] and m["loras"] == ["violet"]
    assert m["controlnets"] == ["position"] and m["takes_picture"] and not m["needs_mask"]
    assert m["defaults"] == {"steps": 20, "guidance": 4.0, "sampler": "ddim"}
    names = [s["name"] for s in m["samplers"]]
    assert "ddim" in names and "euler_a" in names and "flow_euler" not in names  # flow samplers need a flow model
    assert m["preview_decoder"] == "tiny"


BLUE = dict(prompt="a blue star above a yellow square", negative_prompt="red", size="128x128", steps=12, guidance=5,
            sampler="euler_a")


def blue_star(page):
    """A txt2img job through the form (seed left empty, no adapter ticked): its card and image."""
    page.d.execute_script("for (const box of document.querySelectorAll('.lora-on')) box.checked = false")
    page.fill(prompt=BLUE["prompt"], negative=BLUE["negative_prompt"], size=BLUE["size"], steps=BLUE["steps"],
              guidance=BLUE["guidance"], sampler=BLUE["sampler"], seed="")
    card = page.submit()
    return card, page.finish(card)


def blue_star_card(page):
    """The history's blue-star card (test_txt2img's), made here when this worker has not run that test (xdist)."""
    found = [c for c in page.d.find_elements(page.By.CSS_SELECTOR, ".job")
             if "blue star" in c.text and c.get_attribute("data-status") == "succeeded"]
    return found[0] if found else blue_star(page)[0]


def test_txt2img_random_seed_shown_after(page):
    """Seed left empty: the server draws one, the card shows it; the page's image is the API's at that seed, with
    the page's negative prompt, sampler, guidance and size (a setting dropped on the way would change it)."""
    card, got = blue_star(page)
    seed = int(card.get_attribute("data-seed"))
    assert f"seed {seed}" in page.el("info").text
    assert int(card.get_attribute("data-events")) >= 3  # progress (with previews) before the end
    want = api_image(page.server, seed=seed, **BLUE)
    assert got.shape == (128, 128, 3)
    np.testing.assert_array_equal(got, want)
    page.shot("serve-page-txt2img")


def test_img2img_from_an_upload(page, tmp_path):
    rgb = np.full((70, 100, 3), 96, np.uint8)
    rgb[10:35, 10:35] = (220, 30, 30)
    rgb[35:, 50:62] = (30, 200, 60)
    (tmp_path / "scene.png").write_bytes(png(rgb))
    page.fill(prompt="a red circle", negative="", size="64x64", steps=10, guidance=4, sampler="ddim", seed=7)
    page.el("image").send_keys(str(tmp_path / "scene.png"))
    page.wait.until(lambda d: "100x70" in page.el("picturenote").text)
    page.fill(strength=0.6)
    card = page.submit()
    got = page.finish(card)
    assert "resized to 64x64" in card.get_attribute("data-edit")
    want = api_edit(page.server, {"image": png(rgb)}, prompt="a red circle", size="64x64", steps=10, guidance=4,
                    sampler="ddim", seed=7, strength=0.6)
    np.testing.assert_array_equal(got, want)
    plain = api_image(page.server, prompt="a red circle", size="64x64", steps=10, guidance=4, sampler="ddim", seed=7)
    assert not np.array_equal(got, plain)  # the picture counted
    page.shot("serve-page-img2img")
    page.el("clearpicture").click()


def test_inpainting_with_a_painted_mask_on_a_history_image(page):
    """The txt2img result, taken from history ("Use as input"), a stroke painted over its right part with the
    pointer: the mask the page sends marks the stroke and nothing far from it; the image is the API's for that
    picture and mask, and the unmasked left part stays the picture's."""
    from selenium.webdriver.common.action_chains import ActionChains

    source = blue_star_card(page)
    picture = from_data_url(source.find_element(page.By.CSS_SELECTOR, "img.result").get_attribute("src"))
    source.find_element(page.By.CLASS_NAME, "use-input").click()
    page.wait.until(lambda d: "128x128" in page.el("picturenote").text)
    page.el("paint").click()
    page.d.execute_script("document.getElementById('brush').value = 30")
    canvas = page.el("maskcanvas")  # shown at 192x192 px over the 128x128 picture
    chain = ActionChains(page.d).move_to_element_with_offset(canvas, 50, -60).click_and_hold()
    for dy in range(-40, 81, 20):
        chain.move_to_element_with_offset(canvas, 50, dy)
    chain.release().perform()
    page.fill(prompt="a green triangle", negative="", size="128x128", steps=10, guidance=4, sampler="ddim", seed=5, strength="")
    card = page.submit()
    got = page.finish(card)
    mask = from_data_url(page.d.execute_script("return window.__lastMask"))
    from PIL import Image

    alpha = np.asarray(Image.open(io.BytesIO(mask)).convert("RGBA"))[..., 3]
    assert alpha.shape == (128, 128)
    painted = alpha < 128
    cols = np.nonzero(painted.any(axis=0))[0]
    rows = np.nonzero(painted.any(axis=1))[0]
    # the stroke: x = 96 + 50 = 146 css px -> 97 picture px, brush 30 css px -> radius ~10 px; y from 36 to 144 css px
    assert 80 <= cols.min() and cols.max() <= 115 and rows.min() <= 35 and rows.max() >= 85, (cols, rows)
    assert 1500 < painted.sum() < 4000, painted.sum()
    want = api_edit(page.server, {"image": picture, "mask": mask}, prompt="a green triangle", size="128x128",
                    steps=10, guidance=4, sampler="ddim", seed=5)
    np.testing.assert_array_equal(got, want)
    source_rgb = decode_png(picture)
    assert not np.array_equal(got[:, 80:], source_rgb[:, 80:])  # the masked part repainted
    page.shot("serve-page-inpaint")
    page.el("clearpicture").click()
    assert not page.el("paint").is_selected()  # a new picture starts unpainted, with the brush off


def test_lora_from_the_picker(page):
    page.fill(prompt="a violet star left of a red star", negative="", size="64x64", steps=10, guidance=4, sampler="ddim", seed=3)
    page.el("lora-violet").click()
    page.fill(**{"lora-w-violet": 0.8})
    card = page.submit()
    got = page.finish(card)
    assert "lora violet:0.8" in card.text
    body = dict(prompt="a violet star left of a red star", size="64x64", steps=10, guidance=4, sampler="ddim", seed=3)
    np.testing.assert_array_equal(got, api_image(page.server, lora=[{"name": "violet", "scale": 0.8}], **body))
    assert not np.array_equal(got, api_image(page.server, **body))  # the adapter counted
    page.shot("serve-page-lora")
    # history: "Reuse" fills the form with a job's settings (adapters and weights, the seed it used)
    page.el("lora-violet").click()
    page.fill(prompt="something else", seed="", steps=30)
    card.find_element(page.By.CLASS_NAME, "reuse").click()
    assert page.el("lora-violet").is_selected() and page.el("lora-w-violet").get_attribute("value") == "0.8"
    assert page.el("seed").get_attribute("value") == "3" and page.el("steps").get_attribute("value") == "10"
    assert page.el("prompt").get_attribute("value") == "a violet star left of a red star"
    old = blue_star_card(page)
    old.find_element(page.By.CLASS_NAME, "reuse").click()
    assert page.el("seed").get_attribute("value") == old.get_attribute("data-seed")
    assert page.el("sampler").get_attribute("value") == "euler_a" and page.el("size").get_attribute("value") == "128x128"
    assert not page.el("lora-violet").is_selected()


def test_controlnet_without_a_picture(page, tmp_path):
    control = np.zeros((64, 64, 3), np.uint8)
    control[8:28, 36:56] = 255
    (tmp_path / "control.png").write_bytes(png(control))
    page.fill(prompt="a red circle", negative="", size="64x64", steps=8, guidance=4, sampler="ddim", seed=2,
              controlnet="position", cscale=0.9)
    page.el("control").send_keys(str(tmp_path / "control.png"))
    card = page.submit()
    got = page.finish(card)
    assert "controlnet position" in card.text
    r = page.server.client.post("/v1/jobs/edits", files={"control": ("c.png", png(control), "image/png")},
                                data={"prompt": "a red circle", "size": "64x64", "steps": "8", "guidance": "4",
                                      "sampler": "ddim", "seed": "2", "controlnet": "position:0.9"})
    assert r.status_code == 202, r.text
    job = r.json()["id"]
    page.wait.until(lambda d: page.server.client.get(f"/v1/jobs/{job}").json()["status"] == "succeeded")
    np.testing.assert_array_equal(got, decode_png(page.server.client.get(f"/v1/jobs/{job}/images/0").content))
    plain = api_image(page.server, prompt="a red circle", size="64x64", steps=8, guidance=4, sampler="ddim", seed=2)
    assert not np.array_equal(got, plain)  # the net counted
    page.fill(controlnet="")


def test_cancel_mid_run_with_live_previews(page):
    page.fill(prompt="two green triangles", size="128x128", steps=100, sampler="ddim", seed="")
    card = page.submit()
    page.wait.until(lambda d: card.get_attribute("data-status") == "running"
                    and (page.el("current").get_attribute("src") or "").startswith("data:image/png"))
    step_seen = int(card.find_element(page.By.CLASS_NAME, "steps").text.split()[1].split("/")[0])
    page.shot("serve-page-preview")
    page.el("cancel").click()
    page.finish(card, "cancelled")
    job = page.server.client.get(f"/v1/jobs/{page.job_id(card)}").json()
    assert job["status"] == "cancelled" and step_seen <= job["step"] < 100, job
    assert page.el("cancel").get_attribute("disabled")
    page.shot("serve-page-cancelled")


def test_bad_input_is_said_on_the_page(page):
    """The service's 400 message is shown (no alert box, no card); the next good job runs."""
    before = len(page.d.find_elements(page.By.CSS_SELECTOR, ".job"))
    page.fill(prompt="   ", steps=10)  # the browser's own checks (required, min/max) pass it; the service's do not
    page.el("submit").click()
    page.wait.until(lambda d: page.el("message").text)
    assert "prompt must not be empty" in page.el("message").text
    assert len(page.d.find_elements(page.By.CSS_SELECTOR, ".job")) == before


def test_history_survives_a_reload(page):
    blue_star_card(page)
    done = [c.get_attribute("id") for c in page.d.find_elements(page.By.CSS_SELECTOR, ".job")
            if c.get_attribute("data-status") == "succeeded"]
    page.d.refresh()
    page.wait.until(lambda d: "ready" == d.find_element(page.By.ID, "ready").text)
    cards = page.d.find_elements(page.By.CSS_SELECTOR, ".job")
    assert [c.get_attribute("id") for c in cards] == done  # the newest first, the cancelled job not kept
    assert all(c.get_attribute("data-restored") == "1" for c in cards)
    blue = [c for c in cards if "blue star" in c.text][0]
    blue.find_element(page.By.CLASS_NAME, "reuse").click()
    assert page.el("seed").get_attribute("value") == blue.get_attribute("data-seed")
    assert page.el("prompt").get_attribute("value") == BLUE["prompt"]
