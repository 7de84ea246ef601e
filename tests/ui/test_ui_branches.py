"""A real browser against the real app: edit an earlier message and page between the versions,
Regenerate and page back to the first reply, an export and import that keep the versions.

The tests run in order on one page, each going on from the conversation the one before left.
Replies are greedy (temperature 0), so a version paged back to is compared with what the page
showed before, to the letter."""

from __future__ import annotations

import json
import re

import pytest
from playwright.sync_api import expect

from .browser import SETTLED, open_browser, set_number, wait_until_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")



@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def page(app):
    with open_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000}, accept_downloads=True)
        page.set_default_timeout(30000)
        page.goto(app.url)
        wait_until_ready(page)
        set_number(page, "temperature", 0)
        set_number(page, "max_new_tokens", 24)
        yield page


def chat_text(page) -> str:
    return page.locator("#chatbot .message-wrap").inner_text()


def users(page):
    return page.locator('#chatbot [data-testid="user"]')


def settle(page, replies: int) -> None:
    page.wait_for_function(SETTLED, arg=replies, timeout=90000)


def send(page, text: str) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")


def position(page) -> str:
    return page.locator("#branch-position").inner_text().strip()


def wait_position(page, text: str) -> None:
    page.locator("#branch-position", has_text=text).wait_for()


def test_editing_the_second_message_keeps_the_old_turns_as_a_version(page, app):
    for i, text in enumerate(["What are the modes?", "What is int8?", "How do I share it?"]):
        send(page, text)
        settle(page, i + 1)
    assert not page.locator("#branches").is_visible()  # no versions yet
    original = chat_text(page)
    edits_before = app.log().count("chat: session")

    page.locator('#chatbot button[aria-label="Edit"]').nth(1).click()  # user messages only
    page.locator("#chatbot textarea").fill("What is bf16?")
    page.locator('#chatbot button[aria-label="Submit"]').click()
    page.wait_for_function("() => document.querySelectorAll('#chatbot [data-testid=user]')"
                           ".length === 2")
    settle(page, 2)
    wait_position(page, "2 / 2")
    edited = chat_text(page)
    assert "What is bf16?" in edited and "What is int8?" not in edited
    assert "How do I share it?" not in edited
    assert "your message 2" in page.locator("#branch-point input").input_value()
    # The reply to the edit was sent the current path only: the first turn, then the edit.
    chats = [line for line in app.log().splitlines() if "chat: session" in line]
    assert len(chats) == edits_before + 1
    assert "2 earlier messages, new message of 13 chars" in chats[-1]

    page.locator("#branch-prev").click()
    wait_position(page, "1 / 2")
    assert chat_text(page) == original  # the earlier version comes back whole
    assert users(page).count() == 3
    page.locator("#branch-next").click()
    wait_position(page, "2 / 2")
    assert chat_text(page) == edited


def test_regenerate_adds_a_version_of_the_reply(page):
    first_reply = page.locator('#chatbot [data-testid="bot"]').last.inner_text()
    set_number(page, "max_new_tokens", 3)  # the new reply is told apart by its length
    page.locator("#regenerate").click()
    page.locator('#chatbot [data-testid="bot"] sub', has_text="/ 3 out").wait_for(timeout=90000)
    settle(page, 2)
    # The pager already read "2 / 2" (the edited message's versions): wait for its redraw.
    expect(page.locator("#branch-point input")).to_have_value(
        re.compile("the reply to message 2"), timeout=30000)
    wait_position(page, "2 / 2")
    page.locator("#branch-prev").click()
    wait_position(page, "1 / 2")
    assert page.locator('#chatbot [data-testid="bot"]').last.inner_text() == first_reply
    # The versions are kept in the browser with the conversation: a reload has them all.
    shown = chat_text(page)
    page.reload()
    wait_until_ready(page)
    settle(page, 2)
    page.locator("#branches").wait_for()
    assert chat_text(page) == shown
    set_number(page, "max_new_tokens", 24)


def test_export_then_import_keeps_the_versions(page, tmp_path):
    shown = chat_text(page)
    page.get_by_text("Export / import").click()
    page.locator("#export").click()
    link = page.locator('a[download^="conversation-"]')
    with page.expect_download() as download:
        link.click()
    exported = tmp_path / "exported.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text(encoding="utf-8"))
    assert [m.get("branch") for m in data["messages"] if "branches" in m] == [1, 0]

    page.locator("#clear").click()
    page.wait_for_function("() => !document.querySelector('#chatbot [data-testid=user]')")
    page.locator("#branches").wait_for(state="hidden")
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(exported))
    settle(page, 2)
    wait_position(page, "1 / 2")
    assert chat_text(page) == shown
    # Both versions came back: at the edited message the earliest version, all three turns.
    # A click on the message picks its versions in the pager.
    users(page).nth(1).click()
    wait_position(page, "2 / 2")
    assert "your message 2" in page.locator("#branch-point input").input_value()
    page.locator("#branch-point").click()  # and so does its list
    page.get_by_role("option", name="the reply to message 2").click()
    wait_position(page, "1 / 2")
    page.locator("#branch-point").click()
    page.get_by_role("option", name="your message 2").click()
    wait_position(page, "2 / 2")
    page.locator("#branch-prev").click()
    wait_position(page, "1 / 2")
    assert users(page).count() == 3 and "What is int8?" in chat_text(page)
