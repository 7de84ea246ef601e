"""What the UI and the APIs need from an engine, whichever serves the model.

Two engines satisfy it: model_utils.engine.Engine (the model loaded in this process) and
model_utils.backends.remote.RemoteEngine (an OpenAI-compatible server elsewhere: vLLM, SGLang,
TGI, Ollama, another instance of this app). The UI's panels and endpoints call only these
members, so the same page, logins and /v1 endpoint sit in front of either.

Light on purpose: app.py reads the backend flags before anything heavy is imported (--help and
refused flags answer at once), so nothing here imports torch.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:  # the types only: importing them would import torch
    from model_utils.chat.updates import ChatUpdate
    from model_utils.loading.load_stages import Progress
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.loading.placement import FitEstimate
    from model_utils.memory import MemorySnapshot
    from model_utils.runtime.generation_settings import GenerationSettings
    from model_utils.runtime.grammar import OutputFormat


@runtime_checkable
class ChatBackend(Protocol):
    """The engine surface the UI, the gradio endpoints and the /v1 endpoint use."""

    # Replies decoded together, and more that may wait: the UI lets max_batch + max_queue
    # handlers run at once (server.common.reply_concurrency).
    max_batch: int
    max_queue: int

    def status(self) -> dict:
        """What serves: loaded, model, mode, placement, context_tokens, is_demo, ... Cheap:
        called on every page load, reply and timer tick."""

    def status_version(self) -> int:
        """A number that changes whenever status() may have changed (polled by every page)."""

    def start_memory_sampler(self, interval_s: float = 2.0) -> None:
        """Start the one background memory sampler (app.py calls it once)."""

    def queue_status(self) -> dict | None:
        """{active, waiting, max_batch, max_queue}, or None when nothing can reply."""

    def memory_snapshot(self) -> MemorySnapshot:
        """Memory now (and a point in the history the memory plot draws)."""

    def supports_thinking(self) -> bool:
        """Whether the Thinking switch means something for what serves."""

    def default_settings(self) -> GenerationSettings:
        """The recommended settings (None where the server's own default applies)."""

    def chat(self, messages: list[dict], settings: GenerationSettings | None = None, *,
             system_prompt: str | None = None, thinking: bool = True,
             stop: threading.Event | None = None,
             output_format: OutputFormat | None = None,
             logprobs: int | None = None) -> Iterator[ChatUpdate]:
        """Stream one reply. Input refused before anything is generated raises one of
        server.replies.INPUT_ERRORS on the first next(); setting `stop` or closing the iterator
        ends the reply and frees its place. `output_format`: tools and a format the reply must
        follow (runtime/grammar.py); tool calls come in the answer as <tool_call> blocks.
        `logprobs`: each token's log-probability and this many alternatives, in the updates."""

    def generate_text(self, messages: list[dict], settings: GenerationSettings | None = None,
                      **kwargs) -> ChatUpdate:
        """The whole reply at once."""

    def load(self, request: LoadRequest, progress: Progress | None = None) -> dict:
        """Load or switch models; LoadError says why not."""

    def unload(self) -> dict:
        """Unload; the status afterwards."""

    def estimate(self, request: LoadRequest) -> FitEstimate:
        """Whether a model would fit (raises where the question has no answer here)."""


__all__ = ["ChatBackend"]
