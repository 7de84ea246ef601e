"""Chats of logged-in users, in real browsers against the real app with --chat-store: each user
finds their chats from another browser (and after a restart), and never sees another user's,
the admin included; a preset saved with a switch of chat right behind it stays with its chat;
a store file that cannot be read stops the start with a plain message."""

from __future__ import annotations

import subprocess
import sys

import pytest

from .browser import (
    SETTLED,
    open_browser,
    preset_kept_after_reload,
    preset_shown,
    save_preset_during_switch,
    set_number,
    view_landed,
    wait_titles,
    wait_until_ready,
)
from .conftest import ROOT

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ANN, BOB = ("ann", "pw-ann"), ("bob", "pw-bob")
ANNS, BOBS = "What are the modes?", "How do I share it?"
MODEL_PRESET = "Model's recommended"


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    return tmp_path_factory.mktemp("store") / "chats.sqlite3"


def app_flags(store_path) -> list[str]:
    return ["--auth", "ann:pw-ann", "--auth", "bob:pw-bob", "--admin", "ann",
            "--chat-store", str(store_path), "--model", "demo", "--mode", "bf16",
            "--placement", "cpu"]


@pytest.fixture(scope="module")
def app(start_app, store_path):
    return start_app(*app_flags(store_path))


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


def log_in(browser, url: str, login: tuple[str, str]):
    """A new browser context: no storage shared with any other page."""
    page = browser.new_context(viewport={"width": 1500, "height": 1000}).new_page()
    page.set_default_timeout(60000)
    page.goto(url)
    page.get_by_label("username").fill(login[0])
    page.get_by_label("password").fill(login[1])
    page.get_by_role("button", name="Login").click()
    wait_until_ready(page)
    return page


def send(page, text: str) -> None:
    set_number(page, "max_new_tokens", 16)
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function(SETTLED, arg=1, timeout=90000)


def test_each_user_finds_their_own_chats_from_another_browser_and_never_anothers(browser,
                                                                                   app):
    ann = log_in(browser, app.url, ANN)
    wait_titles(ann, ["New chat"])
    send(ann, ANNS)
    wait_titles(ann, [ANNS])

    bob = log_in(browser, app.url, BOB)
    wait_titles(bob, ["New chat"])
    assert ANNS not in bob.locator("#chatbot").inner_text()
    send(bob, BOBS)
    wait_titles(bob, [BOBS])
    bob.locator("#chat-search textarea").fill("modes")  # search stays within bob's chats
    wait_titles(bob, [])
    bob.context.close()

    # Another browser of ann's (nothing in its storage): her chat, from the server.
    elsewhere = log_in(browser, app.url, ANN)
    wait_titles(elsewhere, [ANNS])
    elsewhere.locator('#chatbot [data-testid="user"]', has_text=ANNS).wait_for()
    assert BOBS not in elsewhere.locator("#chatbot").inner_text()
    elsewhere.context.close()

    # The same browser after ann logs out: bob sees his chats only.
    ann.locator("#logout").click()
    ann.get_by_label("username").wait_for()
    ann.get_by_label("username").fill(BOB[0])
    ann.get_by_label("password").fill(BOB[1])
    ann.get_by_role("button", name="Login").click()
    wait_until_ready(ann)
    wait_titles(ann, [BOBS])
    assert ANNS not in ann.locator("#chatbot").inner_text()
    ann.context.close()


def test_a_preset_saved_just_before_a_switch_stays_with_the_chat_it_was_saved_in(browser,
                                                                               app):
    """As without logins (test_ui_chat_list), with the chats and presets in the store: the
    chat opened right behind the save does not get the preset, and the chat it was saved in
    keeps it across a reload."""
    bob = log_in(browser, app.url, BOB)
    bob.locator('#chatbot [data-testid="user"]', has_text=BOBS).wait_for()
    view_landed(bob)  # else the page load's own preset could land over the pick
    bob.locator("#preset input").first.click()
    bob.get_by_role("option", name=MODEL_PRESET).click()
    preset_shown(bob, MODEL_PRESET)
    bob.locator("#chat-new").click()  # a second chat, with the same preset
    bob.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    send(bob, ANNS)
    wait_titles(bob, [ANNS, BOBS])
    save_preset_during_switch(bob, prompt="Be terse.", name="terse", opened=BOBS)

    preset_kept_after_reload(bob, opened=BOBS, opened_preset=MODEL_PRESET, saved_in=ANNS,
                             saved_in_title=ANNS, saved="terse", prompt="Be terse.")
    bob.context.close()


def test_the_chats_survive_a_restart(browser, app, start_app, store_path):
    app.stop()
    again = start_app(*app_flags(store_path))
    page = log_in(browser, again.url, ANN)
    wait_titles(page, [ANNS])
    page.locator('#chatbot [data-testid="user"]', has_text=ANNS).wait_for()
    page.context.close()


def test_a_store_that_cannot_be_read_stops_the_start_in_plain_words(tmp_path):
    damaged = tmp_path / "chats.sqlite3"
    damaged.write_bytes(b"not a database at all" * 100)
    before = damaged.read_bytes()
    result = subprocess.run(
        [sys.executable, "app.py", "--auth", "a:b", "--chat-store", str(damaged),
         "--log-file", str(tmp_path / "server.log")],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "--chat-store: the chat store chats.sqlite3 cannot be read" in result.stderr
    assert "left as it is" in result.stderr and "Traceback" not in result.stderr
    assert damaged.read_bytes() == before
