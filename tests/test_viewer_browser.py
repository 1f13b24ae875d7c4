"""The viewer in a real headless Chromium (Debian's /usr/bin/chromium, driven by Playwright's
Python package; no browser download). Skipped when chromium is absent (conftest).

Opens the index, a run, the episode list and an episode full of hostile HTML/JS; checks the
text shows literally, no script ran and no dialog opened; clicks through the turn replay and
uses the keyboard; saves screenshots under the test's temp dir (printed with -s).
"""

from __future__ import annotations

import shutil
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.browser

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import uvicorn

    from agentopd.viewer import create_app
    from viewer_fixtures import build_run

    root = tmp_path_factory.mktemp("runs")
    fx = build_run(root / "demo")
    port = _free_port()
    config = uvicorn.Config(create_app(root), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.time() + 20
    while not srv.started:
        assert time.time() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", fx
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser():
    if shutil.which("chromium") is None:
        pytest.skip("needs /usr/bin/chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        yield b
        b.close()


def test_pages_hostile_text_and_replay(server, browser, tmp_path):
    base, fx = server
    page = browser.new_page(viewport={"width": 1400, "height": 900})
    dialogs, errors, requests = [], [], []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("request", lambda r: requests.append(r.url))
    shots = tmp_path / "screenshots"
    shots.mkdir()

    page.goto(base + "/")
    assert page.locator("table.grid a", has_text="demo").count() == 1
    page.screenshot(path=shots / "index.png", full_page=True)

    page.click("text=demo")
    page.wait_for_url(f"{base}/runs/demo")
    assert page.locator("figure.chart svg polyline").count() >= 3  # loss, kl/mean, success
    assert page.locator("figure.chart.wide svg rect").count() > 0  # the per-turn KL heatmap
    page.screenshot(path=shots / "run.png", full_page=True)

    page.click("a.button:has-text('all episodes')")
    assert page.locator("table.episodes tbody tr").count() == len(fx.ids)
    page.select_option("select[name=success]", "false")
    page.click("button[type=submit]")
    assert "success=false" in page.url
    assert page.locator("table.episodes .badge.good").count() == 0
    page.screenshot(path=shots / "episodes.png", full_page=True)

    page.goto(f"{base}/runs/demo/episodes/{fx.hostile_id}")
    text = page.inner_text("main")
    assert "<script>window.__pwned=1</script>" in text
    assert '<img src=x onerror="window.__pwned=2">' in text
    assert "</textarea><script>alert(1)</script>" in text
    assert page.evaluate("typeof window.__pwned") == "undefined"
    assert page.locator("main script, main img, main textarea, main b").count() == 0
    page.screenshot(path=shots / "episode_hostile.png", full_page=True)

    # turn replay: the controls exist only with JS; next shows turn 0 alone, then turn 1, ...
    turns = page.locator("section.turn")
    n = turns.count()
    assert n == 3 and page.locator("#replay").is_visible()
    page.click("#turn-next")
    assert page.inner_text("#turn-pos") == f"turn 0 of {n - 1}"
    assert page.locator("section.turn:visible").count() == 1
    page.click("#turn-next")
    assert page.locator("section.turn:visible").count() == 2 and page.url.endswith("#turn-1")
    page.screenshot(path=shots / "episode_replay.png")
    page.keyboard.press("ArrowRight")
    assert page.inner_text("#turn-pos") == f"turn 2 of {n - 1}"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")
    assert page.locator("section.turn:visible").count() == 1
    page.click("#turn-all")
    assert page.locator("section.turn:visible").count() == n

    # a student token: focusable, its exact numbers in the title and in the status line on focus
    tok = page.locator("section.turn .t.s").first
    tok.focus()
    title = tok.get_attribute("title")
    assert "log-ratio" in title and page.inner_text("#tok-info") == title

    # an ordinary episode with a long (folded) tool result; the keyboard moves between episodes
    page.goto(f"{base}/runs/demo/episodes/{fx.ids[0]}")
    assert page.locator("details.fold").count() >= 1
    page.screenshot(path=shots / "episode.png", full_page=True)
    page.keyboard.press("n")
    page.wait_for_url(f"{base}/runs/demo/episodes/{fx.ids[1]}")

    page.goto(f"{base}/runs/demo/episodes/no-such-episode")
    assert "404" in page.inner_text("h1")

    assert not dialogs and not errors, (dialogs, errors)
    assert all(u.startswith(base) for u in requests), [u for u in requests if not u.startswith(base)]
    print(f"\nscreenshots: {shots}")
    assert sorted(p.name for p in shots.iterdir()) == sorted(
        ["index.png", "run.png", "episodes.png", "episode_hostile.png", "episode_replay.png", "episode.png"]
    )
    page.close()


def test_works_without_javascript(server, browser):
    base, fx = server
    ctx = browser.new_context(java_script_enabled=False)
    page = ctx.new_page()
    page.goto(f"{base}/runs/demo/episodes/{fx.hostile_id}")
    assert not page.locator("#replay").is_visible()  # JS-only controls stay hidden
    assert page.locator("section.turn:visible").count() == 3  # every turn is shown
    page.click("section#turn-0 .turnnav a:has-text('turn 1')")
    assert page.url.endswith("#turn-1")
    ctx.close()

