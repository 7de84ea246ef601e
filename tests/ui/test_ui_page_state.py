"""What the page says about itself, in a real browser against the real app: every open page
follows a model change made elsewhere, the reply's generating state, error badges that do not
outlive their toast, settings and a cut-short reply that survive a reload, the slider range,
the load message, and the memory plot's clock axis.

Every wait polls with a generous deadline: nothing here asserts that something is fast.
"""

from __future__ import annotations

import re
import time

import pytest
from gradio_client import Client

from .browser import open_browser, set_number, wait_until_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEMO_CONTEXT = 4096  # the demo model's max_position_embeddings
WAIT_MS = 60000


@pytest.fixture(scope="module")
def app(start_random_demo):
    """Random weights under the demo's name: the generating state needs a reply long enough
    to be seen (and stopped)."""
    return start_random_demo("--model", "demo", "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


def open_page(browser, url: str, console: list | None = None):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    page.set_default_timeout(WAIT_MS)
    if console is not None:
        page.on("console", lambda message: console.append(f"{message.type}: {message.text}"))
    page.goto(url)
    wait_until_ready(page)
    return page



def send(page, text: str) -> None:
    page.locator("#message textarea").fill(text)
    page.locator("#message textarea").press("Enter")


def slider_max(page) -> int:
    return int(page.locator('#max-new-tokens input[type="range"]').get_attribute("max"))


def wait_until(check, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def test_slider_range_is_the_models_context_and_the_context_field_is_empty(browser, app):
    page = open_page(browser, app.url)
    wait_until(lambda: slider_max(page) == DEMO_CONTEXT, "the slider's max to be the context")
    page.get_by_role("tab", name="Model").click()
    page.get_by_text("Advanced").click()
    field = page.locator("#context-tokens textarea, #context-tokens input").first
    assert field.input_value() == ""
    assert "the model's own" in field.get_attribute("placeholder")
    page.context.close()


def test_every_page_follows_a_change_made_through_the_api(browser, app, artifacts):
    chat_page = open_page(browser, app.url)  # stays on the Chat tab
    other = open_page(browser, app.url)
    other.get_by_role("tab", name="Benchmark").click()  # neither page shows Memory
    for page in (chat_page, other):
        page.locator("#headline").get_by_text("bf16").wait_for()
    wait_for_model_defaults(chat_page)
    set_number(chat_page, "max_new_tokens", 4000)  # more than the next model's context
    client = Client(app.url, verbose=False)
    try:
        client.predict(api_name="/unload_model")
        for page in (chat_page, other):
            page.locator("#headline").get_by_text("no model loaded").wait_for()
        chat_page.get_by_role("tab", name="Model").click()
        chat_page.locator("#model-status").get_by_text("No model loaded").wait_for()

        # A load with a smaller context: the header, the status and the slider follow.
        client.predict("demo", "nf4", "cpu", None, None, "bf16", 2048, api_name="/load_model")
        for page in (chat_page, other):
            page.locator("#headline").get_by_text("nf4").wait_for()
        chat_page.locator("#model-status").get_by_text("nf4", exact=True).wait_for()
        chat_page.get_by_role("tab", name="Chat").click()
        wait_until(lambda: slider_max(chat_page) == 2048, "the slider to follow the context")
        tokens = chat_page.locator('input[aria-label^="number input for max_new_tokens"]')
        wait_until(lambda: tokens.input_value() == "2048", "the value to be clamped to it")
        chat_page.locator("#demo-notice").wait_for()
        other.screenshot(path=str(artifacts / "followed-api-switch.png"))
    finally:
        client.predict("demo", "bf16", "cpu", api_name="/load_model")
    for page in (chat_page, other):
        page.locator("#headline").get_by_text("bf16").wait_for()
        page.context.close()


def test_send_is_disabled_and_stop_enabled_only_while_a_reply_streams(browser, app, artifacts):
    page = open_page(browser, app.url)
    stop, send_button = page.locator("#stop"), page.locator("#send")
    assert stop.is_disabled() and send_button.is_enabled()
    wait_for_model_defaults(page)
    set_number(page, "temperature", 0)
    set_number(page, "max_new_tokens", 4000)
    # Every change of the two buttons is recorded in the page, so a reply that ends quickly
    # is still seen in its generating state.
    page.evaluate("""() => {
        window.buttonStates = [];
        const record = () => {
            const stop = document.querySelector('#stop'), send = document.querySelector('#send');
            if (stop && send) window.buttonStates.push([stop.disabled, send.disabled,
                                                        stop.className]);
        };
        new MutationObserver(record).observe(document.body,
            {subtree: true, attributes: true, attributeFilter: ['disabled', 'class']});
    }""")
    send(page, "Write a very long story.")
    page.locator("#chatbot").get_by_text("Write a very long story.").wait_for()
    # Generating: Stop enabled and drawn as the red "stop" button, Send disabled.
    page.wait_for_function("() => window.buttonStates.some(([stop, send, style]) =>"
                           " !stop && send && style.split(' ').includes('stop'))")
    if stop.is_enabled():
        page.screenshot(path=str(artifacts / "generating.png"))
        # Clicked only if still enabled, in the page at once: the reply may end meanwhile.
        page.evaluate("() => { const b = document.querySelector('#stop');"
                      " if (!b.disabled) b.click(); }")
    page.locator("#chatbot sub").wait_for()
    wait_until(lambda: stop.is_disabled() and send_button.is_enabled(),
               "Stop to be disabled and Send enabled after the reply")
    page.context.close()


def test_error_badges_go_with_the_error(browser, app, artifacts):
    page = open_page(browser, app.url)
    send(page, "hello " * 5000)
    # In the toast: the context budget line under the box says it too, and stays.
    toast = page.locator(".toast-body").get_by_text("context window", exact=False).first
    toast.wait_for()
    badges = page.locator("#chatbot span.error, #message span.error")
    wait_until(lambda: badges.count() == 0, "the red Error badges to go")
    page.screenshot(path=str(artifacts / "after-error.png"))
    wait_until(lambda: not toast.is_visible(), "the toast to go")
    assert badges.count() == 0
    # The page is usable again: Send enabled, Stop disabled, the message still in the box.
    assert page.locator("#send").is_enabled() and page.locator("#stop").is_disabled()
    assert page.locator("#message textarea").input_value().startswith("hello hello")
    page.context.close()


def stored_conversation(page) -> str | None:
    """The conversation as the browser keeps it (encrypted by gradio: only compared here)."""
    return page.evaluate("() => localStorage.getItem('qwen-chat-conversation')")


def stored_settings(page) -> str | None:
    """The settings as the browser keeps them (encrypted by gradio: only compared here)."""
    return page.evaluate("() => localStorage.getItem('qwen-chat-settings')")


def wait_for_model_defaults(page) -> None:
    """The page-load handler has put the model's recommended settings in (the demo model's
    generation_config has top_k 20, the sliders start at 0): a change made before that
    would be overwritten by it."""
    top_k = page.locator('input[aria-label^="number input for top_k"]')
    wait_until(lambda: top_k.input_value() == "20", "the model's settings on page load")


def test_settings_survive_a_reload(browser, app):
    page = open_page(browser, app.url)
    wait_for_model_defaults(page)
    before = stored_settings(page)
    page.locator("#system-prompt textarea").fill("Answer like a pirate.")
    set_number(page, "temperature", 1.3)
    set_number(page, "max_new_tokens", 77)
    page.locator("#system-prompt textarea").press("Tab")
    # Saved when the browser's copy has changed and then stays the same for a while.
    wait_until(lambda: stored_settings(page) != before, "the settings to be saved")
    last, steady_since = stored_settings(page), time.monotonic()
    while time.monotonic() - steady_since < 3:
        time.sleep(0.2)
        if (now := stored_settings(page)) != last:
            last, steady_since = now, time.monotonic()
    page.reload()
    wait_until_ready(page)
    prompt = page.locator("#system-prompt textarea")
    wait_until(lambda: prompt.input_value() == "Answer like a pirate.", "the system prompt")
    temperature = page.locator('input[aria-label^="number input for temperature"]')
    tokens = page.locator('input[aria-label^="number input for max_new_tokens"]')
    wait_until(lambda: float(temperature.input_value()) == 1.3, "the temperature")
    wait_until(lambda: int(tokens.input_value()) == 77, "max_new_tokens")
    page.context.close()


def test_a_reload_during_a_reply_keeps_the_message_and_the_partial_reply(browser, app,
                                                                         artifacts):
    page = open_page(browser, app.url)
    page.locator("#clear").click()
    wait_for_model_defaults(page)
    set_number(page, "temperature", 0)
    set_number(page, "max_new_tokens", 4000)
    before = stored_conversation(page)
    send(page, "Tell me everything, at length.")
    # The stored conversation changes as the reply starts (the message, an empty reply) and
    # again at its first save of the growing reply (SAVE_INTERVAL_S in): reload right then.
    wait_until(lambda: stored_conversation(page) != before, "the message stored")
    started = stored_conversation(page)
    wait_until(lambda: stored_conversation(page) != started, "the growing reply stored")
    streaming = page.locator("#stop").is_enabled()
    page.reload()
    wait_until_ready(page)
    page.locator("#chatbot").get_by_text("Tell me everything, at length.").wait_for()
    bot = page.locator('#chatbot [data-testid="bot"]').last
    bot.wait_for()
    wait_until(lambda: len(bot.inner_text().strip()) > 20, "the partial reply")
    if streaming:
        # Cut short by the reload: kept as far as it got, and marked so. The random demo's
        # reply can also end in the moment between reading Stop and the reload: then it is
        # kept whole, under its own line ("... tok/s ... out · <mode>").
        line = page.locator("#chatbot sub").last
        wait_until(lambda: "interrupted" in line.inner_text()
                   or re.search(r"tok/s · \d+ in.* out · ", line.inner_text()),
                   "the reply's line")
    page.screenshot(path=str(artifacts / "reloaded-mid-reply.png"))
    page.context.close()


def test_load_message_names_its_figures_and_progress_has_its_own_place(browser, app):
    page = open_page(browser, app.url)
    page.get_by_role("tab", name="Model").click()
    page.locator("#load").click()
    message = page.locator("#model-message")
    # The message once done (the progress line drawn there during the load says "loaded" too).
    message.get_by_text("ready to serve").wait_for()
    # gradio's progress timer ("0.1s") can linger in the box a moment after the message lands
    wait_until(lambda: message.inner_text().startswith("Loaded"), "the progress timer to go")
    text = message.inner_text()
    assert text.startswith("Loaded demo model"), text
    assert re.search(r"ready to serve [\d.]+ s after the click", text), text
    # One timing per place: the click's wait in the message, the stages in the status box.
    assert len(re.findall(r"\d s\b", text)) == 1, text
    # The status box is another output, drawn on its own after the message.
    timing = r"getting ready took|read in [\d.]+ s"
    status = page.locator("#model-status")
    wait_until(lambda: re.search(timing, status.inner_text()), "the status after the load")
    assert len(re.findall(timing, status.inner_text())) == 1, status.inner_text()
    page.context.close()


def test_memory_plot_has_clock_times_and_no_console_warnings(browser, app, artifacts):
    console: list[str] = []
    page = open_page(browser, app.url, console)
    page.get_by_role("tab", name="Memory").click()
    labels = page.locator("#memory-plot text.mem-time")
    labels.first.wait_for()
    texts = labels.all_text_contents()  # SVG text has no innerText
    assert texts and all(re.fullmatch(r"\d\d:\d\d:\d\d", t) for t in texts), texts
    assert len(set(texts)) == len(texts), f"repeated time labels {texts}"
    page.wait_for_timeout(5000)  # a few redraws
    page.screenshot(path=str(artifacts / "memory-plot.png"), full_page=True)
    assert not [line for line in console if "Vega" in line], console
    page.context.close()
