"""The chat list in a real browser against the real app, without logins (the chats kept in the
browser): two chats kept apart across a reload, a preset applied to a chat and remembered with
its Thinking switch, chats switched while their changes are still being written, search,
delete with undo (and a write arriving after the delete), and a preset saved with a switch of
chat right behind it.

The tests run in order on one page, each going on from the chats the one before left."""

from __future__ import annotations

import json
import time

import pytest
from playwright.sync_api import expect

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

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FIRST, SECOND = "What are the modes?", "How do I share it?"
MODEL_PRESET = "Model's recommended"


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def page(app):
    with open_browser() as browser:
        page = browser.new_page(viewport={"width": 1500, "height": 1100})
        page.set_default_timeout(30000)
        page.goto(app.url)
        wait_until_ready(page)
        set_number(page, "max_new_tokens", 24)
        yield page


def chat_text(page) -> str:
    return page.locator("#chatbot .message-wrap").inner_text()


def send(page, text: str, replies: int) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function(SETTLED, arg=replies, timeout=90000)


def open_chat(page, title: str) -> None:
    page.locator("#chat-list label", has_text=title).click()
    page.locator('#chatbot [data-testid="user"]', has_text=title).wait_for()


def thinking_shown(page, checked: bool) -> None:
    expect(page.locator("#thinking input")).to_be_checked(checked=checked)


def slider(page, label: str) -> float:
    return float(page.locator(f'input[aria-label^="number input for {label}"]').input_value())


def test_two_chats_are_kept_apart_across_a_reload(page):
    wait_titles(page, ["New chat"])
    send(page, FIRST, 1)
    wait_titles(page, [FIRST])  # titled from the first message
    page.locator("#chat-new").click()
    page.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    send(page, SECOND, 1)
    wait_titles(page, [SECOND, FIRST])  # newest first
    assert FIRST not in chat_text(page)

    page.reload()
    wait_until_ready(page)
    wait_titles(page, [SECOND, FIRST])
    page.locator('#chatbot [data-testid="user"]', has_text=SECOND).wait_for()
    open_chat(page, FIRST)
    assert SECOND not in chat_text(page)
    assert page.locator('#chatbot [data-testid="bot"]').count() == 1
    open_chat(page, SECOND)
    assert FIRST not in chat_text(page)


def test_a_preset_is_applied_to_a_chat_and_remembered_with_its_thinking_switch(page):
    open_chat(page, FIRST)
    page.locator("#system-prompt textarea").fill("Answer in one line.")
    set_number(page, "temperature", 0)
    set_number(page, "top_k", 7)
    page.locator("#preset-name input, #preset-name textarea").first.fill("precise")
    page.locator("#preset-save").click()
    page.locator("#preset input").first.wait_for()
    preset_shown(page, "precise")

    # The other chat: the model's own settings, and Thinking off.
    open_chat(page, SECOND)
    page.locator("#preset input").first.click()
    page.get_by_role("option", name=MODEL_PRESET).click()
    page.wait_for_function("""() => Number(document.querySelector(
        'input[aria-label^="number input for top_k"]').value) !== 7""")
    page.locator("#thinking input").uncheck()

    open_chat(page, FIRST)
    preset_shown(page, "precise")
    page.wait_for_function("""() => Number(document.querySelector(
        'input[aria-label^="number input for top_k"]').value) === 7""")
    assert slider(page, "temperature") == 0
    assert page.locator("#system-prompt textarea").input_value() == "Answer in one line."
    thinking_shown(page, True)

    open_chat(page, SECOND)
    preset_shown(page, MODEL_PRESET)
    thinking_shown(page, False)
    assert page.locator("#system-prompt textarea").input_value() == ""
    page.reload()  # the chat shown keeps its preset and switch across a reload
    wait_until_ready(page)
    page.locator('#chatbot [data-testid="user"]', has_text=SECOND).wait_for()
    preset_shown(page, MODEL_PRESET)
    thinking_shown(page, False)


def test_chats_switched_while_their_changes_are_written_keep_their_own(page):
    """The Thinking switch flipped and another chat opened at once, its view landing while
    the write of the switch is still queued; then a reload right after the last switch. Each
    chat keeps its own preset and switch: none is written with the other's (FIRST "precise"
    and SECOND the model's preset, from the test before)."""
    for second_thinks in (True, False) * 2:  # flipped and flipped back, twice
        open_chat(page, SECOND)
        page.locator("#thinking input").set_checked(second_thinks)
        open_chat(page, FIRST)
        page.locator("#thinking input").set_checked(not second_thinks)
        open_chat(page, SECOND)
        preset_shown(page, MODEL_PRESET)
        thinking_shown(page, second_thinks)
        page.reload()
        wait_until_ready(page)
        page.locator('#chatbot [data-testid="user"]', has_text=SECOND).wait_for()
        preset_shown(page, MODEL_PRESET)
        thinking_shown(page, second_thinks)
        open_chat(page, FIRST)
        preset_shown(page, "precise")
        thinking_shown(page, not second_thinks)
        page.reload()
        wait_until_ready(page)
        page.locator('#chatbot [data-testid="user"]', has_text=FIRST).wait_for()
        preset_shown(page, "precise")
        thinking_shown(page, not second_thinks)
        assert page.locator("#system-prompt textarea").input_value() == "Answer in one line."


