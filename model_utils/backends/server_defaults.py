"""The sampling defaults a model server reports for its model, where it reports them.

- the /models entry itself: this app's own /v1/models gives `default_settings` (the loaded
  model's generation_config, by this app's setting names), so one instance in front of another
  starts its sliders at the model's values;
- SGLang: GET /get_model_info (beside /v1) gives `preferred_sampling_params` (its
  --preferred-sampling-params, a JSON object by SGLang's names, or null).

vLLM applies the model's generation_config to what a request leaves unset but reports it
nowhere: there the sliders say the values are this app's (the Chat tab's "server default"
note). Nothing here raises: a server that answers none of this has no reported defaults.
"""

from __future__ import annotations

import json
import logging
import math

import httpx

from .answer_deadline import AnswerDeadline

log = logging.getLogger("backends")

MAX_INFO_BYTES = 64 * 1024
INFO_TIMEOUT_S = 10.0  # a page load waits for this answer (the sliders' starting values)
# This app's setting -> the names servers use for it.
NAMES = {"temperature": ("temperature",), "top_p": ("top_p",), "top_k": ("top_k",),
         "repetition_penalty": ("repetition_penalty",)}


def reported_defaults(client: httpx.Client, base_url: str, entry: dict,
                      timeout_s: float = INFO_TIMEOUT_S) -> dict:
    """{setting: value} the server reports for the model of `entry` ({} when none), its
    answer read within `timeout_s` whatever the pace (`client`: one whose connections are
    not kept alive, see answer_deadline.py)."""
    found = _settings_of(entry.get("default_settings"))
    if found:
        return found
    root = base_url.rstrip("/").removesuffix("/v1")
    deadline = AnswerDeadline(timeout_s)
    try:
        with deadline, client.stream("GET", f"{root}/get_model_info",
                                     extensions={"trace": deadline.trace}) as response:
            if response.status_code != 200:
                return {}
            body = b""
            for piece in response.iter_raw():
                body += piece
                if len(body) > MAX_INFO_BYTES:
                    return {}
        info = json.loads(body)
    except (httpx.HTTPError, ValueError, RecursionError):
        return {}
    preferred = info.get("preferred_sampling_params") if isinstance(info, dict) else None
    if isinstance(preferred, str):
        try:
            preferred = json.loads(preferred)
        except (ValueError, RecursionError):
            return {}
    return _settings_of(preferred)


def _settings_of(given) -> dict:
    """The settings a server's object names, each a finite number in its range; top_k -1
    (SGLang's "off") is 0, this app's."""
    if not isinstance(given, dict):
        return {}
    out = {}
    for name, keys in NAMES.items():
        value = next((given[k] for k in keys if k in given), None)
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            continue
        if name == "top_k":
            value = 0 if value < 0 else int(value)
        if name == "temperature" and not 0 <= value <= 100:
            continue
        if name == "top_p" and not 0 < value <= 1:
            continue
        if name == "repetition_penalty" and not 0 < value <= 100:
            continue
        out[name] = value
    return out
