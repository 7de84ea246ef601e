"""A decode step's sampled tokens, copied to the host without stopping the device."""

from __future__ import annotations

from collections.abc import Callable

import torch


class TokenReadback:
    """Copies a step's sampled tokens to the host without stopping the device.

    On CUDA the copy goes into one of two pinned buffers (at most two steps are in flight)
    and an event marks when it has landed; reading waits for that event only, while the
    step launched after it keeps the GPU busy. The events block rather than spin: the
    waiting thread sleeps instead of burning a CPU core that the web server's threads need,
    and the moment it takes to wake up is hidden behind the step already queued. On the CPU
    the tokens are there already.
    """

    def __init__(self, device: torch.device, rows: int):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.buffers = [torch.empty(rows, dtype=torch.long, pin_memory=True)
                            for _ in range(2)]
            self.events = [torch.cuda.Event(blocking=True), torch.cuda.Event(blocking=True)]
            self.turn = 0

    def start(self, tokens: torch.Tensor) -> Callable[[], list[int]]:
        if not self.cuda:
            return tokens.tolist
        buffer, event = self.buffers[self.turn][:len(tokens)], self.events[self.turn]
        self.turn ^= 1
        buffer.copy_(tokens, non_blocking=True)
        event.record()

        def read() -> list[int]:
            event.synchronize()
            return buffer.tolist()

        return read