def test_search_lists_the_chats_holding_the_words(page):
    search = page.locator("#chat-search input, #chat-search textarea").first
    search.fill("share")
    wait_titles(page, [SECOND])
    search.fill("modes WHAT")
    wait_titles(page, [FIRST])
    search.fill("no such words here")
    wait_titles(page, [])
    search.fill("")
    wait_titles(page, [SECOND, FIRST])


def test_rename_then_delete_with_undo(page):
    open_chat(page, FIRST)
    title = page.locator("#chat-title input, #chat-title textarea").first
    title.fill("Modes talk")
    page.locator("#chat-rename").click()
    wait_titles(page, [SECOND, "Modes talk"])

    page.locator("#chat-delete").click()
    wait_titles(page, [SECOND])
    page.locator("#chat-list-notice", has_text="Deleted “Modes talk”").wait_for()
    page.locator('#chatbot [data-testid="user"]', has_text=SECOND).wait_for()
    page.locator("#chat-undo-delete").click()
    wait_titles(page, [SECOND, "Modes talk"])
    page.locator('#chatbot [data-testid="user"]', has_text=FIRST).wait_for()
    page.locator("#chat-undo-delete").wait_for(state="hidden")
    page.reload()
    wait_until_ready(page)
    wait_titles(page, [SECOND, "Modes talk"])


def test_a_preset_saved_just_before_a_switch_stays_with_the_chat_it_was_saved_in(page):
    """Save preset, and the other chat opened at once, before the save is back: after a
    reload the preset is among the presets, the chat it was saved in remembers it, and the
    chat opened does not."""
    page.locator("#chat-list label", has_text="Modes talk").click()
    page.locator('#chatbot [data-testid="user"]', has_text=FIRST).wait_for()
    view_landed(page)
    save_preset_during_switch(page, prompt="Be brisk.", name="brisk", opened=SECOND)

    preset_kept_after_reload(page, opened=SECOND, opened_preset=MODEL_PRESET, saved_in=FIRST,
                             saved_in_title="Modes talk", saved="brisk", prompt="Be brisk.")


def test_leaving_the_preset_picker_keeps_the_settings_changed_since_the_pick(page):
    """The page sends the picker's value again whenever it loses focus: not a pick, so the
    settings changed since the chat's preset was picked stay ("Modes talk", with "brisk" and
    top_k 5 from the test before)."""
    preset_shown(page, "brisk")
    set_number(page, "top_k", 3)
    page.locator("#preset input").first.click()
    page.keyboard.press("Escape")
    page.locator("#system-prompt textarea").click()  # the picker loses focus
    # A save runs on the same queue after that event, so its name lands after it.
    page.locator("#preset-name input, #preset-name textarea").first.fill("after a blur")
    page.locator("#preset-save").click()
    preset_shown(page, "after a blur")
    assert slider(page, "top_k") == 3
    # A pick of the chat's preset, even the one shown, applies it.
    set_number(page, "top_k", 9)
    page.locator("#preset input").first.click()
    page.get_by_role("option", name="brisk").click()
    page.wait_for_function("""() => Number(document.querySelector(
        'input[aria-label^="number input for top_k"]').value) === 5""")
    page.locator("#preset input").first.click()
    page.get_by_role("option", name="brisk").click()  # the same again, after a change
    set_number(page, "top_k", 9)
    page.locator("#preset input").first.click()
    page.get_by_role("option", name="brisk").click()
    page.wait_for_function("""() => Number(document.querySelector(
        'input[aria-label^="number input for top_k"]').value) === 5""")


def test_a_write_that_reaches_the_server_after_a_delete_does_not_bring_the_chat_back(page):
    """A change typed into the chat shown, then Delete: the browser sends the change's write
    first, but under load it can reach the server second (each event is its own request).
    Run after the delete, from a chat this page no longer shows, it is left out: written, it
    brought the chat back as a new one titled by its first message."""
    page.locator("#chat-list label", has_text="Modes talk").click()
    page.locator('#chatbot [data-testid="user"]', has_text=FIRST).wait_for()
    view_landed(page)
    chat_id = page.locator("#chat-id textarea, #chat-id input").first.input_value()
    held = []

    def hold_the_write(route):
        """Holds back the write of the chat shown (its first input is the chat's id)."""
        sent = json.loads(route.request.post_data or "{}")
        if sent.get("data", [None])[:1] == [chat_id] and "Typed as it went." in str(sent):
            held.append(route)
        else:
            route.continue_()

    page.route("**/gradio_api/queue/join*", hold_the_write)
    page.locator("#system-prompt textarea").fill("Typed as it went.")
    deadline = time.monotonic() + 30
    while not held and time.monotonic() < deadline:
        page.wait_for_timeout(50)  # the write is sent once the settings' own save is back
    assert held, "the write of the typed system prompt was not sent"
    page.locator("#chat-delete").click()
    page.locator("#chat-list-notice", has_text="Deleted “Modes talk”").wait_for()
    for route in held:  # the write reaches the server now, after the delete
        route.continue_()
        route.request.response()
    page.unroute("**/gradio_api/queue/join*")
    page.locator("#chat-new").click()  # runs after the write, on the same queue
    wait_titles(page, ["New chat", SECOND])
    page.reload()
    wait_until_ready(page)
    wait_titles(page, ["New chat", SECOND])
