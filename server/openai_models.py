"""What /v1/models says of the loaded model: its id for clients and its sampling defaults."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from model_utils.backends.server_defaults import NAMES as SAMPLING_NAMES

if TYPE_CHECKING:
    from model_utils.engine import Engine


def sampling_defaults(engine: Engine) -> dict:
    """The loaded model's sampling defaults (its generation_config), {} without any."""
    try:
        settings = engine.default_settings().as_dict()
    except Exception:  # noqa: BLE001 - no model, or a model server that cannot be asked now
        return {}
    return {k: settings[k] for k in SAMPLING_NAMES if settings.get(k) is not None}


def model_id(status: dict) -> str:
    """The loaded model's id for clients: "demo", a hub id, or its folder's name (a model
    server's: the name it gives, model_entry.shown_name); no spaces."""
    if status.get("is_demo"):
        return "demo"
    if status.get("remote"):
        return str(status.get("model", "")).replace(" ", "-") or "model"
    label = str(status.get("model", ""))
    name = label.removesuffix(" (HF cache)") if label.endswith(" (HF cache)") \
        else Path(str(status.get("path", label))).name
    return name.replace(" ", "-") or "model"
