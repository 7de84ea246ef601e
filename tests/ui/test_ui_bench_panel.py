"""The Benchmark tab in a real browser: run it on the loaded demo model, read the table; under
--admin only the admin may run it (the button is disabled for others, and the handler refuses
them even when the page is tampered with)."""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from .browser import open_browser

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
# Text holding "GB" drawn in the bundled font's bold face, whose "B" is a small capital (the
# cards and tables read "Gʙ"): the unit must be in another face or weight.
BOLD_GB = """root => { const bad = [];
    const walk = document.createTreeWalker(document.querySelector(root), NodeFilter.SHOW_TEXT);
    while (walk.nextNode()) { const node = walk.currentNode;
        if (!/[GM]B/.test(node.textContent)) continue;
        const style = getComputedStyle(node.parentElement);
        if (Number(style.fontWeight) >= 600 && style.fontFamily.startsWith('"Source Sans Pro"'))
            bad.push(node.textContent); }
    return bad; }"""


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu")


@pytest.fixture(scope="module")
def admin_app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--auth", "boss:pw", "--auth", "guest:pw", "--admin", "boss")


def open_tab(browser, url, login=None):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(90000)
    page.goto(url)
    if login:
        page.get_by_label("username").fill(login)
        page.get_by_label("password").fill("pw")
        page.get_by_role("button", name="Login").click()
    page.get_by_role("tab", name="Benchmark").click()
    return page


def test_benchmark_tab_shows_a_readable_table_and_keeps_the_rest_in_details(app, artifacts):
    with open_browser() as browser:
        page = open_tab(browser, app.url)
        page.locator("#bench-run").click()
        table = page.locator("#bench-table table")
        table.wait_for()
        header = table.locator("thead").inner_text()
        for column in ("Mode", "Batch", "Time to first token (ms)", "Tokens/s per reply",
                       "x plain generate", "Logprobs close", "Logit error ratio", "Peak GB"):
            assert column in header
        assert "_" not in header  # no snake_case column names
        cells = [c.strip() for c in table.locator("tbody tr").first.inner_text().split("\t")]
        assert cells[0] == "fp32" and cells[1] == "1"
        assert cells[4] == "-"  # all replies' tokens/s: one reply
        assert cells[6] == "yes"  # logprobs close to plain generate on the CPU
        assert "None" not in table.inner_text() and "False" not in table.inner_text()
        # Headers whole: no header laid out on more lines than it has words ("Mod e" was
        # "Mode" broken inside the word in a narrow column).
        lines_of = """h => { const r = document.createRange(); r.selectNodeContents(h);
            return new Set([...r.getClientRects()].map(x => Math.round(x.top))).size; }"""
        for th in table.locator("thead th").all():
            assert th.evaluate(lines_of) <= len(th.inner_text().split()), th.inner_text()
        # The CPU's path is eager like plain generate's: the page says what ratio to expect.
        assert "x plain generate near 1" in page.locator("#bench-table").inner_text()
        # Every other figure is in a collapsed block, opened on request.
        full = page.locator("#bench-full")
        assert not full.is_visible()
        page.locator("#bench-details").get_by_text("Details").click()
        full.locator("table").wait_for()
        assert "peer_tok_s" in full.inner_text() and "None" not in full.inner_text()
        # A figure a line, a run a column: columns wide enough to read.
        widths = full.locator("thead th").evaluate_all(
            "hs => hs.map(h => h.getBoundingClientRect().width)")
        assert len(widths) == 2 and min(widths) > 80, widths
        page.screenshot(path=str(artifacts / "benchmark-tab.png"), full_page=True)
        assert page.evaluate(BOLD_GB, "#bench-table") == []
        page.get_by_role("tab", name="Memory").click()
        page.locator("#memory-cards b").first.wait_for()
        assert page.evaluate(BOLD_GB, "#memory-cards") == []


def test_under_admin_a_guest_cannot_run_the_benchmark(admin_app, artifacts):
    with open_browser() as browser:
        page = open_tab(browser, admin_app.url, login="guest")
        button = page.locator("#bench-run")
        page.get_by_text("Only the admin user").wait_for()
        page.wait_for_timeout(1000)  # the page load's update has come by now
        expect(button).to_be_disabled()
        # A tampered page enables the button: the server refuses all the same.
        button.evaluate("b => { b.disabled = false; b.removeAttribute('disabled'); }")
        button.click(force=True)
        page.get_by_text("only the admin user (boss) may run the benchmark").first.wait_for()
        assert page.locator("#bench-table table").count() == 0
        page.screenshot(path=str(artifacts / "benchmark-guest.png"), full_page=True)
        assert "refused run the benchmark for user 'guest'" in admin_app.log()

        admin = open_tab(browser, admin_app.url, login="boss")
        expect(admin.locator("#bench-run")).to_be_enabled()
        expect(admin.get_by_text("Only the admin user")).to_have_count(0)
