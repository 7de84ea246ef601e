"""Logins in a real browser: the login page names the app, a guest (logged in, not the admin)
sees Load and Unload disabled with the reason, the admin sees them enabled, and Log out
ends the session (back to the login page, and it stays there on a reload)."""

from __future__ import annotations

import pytest

from .browser import open_browser, wait_until_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--auth", "boss:pw1", "--auth", "guest:pw2", "--admin", "boss",
                     "--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


def log_in(browser, url: str, user: str, password: str):
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.set_default_timeout(60000)
    page.goto(url)
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    wait_until_ready(page)
    return page


def test_login_page_names_the_app(browser, app, artifacts):
    page = browser.new_page()
    page.goto(app.url)
    page.get_by_label("username").wait_for(timeout=60000)
    page.get_by_text("Qwen chat").first.wait_for()
    page.screenshot(path=str(artifacts / "login.png"))
    page.close()


def test_guest_sees_load_and_unload_disabled_with_the_reason(browser, app, artifacts):
    page = log_in(browser, app.url, "guest", "pw2")
    page.get_by_role("tab", name="Model").click()
    note = page.locator("#admin-note")
    note.get_by_text("Load and Unload are disabled").wait_for()
    assert "only the admin user (boss)" in note.inner_text()
    assert "you are guest" in note.inner_text()
    page.wait_for_function("() => document.querySelector('#load').disabled"
                           " && document.querySelector('#unload').disabled")
    page.screenshot(path=str(artifacts / "guest-model-panel.png"))
    page.context.close()


def test_admin_sees_load_and_unload_enabled(browser, app):
    page = log_in(browser, app.url, "boss", "pw1")
    page.get_by_role("tab", name="Model").click()
    page.locator("#model-status").get_by_text("bf16", exact=True).wait_for()
    page.wait_for_timeout(1000)  # past the page-load handlers that disable them for guests
    assert page.locator("#load").is_enabled() and page.locator("#unload").is_enabled()
    assert "disabled" not in page.locator("#admin-note").inner_text()
    page.context.close()


def test_log_out_returns_to_the_login_page(browser, app):
    page = log_in(browser, app.url, "guest", "pw2")
    page.locator("#logout").click()
    page.get_by_label("username").wait_for()
    page.reload()  # the login cookie is gone: still the login page
    page.get_by_label("username").wait_for()
    assert page.locator("#message textarea").count() == 0
    page.context.close()
