"""The pages as a newcomer meets them in a browser (Playwright driving Debian's Chromium
against a real standalone server): the dashboard on a phone and on a desktop, the
banner's ``api:`` link followed while logged out, the keys page's form and its one-time
key, and the favicon every page asks for."""

from __future__ import annotations

import io
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from PIL import Image
from playwright.sync_api import Page, expect

from tests.conftest import CliResult, run_program, start_server, stop_server
from tests.test_browser import SIM, browser, log_in, server_env  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

PHONE, DESKTOP = 390, 1280

# What sticks out sideways: the page's own width, and each element wider than the window
# or reaching past its edges, except inside a box made to scroll sideways (a table's
# .scroll-x, the timeline on a phone); and which boxes do scroll.
OVERFLOW = """() => {
  const width = window.innerWidth;
  const scrolls = (element) => ["auto", "scroll"].includes(getComputedStyle(element).overflowX);
  const inScroller = (element) => {
    for (let up = element.parentElement; up && up !== document.body; up = up.parentElement) {
      if (scrolls(up)) return true;
    }
    return false;
  };
  const name = (element) => {
    const id = element.id ? "#" + element.id : "";
    const cls = element.classList.length ? "." + [...element.classList].join(".") : "";
    return `${element.tagName.toLowerCase()}${id}${cls}`;
  };
  const out = [];
  const scrolling = [];
  for (const element of document.body.querySelectorAll("*")) {
    const wide = element.scrollWidth > element.clientWidth;
    if (scrolls(element) && wide) scrolling.push(name(element));
    if (inScroller(element)) continue;
    const box = element.getBoundingClientRect();
    if (box.width === 0 && box.height === 0) continue;
    if (box.right > width + 0.5 || box.left < -0.5) {
      out.push(`${name(element)} ${Math.round(box.left)}..${Math.round(box.right)}`);
    }
  }
  return {page: document.documentElement.scrollWidth, width, out, scrolling};
}"""


def overflow(page: Page) -> dict[str, Any]:
    found: dict[str, Any] = page.evaluate(OVERFLOW)
    return found


@pytest.fixture
def busy_server(server_env):  # noqa: F811 (the fixture imported above)
    """A server with an engine, a model that runs (its memory held, its events written)
    and two stopped ones with long names: a dashboard with something in every part."""
    setup = [
        ["engine", "add", "sim", "--kind", "vllm", "--command", SIM,
         "--env", "CAPYCTL_SIM_WEIGHTS_BYTES=2GiB"],
        ["deployment", "add", "llama", "--engine", "sim", "--source", "llama",
         "--gpu-memory", "8GiB", "--alias", "chat", "--pinned"],
        ["deployment", "add", "qwen-coder-32b-instruct", "--engine", "sim",
         "--source", "Qwen/Qwen2.5-Coder-32B-Instruct", "--gpu-memory", "12GiB"],
        ["deployment", "add", "mistral-small-24b-instruct", "--engine", "sim",
         "--source", "mistralai/Mistral-Small-24B-Instruct-2501", "--gpu-memory", "12GiB"],
    ]  # fmt: skip
    results = [run_program(server_env, *argv) for argv in setup]
    assert all(r.code == 0 for r in results), [r.err for r in results]
    server = start_server(server_env)
    try:
        started: list[CliResult] = []
        starter = threading.Thread(
            target=lambda: started.append(run_program(server_env, "deployment", "start", "llama"))
        )
        starter.start()
        starter.join(timeout=90)
        assert started, "the start did not end"
        assert started[0].code == 0, started[0].err
        yield server
    finally:
        stop_server(server, signal.SIGTERM)


