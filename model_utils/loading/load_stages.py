"""How long each stage of a load took: reading weights, quantizing, compiling, capturing.

The load reports its progress as (fraction, message) calls: the manager's own steps, the
weight-only quantizer's per-layer messages, the engine's compile and capture steps. StageClock
sits between them and the caller's progress bar: every message whose stage name (the text
before a ':' or '(') differs from the last one's closes the previous stage, and the bar shows
how long that one took. The stages end up in the status, so a user sees where a switch's
seconds went.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

Progress = Callable[[float, str], None]  # (fraction done, what is happening)


def stage_name(message: str) -> str:
    return re.split(r"[:(]", message, maxsplit=1)[0].strip()


@dataclass(frozen=True)
class Stage:
    name: str
    seconds: float

    def as_dict(self) -> dict:
        return {"stage": self.name, "s": round(self.seconds, 2)}


class StageClock:
    def __init__(self, progress: Progress, clock: Callable[[], float] = time.perf_counter):
        self._progress = progress
        self._clock = clock
        self._started = clock()
        self._current: tuple[str, float] | None = None
        self.stages: list[Stage] = []

    def __call__(self, fraction: float, message: str) -> None:
        name = stage_name(message)
        now = self._clock()
        suffix = ""
        if self._current is None or self._current[0] != name:
            if self._current is not None:
                done = self._close(now)
                suffix = f" [{done.name}: {done.seconds:.1f} s]"
            self._current = (name, now)
        self._progress(fraction, message + suffix)

    def _close(self, now: float) -> Stage:
        name, since = self._current
        stage = Stage(name, now - since)
        self.stages.append(stage)
        return stage

    def finish(self) -> list[Stage]:
        """Close the open stage; the stages in order (their sum is the whole load)."""
        if self._current is not None:
            self._close(self._clock())
            self._current = None
        return list(self.stages)

    def report(self, fraction: float, message: str) -> None:
        """A message past the stages (the final one), passed on as it is."""
        self._progress(fraction, message)

    @property
    def elapsed(self) -> float:
        return self._clock() - self._started


def summary(stages: list[Stage], *, top: int = 4) -> str:
    """'reading weights 8.1 s, compiling 20.3 s, ...': the longest stages in load order."""
    longest = sorted(stages, key=lambda s: -s.seconds)[:top]
    keep = [s for s in stages if s in longest]
    return ", ".join(f"{s.name} {s.seconds:.1f} s" for s in keep)
