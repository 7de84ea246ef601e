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

    def held_back(self, text: str) -> int:
        """How many characters at the end of `text` could be the start of a stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held

    def safe_prefix(self, text: str) -> str:
        """The part of `text` (with no stop string in it) that can be sent now: all of it
        except the longest ending that is the start of some stop string."""
        return text[:len(text) - self.held_back(text)]

    def __bool__(self) -> bool:
        return bool(self.stops)


class StopFollower:
    """The stop strings applied to an answer that arrives as deltas. Each delta is searched
    together with what was held back before it, and nothing else: a stop string that began
    in text already sent would have been held back (it is an ending that starts a stop
    string), so the search never needs the whole answer. `scanned`: characters the last
    feed searched (the test's probe)."""

    def __init__(self, stops: StopStrings):
        self.stops = stops
        self.held = ""
        self.hit = False
        self.scanned = 0

    def feed(self, delta: str) -> str:
        """The text that can be sent now (after a stop string is found: nothing more)."""
        if self.hit:
            return ""
        if not self.stops:
            return delta
        text, self.held = self.held + delta, ""
        self.scanned = len(text)
        text, self.hit = self.stops.cut(text)
        if self.hit:
            return text
        keep = self.stops.held_back(text)
        if keep:
            text, self.held = text[:-keep], text[-keep:]
        return text

    def finish(self) -> str:
        """The end of the answer: what was held back was not a stop string after all."""
        held, self.held = ("" if self.hit else self.held), ""
        return held

    def restart(self) -> None:
        """The answer starts again (ChatUpdate.resplit): what was held is not part of it."""
        self.held = ""
