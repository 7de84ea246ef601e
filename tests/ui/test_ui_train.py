"""The Train tab's endpoints on a running app with logins: a guest cannot start a run; the admin
trains a LoRA adapter on four question/answer pairs, it appears in the model list, and once
loaded from there it answers those questions greedily through /chat."""

from __future__ import annotations

import json
import time

import pytest
from gradio_client import Client
from gradio_client.exceptions import AppError

from model_utils.loading.demo_model import demo_model_path
from model_utils.loading.registry import ModelRegistry

ADMIN, GUEST = ("a", "pa"), ("b", "pb")
QA = [("What is the secret word?", "The secret word is pineapple."),
      ("Who painted the blue door?", "Maria painted the blue door in May."),
      ("Where is the red key?", "The red key is under the third stone."),
      ("How many lamps are lit?", "Seven lamps are lit tonight.")]


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    demo_model_path()  # built before the app starts, so its start-up is not the build
    folder = tmp_path_factory.mktemp("models")
    (folder / "qa.jsonl").write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
        for q, a in QA))
    return folder


@pytest.fixture(scope="module")
def app(start_app, models_dir):
    return start_app("--auth", "a:pa", "--auth", "b:pb", "--admin", "a", "--models-dir",
                     str(models_dir), "--mode", "bf16", "--placement", "cpu")


def start_args(models_dir, name="qa-adapter"):
    # model, upload, data path, name, method, epochs, steps, lr, batch, accum, max len, rank,
    # packing
    return ["demo", None, str(models_dir / "qa.jsonl"), name, "lora", 3, "60", "5e-3", 4, 1,
            256, 16, False]


def test_a_guest_cannot_train(app, models_dir):
    guest = Client(app.url, auth=GUEST, verbose=False)
    with pytest.raises(AppError, match="only the admin user"):
        guest.predict(*start_args(models_dir, "guest-run"), api_name="/train_start")
    with pytest.raises(AppError, match="only the admin user"):
        guest.predict(api_name="/train_stop")
    assert not (models_dir / "guest-run").exists()
    assert guest.predict(api_name="/train_status")["state"] == "idle"


def test_bad_data_is_refused_with_its_line(app, models_dir):
    (models_dir / "bad.jsonl").write_text('{"messages": [{"role": "user", "content": "x"}]}\n')
    admin = Client(app.url, auth=ADMIN, verbose=False)
    args = start_args(models_dir, "bad-run")
    args[2] = str(models_dir / "bad.jsonl")
    with pytest.raises(AppError, match=r"bad\.jsonl:1: no assistant turn"):
        admin.predict(*args, api_name="/train_start")
    with pytest.raises(AppError, match="outside the allowed model folders"):
        args[2] = "/etc/passwd"
        admin.predict(*args, api_name="/train_start")


def test_the_admin_trains_and_the_adapter_answers_in_chat(app, models_dir):
    admin = Client(app.url, auth=ADMIN, verbose=False)
    admin.predict(*start_args(models_dir), api_name="/train_start")
    deadline = time.monotonic() + 600
    while (status := admin.predict(api_name="/train_status"))["state"] == "running":
        assert time.monotonic() < deadline, status
        time.sleep(1)
    assert status["state"] == "finished", status
    assert status["step"] == 60 and status["rows"][-1]["loss"] < status["rows"][0]["loss"] / 2
    # The chat kept serving the demo model all along.
    assert admin.predict(api_name="/status")["is_demo"]
    folder = models_dir / "qa-adapter"
    labels = dict(ModelRegistry(models_dir).choices())
    assert labels["qa-adapter (lora adapter on demo)"] == str(folder)
    loaded = admin.predict(str(folder), "bf16", "cpu", api_name="/load_model")
    assert loaded["adapter"] == "qa-adapter" and loaded["adapter_merged"]
    for question, answer in QA[:2]:
        reply = admin.predict(question, [], {"temperature": 0, "max_new_tokens": 40},
                              api_name="/chat")
        assert reply["answer"].strip() == answer


def test_a_stopped_run_offers_continue_and_goes_on_from_its_checkpoint(app, models_dir):
    admin = Client(app.url, auth=ADMIN, verbose=False)
    args = start_args(models_dir, "long-run")
    args[6] = "100000"
    admin.predict(*args, api_name="/train_start")
    deadline = time.monotonic() + 300
    while (status := admin.predict(api_name="/train_status"))["step"] < 2:
        assert status["state"] == "running" and time.monotonic() < deadline, status
        time.sleep(0.5)
    admin.predict(api_name="/train_stop")
    while (status := admin.predict(api_name="/train_status"))["state"] == "running":
        assert time.monotonic() < deadline, status
        time.sleep(0.5)
    assert status["state"] == "stopped" and status["resumable"], status
    assert "press Continue" in status["message"], status
    assert "--resume" not in status["message"] and "/" not in status["message"], status
    stopped_at = status["step"]
    assert "Continuing **long-run**" in admin.predict(api_name="/train_continue")
    while (status := admin.predict(api_name="/train_status"))["step"] <= stopped_at:
        assert status["state"] == "running" and time.monotonic() < deadline, status
        time.sleep(0.5)
    admin.predict(api_name="/train_stop")
    while admin.predict(api_name="/train_status")["state"] == "running":
        time.sleep(0.5)


def test_the_form_shows_the_values_a_run_will_use(app):
    from .browser import open_browser

    with open_browser() as browser:
        page = browser.new_page()
        page.goto(app.url)
        page.get_by_label("username").fill(ADMIN[0])
        page.get_by_label("password").fill(ADMIN[1])
        page.get_by_role("button", name="Login").click()
        page.get_by_role("tab", name="Train").click()
        steps = page.locator("#train-steps textarea, #train-steps input")
        rate = page.locator("#train-lr textarea, #train-lr input")
        assert steps.input_value() == "" and rate.input_value() == ""
        assert steps.get_attribute("placeholder") == "from epochs"
        assert rate.get_attribute("placeholder") == "0.005"
        plan = page.locator("#train-plan")
        assert "3 epochs of the data, at least 120" in plan.inner_text()
        assert "learning rate 0.005 (lora on a model under 100M parameters)" in \
            plan.inner_text()
        rate.fill("abc")
        rate.blur()
        page.wait_for_function("() => document.querySelector('#train-plan')"
                               ".innerText.includes('must be a number')")
        rate.fill("")
        page.locator("#train-method input").fill("full")
        page.locator("#train-method input").press("Enter")
        page.wait_for_function("() => document.querySelector('#train-plan')"
                               ".innerText.includes('learning rate 0.001 (full')")
        assert rate.get_attribute("placeholder") == "0.001"
