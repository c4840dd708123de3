"""Driving a page folder (tests/web/test_web.py, bench/web_table.py): a static server, headless Chromium (selenium,
Debian's chromium) working the page through its test contract (#prompt, #seed, #steps, #generate, #status, img#result)."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import io
import threading
from pathlib import Path

import numpy as np

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
FLAGS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
         "--disable-extensions", "--disable-sync", "--no-first-run", "--window-size=1000,900")


def have_chromium() -> bool:
    return CHROMIUM.exists() and CHROMEDRIVER.exists()


class _Handler(http.server.SimpleHTTPRequestHandler):
    isolated = False

    def end_headers(self):
        if self.isolated:  # cross-origin isolation: SharedArrayBuffer, so onnxruntime-web may use threads
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
        super().end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def static_server(folder: Path, isolated: bool = False):
    """`python -m http.server` over `folder` (with COOP/COEP headers when `isolated`); yields its base URL."""
    handler = type("H", (_Handler,), {"isolated": isolated})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def chrome():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in FLAGS:
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)


def wait_status(driver, accept, timeout: float) -> str:
    """Wait until #status satisfies accept(text) (or reads error: ...); returns the text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def check(d):
        text = d.find_element(By.ID, "status").text
        return text if accept(text) or text.startswith("error:") else False

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(check)


def open_page(driver, url: str, timeout: float = 120) -> str:
    driver.get(url)
    return wait_status(driver, lambda t: t == "ready", timeout)


def generate(driver, prompt: str, seed: int | str, steps: int | str, timeout: float = 300, **fields) -> dict:
    """Fill the contract's inputs (and optional #guidance, #sampler, #negative, #picture: a file path), click
    #generate, wait for #status; returns {status, notice, image (uint8 HWC or None), dataset, statuses (each
    text #status showed)}."""
    from PIL import Image
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    for key, value in (("prompt", prompt), ("seed", seed), ("steps", steps), *fields.items()):
        el = driver.find_element(By.ID, key)
        if key == "sampler":
            Select(el).select_by_value(value)
            continue
        if key == "picture":  # an editing page's file input: the picture file's path
            el.send_keys(str(value))
            continue
        driver.execute_script("arguments[0].value = arguments[1]", el, str(value))
    driver.execute_script(STATUS_LOG)
    driver.execute_script("document.getElementById('status').textContent = 'clicked'")
    driver.find_element(By.ID, "generate").click()
    status = wait_status(driver, lambda t: t == "done", timeout)
    image = None
    if status == "done":
        src = driver.find_element(By.ID, "result").get_attribute("src")
        assert src.startswith("data:image/png;base64,"), src[:40]
        image = np.asarray(Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB"))
    return {"status": status, "notice": driver.find_element(By.ID, "notice").text, "image": image,
            "dataset": driver.execute_script("return Object.assign({}, document.body.dataset)"),
            "statuses": driver.execute_script("return window.__statusLog.slice(1)")}  # after 'clicked'


# every text #status takes, in order (the mutation records: none is lost to batching)
STATUS_LOG = """
window.__statusLog = [];
if (!window.__statusObserver) {
  window.__statusObserver = new MutationObserver((records) => {
    for (const r of records) for (const n of r.addedNodes) window.__statusLog.push(n.textContent);
  });
  window.__statusObserver.observe(document.getElementById('status'), { childList: true });
}
"""
