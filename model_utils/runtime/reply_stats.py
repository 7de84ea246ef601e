"""What a reply's stats line says: time to first token, speed, tokens in and out. No torch:
the app in front of a remote model server fills it too."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class ReplyStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    ttft_ms: float = 0.0
    tok_s: float = 0.0  # decode speed: tokens after the first / time after the first
    total_s: float = 0.0
    stopped: bool = False  # by the user's Stop
    finish_reason: str = ""  # "eos" | "length" | "stop" ("error" when the batch step failed)
    decode_path: str = ""
    batched_with: int = 1  # the most replies decoded in one step together, this one included
    cached_tokens: int = 0  # prompt tokens whose keys and values were found in the KV cache

    def as_dict(self) -> dict:
        return asdict(self)

    def line(self) -> str:
        cached = f" ({self.cached_tokens} cached)" if self.cached_tokens else ""
        return (f"{self.ttft_ms:.0f} ms to first token · {self.tok_s:.1f} tok/s · "
                f"{self.prompt_tokens} in{cached} / {self.new_tokens} out")
