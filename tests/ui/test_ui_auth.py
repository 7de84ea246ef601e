"""Logins, the admin rule, and --share when no tunnel can be made (this machine is offline).

One app for the module: --share with two logins (one from --auth-file), admin "a", and a
--model given as a folder path (a copy of the demo model), which must be allowed to load.
"""

from __future__ import annotations

import shutil

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from model_utils.loading.demo_model import demo_model_path

from .browser import open_browser

ADMIN, USER = ("a", "b"), ("c", "d")


@pytest.fixture(scope="module")
def model_copy(tmp_path_factory):
    target = tmp_path_factory.mktemp("models") / "my-demo"
    shutil.copytree(demo_model_path(), target)
    return target


@pytest.fixture(scope="module")
def app(start_app, tmp_path_factory, model_copy):
    logins = tmp_path_factory.mktemp("auth") / "logins.txt"
    logins.write_text("# user:password per line\n\nc:d\n")
    return start_app("--share", "--auth", "a:b", "--auth-file", str(logins), "--admin", "a",
                     "--model", str(model_copy), "--mode", "bf16", "--placement", "cpu")


def test_login_is_required(app):
    with pytest.raises(Exception):  # noqa: B017 - the client fails in its own ways
        Client(app.url, verbose=False).predict(api_name="/status")
    with pytest.raises(Exception):  # noqa: B017
        Client(app.url, auth=("c", "wrong"), verbose=False)


def test_model_named_on_the_command_line_is_allowed(app, model_copy):
    status = Client(app.url, auth=ADMIN, verbose=False).predict(api_name="/status")
    assert status["loaded"] and not status["is_demo"]
    assert status["model_path"] == str(model_copy.resolve())
    # Other users do not see where the server keeps it.
    guest = Client(app.url, auth=USER, verbose=False).predict(api_name="/status")
    assert guest["model_path"] == "…/my-demo"


def test_only_the_admin_may_load_or_unload(app):
    user = Client(app.url, auth=USER, verbose=False)
    with pytest.raises(AppError, match="only the admin user"):
        user.predict("demo", "nf4", "cpu", api_name="/load_model")
    with pytest.raises(AppError, match="only the admin user"):
        user.predict(api_name="/unload_model")
    assert user.predict(api_name="/status")["mode"] == "bf16"
    # Chatting is for everyone.
    assert user.predict("Hi", [], {"max_new_tokens": 4, "temperature": 0}, api_name="/chat")["done"]
    assert "refused load or switch models for user 'c'" in app.log()

    admin = Client(app.url, auth=ADMIN, verbose=False)
    assert admin.predict("demo", "nf4", "cpu", api_name="/load_model")["mode"] == "nf4"
    assert user.predict(api_name="/status")["mode"] == "nf4"


def test_failed_share_link_is_reported_and_the_app_serves_locally(app, artifacts):
    assert "share link could not be created" in app.output()
    assert "share link could not be created" in app.log()
    with open_browser() as browser:
        page = browser.new_page()
        page.goto(app.url)
        # gradio's login form, then the page with the notice in its banner.
        page.get_by_label("username").fill("c")
        page.get_by_label("password").fill("d")
        page.get_by_role("button", name="Login").click()
        banner = page.locator("#banner")
        banner.get_by_text("could not be created").wait_for(timeout=30000)
        assert "serving locally only" in banner.inner_text()
        page.screenshot(path=str(artifacts / "share-failed-banner.png"))
        # The non-admin user sees Load disabled with the reason (the handler refuses too:
        # test_only_the_admin_may_load_or_unload).
        page.get_by_role("tab", name="Model").click()
        page.locator("#admin-note").get_by_text("only the admin user").wait_for(timeout=30000)
        assert page.locator("#load").is_disabled()
