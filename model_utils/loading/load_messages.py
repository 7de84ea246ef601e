"""What a user is told when a load fails: one line they can act on, from whatever the loader
raised. The page and the API show it to anyone, so an exception's own text is passed on only
where it is already plain (the app's LoadError, ValueError, OSError); the few failures a
library words for its developers (a damaged safetensors file, weights of other shapes than the
config says) are put in words here."""

from __future__ import annotations

import torch

from model_utils.errors import LoadError

from .weight_files import damaged_message


def user_message(error: BaseException) -> str:
    """One line a user can act on, from whatever from_pretrained raised."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return "out of GPU memory while loading: pick a smaller mode or allow CPU offload"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if type(error).__name__ == "SafetensorError":  # its text: "Error while deserializing ..."
        return damaged_message()
    if "ignore_mismatched_sizes" in text:  # transformers' report of the shapes is in the log
        return ("the weights do not match the model's config.json (tensors of other shapes): "
                "the files are of different models, or the config was edited")
    if "safetensors" in text.lower() and "no file named" in text.lower():
        text += " (this app loads safetensors weights only)"
    if isinstance(error, (LoadError, ValueError, OSError)):
        return text
    return f"{type(error).__name__}: {text}"
