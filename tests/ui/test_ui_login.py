"""Logins in a real browser: the login page names the app, a guest (logged in, not the admin)
sees Load and Unload disabled with the reason, the admin sees them enabled, and Log out
ends the session (back to the login page, and it stays there on a reload)."""

from __future__ import annotations

import json

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


def log_in_on(page, user: str, password: str) -> None:
    page.get_by_label("username").fill(user)
    page.get_by_label("password").fill(password)
    page.get_by_role("button", name="Login").click()
    wait_until_ready(page)


def chat_as_guest(browser, app):
    """A guest's conversation and system prompt, kept in this browser's storage."""
    page = log_in(browser, app.url, "guest", "pw2")
    # A new chat each time: the guest's chats of the tests before are kept (on the server).
    page.locator("#chat-new").click()
    page.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    page.locator("#system-prompt textarea").fill("The guest's private system prompt.")
    page.locator("#message textarea").fill("The guest's private question")
    page.locator("#message textarea").press("Enter")
    page.locator('#chatbot [data-testid="bot"]').first.wait_for()
    page.locator("#send:not([disabled])").wait_for()
    page.reload()  # kept across a reload: it is in the browser's storage
    wait_until_ready(page)
    page.locator("#chatbot").get_by_text("The guest's private question").wait_for()
    return page


def assert_a_fresh_chat_for_boss(page, app) -> None:
    assert page.locator("#chatbot").get_by_text("private question").count() == 0
    assert page.locator("#system-prompt textarea").input_value() == ""
    assert "private question" not in page.locator("#chat-list").inner_text()
    page.locator("#chat-new").click()  # boss's own chats of the tests before are his
    page.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    page.locator("#message textarea").fill("Hello from boss")
    page.locator("#message textarea").press("Enter")
    page.locator("#chatbot").get_by_text("Hello from boss").wait_for()
    page.locator("#send:not([disabled])").wait_for()
    chats = [line for line in app.log().splitlines() if "chat: session" in line]
    assert ", 0 earlier messages," in chats[-1], chats[-1]  # nothing of the guest's was sent


def test_after_log_out_the_next_login_starts_with_an_empty_chat(browser, app):
    page = chat_as_guest(browser, app)
    page.locator("#logout").click()
    log_in_on(page, "boss", "pw1")
    assert_a_fresh_chat_for_boss(page, app)
    page.context.close()


def test_a_login_that_ended_without_log_out_does_not_pass_its_chat_on(browser, app):
    page = chat_as_guest(browser, app)
    page.context.clear_cookies()  # the session ends (expired, cleared), storage stays
    page.goto(app.url)
    log_in_on(page, "boss", "pw1")
    assert_a_fresh_chat_for_boss(page, app)
    page.context.close()


def import_file(page, path) -> None:
    if not page.locator("#import").is_visible():
        page.get_by_text("Export / import").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(path))


def test_an_import_the_browser_cannot_keep_is_refused_and_one_it_can_is_kept(
        browser, app, tmp_path):
    """Under the 5 MB upload cap, a conversation of 3 MB used to be accepted and then lost at
    the next reload (localStorage's quota); now it is refused, and 1.9 MB is kept."""
    page = log_in(browser, app.url, "guest", "pw2")
    fits = tmp_path / "fits.json"
    fits.write_text(json.dumps([{"role": "user", "content": "FITS " + "a" * 1_900_000}]))
    import_file(page, fits)
    page.locator("#chatbot").get_by_text("FITS", exact=False).first.wait_for()
    page.wait_for_timeout(1500)  # the browser's copy is written after the update
    page.reload()
    wait_until_ready(page)
    page.locator("#chatbot").get_by_text("FITS", exact=False).first.wait_for()

    too_big = tmp_path / "too-big.json"
    too_big.write_text(json.dumps([{"role": "user", "content": "BIG " + "b" * 3_000_000}]))
    assert too_big.stat().st_size < 5 * 2**20
    import_file(page, too_big)
    page.get_by_text("the browser keeps at most 2 MB").first.wait_for()
    page.reload()  # nothing lost: the conversation kept before is still there
    wait_until_ready(page)
    page.locator("#chatbot").get_by_text("FITS", exact=False).first.wait_for()
    assert page.locator("#chatbot").get_by_text("BIG b", exact=False).count() == 0
    page.context.close()


def post_login(url: str, user: str, password: str) -> tuple[int, str]:
    import urllib.error
    import urllib.parse
    import urllib.request

    body = urllib.parse.urlencode({"username": user, "password": password}).encode()
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/login", data=body),
                                    timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_failed_logins_are_logged_and_limited(app):
    for _ in range(5):
        assert post_login(app.url, "boss", "guess")[0] == 400
    status, body = post_login(app.url, "boss", "pw1")  # even the right password, for now
    assert status == 429 and "too many failed logins for this user: try again in" in body
    assert app.log().count("login failed for user 'boss' from 127.0.0.1") == 5
    assert "guess" not in app.log()  # passwords are never logged
    assert post_login(app.url, "guest", "pw2")[0] == 200  # other names are not locked out
