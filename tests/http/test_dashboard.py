"""/dashboard in a real headless Chromium: behind the API key (HTTP Basic for browsers), and
its numbers and charts follow live traffic. The screenshot lands in test-artifacts/."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from tests.http.conftest import API_KEY, MODEL, REPO, ServerProcess

CHROMIUM = Path("/usr/bin/chromium")
# As root in a closed network: no sandbox, and none of Chromium's background connections.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ARTIFACTS = REPO / "test-artifacts"


def _traffic(base_url: str) -> None:
    """Streams that keep the engine busy for a few seconds."""

    def one(i: int) -> None:
        with httpx.stream(
            "POST",
            f"{base_url}/v1/completions",
            headers={"Authorization": f"Bearer {API_KEY}"},
            json={
                "model": MODEL,
                "prompt": f"Count to twenty, take {i}:",
                "max_tokens": 48,
                "stream": True,
                "ignore_eos": True,
            },
            timeout=120,
        ) as response:
            for _ in response.iter_lines():
                pass

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_dashboard_in_chromium(server: ServerProcess) -> None:
    if not CHROMIUM.exists():
        pytest.fail("Chromium is missing: apt-get install chromium (scripts/test installs it)")
    from playwright.sync_api import sync_playwright

    url = f"{server.base_url}/dashboard"
    # Without the key: a Basic challenge, so that a browser asks for it.
    denied = httpx.get(url, timeout=10)
    assert denied.status_code == 401
    assert denied.headers["www-authenticate"].startswith("Basic")
    wrong = httpx.get(url, auth=("admin", "not-the-key"), timeout=10)
    assert wrong.status_code == 401
    # Basic is for the page only; the API still wants a Bearer token.
    basic_api = httpx.get(f"{server.base_url}/v1/models", auth=("admin", API_KEY), timeout=10)
    assert basic_api.status_code == 401
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(
                http_credentials={"username": "admin", "password": API_KEY},
                viewport={"width": 1280, "height": 900},
            )
            page = context.new_page()
            problems: list[str] = []
            page.on("pageerror", lambda exc: problems.append(str(exc)))
            page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
            shown = page.goto(url)
            assert shown is not None and shown.status == 200
            assert page.text_content("#model") == MODEL
            page.wait_for_function(
                "document.getElementById('status').textContent.startsWith('live')"
            )

            load = threading.Thread(target=_traffic, args=(server.base_url,))
            load.start()
            try:
                # A poll during generation sees tokens flow and requests run.
                page.wait_for_function(
                    "parseFloat(document.getElementById('gen-rate').textContent) > 0",
                    timeout=90_000,
                )
            finally:
                load.join()
            page.wait_for_function(
                "document.getElementById('ttft-note').textContent.includes('p99')", timeout=10_000
            )
            page.wait_for_function(
                "document.getElementById('itl-note').textContent.includes('p50')", timeout=10_000
            )
            page.wait_for_function(
                "parseInt(document.getElementById('finished').textContent) >= 4", timeout=10_000
            )
            assert (page.text_content("#kv") or "").endswith("%")
            # The charts drew something: the request chart's canvas is not blank.
            drawn = page.evaluate(
                """() => { const c = document.getElementById('tokens-chart');
                  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                  let inked = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) inked++;
                  return inked; }"""
            )
            assert drawn > 100
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "dashboard.png"), full_page=True)
            assert problems == []
        finally:
            browser.close()
