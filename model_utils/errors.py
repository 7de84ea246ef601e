"""The errors the engine raises to its callers, in one place.

Each class says what went wrong in words meant for the user; server/errors.py maps them to HTTP
codes and gr.Error once, and the CLI to its exit codes. This module imports nothing, so any
layer can name these classes (a refused CLI flag, an endpoint's mapping) without importing
torch, and no runtime module imports the model manager just for an exception.
"""

from __future__ import annotations


class LoadError(RuntimeError):
    """A load that did not happen, or no model to answer; the message is meant for the user."""


NO_MODEL = "no model is loaded: load one first (the Model tab, or the load_model endpoint)"


class ModelBusy(RuntimeError):
    """A switch refused because replies are still streaming, or a reply refused for now."""


class QueueFull(ModelBusy):
    """Too many requests in flight: the caller should say "busy, try again shortly".
    A ModelBusy, so a front end that already presents ModelBusy presents this too."""


class ShuttingDown(ModelBusy):
    """The server is closing: no new reply starts, and open ones may be ended early."""


class ModelNotFound(ValueError):
    """A model name that does not resolve to a loadable checkpoint (message says why)."""


class ChatInputError(ValueError):
    """Input the chat cannot turn into a prompt; the message says what to change."""


class InvalidParameter(ValueError):
    """A generation setting or engine option out of range; .name is the parameter, .message
    what is wrong with it."""

    def __init__(self, name: str, message: str):
        super().__init__(f"{name}: {message}")
        self.name, self.message = name, message


class WorkerLost(RuntimeError):
    """A tensor-parallel worker process died (killed, crashed, out of memory): the reply it
    was part of ends with this, the model is unloaded, and a new load starts fresh workers."""
