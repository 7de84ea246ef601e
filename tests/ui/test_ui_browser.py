"""A real browser (Chromium via Playwright) against the real app: chat with a streamed reply,
Stop, switch the mode with the dropdown + Load, and watch the status and memory panels follow."""

from __future__ import annotations

import json

import pytest
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError

from model_utils.loading.modes import MODES

from .browser import open_browser, set_number, wait_until_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def app(start_random_demo):
    """Random weights under the demo's name: Stop and the streaming checks need long replies."""
    return start_random_demo("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def page(app):
    with open_browser() as browser:
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(30000)
        page.goto(app.url)
        wait_until_ready(page)
        yield page



def bot_messages(page):
    return page.locator('#chatbot [data-testid="bot"]')


def send(page, text: str) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")


def test_demo_notice_is_plain(page):
    assert "tiny demo model: it knows only about fifty questions about this app" in page.locator(
        "#demo-notice").inner_text()


def test_empty_message_sends_nothing(page):
    send(page, "   ")
    page.wait_for_timeout(1500)
    assert page.locator('#chatbot [data-testid="user"]').count() == 0
    assert bot_messages(page).count() == 0


def test_too_long_message_gets_the_engines_message_and_stays_in_the_box(page):
    text = "hello " * 5000
    send(page, text)
    page.get_by_text("context window", exact=False).first.wait_for()
    assert page.locator("#message textarea").input_value() == text
    assert bot_messages(page).count() == 0  # the conversation is unchanged
    page.locator("#message textarea").fill("")


# Records, in the page, every text the last reply bubble shows: each update the browser renders
# is seen, however fast the reply is decoded (sampling from the test missed short replies).
RECORD_REPLY_TEXTS = """() => {
    window.replyTexts = [];
    const record = () => {
        const bots = document.querySelectorAll('#chatbot [data-testid=bot]');
        const text = bots.length ? bots[bots.length - 1].innerText : null;
        if (text !== null && window.replyTexts[window.replyTexts.length - 1] !== text)
            window.replyTexts.push(text);
    };
    window.replyObserver = new MutationObserver(record);
    window.replyObserver.observe(document.querySelector('#chatbot'),
                                 {subtree: true, childList: true, characterData: true});
}"""


def test_reply_streams_in_and_gets_a_stats_line(page, artifacts):
    set_number(page, "temperature", 0)
    set_number(page, "max_new_tokens", 64)
    page.evaluate(RECORD_REPLY_TEXTS)
    send(page, "Hello, model!")
    page.locator("#chatbot sub").wait_for(timeout=90000)  # the stats line ends the reply
    seen = page.evaluate("() => { window.replyObserver.disconnect(); return window.replyTexts; }")
    final = bot_messages(page).last.inner_text()
    assert "tok/s" in final and "64 out" in final and "bf16" in final
    # The server sends the first piece of text on its own and the end with its stats line,
    # so some text is on the page before the reply is finished.
    partial = [t for t in seen if "tok/s" not in t and t.strip(" ▌")]
    assert partial, f"expected to see the reply grow, saw {seen!r}"
    page.screenshot(path=str(artifacts / "chat.png"))


def test_stop_ends_the_reply_at_once(page):
    set_number(page, "max_new_tokens", 4000)
    send(page, "Write a very long story.")
    page.locator("#chatbot").get_by_text("Write a very long story.").wait_for()
    page.wait_for_function(  # some tokens arrived
        "() => { const m = document.querySelectorAll('#chatbot [data-testid=bot]');"
        " return m.length >= 2 && m[m.length-1].innerText.length > 20; }")
    page.locator("#stop").click()
    page.locator("#chatbot sub", has_text="stopped").wait_for(timeout=15000)
    last = bot_messages(page).last.inner_text()
    assert "4000 out" not in last
    set_number(page, "max_new_tokens", 64)


def test_conversation_survives_a_reload(page):
    page.reload()
    wait_until_ready(page)
    page.locator("#chatbot").get_by_text("Hello, model!").wait_for()
    page.locator("#chatbot").get_by_text("Write a very long story.").wait_for()


def test_regenerate_replaces_the_last_reply(page, app):
    replies_before = app.log().count("reply: model=")
    users, bots = page.locator('#chatbot [data-testid="user"]').count(), bot_messages(page).count()
    # The reload reset the sliders: a short greedy reply again, so that it ends in good time.
    set_number(page, "temperature", 0)
    set_number(page, "max_new_tokens", 64)
    page.locator("#regenerate").click()
    # The new reply ends with its own stats line; the stopped one it replaces says "stopped".
    bot_messages(page).last.locator("sub", has_text="/ 64 out").filter(
        has_not_text="stopped").wait_for(timeout=90000)
    assert app.log().count("reply: model=") == replies_before + 1
    assert page.locator('#chatbot [data-testid="user"]').count() == users
    assert bot_messages(page).count() == bots
    assert "stopped" not in bot_messages(page).last.inner_text()


def test_undo_then_import_with_reasoning(page, tmp_path):
    before = bot_messages(page).count()
    page.locator("#undo").click()
    page.locator("#message textarea").get_by_text("Write a very long story.")
    page.wait_for_function(f"() => document.querySelectorAll('#chatbot [data-testid=bot]')"
                           f".length < {before}")
    assert page.locator("#message textarea").input_value() == "Write a very long story."
    # An exported conversation with reasoning: the reasoning is a collapsed "thought" bubble.
    exported = tmp_path / "conversation.json"
    exported.write_text(json.dumps({"format": "qwen-chat-conversation", "version": 1,
                                    "system_prompt": "Be brief.", "messages": [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "Two plus two is four.",
         "stats": "1 ms to first token"}]}))
    page.get_by_text("Export / import").click()
    with page.expect_file_chooser() as chooser:
        page.locator("#import").click()
    chooser.value.set_files(str(exported))
    page.locator("#chatbot").get_by_text("What is 2+2?").wait_for()
    page.locator("#chatbot").get_by_text("Reasoning").wait_for()
    assert page.locator("#system-prompt textarea").input_value() == "Be brief."


