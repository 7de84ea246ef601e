"""The context budget line under the message box, in a real browser against the real app with
a small context (1024 tokens): counted once the text stops changing (typed, pasted, filled or
deleted), the same count as the prompt then sent, the warning before the oldest turns would be
left out, the notice after; and with --backend (no tokenizer here) an estimate that says it is
one, from the page and /count_tokens.
"""

from __future__ import annotations

import json
import re

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from model_utils.chat.budget import PromptBudget
from server.context_budget import budget_line

from .browser import SETTLED, open_browser, set_number, wait_until_ready
from .fake_model_server import FakeModelServer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

CONTEXT = 1024
REPLY = 24  # max_new_tokens: the room kept for the reply, and short replies


def test_the_line_in_words():
    assert budget_line(PromptBudget(1234, 8192, 512)) == \
        "1 234 / 8 192 tokens · 512 kept for the reply"
    assert "Close to the context window" in budget_line(PromptBudget(7000, 8192, 512))
    assert "leaves the oldest 2 message(s) out" in budget_line(
        PromptBudget(7600, 8192, 512, dropped_messages=2))
    estimate = budget_line(PromptBudget(40, None, None, estimated=True))
    assert estimate.startswith("≈ 40 tokens") and "an estimate" in estimate
    assert budget_line(PromptBudget(0, 256, 16, error="too long")) == "⚠ too long"


@pytest.fixture(scope="module")
def app(start_app):
    return start_app("--model", "demo", "--mode", "bf16", "--placement", "cpu",
                     "--context-tokens", str(CONTEXT))


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def page(app, browser):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30000)
    page.goto(app.url)
    wait_until_ready(page)
    set_number(page, "temperature", 0)
    set_number(page, "max_new_tokens", REPLY)
    page.locator(LINE, has_text=f"{REPLY} kept for the reply").wait_for()
    return page


LINE = "#context-budget [data-testid=markdown]"  # the text, not the (hidden) status tracker


def line(page) -> str:
    return page.locator(LINE).inner_text()


def tokens(text: str) -> int:
    return int(re.match(r"≈? ?([\d ]+) /", text).group(1).replace(" ", ""))


def trigger_id(page) -> int:
    """The component id of the hidden button whose click counts."""
    return page.evaluate("() => window.gradio_config.components.find("
                         "c => c.props.elem_id === 'context-budget-count').id")


def counting_event(page, button: int) -> int:
    """The id of the event that counts: the one the hidden button's click triggers."""
    return page.evaluate("(button) => window.gradio_config.dependencies.find(d => d.targets"
                         ".some(([id, event]) => id === button && event === 'click')).id",
                         button)


def record_counts(page) -> tuple[list[dict], list[dict]]:
    """Lists that fill with the counts this page asks for from now on: (those of the hidden
    button, typing's; those of any other trigger)."""
    button = trigger_id(page)
    event = counting_event(page, button)
    typing, others = [], []

    def seen(request) -> None:
        if request.method != "POST" or "queue/join" not in request.url:
            return
        body = json.loads(request.post_data or "{}")
        if body.get("fn_index") == event:
            (typing if body.get("trigger_id") == button else others).append(body)

    page.on("request", seen)
    return typing, others


def test_counted_once_typing_stops_and_the_count_is_what_is_sent(page, app):
    counts, others = record_counts(page)
    before = line(page)
    assert f"/ {CONTEXT:,} tokens".replace(",", " ") in before
    page.locator("#message textarea").press_sequentially("How do I share it?", delay=40)
    page.wait_for_function("([css, before]) => document.querySelector(css).innerText"
                           " !== before", arg=[LINE, before])
    typed = tokens(line(page))
    assert typed > tokens(before)
    # 18 keys, one count: the count waits for the typing to stop (a stall of the loaded
    # machine between two keys may let one more through).
    assert 1 <= len(counts) <= 2, counts
    # Nothing else counted meanwhile: an idle page's conversation does not "change" (a count
    # then would read the message half typed).
    assert not others, others
    assert "⚠" not in line(page)
    # The endpoint counts the same; bad input is a plain message.
    client = Client(app.url, verbose=False)
    counted = client.predict("How do I share it?", [], {"max_new_tokens": REPLY}, "", True,
                             api_name="/count_tokens")
    assert counted["prompt_tokens"] == typed and counted["estimated"] is False
    with pytest.raises(AppError, match="history must be a list"):
        client.predict("x", "not a list", None, "", True, api_name="/count_tokens")

    page.locator("#message textarea").press("Enter")
    page.wait_for_function(SETTLED, arg=1, timeout=90000)
    stats = page.locator('#chatbot [data-testid="bot"] sub').last.inner_text()
    assert f"{typed} in /" in stats  # the count is the prompt the reply was given


