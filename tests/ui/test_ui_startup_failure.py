"""The app started with a --model whose weights file is damaged, in a real browser: the page
says why in plain words (the file by its name, no library error text), and once a model loads
from the Model tab the start-up failure's notice leaves every page, open or opened later, and
stays gone after an unload."""

from __future__ import annotations

import pytest
from gradio_client import Client

from model_utils.loading.demo_model import demo_model_path

from .browser import open_browser, wait_until_ready

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

FAILED = "start-up model did not load"
DAMAGED = "model.safetensors is damaged or incomplete"


@pytest.fixture(scope="module")
def damaged_model(tmp_path_factory):
    """The demo checkpoint with garbage where its weights file's header should be."""
    folder = tmp_path_factory.mktemp("models") / "damaged"
    folder.mkdir()
    for item in demo_model_path().iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    (folder / "model.safetensors").write_bytes(bytes(range(256)) * 64)
    return folder


@pytest.fixture(scope="module")
def app(start_app, damaged_model):
    return start_app("--model", str(damaged_model), "--mode", "bf16", "--placement", "cpu")


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


def open_page(browser, app):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(30000)
    page.goto(app.url)
    wait_until_ready(page)
    return page


def test_the_notice_says_why_and_goes_once_a_model_loads(app, browser, damaged_model):
    loader, other = open_page(browser, app), open_page(browser, app)
    for page in (loader, other):
        page.locator("#banner").get_by_text(FAILED).wait_for()
        banner = page.locator("#banner").inner_text()
        assert DAMAGED in banner, banner
        assert "SafetensorError" not in banner and "deserializing" not in banner
        assert str(damaged_model.parent) not in banner  # the file by its name only
    other.get_by_role("tab", name="Model").click()
    other.locator("#model-message").get_by_text(FAILED).wait_for()

    # A model loaded from the Model tab of one page.
    loader.get_by_role("tab", name="Model").click()
    loader.locator("#model-path input, #model-path textarea").fill("demo")
    loader.locator("#estimate").get_by_text("Fits").wait_for()
    loader.locator("#load").click()
    loader.locator("#model-message").get_by_text("ready to serve").wait_for(timeout=60000)
    loader.locator("#headline").get_by_text("bf16", exact=False).wait_for()

    # Gone from both open pages (the other one follows the engine's status), its Model tab's
    # message too.
    for page in (loader, other):
        page.wait_for_function("() => !document.querySelector('#banner').innerText"
                               f".includes({FAILED!r})")
    other.wait_for_function("() => !document.querySelector('#model-message').innerText"
                            f".includes({FAILED!r})")
    # And from a page opened now, and after an unload.
    fresh = open_page(browser, app)
    fresh.locator("#headline").get_by_text("bf16", exact=False).wait_for()
    assert FAILED not in fresh.locator("#banner").inner_text()
    fresh.get_by_role("tab", name="Model").click()
    fresh.locator("#model-status").get_by_text("bf16", exact=True).wait_for()
    assert FAILED not in fresh.locator("#model-message").inner_text()
    assert Client(app.url, verbose=False).predict(api_name="/unload_model")["loaded"] is False
    fresh.reload()
    wait_until_ready(fresh)
    fresh.locator("#headline").get_by_text("no model", exact=False).wait_for()
    assert FAILED not in fresh.locator("#banner").inner_text()
    for page in (loader, other, fresh):
        page.close()
