"""The Train tab's endpoints on a running app with logins: a guest cannot start a run; the admin
trains a LoRA adapter on four question/answer pairs, it appears in the model list, and once
loaded from there it answers those questions greedily through /chat."""

from __future__ import annotations

import json
import os
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


def test_the_form_shows_the_values_a_run_will_use_and_its_start_line_goes_when_done(app,
                                                                                 models_dir):
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
        assert "3 epochs of the data, at least 200" in plan.inner_text()
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
        # A short run: its start line goes once it has ended (the progress line says how).
        page.locator("#train-data-path textarea, #train-data-path input").fill(
            str(models_dir / "qa.jsonl"))
        page.locator("#train-name textarea, #train-name input").fill("browser-run")
        steps.fill("5")
        page.locator("#train-start").click()
        message = page.locator("#train-message")
        page.wait_for_function("() => document.querySelector('#train-message')"
                               ".innerText.includes('Training browser-run')")
        page.wait_for_function("() => document.querySelector('#train-progress')"
                               ".innerText.includes('finished')", timeout=120_000)
        page.wait_for_function("() => !document.querySelector('#train-message')"
                               ".innerText.includes('Training browser-run')", timeout=10_000)
        assert "browser-run" not in message.inner_text()


def run_console(models_dir, name: str) -> str:
    path = models_dir / name / "console.txt"
    return path.read_text(errors="replace") if path.exists() else ""


def wait_for(condition, seconds: float, what: str):
    deadline = time.monotonic() + seconds
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.3)
    return value


def test_absurd_sizes_are_refused_naming_the_field(app, models_dir):
    admin = Client(app.url, auth=ADMIN, verbose=False)
    before = admin.predict(api_name="/train_status")
    args = start_args(models_dir, "huge-run")
    args[9] = 1_000_000  # gradient accumulation: an optimizer step that never ends
    with pytest.raises(AppError, match=r"Grad accumulation \(grad_accum\) must be a whole "
                                       r"number from 1 to 4,096"):
        admin.predict(*args, api_name="/train_start")
    args[8], args[9], args[10] = 1024, 4096, 256  # each within its field, not together
    with pytest.raises(AppError, match=r"Grad accumulation x Batch size x Max tokens is "
                                       r"1,073,741,824 tokens per optimizer step; at most "
                                       r"16,777,216: lower Grad accumulation"):
        admin.predict(*args, api_name="/train_start")
    assert not (models_dir / "huge-run").exists()
    after = admin.predict(api_name="/train_status")  # the last run's report, untouched
    assert (after["state"], after.get("name")) == (before["state"], before.get("name"))


def test_stop_ends_a_run_inside_a_long_optimizer_step(app, models_dir):
    """4096 micro-batches to one optimizer step: Stop used to wait for the step to end (at
    gradient accumulation 1e6, never). Now it is checked between micro-batches."""
    admin = Client(app.url, auth=ADMIN, verbose=False)
    args = start_args(models_dir, "long-step")
    args[6], args[8], args[9], args[10] = 2, 1, 4096, 64
    admin.predict(*args, api_name="/train_start")
    wait_for(lambda: "fine-tuning" in run_console(models_dir, "long-step"), 120,
             "the run did not reach its training loop")
    time.sleep(1.0)  # inside step 1 now: a micro-batch is a few ms
    assert "Stopping" in admin.predict(api_name="/train_stop")
    status = wait_for(lambda: (s := admin.predict(api_name="/train_status"))["state"] !=
                      "running" and s, 15, "the run did not stop within 15 s of Stop")
    assert status["state"] == "stopped" and status["step"] == 0, status
    assert "Stopped at step 0; its checkpoint is kept" in status["message"], status
    assert str(models_dir) not in status["message"]  # no server paths


def test_a_run_ended_before_any_checkpoint_leaves_its_name_free(app, models_dir):
    """A run killed outright (no checkpoint): its folder holds only the run's console and
    log, and the same name starts a new run instead of "exists already" for ever."""
    import signal

    from model_utils.finetune import run_lock

    admin = Client(app.url, auth=ADMIN, verbose=False)
    args = start_args(models_dir, "killed-run")
    args[6] = 100_000
    admin.predict(*args, api_name="/train_start")
    lock = wait_for(lambda: run_lock.read(models_dir / "killed-run"), 120, "no run.json")
    os.kill(lock.pid, signal.SIGKILL)
    wait_for(lambda: admin.predict(api_name="/train_status")["state"] == "failed", 15,
             "the killed run is not reported failed")
    assert not (models_dir / "killed-run" / "checkpoint").exists()
    args[6] = 2
    assert "Training **killed-run**" in admin.predict(*args, api_name="/train_start")
    wait_for(lambda: admin.predict(api_name="/train_status")["state"] == "finished", 120,
             "the second run under the same name did not finish")


def test_data_with_line_separators_and_unreadable_lines(app, models_dir):
    """U+2028 and U+0085 inside a JSON string are valid JSONL (only \\n ends a line); deep
    nesting and a 5000-digit number get a plain message naming the line."""
    admin = Client(app.url, auth=ADMIN, verbose=False)
    text = "Line\u2028separated\u0085reply."
    (models_dir / "separators.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "Say it"}, {"role": "assistant", "content": text}]},
        ensure_ascii=False) + "\n", encoding="utf-8")
    args = start_args(models_dir, "separators")
    args[2], args[6] = str(models_dir / "separators.jsonl"), 1
    assert "Training **separators**" in admin.predict(*args, api_name="/train_start")
    wait_for(lambda: admin.predict(api_name="/train_status")["state"] == "finished", 120,
             "the run on U+2028 data did not finish")
    for name, line, message in (
            ("deep", "[" * 100_000 + "]" * 100_000, r"deep\.jsonl:1: nested too deeply"),
            ("bigint", '{"messages": ' + "1" * 5000 + "}",
             r"bigint\.jsonl:1: holds a number too long to read")):
        (models_dir / f"{name}.jsonl").write_text(line + "\n")
        args = start_args(models_dir, f"{name}-run")
        args[2] = str(models_dir / f"{name}.jsonl")
        with pytest.raises(AppError, match=message):
            admin.predict(*args, api_name="/train_start")
    assert admin.predict(api_name="/status")["model"]  # the server is up, serving


def test_the_loss_curve_sent_is_bounded():
    from model_utils.finetune.runner import MAX_CURVE_POINTS, curve

    rows = [{"step": i + 1, "loss": 1.0 / (i + 1)} for i in range(10_000)]
    sent = curve(rows)
    assert len(sent) == MAX_CURVE_POINTS and sent[0] == rows[0] and sent[-1] == rows[-1]
    assert curve(rows[:50]) == rows[:50]
