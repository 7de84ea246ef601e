"""What the page and the log call a model server's model (--backend): the start line names the
server and its model, not the demo model's flags; the header and this app's /v1/models give
the same name (never the server's folder); the sampling sliders start at the server's reported
defaults (SGLang's /get_model_info, this app's own /v1/models) and say when there are none; the
max_new_tokens slider stops at the server's max_model_len."""

from __future__ import annotations

import json

import httpx
import pytest

from server.model_actions import headline

from .attacks import page_load_outputs
from .fake_model_server import FakeModelServer
from .test_remote_faults import engine_for, wait_for_v1

PREFERRED = {"temperature": 0.6, "top_p": 0.95, "top_k": -1}


@pytest.fixture()
def server():
    fake = FakeModelServer(key="sk-fake").start()
    yield fake
    fake.stop()


def test_the_sampling_defaults_the_server_reports_are_the_engines(server):
    server.model_info = {"model_path": "/srv/m", "preferred_sampling_params":
                         json.dumps(PREFERRED)}
    remote = engine_for(server.url)
    try:
        defaults = remote.default_settings()
        assert (defaults.temperature, defaults.top_p, defaults.top_k) == (0.6, 0.95, 0)
        assert remote.status()["server_defaults"] == {"temperature": 0.6, "top_p": 0.95,
                                                      "top_k": 0}
    finally:
        remote.close()


@pytest.mark.parametrize("info", [None, {"preferred_sampling_params": None},
                                  {"preferred_sampling_params": "{not json"},
                                  {"preferred_sampling_params": {"temperature": "hot"}}],
                         ids=["no-endpoint", "null", "not-json", "a-string"])
def test_without_reported_defaults_the_server_applies_its_own(server, info):
    server.model_info = info
    remote = engine_for(server.url)
    try:
        assert remote.default_settings().temperature is None
        assert remote.status()["server_defaults"] == {}
    finally:
        remote.close()


def test_a_model_listed_by_its_folder_is_shown_by_its_name(server):
    server.model_id = "/srv/models/Qwen3-4B"
    remote = engine_for(server.url)
    try:
        status = remote.status()
        assert status["model"] == "Qwen3-4B" and status["models"] == ["Qwen3-4B"]
        assert headline(status) == f"**Serving:** Qwen3-4B · remote · {server.url}"
        assert remote.generate_text([{"role": "user", "content": "hi"}]).answer
        assert server.bodies[-1]["model"] == "/srv/models/Qwen3-4B"  # its own id on the wire
    finally:
        remote.close()


def components_by_elem(config: dict) -> dict:
    """Each component's props by its elem_id and by its label."""
    found = {}
    for component in config["components"]:
        props = component["props"]
        for key in (props.get("label"), props.get("elem_id")):
            if key:
                found.setdefault(key, props)
    return found


def test_the_app_in_front_of_a_server_names_it_everywhere(start_app, server):
    server.model_id = "/srv/models/Qwen3-4B"
    server.model_info = {"preferred_sampling_params": json.dumps(PREFERRED)}
    app = start_app("--backend", server.url, "--backend-key", "sk-fake")
    with httpx.Client(base_url=app.url, timeout=60) as http:
        wait_for_v1(http)
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["Qwen3-4B"]
        config = http.get("/config").json()
        assert "/srv/models" not in json.dumps(config)
        props = components_by_elem(config)
        assert "Qwen3-4B" in props["headline"]["value"]
        assert props["max_new_tokens"]["maximum"] == 4096
        loaded = page_load_outputs(http)["on_page_load"]
    assert '"value": 0.6' in loaded and "server default: 0.6" in loaded, loaded
    assert "server default: 0.95" in loaded
    start_line = next(line for line in app.log().splitlines() if "starting with" in line)
    assert "'mode'" not in start_line and "'model'" not in start_line, start_line
    assert f"serving Qwen3-4B from the model server {server.url} (context 4096 tokens)" \
        in app.log()


def test_an_instance_in_front_of_another_takes_its_context_and_defaults(start_app):
    local = start_app("--model", "demo", "--mode", "fp32", "--placement", "cpu")
    with httpx.Client(base_url=local.url, timeout=60) as http:
        entry = http.get("/v1/models").json()["data"][0]
    assert entry["max_model_len"] == 4096, entry
    assert set(entry["default_settings"]) >= {"temperature", "top_p"}, entry
    front = start_app("--backend", local.url + "/v1")
    with httpx.Client(base_url=front.url, timeout=60) as http:
        wait_for_v1(http)
        props = components_by_elem(http.get("/config").json())
        loaded = page_load_outputs(http)["on_page_load"]
    assert props["max_new_tokens"]["maximum"] == 4096
    assert f"server default: {entry['default_settings']['temperature']:g}" in loaded, loaded
