"""The Benchmark tab in a real browser: run it on the loaded demo model, see the table."""

from __future__ import annotations

import pytest

from .browser import open_browser

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu")


def test_benchmark_tab_runs_and_shows_the_comparison(app, artifacts):
    with open_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60000)
        page.goto(app.url)
        page.get_by_role("tab", name="Benchmark").click()
        page.locator("#bench-run").click()
        table = page.locator("#bench-table table")
        table.wait_for()
        text = table.inner_text()
        for column in ("tok_s", "peer_tok_s", "speedup", "greedy_match"):
            assert column in text
        row = table.locator("tbody tr").first.inner_text()
        assert row.split("\t")[0].strip() == "fp32"
        assert "True" in row  # greedy tokens equal plain generate on the CPU (fp32)
        page.screenshot(path=str(artifacts / "benchmark-tab.png"), full_page=True)
