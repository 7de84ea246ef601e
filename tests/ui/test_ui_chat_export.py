"""Export all chats, in a real browser against the real app without logins: three chats made in
the page (one with two versions of its reply) and a preset. The file holds every chat, newest
first as the list shows them, with its messages and versions, and the presets; imported into
another browser (nothing kept there) it gives them all back.

The tests run in order: the import takes the file the export wrote."""

from __future__ import annotations

import json

import pytest

from .browser import (
    SETTLED,
    open_browser,
    preset_offered,
    preset_shown,
    set_number,
    titles,
    wait_titles,
    wait_until_ready,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUESTIONS = ["What are the modes?", "What is int8?", "How do I share it?"]
NEWEST_FIRST = QUESTIONS[::-1]


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The export's file, and what the page showed of each chat: {title: chatbot text}."""
    return tmp_path_factory.mktemp("export") / "chats.json", {}


def new_page(browser, url: str):
    """A page of its own browser context: storage shared with no other page."""
    page = browser.new_context(viewport={"width": 1500, "height": 1100},
                               accept_downloads=True).new_page()
    page.set_default_timeout(30000)
    page.goto(url)
    wait_until_ready(page)
    return page


def chat_text(page) -> str:
    return page.locator("#chatbot .message-wrap").inner_text()


def send(page, text: str) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")
    page.wait_for_function(SETTLED, arg=1, timeout=90000)


def open_chat(page, title: str) -> None:
    page.locator("#chat-list label", has_text=title).click()
    page.locator('#chatbot [data-testid="user"]', has_text=title).wait_for()


def test_export_all_holds_every_chat_newest_first_with_its_messages(browser, app, exported):
    path, shown = exported
    page = new_page(browser, app.url)
    set_number(page, "max_new_tokens", 24)
    wait_titles(page, ["New chat"])
    for i, question in enumerate(QUESTIONS):
        if i:
            page.locator("#chat-new").click()
            page.wait_for_function(
                "() => !document.querySelector('#chatbot [data-testid=user]')")
        send(page, question)
        wait_titles(page, QUESTIONS[i::-1])
    # The chat shown (the newest): a second version of its reply, its own system prompt and a
    # preset saved there.
    set_number(page, "max_new_tokens", 3)  # the new version is told apart by its length
    page.locator("#regenerate").click()
    page.locator('#chatbot [data-testid="bot"] sub', has_text="/ 3 out").wait_for(timeout=90000)
    page.wait_for_function(SETTLED, arg=1, timeout=90000)
    page.locator("#branch-position", has_text="2 / 2").wait_for()
    page.locator("#system-prompt textarea").fill("Be short.")
    page.locator("#preset-name input, #preset-name textarea").first.fill("short")
    page.locator("#preset-save").click()
    preset_shown(page, "short")
    for title in NEWEST_FIRST:
        open_chat(page, title)
        shown[title] = chat_text(page)

    page.get_by_text("Export / import").click()
    page.locator("#export-all").click()
    with page.expect_download() as download:
        page.locator('a[download^="chats-"]').click()
    download.value.save_as(path)
    data = json.loads(path.read_text(encoding="utf-8"))

    assert (data["format"], data["version"]) == ("qwen-chat-chats", 1)
    assert titles(page) == NEWEST_FIRST
    assert [chat["title"] for chat in data["chats"]] == NEWEST_FIRST
    assert len({chat["id"] for chat in data["chats"]}) == 3
    for chat, question in zip(data["chats"], NEWEST_FIRST, strict=True):
        user, reply = chat["messages"]
        assert (user["role"], user["content"]) == ("user", question)
        assert reply["role"] == "assistant" and reply["stats"]
    newest = data["chats"][0]
    reply = newest["messages"][1]
    assert reply["branch"] == 1 and len(reply["branches"]) == 1
    assert "/ 3 out" in reply["stats"]
    (earlier,) = reply["branches"][0]
    assert earlier["role"] == "assistant" and "/ 3 out" not in earlier["stats"]
    # Every 24-token reply has its text (a sampled 3-token one may have stopped inside its
    # reasoning before a visible word: "no answer yet").
    for message in [earlier] + [chat["messages"][1] for chat in data["chats"][1:]]:
        assert message["content"] or message.get("reasoning"), message
    assert (newest["system_prompt"], newest["preset"]) == ("Be short.", "short")
    assert [c["preset"] for c in data["chats"][1:]] == ["", ""]
    assert data["presets"]["short"]["system_prompt"] == "Be short."
    assert data["presets"]["short"]["settings"]["max_new_tokens"] == 3
    page.context.close()


def test_the_export_imported_into_another_browser_gives_every_chat_back(browser, app,
                                                                        exported):
    path, shown = exported
    page = new_page(browser, app.url)
    wait_titles(page, ["New chat"])
    page.get_by_text("Export / import").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(path))
    page.locator("#chat-list-notice", has_text="Imported 3 chats").wait_for()
    # Each chat keeps its last change's time: the new chat of this page stays the newest.
    wait_titles(page, ["New chat", *NEWEST_FIRST])
    for title in NEWEST_FIRST:
        open_chat(page, title)
        page.wait_for_function("(text) => document.querySelector("
                               "'#chatbot .message-wrap').innerText === text",
                               arg=shown[title])
    open_chat(page, NEWEST_FIRST[0])
    page.locator("#branch-position", has_text="2 / 2").wait_for()
    preset_shown(page, "short")
    assert page.locator("#system-prompt textarea").input_value() == "Be short."
    page.locator("#branch-prev").click()
    page.locator("#branch-position", has_text="1 / 2").wait_for()
    preset_offered(page, "short")
    page.context.close()
