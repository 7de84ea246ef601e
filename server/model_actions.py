"""Load, unload and describe models: shared by the model panel and the API endpoints, so a
click and a gradio_client call go through the same checks (admin, input, engine errors)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.errors import LoadError, ModelBusy
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.modes import MODES
from model_utils.loading.placement import Placement, available_placements

from .common import require_admin, user_error
from .errors import client_error, hide_paths, models_dir_of, shows_full_paths

if TYPE_CHECKING:
    from model_utils.engine import Engine

log = logging.getLogger("ui")

COMPUTE_DTYPES = ("bf16", "fp16", "fp32")


def default_placement() -> str:
    """One GPU when the model fits there (the engine's "auto"), else the CPU."""
    return "auto" if len(available_placements()) > 1 else "cpu"


def make_request(*, model: str, mode: str, placement: str | None,
                 max_memory_gb: dict | None = None, offload_folder: str | None = None,
                 compute_dtype: str = "bf16", context_tokens: float | None = None
                 ) -> LoadRequest:
    """Check the shape of what the user picked and build a LoadRequest. Whether the model
    exists and fits is the engine's business (it answers with a message)."""
    model = (model or "").strip() or "demo"
    if mode not in MODES:
        raise user_error(f"unknown mode {mode!r}; choose one of: {', '.join(MODES)}")
    if compute_dtype not in COMPUTE_DTYPES:
        raise user_error(f"compute_dtype must be one of {', '.join(COMPUTE_DTYPES)}")
    caps = {}
    for device, gb in (max_memory_gb or {}).items():
        if not isinstance(gb, (int, float)) or isinstance(gb, bool) or not math.isfinite(gb) \
                or gb < 0:
            raise user_error(f"max memory for {device} must be a number of GB >= 0, got {gb!r}")
        if gb > 0:  # 0 means "no cap"
            caps[str(device)] = float(gb)
    if context_tokens in (None, 0, ""):
        context = None
    elif (isinstance(context_tokens, (int, float)) and not isinstance(context_tokens, bool)
          and float(context_tokens).is_integer() and context_tokens > 0):
        context = int(context_tokens)
    else:
        raise user_error(f"context_tokens must be a positive integer, got {context_tokens!r}")
    placement = Placement(target=(placement or default_placement()).strip(),
                          max_memory_gb=caps,
                          offload_folder=(offload_folder or "").strip() or None)
    return LoadRequest(model=model, mode=mode, placement=placement,
                       compute_dtype=compute_dtype, context_tokens=context)


def load(engine: Engine, request: LoadRequest, *, admin: str | None, who: gr.Request | None,
         progress: Callable[[float, str], None] | None = None) -> dict:
    """Load (or switch to) `request`; gr.Error with the engine's reason on refusal or failure.
    On failure the engine has already put the previous model back."""
    require_admin(admin, who, "load or switch models")
    log.info("load requested by %s: %s %s on %s", _user(who), request.model, request.mode,
             request.placement.describe())
    try:
        return engine.load(request, progress=progress)
    except Exception as error:  # LoadError, ModelBusy, or a bug (logged): a plain message
        message = client_error(error, context="load").message
        if not shows_full_paths(admin, getattr(who, "username", None)):
            message = hide_paths(message, models_dir_of(engine))
        raise user_error(message) from error


def unload(engine: Engine, *, admin: str | None, who: gr.Request | None) -> dict:
    require_admin(admin, who, "unload models")
    log.info("unload requested by %s", _user(who))
    try:
        return engine.unload()
    except (LoadError, ModelBusy) as error:  # LoadError: a model server's models stay there
        raise user_error(str(error)) from error


def estimate_text(engine: Engine, request: LoadRequest, *, full_paths: bool = True) -> str:
    """The fit estimate as one Markdown line; never raises (it runs on every change).
    full_paths=False (a guest): server paths shown relative to the models folder."""
    try:
        estimate = engine.estimate(request)
    except Exception as error:  # noqa: BLE001 - an unknown path etc.: say so, don't fail
        text = _first_line(error)
        return "**Cannot estimate:** " + (text if full_paths else
                                         hide_paths(text, models_dir_of(engine)))
    verdict = "**Fits**" if estimate.fits else "**Does not fit**"
    return f"{verdict}: {estimate.message()}"


def status_markdown(status: dict) -> str:
    """engine.status() as Markdown: what is loaded, where, and what it cost."""
    if not status.get("loaded"):
        return "**No model loaded.** Pick one above and press Load."
    lines = [(f"**{status['model']}** · mode **{status['mode']}** · "
              f"placement {status['placement']}")]
    rows = ["| device | layers | weights (GB) |", "|---|---|---|"]
    for device, entry in (status.get("device_map") or {}).items():
        rows.append(f"| {device} | {entry.get('layers', '-')} | {entry.get('gb', 0):.4f} |")
    lines.append("\n".join(rows))
    path = status.get("decode_path", "?")
    if status.get("decode_path_reason"):
        path += f" ({status['decode_path_reason']})"
    lines.append(f"footprint {status.get('footprint_gb', 0):.4f} GB · context "
                 f"{status.get('context_tokens')} tokens · decode path {path}")
    for note in status.get("notes") or []:
        lines.append(f"*{note}*")
    if blocks := status.get("kv_blocks"):
        n = blocks["block_tokens"]
        lines.append(f"KV cache: {blocks['total'] * n:,} tokens in blocks of {n} "
                     f"({status.get('kv_cache_gb', 0):.2f} GB), shared by every reply; "
                     f"{blocks['used'] * n:,} in use, {blocks['cached'] * n:,} kept for reuse")
    if status.get("load_stages"):
        stages = ", ".join(f"{s['stage']} {s['s']:.1f} s" for s in status["load_stages"])
        # The load's one timing here, with its parts (the page's message times the click).
        lines.append(f"getting ready took {status.get('ready_s', 0):.1f} s: {stages}")
    if graphs := status.get("compiled_graphs"):
        lines.append("compiled graphs: the decode step's code compiled for an earlier load of "
                     "this mode, kept in this process" if graphs.get("kept") else
                     f"compiled graphs: {graphs['hits']} from the compile cache, "
                     f"{graphs['misses']} compiled afresh")
    if switch := status.get("last_switch"):
        lines.append(switch_line(switch, status.get("compiled_graphs") or {}))
    if parked := status.get("parked"):
        lines.append(f"parked in host memory for a switch back: "
                     f"{', '.join(parked['models']) or 'nothing'} ({parked['gb']:.2f} of "
                     f"{parked['limit_gb']} GB)")
    if status.get("estimate"):
        lines.append(f"estimate at load: {status['estimate']}")
    return "\n\n".join(lines)


def switch_line(switch: dict, graphs: dict) -> str:
    """What the last load cost as a whole (its checks, the unload of the model before it,
    getting ready) and what it took from caches instead of doing again."""
    if switch.get("failed"):
        head = (f"the last switch, to {switch['failed']}, failed: this model was loaded again "
                f"in {switch['s']:.1f} s")
    elif switch.get("replaced"):
        head = (f"the last switch took {switch['s']:.1f} s, unloading {switch['replaced']} "
                f"{switch['unload_s']:.1f} s of it")
    else:
        head = f"the load took {switch['s']:.1f} s"
    cached = ["the tokenizer (kept from the mode before)"] \
        if "tokenizer" in switch.get("from_caches", []) else []
    if "parked weights" in switch.get("from_caches", []):
        cached.append("the weights (parked in host memory by an earlier switch, --park-gb)")
    if graphs.get("kept"):
        cached.append("the compiled decode step (kept from an earlier load of this mode)")
    elif graphs.get("hits"):
        cached.append(f"{graphs['hits']} of {graphs['hits'] + graphs.get('misses', 0)} "
                      "compiled graphs (torch.compile's cache)")
    return f"{head}; from caches: {', '.join(cached) if cached else 'nothing'}"


def loaded_message(status: dict, ready_s: float) -> str:
    """What a Load click did, timed once: the whole wait (unloading the previous model,
    reading the weights, preparing decoding). Its stages are in the status box below."""
    return (f"Loaded {status['model']} in {status['mode']}: ready to serve {ready_s:.2f} s "
            "after the click (the stages are in the status below).")


def unload_message(status: dict) -> str:
    """What engine.unload() reported: did the memory come back?"""
    report = status.get("unloaded")
    if not report:
        return "Nothing was loaded."
    leftover = report.get("leftover") or {}
    if not leftover:
        return f"Unloaded {report['model']}: all memory came back."
    return f"Unloaded {report['model']}; {still_held(report)}."


def still_held(report: dict) -> str:
    """An unload report's leftover in words (and the largest tensors holding it, if known)."""
    leftover = report.get("leftover") or {}
    if not leftover:
        return "all memory came back"
    held = ", ".join(f"{k} {v:.3f} GB" for k, v in leftover.items())
    text = f"still held over what was in use before it loaded: {held}"
    if report.get("held_by"):
        text += f" (largest tensors still referenced: {'; '.join(report['held_by'])})"
    return text


def headline(status: dict) -> str:
    """One line for the page header: what is serving right now."""
    if not status.get("loaded") and status.get("remote"):  # in front of a model server
        why = "is down" if not status["health"]["ok"] else f"does not serve {status['model']}"
        return f"**Serving:** nothing now: the model server {status['backend_url']} {why}"
    if not status.get("loaded"):
        return "**Serving:** no model loaded"
    return (f"**Serving:** {status['model']} · {status['mode']} · {status['placement']}")


def _user(who: gr.Request | None) -> str:
    return repr(getattr(who, "username", None)) if who is not None else "the app"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# -- the model lists of the Model and Train tabs ----------------------------------------------------
# A dropdown's choices go to every browser in the page config, guests' too, so their values
# are the list's labels ("demo-copy (folder)"), never the server's paths; the handlers turn a
# label back into the name the registry loads (model_named).
def model_picks(registry, *, bases_only: bool = False) -> list[tuple[str, str]]:
    """(label, value) pairs for a dropdown of the models offered; bases_only: no adapters."""
    return [(label, label) for label, _ in registry.choices()
            if not bases_only or "adapter on" not in label]


def model_named(registry, value: str | None) -> str | None:
    """A model dropdown's value -> the registry's name for it. A value that is not a label of
    the list (an API client's "demo", folder path or hub id) is passed on as it is."""
    for label, name in registry.choices():
        if label == value:
            return name
    return value