def test_the_dashboard_fits_a_phone_and_a_desktop(busy_server, browser):  # noqa: F811
    """At 390 px the page was 861 px wide (the models table and the events stuck out, the
    nav wrapped); now nothing is wider than the window but the tables' own scrollers."""
    base = busy_server.base_url
    shots = os.environ.get("CAPYCTL_SCREENSHOT_DIR")
    for width, name in ((PHONE, "dashboard-phone.png"), (DESKTOP, "dashboard.png")):
        context = browser.new_context(viewport={"width": width, "height": 844})
        page = context.new_page()
        log_in(page, base, "alice")
        expect(page).to_have_url(f"{base}/")
        row = page.locator('tr[data-deployment="llama"]')
        expect(row.locator("td.state")).to_have_text("ready")
        expect(page.locator("#events li").first).to_be_visible()
        expect(page.locator("svg.timeline")).to_have_count(1)
        found = overflow(page)
        assert found["page"] <= found["width"], found
        assert found["out"] == [], found
        # The nav is one line: its links sit side by side, not stacked.
        links = page.locator("header.top nav a")
        tops = {round(links.nth(i).bounding_box()["y"]) for i in range(links.count())}
        assert len(tops) == 1, tops
        # On a phone the models table scrolls in its box, and so does the timeline (drawn
        # wide enough to read); on a desktop nothing needs to.
        expect(page.locator("#deployments").locator("xpath=..")).to_have_class("scroll-x")
        if width == PHONE:
            assert found["scrolling"] == ["article.card.timeline-host", "div.scroll-x"], found
        else:
            assert found["scrolling"] == [], found
        if shots:  # how docs/images/dashboard.png and dashboard-phone.png are made
            save_small(page.screenshot(full_page=True), Path(shots) / name)
        context.close()


def save_small(png: bytes, path: Path) -> None:
    """A screenshot for the docs in 128 colours: a third of the bytes, the same to see."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    small = image.quantize(colors=128, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    small.save(path, optimize=True)


def test_the_banners_api_link_logs_a_browser_in_and_back(busy_server, browser):  # noqa: F811
    """Logged out, the ``api:`` link of the start banner (/api/docs/) was a bare 401; a
    browser now gets the login page and, once logged in, the API docs. A client that is not
    a browser still gets 401."""
    base = busy_server.base_url
    page = browser.new_context().new_page()
    page.goto(f"{base}/api/docs/")
    expect(page).to_have_url(f"{base}/login/?next=/api/docs/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "alice-password-1")
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{base}/api/docs/")
    expect(page.locator(".swagger-ui")).to_be_visible()
    assert httpx.get(f"{base}/api/docs/").status_code == 401  # not a browser: as before
    # A next that leaves the site is not followed.
    page = browser.new_context().new_page()
    page.goto(f"{base}/login/?next=https://evil.example/")
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "alice-password-1")
    page.click("button[type=submit]")
    expect(page).to_have_url(f"{base}/")


def test_the_keys_form_lines_up_and_copies_the_new_key(busy_server, browser):  # noqa: F811
    """Bob's model list box sat beside the bottom of its label; the one-time key had no
    copy button. Each box now sits under its label, at its left, and a button copies it."""
    base = busy_server.base_url
    context = browser.new_context(viewport={"width": PHONE, "height": 844})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=base)
    bob = context.new_page()
    log_in(bob, base, "bob")
    expect(bob).to_have_url(f"{base}/keys/")
    for control in ("input[name=name]", "select[name=models]", "select[name=expires]"):
        box = bob.locator(f"#create-key {control}").bounding_box()
        label = bob.locator(f"#create-key label:has({control})").bounding_box()
        assert box is not None
        assert label is not None
        assert abs(box["x"] - label["x"]) < 1, (control, box, label)  # its left edge
        assert box["y"] > label["y"] + 10, (control, box, label)  # below the label's words
    bob.fill("input[name=name]", "laptop")
    bob.click("#create-key button[type=submit]")
    key = bob.locator("[data-key]").inner_text().strip()
    assert key.startswith("capy_")
    bob.click("button[data-copy]")
    expect(bob.locator("button[data-copy]")).to_have_text("Copied")
    assert bob.evaluate("navigator.clipboard.readText()") == key
    found = overflow(bob)
    assert found["page"] <= found["width"], found
    assert found["out"] == [], found


def test_every_page_has_a_favicon(busy_server, browser):  # noqa: F811
    """Every page's browser asked /favicon.ico and got 404."""
    base = busy_server.base_url
    icon = httpx.get(f"{base}/favicon.ico")
    assert icon.status_code == 200
    assert icon.headers["content-type"].startswith("image/"), icon.headers
    page: Page = browser.new_context().new_page()
    missing: list[str] = []
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    for path in ("/login/", "/admin/login/"):
        page.goto(f"{base}{path}")
        href = page.locator("link[rel=icon]").get_attribute("href")
        assert href is not None, path
        assert httpx.get(f"{base}{href}").status_code == 200, href
    log_in(page, base, "alice")
    for path in ("/", "/keys/", "/admin/"):
        page.goto(f"{base}{path}")
        expect(page.locator("link[rel=icon]")).to_have_count(1)
    assert missing == []
