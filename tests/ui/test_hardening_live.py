"""The hardening catalogue's cases that change the app while it serves or load it heavily:
each beside other users' replies (tests/ui/attacks.py's Victims), which must complete.

One app for the module: admin "ann" from --auth, guests "bob" and "cat" from --auth-file.
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import threading
import time

import httpx
import pytest
from gradio_client import Client

from model_utils.loading.demo_model import demo_model_path

from .attacks import (
    Victims,
    page_load_outputs,
    page_login,
    plain_problems,
    run_by_index,
    train,
)
from .browser import open_browser, wait_until_ready
from .test_ui_login import import_file

ADMIN, GUEST, LEAVER, NEWCOMER = ("ann", "ann-secret"), ("bob", "bob-secret"), \
    ("cat", "cat-secret"), ("dan", "dan-secret")
BEARER = {"Authorization": f"Bearer {GUEST[0]}:{GUEST[1]}"}


def bearer(user: tuple[str, str]) -> dict:
    return {"Authorization": f"Bearer {user[0]}:{user[1]}"}


def wait_for(condition, timeout: float = 60, what: str = "the condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {timeout} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def logins_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("auth") / "logins.txt"
    path.write_text(f"# the guests\n{':'.join(GUEST)}\n{':'.join(LEAVER)}\n")
    return path


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    shutil.copytree(demo_model_path(), root / "demo-copy")
    return root


@pytest.fixture(scope="module")
def app(start_app, logins_file, models_dir):
    return start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu",
                     "--auth", ":".join(ADMIN), "--auth-file", str(logins_file),
                     "--admin", ADMIN[0], "--models-dir", str(models_dir),
                     "--max-batch", "4", "--max-queue", "8")


def victims(app) -> Victims:
    return Victims(app.url, v1_headers=BEARER,
                   gradio=Client(app.url, auth=GUEST, verbose=False))


# -- --auth-file is followed ------------------------------------------------------------------------
def test_a_user_taken_out_of_the_logins_file_is_refused_and_one_added_can_log_in(
        app, logins_file):
    page = page_login(app.url, *LEAVER)
    assert page.get("/config").status_code == 200
    with httpx.Client(base_url=app.url, timeout=120) as http:
        assert http.get("/v1/models", headers=bearer(LEAVER)).status_code == 200
        refused = http.post("/login", data=dict(zip(("username", "password"), NEWCOMER)))
        assert refused.status_code == 400
        others = victims(app).start()
        logins_file.write_text(f"{':'.join(GUEST)}\n{':'.join(NEWCOMER)}\n")

        # The next request of the removed user is refused, through the API and the page.
        assert http.get("/v1/models", headers=bearer(LEAVER)).status_code == 401
        assert page.get("/config").status_code == 401
        assert page.post("/login", data=dict(zip(("username", "password"), LEAVER))) \
            .status_code == 400
        # The added one logs in and is served.
        assert http.get("/v1/models", headers=bearer(NEWCOMER)).status_code == 200
        newcomer = page_login(app.url, *NEWCOMER)
        assert newcomer.get("/config").status_code == 200
        assert others.finish() == {"v1": "complete", "chat": "complete"}
        assert http.get("/v1/models", headers=BEARER).status_code == 200
    page.close()
    newcomer.close()
    wait_for(lambda: "added ['dan'], removed ['cat']" in app.log(), what="the reload's log line")


# -- images in what the chatbot shows come only from the app ---------------------------------------
class HitCounter:
    """An HTTP server of our own on another port, counting the requests that reach it."""

    def __init__(self):
        counter = self
        self.paths: list[str] = []

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                counter.paths.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/gif")
                self.end_headers()
                self.wfile.write(PIXEL)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


PIXEL = bytes.fromhex("47494638396101000100800000ffffff00000021f90401000000002c00000000010001"
                      "0000020144003b")


@pytest.fixture
def outside():
    counter = HitCounter()
    yield counter
    counter.close()


@pytest.fixture(scope="module")
def browser():
    with open_browser() as browser:
        yield browser


def guest_page(browser, app):
    page = browser.new_context(viewport={"width": 1400, "height": 900}).new_page()
    page.set_default_timeout(120000)
    page.goto(app.url)
    page.get_by_label("username").fill(GUEST[0])
    page.get_by_label("password").fill(GUEST[1])
    page.get_by_role("button", name="Login").click()
    wait_until_ready(page)
    return page


ALL_IMAGES_SETTLED = """(count) => {
    const images = [...document.querySelectorAll('#chatbot img')];
    return images.length >= count && images.every((image) => image.complete);
}"""


def test_images_in_messages_and_imports_are_not_fetched_from_outside(
        browser, app, outside, tmp_path):
    page = guest_page(browser, app)
    imported = tmp_path / "imported.json"
    imported.write_text(json.dumps([
        {"role": "user", "content": f"IMPORTED ![pixel]({outside.url}/markdown-import.gif)"},
        {"role": "assistant", "content": f'HTML <img src="{outside.url}/html-import.gif">'}]))
    import_file(page, imported)
    page.locator("#chatbot").get_by_text("IMPORTED", exact=False).first.wait_for()
    page.locator("#message textarea").fill(f"TYPED ![pixel]({outside.url}/markdown-typed.gif)")
    page.locator("#message textarea").press("Enter")
    page.locator("#chatbot").get_by_text("TYPED", exact=False).first.wait_for()
    # Each image has been tried (loaded or refused) before the count is read.
    page.wait_for_function(ALL_IMAGES_SETTLED, arg=3)
    assert outside.paths == []
    page.context.close()
    policy = httpx.get(app.url + "/", timeout=60).headers["content-security-policy"]
    assert "img-src 'self'" in policy


# -- a guest's page names no server folder --------------------------------------------------------
def server_folders(models_dir) -> list[str]:
    return [str(models_dir), str(demo_model_path().parent), os.path.expanduser("~") + "/"]


def test_a_guests_page_config_and_page_load_name_no_server_folder(app, models_dir):
    guest = page_login(app.url, *GUEST)
    others = victims(app).start()
    config = guest.get("/config").text
    loaded = page_load_outputs(guest)
    assert others.finish() == {"v1": "complete", "chat": "complete"}
    assert "demo-copy (folder)" in config  # the list is there, by its labels
    assert len(loaded) >= 4 and all('"error"' not in out for out in loaded.values()), loaded
    for folder in server_folders(models_dir):
        assert folder not in config
        for name, out in loaded.items():
            assert folder not in out, (name, out)
    guest.close()


def by_elem_id(http: httpx.Client, api_name: str, values: dict[str, object]) -> str:
    """Call a page handler with its default inputs except `values` (by elem_id)."""
    config = http.get("/config").json()
    components = {c["id"]: c for c in config["components"]}
    dep = next(d for d in config["dependencies"] if d.get("api_name") == api_name)
    data = [values.get(components[i]["props"].get("elem_id"), components[i]["props"].get("value"))
            for i in dep["inputs"]]
    return run_by_index(http, dep["id"], data)


def test_a_model_picked_by_its_label_is_the_folder_it_names(app):
    admin = page_login(app.url, *ADMIN)
    estimate = by_elem_id(admin, "estimate", {"model": "demo-copy (folder)", "mode": "fp32"})
    assert "**Fits**" in estimate and "Cannot estimate" not in estimate, estimate
    unknown = by_elem_id(admin, "estimate", {"model": "nowhere (folder)", "mode": "fp32"})
    assert "not in the list of choices" in unknown, unknown
    admin.close()


# -- the Train tab's base models follow the models folder ---------------------------------------------
def test_the_train_tabs_base_models_follow_the_models_folder(app, models_dir):
    admin = page_login(app.url, *ADMIN)
    assert "arrived-later (folder)" not in admin.get("/config").text
    shutil.copytree(demo_model_path(), models_dir / "arrived-later")
    listed = by_elem_id(admin, "train_models", {})
    assert "arrived-later (folder)" in listed, listed
    assert str(models_dir) not in listed
    admin.close()


# -- a big training file is read by the run, not by the server ---------------------------------------
BIG_DATA_MB = 100
START_BOUND_S = 5.0  # the server parsing it took ~8 s for 100 MB on an idle machine


def test_a_big_training_file_is_checked_by_the_run_and_replies_go_on(app, models_dir):
    line = json.dumps({"messages": [{"role": "user", "content": "sea " * 120},
                                    {"role": "assistant", "content": "waves " * 120}]}) + "\n"
    count = BIG_DATA_MB * 2**20 // len(line)
    big = models_dir / "big.jsonl"
    with big.open("w") as out:
        for _ in range(count):
            out.write(line)
        out.write("{not json\n")  # the run must find this, with its line number
    admin = Client(app.url, auth=ADMIN, verbose=False)
    others = victims(app).start()
    started = time.monotonic()
    outcome = train(admin, big, name="big-run")
    start_s = time.monotonic() - started
    assert others.finish() == {"v1": "complete", "chat": "complete"}
    assert outcome.status == 200 and "Training" in outcome.message, outcome
    assert start_s < START_BOUND_S, f"Start took {start_s:.1f} s"

    def ended():
        return admin.predict(api_name="/train_status")["state"] not in ("running", "idle")

    wait_for(ended, timeout=600, what="the run's end")
    status = admin.predict(api_name="/train_status")
    assert status["state"] == "failed", status
    assert f"big.jsonl:{count + 1}: not valid JSON" in status["message"], status
    assert not plain_problems(status["message"]), status
