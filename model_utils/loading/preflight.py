"""What a load request is checked against before the current model is unloaded.

Everything here is judged without the weights: the request's types, the files (safetensors
present, their headers readable), the config, the compute dtype, the context window. A refusal
is a ValueError with a plain message (the manager presents it as a LoadError), naming the model
by its label, never by a server path. The fit itself is placement.estimate_fit, given
held_gb() as reclaimable; fit() picks the context a load gets from it.
"""

from __future__ import annotations

import logging

from model_utils.memory import GB

from .modes import COMPUTE_DTYPES, Mode
from .placement import FitEstimate, estimate_fit
from .weight_files import unreadable_weights

log = logging.getLogger(__name__)

# A context window a model may be loaded with: room for a short prompt and reply at least, at
# most what the model's positions cover (rope scaling included), and 1M tokens when the config
# does not say.
MIN_CONTEXT_TOKENS = 16
MAX_CONTEXT_TOKENS = 2**20
# Without a context asked for, one that fits is taken when the model's own does not: at least
# this many tokens, in steps of CONTEXT_STEP (a fraction of a GB of KV for any model served).
FITTED_CONTEXT_MIN = 2048
CONTEXT_STEP = 1024
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class PreflightError(ValueError):
    """A load request refused before anything was unloaded or loaded."""


def check_types(request) -> None:
    """Each field of a load request of the type it must have (front ends pass JSON values
    through); refused before anything else is looked at."""
    for name in ("model", "mode", "compute_dtype"):
        value = getattr(request, name)
        if not isinstance(value, str) or len(value) > 4096:
            raise PreflightError(f"{name} must be a name (text), got {type(value).__name__}")
    context = request.context_tokens
    if context is not None and (isinstance(context, bool) or not isinstance(context, int)):
        raise PreflightError(f"context_tokens must be a whole number of tokens, got "
                             f"{type(context).__name__} {str(context)[:30]}")


def require_safetensors(source) -> None:
    """The loader reads safetensors only (use_safetensors=True: a pickle file can run code when
    read), so a folder without any is refused now rather than after an unload; and so is one
    whose weights files are damaged, cut short or missing (their headers are read: see
    weight_files)."""
    if source.is_demo:
        return
    if not any(source.path.glob("*.safetensors")):
        pickles = sorted(p.name for p in source.path.iterdir() if p.suffix in PICKLE_SUFFIXES)
        found = f" (it has {', '.join(pickles[:3])})" if pickles else ""
        raise PreflightError(f"{source.label} has no .safetensors weights{found}: this app "
                             "loads safetensors only, as pickle files can run code when read")
    if reason := unreadable_weights(source.path):
        raise PreflightError(f"{source.label}: {reason}")


def check_compute_dtype(mode: Mode, compute_dtype: str) -> None:
    if mode.is_quantized and compute_dtype not in COMPUTE_DTYPES:
        raise PreflightError(f"unknown compute dtype {compute_dtype[:40]!r}; choose one of: "
                             f"{', '.join(COMPUTE_DTYPES)}")


def read_config(source, *, trust_remote_code: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(source.path, trust_remote_code=trust_remote_code)
    except Exception as error:  # noqa: BLE001 - one line for the user, without our paths
        log.warning("config of %s unreadable: %s", source.path, error)
        lines = str(error).strip().splitlines()
        reason = (lines[0] if lines else type(error).__name__).replace(str(source.path),
                                                                        source.path.name)
        raise PreflightError(f"{source.label}: its config cannot be read ({reason[:300]})"
                             ) from error


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def native_context(config) -> int | None:
    native = getattr(_text_config(config), "max_position_embeddings", None)
    return native if isinstance(native, int) and native > 0 else None


def context_tokens(config, requested: int | None) -> int:
    """The context window a load asks for: the one requested, or the model's own (its
    max_position_embeddings, which a rope-scaled config states at the scaled length)."""
    return requested or native_context(config) or 4096


def fitted_context(kv_bytes_per_token: float, room_gb: float, wanted: int) -> int | None:
    """The longest context, in steps of CONTEXT_STEP and at least FITTED_CONTEXT_MIN, whose
    KV cache fits in `room_gb` (what the weights leave); None when not even that does."""
    tokens = int(room_gb * GB // max(kv_bytes_per_token, 1)) // CONTEXT_STEP * CONTEXT_STEP
    tokens = min(tokens, wanted)
    return tokens if tokens >= FITTED_CONTEXT_MIN else None


def check_context(config, requested: int | None) -> None:
    """A context window the model's positions cover (a 1e12-token one would be refused only
    by the fit, after a KV cache estimate of petabytes)."""
    if requested is None:
        return
    native = native_context(config)
    scaling = getattr(_text_config(config), "rope_scaling", None) or {}
    factor = scaling.get("factor", 1.0) if isinstance(scaling, dict) else 1.0
    factor = factor if isinstance(factor, (int, float)) and factor >= 1 else 1.0
    limit = min(int(native * factor) if native else MAX_CONTEXT_TOKENS, MAX_CONTEXT_TOKENS)
    if not MIN_CONTEXT_TOKENS <= requested <= limit:
        raise PreflightError(f"context_tokens must be between {MIN_CONTEXT_TOKENS} and {limit} "
                             f"for this model, got {requested}")


def held_gb(loaded, beside: dict[str, float] | None = None) -> dict[str, float]:
    """Per device, what the loaded model holds and unloading gives back: its weights and what
    serving it holds `beside` them (the batch KV cache); the fit of the next model counts it
    as free."""
    if loaded is None:
        return {}
    held = {device: entry["gb"] for device, entry in loaded.device_map.items()}
    for device, gb in (beside or {}).items():
        held[device] = held.get(device, 0.0) + gb
    return held


def fit(config, mode: Mode, request, reclaimable: dict[str, float] | None = None
        ) -> tuple[FitEstimate, int, str]:
    """(the fit estimate, the context the load gets, why it is shorter than the model's
    own or ""). A context that was asked for is kept (and the fit judged with it); else
    the model's own, and when its KV cache does not fit beside the weights, the longest
    that does."""
    context = context_tokens(config, request.context_tokens)
    estimate = estimate_fit(config, mode, request.placement, context_tokens=context,
                            reclaimable_gb=reclaimable)
    if estimate.fits or request.context_tokens is not None:
        return estimate, context, ""
    per_token = estimate.kv_cache_gb * GB / context

    def fits(tokens: int) -> FitEstimate | None:
        found = estimate_fit(config, mode, request.placement, context_tokens=tokens,
                             reclaimable_gb=reclaimable, weights_gb=estimate.weights_gb)
        return found if found.fits else None

    # The room the weights leave (on the target device, or the roomiest), then checked
    # and narrowed by the fit itself.
    caps = {d: min(g, estimate.caps_gb.get(d, float("inf")))
            for d, g in estimate.free_gb.items()}
    target = request.placement.target
    room = (caps[target] if target in caps else max(caps.values(), default=0.0)) \
        - estimate.weights_gb
    tokens = fitted_context(per_token, room, context)
    while tokens is not None and (found := fits(tokens)) is None:
        tokens = fitted_context(per_token, tokens * per_token / GB * 0.9, context)
    if tokens is None:
        return estimate, context, ""
    note = (f"context {tokens} tokens: the model's own {context} do not fit beside its "
            f"weights (their KV cache would take {estimate.kv_cache_gb:.2f} GB)")
    log.info("%s", note)
    return found, tokens, note