def test_recounted_after_a_paste_a_fill_and_a_delete(page, browser):
    """Text that comes in or goes out without a typed character (a paste, a script's fill,
    Backspace, cut) is counted too, once the box has been still for the pause."""
    box = page.locator("#message textarea")
    box.fill("")
    page.wait_for_timeout(600)  # any count of the emptied box has landed
    empty = tokens(line(page))
    counts, _ = record_counts(page)
    # A paste from the clipboard (Ctrl+V): no key types a character.
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.evaluate("(text) => navigator.clipboard.writeText(text)", "word " * 300)
    box.focus()
    box.press("ControlOrMeta+V")
    page.wait_for_function("([css, n]) => parseInt(document.querySelector(css).innerText"
                           ".replace(/ /g, '')) > n", arg=[LINE, empty + 250])
    pasted = tokens(line(page))
    # Select all, then Delete: back to the empty box's count.
    box.press("ControlOrMeta+A")
    box.press("Delete")
    page.wait_for_function("([css, n]) => parseInt(document.querySelector(css).innerText"
                           ".replace(/ /g, '')) === n", arg=[LINE, empty])
    # A fill (what a script or an autofill does), then Backspace after it.
    box.fill("How do I share it?")
    page.wait_for_function("([css, n]) => parseInt(document.querySelector(css).innerText"
                           ".replace(/ /g, '')) > n", arg=[LINE, empty])
    filled = tokens(line(page))
    assert empty < filled < pasted
    box.press("End")
    for _ in range(len("How do I share it?")):
        box.press("Backspace")
    page.wait_for_function("([css, n]) => parseInt(document.querySelector(css).innerText"
                           ".replace(/ /g, '')) === n", arg=[LINE, empty])
    # Each change waited for the box to be still: a handful of counts, not one per key.
    assert len(counts) <= 8, counts


def fitting_alone(app) -> str:
    """The longest message of words that fits the window alone with the room for the reply
    (the last word typed apart as "end"), counted by the app: how many tokens a word takes
    is the model's tokenizer's business. Any earlier turn then leaves no room for it, whatever
    the model replied: the user's own message and the template's markers are tokens too."""
    client = Client(app.url, verbose=False)

    def fits(words: int) -> bool:
        counted = client.predict("word " * words + "end", [], {"max_new_tokens": REPLY}, "",
                                 True, api_name="/count_tokens")
        return counted["dropped_messages"] == 0 and not counted["error"] and \
            counted["prompt_tokens"] + REPLY <= CONTEXT

    low, high = 1, CONTEXT  # fits(low); a word is at least one token, so not fits(high)
    assert fits(low) and not fits(high)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return "word " * low


def test_the_warning_comes_before_the_oldest_turns_are_left_out(page, app):
    for i, text in enumerate(["What are the modes?", "What is int8?"], start=2):
        page.locator("#message textarea").fill(text)
        page.locator("#message textarea").press("Enter")
        page.wait_for_function(SETTLED, arg=i, timeout=90000)
    short = line(page)
    assert "⚠" not in short
    # Fits alone, not after the three turns and the room for the reply.
    long_message = fitting_alone(app)
    page.locator("#message textarea").fill(long_message)
    page.locator("#message textarea").press("End")
    page.locator("#message textarea").press_sequentially("end")
    page.locator(LINE, has_text="Sending this leaves the oldest").wait_for()
    assert tokens(line(page)) <= CONTEXT
    # Sent all the same: the notice after the reply says what was left out, and stays.
    page.locator("#message textarea").press("Enter")
    page.wait_for_function(SETTLED, arg=4, timeout=90000)
    notice = page.locator("#chat-notice")
    notice.get_by_text("were left out of the prompt").wait_for()
    page.locator("#message textarea").press_sequentially("ok", delay=40)
    page.locator(LINE, has_text="Sending this leaves the oldest").wait_for()
    assert "were left out of the prompt" in notice.inner_text()


@pytest.fixture(scope="module")
def remote_app(start_app):
    fake = FakeModelServer().start()  # says max_model_len 4096; no tokenizer comes with it
    yield start_app("--backend", fake.url)
    fake.stop()


def test_with_a_backend_the_count_is_an_estimate_that_says_so(remote_app, browser):
    client = Client(remote_app.url, verbose=False)
    counted = client.predict("How are you?", [{"role": "user", "content": "Hi"},
                                               {"role": "assistant", "content": "Hello."}],
                             {"max_new_tokens": 64}, "", True, api_name="/count_tokens")
    assert counted["estimated"] is True and counted["context_tokens"] == 4096
    assert counted["prompt_tokens"] > 0 and counted["dropped_messages"] == 0
    assert counted["line"].startswith("≈ ") and "an estimate" in counted["line"]

    page = browser.new_page()
    page.set_default_timeout(30000)
    page.goto(remote_app.url)
    wait_until_ready(page)
    page.locator("#message textarea").press_sequentially("Hello there", delay=40)
    page.locator(LINE, has_text="an estimate").wait_for()
    assert line(page).startswith("≈ ") and "/ 4 096 tokens" in line(page)
    page.close()
