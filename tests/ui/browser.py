"""A headless Chromium for the browser tests: Debian's /usr/bin/chromium driven by Playwright."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]


@contextlib.contextmanager
def open_browser() -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield browser
        finally:
            browser.close()


def wait_until_ready(page) -> None:
    """The chat page is ready once its message box opens: the page load has put the saved
    conversation and settings back (a setting changed earlier would be overwritten)."""
    page.locator("#message textarea:not([disabled])").wait_for()


# True once a slider's range input holds the value typed into its number box (a gr.Number has
# no range input: true at once).
_SLIDER_HOLDS = """([label, value]) => {
    const range = document.querySelector(`input[aria-label="range slider for ${label}"]`);
    return !range || Number(range.value) === Number(value);
}"""


def set_number(page, label: str, value) -> None:
    """Types `value` into a setting's number box. Returns once the slider holds it: the
    number box hands its value to the slider on Enter, and a message sent before that would
    go out with the old one (seen under load)."""
    box = page.locator(f'input[aria-label^="number input for {label}"]')
    box.fill(str(value))
    box.press("Enter")
    page.wait_for_function(_SLIDER_HOLDS, arg=[label, value])


# The page has settled: no reply streaming (Send is enabled again and no bubble shows the
# cursor) and the chatbot holds this many replies, each ended by its stats line.
SETTLED = """(replies) => {
    const chat = document.querySelector('#chatbot');
    return !document.querySelector('#send').disabled && !chat.innerText.includes('▌')
        && chat.querySelectorAll('[data-testid=bot] sub').length === replies;
}"""


def titles(page) -> list[str]:
    """The chat list's titles, top to bottom."""
    return [t.strip() for t in page.locator("#chat-list label").all_inner_texts()]


def wait_titles(page, expected: list[str], timeout: float = 30000) -> None:
    """Waits until the chat list shows `expected`; fails naming what it shows instead."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            """(expected) => JSON.stringify([...document.querySelectorAll('#chat-list label')]
                .map(l => l.innerText.trim())) === JSON.stringify(expected)""", arg=expected,
            timeout=timeout)
    except PlaywrightTimeout:
        notice = page.locator("#chat-list-notice").inner_text().strip()
        raise AssertionError(f"the chat list shows {titles(page)} (notice: {notice!r}), "
                             f"not {expected}") from None


def view_landed(page) -> None:
    """The chat shown has its whole view in the widgets: the page names it as the chat they
    hold (#chat-view), which it does once every output of the switch has landed. Wait for the
    new chat's messages first: until its id lands this holds for the chat before."""
    page.wait_for_function("""() => {
        const value = (id) => document.querySelector(`#${id} textarea, #${id} input`).value;
        return value('chat-id') !== '' && value('chat-id') === value('chat-view');
    }""")


def preset_shown(page, name: str) -> None:
    page.wait_for_function("(name) => document.querySelector('#preset input').value === name",
                           arg=name)


def preset_offered(page, name: str) -> None:
    """The preset picker lists `name` (opened, then closed again)."""
    from playwright.sync_api import expect

    page.locator("#preset input").first.click()
    expect(page.get_by_role("option", name=name)).to_be_visible()
    page.keyboard.press("Escape")


def save_preset_then_open(page, name: str, title: str) -> str:
    """Save the settings shown as preset `name` and open the chat titled `title` right after,
    both clicks in one task: between two of Playwright's clicks the save is already back.
    Returns what top_k's number box held as Save was clicked."""
    page.locator("#preset-name input, #preset-name textarea").first.fill(name)
    return page.evaluate("""(title) => {
        const topK = document.querySelector('input[aria-label^="number input for top_k"]').value;
        document.querySelector('#preset-save').click();
        [...document.querySelectorAll('#chat-list label')]
            .find((label) => label.innerText.trim() === title).click();
        return topK;
    }""", title)


def save_preset_during_switch(page, *, prompt: str, name: str, opened: str) -> None:
    """In the chat shown: system prompt `prompt` and top_k 5 saved as preset `name`, and the
    chat titled by its message `opened` opened before the save is back; then that chat shown
    and the preset offered."""
    page.locator("#system-prompt textarea").fill(prompt)
    set_number(page, "top_k", 5)
    # Under load this test has failed with the preset saved at top_k 20: this says whether
    # the box still held 5 when Save was clicked (an event landing over it) or not.
    held = save_preset_then_open(page, name, opened)
    assert held == "5", f"top_k's box held {held} when Save was clicked, not the 5 typed"
    page.locator('#chatbot [data-testid="user"]', has_text=opened).wait_for()
    preset_offered(page, name)


def preset_kept_after_reload(page, *, opened: str, opened_preset: str, saved_in: str,
                             saved_in_title: str, saved: str, prompt: str) -> None:
    """After a reload, with the chat whose message is `opened` shown: it kept `opened_preset`
    and no system prompt, the presets still offer `saved`, and the chat of message `saved_in`
    (opened from the list by its title) shows `saved` with its system prompt `prompt` and
    top_k 5."""
    from playwright.sync_api import expect

    page.reload()
    wait_until_ready(page)
    page.locator('#chatbot [data-testid="user"]', has_text=opened).wait_for()
    preset_shown(page, opened_preset)
    expect(page.locator("#system-prompt textarea")).to_have_value("")
    preset_offered(page, saved)
    page.locator("#chat-list label", has_text=saved_in_title).click()
    page.locator('#chatbot [data-testid="user"]', has_text=saved_in).wait_for()
    preset_shown(page, saved)
    expect(page.locator("#system-prompt textarea")).to_have_value(prompt)
    expect(page.locator('input[aria-label^="number input for top_k"]')).to_have_value("5")
