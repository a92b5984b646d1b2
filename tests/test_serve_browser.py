"""The chat page of `lmforge serve` in a real browser: headless Chromium (Debian's `chromium`
package) driven by Playwright types a message and sees the reply stream in, with tokens/s,
then resets. Skipped where Playwright or Chromium is missing; `make test-browser` installs
both and runs this file. Set LMFORGE_SCREENSHOT=path.png to keep a screenshot of the page."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("LMFORGE_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
if not Path(CHROMIUM).is_file():
    pytest.skip(f"no Chromium at {CHROMIUM} (make test-browser installs Debian's chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (make test-browser)")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

import torch  # noqa: E402

from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.serve import build_server  # noqa: E402
from serve_harness import Running  # noqa: E402


@pytest.fixture(scope="module")
def served(tiny_run):
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(20)
    run = Running(build_server(model.eval(), tok, "tiny-chat", max_tokens=48))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def page(served):
    with sync_api.sync_playwright() as pw:
        try:
            browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                         args=["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        except Exception as exc:  # a Chromium that cannot start here (no sandbox support, missing libraries)
            pytest.skip(f"Chromium at {CHROMIUM} does not start: {exc}")
        pg = browser.new_page(viewport={"width": 900, "height": 600})
        pg.set_default_timeout(30_000)
        yield pg
        browser.close()


def test_chat_page_streams_a_reply_and_resets(served, page):
    page.goto(served.url + "/")
    sync_api.expect(page.locator("#model")).to_contain_text("tiny-chat")
    page.fill("#input", "def value(self):")
    page.press("#input", "Enter")
    sync_api.expect(page.locator(".msg.user")).to_have_text("def value(self):")
    reply = page.locator(".msg.assistant[data-done='1']")
    reply.wait_for()
    assert reply.inner_text().strip(), "the reply is empty"
    sync_api.expect(page.locator("#stats")).to_contain_text("tokens/s")
    assert page.locator(".msg.error").count() == 0
    # the page's reply is what the API gives for the same conversation
    import json
    import urllib.request

    body = json.dumps({"messages": [{"role": "user", "content": "def value(self):"}]}).encode()
    with urllib.request.urlopen(urllib.request.Request(served.url + "/v1/chat/completions", body,
                                                       {"Content-Type": "application/json"}), timeout=30) as r:
        api = json.loads(r.read())
    assert api["choices"][0]["message"]["content"]  # sampled (temperature 1): only its presence is comparable
    if os.environ.get("LMFORGE_SCREENSHOT"):
        page.screenshot(path=os.environ["LMFORGE_SCREENSHOT"])
    page.click("#reset")
    assert page.locator(".msg").count() == 0
    sync_api.expect(page.locator("#stats")).to_have_text("ready")


def test_chat_page_shows_server_errors(served, page):
    page.goto(served.url + "/")
    page.fill("#input", "x " * 400)  # longer than the tiny model's context: a 400 the page reports
    page.press("#input", "Enter")
    sync_api.expect(page.locator(".msg.error")).to_contain_text("context")
