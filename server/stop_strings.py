"""OpenAI's `stop`: the reply ends before the first stop string, which is not included.

The engine streams text, and a stop string may arrive split over several pieces ("\\n\\nUs" then
"er:"). So while streaming, the text that could still be the start of a stop string is held
back, and sent only once the next pieces show that it is not.
"""

from __future__ import annotations


class StopStrings:
    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]

    def cut(self, text: str) -> tuple[str, bool]:
        """(the text before the first stop string, whether one was found)."""
        first = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        return (text[:first], True) if first >= 0 else (text, False)

    def safe_prefix(self, text: str) -> str:
        """The part of `text` (with no stop string in it) that can be sent now: all of it
        except the longest ending that is the start of some stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return text[:len(text) - held]

    def __bool__(self) -> bool:
        return bool(self.stops)