def test_switch_mode_updates_status_and_memory(page, artifacts):
    page.get_by_role("tab", name="Memory").click()
    cards = page.locator("#memory-cards")
    cards.get_by_text("(bf16)").wait_for()
    bf16_cards = cards.inner_text()
    assert "this process (RSS)" in bf16_cards

    page.get_by_role("tab", name="Model").click()
    # The tab is drawn with the loaded model's picks first (typing before that is overwritten).
    page.locator("#estimate").get_by_text("Fits").wait_for()
    # A bad path first: refused with the reason, and the bf16 model keeps serving.
    path_box = page.locator("#model-path input, #model-path textarea")
    refused = page.locator("#estimate").get_by_text("outside the allowed")
    for _ in range(3):
        # The estimate answers for the typed path: the page has sent it, so Load will too. A
        # box filled while the tab's first drawing was still arriving can be drawn over (on a
        # loaded machine): filled again then.
        path_box.fill("/nonexistent/model")
        try:
            refused.wait_for(timeout=10000)
            break
        except PlaywrightTimeoutError:
            assert path_box.input_value() in ("", "/nonexistent/model")
    refused.wait_for()
    page.locator("#load").click()
    page.locator("#model-message").get_by_text("outside the allowed").wait_for()
    assert "bf16" in page.locator("#model-status").inner_text()
    page.locator("#model-path input, #model-path textarea").fill("")

    # What each mode costs, beside the dropdown: drawn as a table, one row per mode.
    page.get_by_text("Modes compared").click()
    compared = page.locator("#modes-compared")
    compared.get_by_text("not a full-size checkpoint").wait_for()
    assert compared.locator("tr").count() == len(MODES) + 1
    assert "|---" not in compared.inner_text()

    page.locator("#mode input").click()
    page.get_by_role("option", name="nf4 4-bit ·").click()
    page.locator("#estimate").get_by_text("Fits").wait_for()
    page.locator("#load").click()
    # The message once done (the progress line drawn there during the load says "loaded" too).
    page.locator("#model-message").get_by_text("ready to serve").wait_for(timeout=60000)
    # The status box is refreshed by a timer too: one taken mid-switch may still be on its way.
    page.locator("#model-status").get_by_text("nf4", exact=True).wait_for()
    status = page.locator("#model-status").inner_text()
    assert "nf4" in status and "cpu" in status and "0-1" in status
    # What the switch cost, the bf16 model's unload in it, and what it did not read again.
    assert "the last switch took" in status and "(bf16)" in status, status
    assert "from caches: the tokenizer (kept from the mode before)" in status, status
    # The header follows (a memory tick taken mid-switch may show "no model" for a moment).
    page.locator("#headline").get_by_text("nf4", exact=False).wait_for()
    page.screenshot(path=str(artifacts / "model-switched.png"), full_page=True)

    page.get_by_role("tab", name="Memory").click()
    cards.get_by_text("(nf4)").wait_for()
    assert cards.inner_text() != bf16_cards
    page.locator("#memory-plot").wait_for()
    page.screenshot(path=str(artifacts / "memory.png"), full_page=True)

    # The chat answers in the new mode: a short reply (the random-weight model of this page
    # writes up to the slider's value, and nf4 on two cores is slow).
    page.get_by_role("tab", name="Chat").click()
    set_number(page, "max_new_tokens", 32)
    send(page, "And now?")
    page.locator("#chatbot sub", has_text="nf4").wait_for(timeout=60000)
