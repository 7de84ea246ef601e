"""The hardening catalogue's cases that change the app while it serves or load it heavily:
each beside other users' replies (tests/ui/attacks.py's Victims), which must complete.

One app for the module: admin "ann" from --auth, guests "bob" and "cat" from --auth-file.
"""

from __future__ import annotations

import time

import httpx
import pytest
from gradio_client import Client

from .attacks import Victims, page_login

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
    return tmp_path_factory.mktemp("models")


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
