"""A trained adapter (model_utils.finetune's output) applied to its base model at load.

An adapter folder may come from anyone who can write into the models folder, so it is checked
before peft reads it: adapter_config.json a bounded JSON object with the types peft expects,
weights in adapter_model.safetensors only (peft falls back to torch.load on a .bin, whose
refusal advises weights_only=False), and LoRA matrices of the rank the config says. What peft
raises after that (weights named for other layers) becomes one plain AdapterError too: the
raw messages were a RecursionError, TypeErrors, a KeyError of the config's own text and a
state-dict dump.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

log = logging.getLogger("loading")

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_RANK = 4096


class AdapterError(ValueError):
    """An adapter folder that cannot be applied; the message says why, plainly."""


def check_adapter(folder: str | Path) -> dict:
    """adapter_config.json of `folder`, once it and the weights' header have been checked."""
    folder = Path(folder)
    config = _read_config(folder)
    name = folder.name
    if config.get("peft_type") != "LORA":
        raise AdapterError(f"adapter {name}: only LoRA adapters are loaded (its "
                           f"{CONFIG} does not say peft_type LORA)")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= MAX_RANK:
        raise AdapterError(f"adapter {name}: r in {CONFIG} must be a whole number from 1 to "
                           f"{MAX_RANK}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) \
            or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"adapter {name}: lora_alpha in {CONFIG} must be a positive number")
    for key in ("target_modules", "modules_to_save"):
        value = config.get(key)
        if value is not None and not isinstance(value, str) and not (
                isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise AdapterError(f"adapter {name}: {key} in {CONFIG} must be a module name or "
                               "a list of them")
    _check_weights(folder, rank)
    return config


def apply_adapter(model: torch.nn.Module, folder, *, merge: bool) -> torch.nn.Module:
    """The base model with a peft adapter applied. Merged into the weights where the mode
    allows (fp32/bf16/fp16: the result is a plain model, so the fast decode path applies as to
    any other); on bitsandbytes weights it stays a separate LoRA branch beside each quantized
    layer (merging would round the sum to 4 or 8 bits). Either way the transformers model
    itself is returned, not peft's wrapper, so the engine sees the same classes as ever."""
    from peft import PeftModel

    check_adapter(folder)
    try:
        wrapped = PeftModel.from_pretrained(model, folder, is_trainable=False)
    except (RuntimeError, TypeError, KeyError, ValueError, AttributeError, IndexError,
            RecursionError) as error:
        log.warning("adapter %s did not apply: %s", folder, str(error).splitlines()[0][:300])
        raise AdapterError(f"adapter {Path(folder).name} does not fit its base model: its "
                           "weights name or shape layers the base model does not have") \
            from None
    return wrapped.merge_and_unload() if merge else wrapped.get_base_model()


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise AdapterError(f"adapter {folder.name}: {CONFIG} is larger than 1 MB")
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError:
        raise AdapterError(f"adapter {folder.name}: {CONFIG} cannot be read") from None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        raise AdapterError(f"adapter {folder.name}: {CONFIG} is not valid JSON (or is nested "
                           "too deeply)") from None
    if not isinstance(config, dict):
        raise AdapterError(f"adapter {folder.name}: {CONFIG} must hold a JSON object")
    return config


def _check_weights(folder: Path, rank: int) -> None:
    from safetensors import safe_open

    path = folder / WEIGHTS
    if not path.is_file():
        raise AdapterError(f"adapter {folder.name} has no {WEIGHTS}: this app loads "
                           "adapters' weights from safetensors only")
    try:
        with safe_open(str(path), framework="pt") as weights:
            shapes = {key: weights.get_slice(key).get_shape() for key in weights.keys()}
    except Exception:  # noqa: BLE001 - safetensors raises its own error types
        raise AdapterError(f"adapter {folder.name}: {WEIGHTS} is not a readable safetensors "
                           "file") from None
    for key, shape in shapes.items():
        if len(shape) != 2 or not ("lora_A" in key or "lora_B" in key):
            continue
        found = shape[0] if "lora_A" in key else shape[1]
        if found != rank:
            raise AdapterError(f"adapter {folder.name}: its weights are of rank {found}, its "
                               f"{CONFIG} says r={rank}")
