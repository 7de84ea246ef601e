"""The reply's reasoning (Qwen3's <think>...</think>) apart from its answer, whole or streamed.

split_reasoning splits a whole text. ReasoningSplitter does the same split piece by piece as
the reply streams: each piece is looked at once, with at most a few held-back characters (a tag
split over two pieces, "<thi" + "nk>"; newlines at the reasoning's end, which the split drops
once </think> arrives), so a step costs the piece and not the reply. Joined, its output is
split_reasoning of the whole text (of THINK_OPEN + the text when the prompt opened the block).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from functools import cached_property

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_STRAY_CLOSE = re.compile(re.escape(THINK_CLOSE) + r"\s*")


def split_reasoning(text: str) -> tuple[str, str]:
    """Decoded reply -> (reasoning, answer).

    Qwen3 writes "<think>\\n...\\n</think>\\n\\n" before the answer when thinking is on. Until
    </think> arrives, everything after <think> is reasoning.
    """
    stripped = text.lstrip()
    if THINK_CLOSE in text:
        before, after = text.split(THINK_CLOSE, 1)
        return before.split(THINK_OPEN, 1)[-1].strip("\n"), drop_stray_closes(after).lstrip("\n")
    if stripped.startswith(THINK_OPEN):
        return stripped[len(THINK_OPEN):].lstrip("\n"), ""
    return "", text


def drop_stray_closes(answer: str) -> str:
    """The answer without the further </think> tags a model may write after its reasoning
    ended (each with the blanks after it): they close nothing, and are not the answer."""
    return _STRAY_CLOSE.sub("", answer)


def prompt_opens_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open think block: some templates (QwQ,
    Qwen3's thinking-only models) write "<think>\\n" after the assistant header themselves, so
    the reply starts with reasoning and only its end tag shows."""
    return prompt.rstrip().endswith(THINK_OPEN)


@dataclass(frozen=True)
class ReasoningDelta:
    """What a piece added. `resplit`: a </think> arrived in a reply that had not opened the
    block, so what was shown as the answer is the reasoning after all (split_reasoning's
    reading); `reasoning` is then all of it and `answer` the start of the new answer."""

    reasoning: str = ""
    answer: str = ""
    resplit: bool = False

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.answer or self.resplit)

    def then(self, later: ReasoningDelta) -> ReasoningDelta:
        """This delta and the next as one (a resplit restarts the answer; the reasoning was
        empty until then, so it only grows)."""
        answer = later.answer if later.resplit else self.answer + later.answer
        return ReasoningDelta(self.reasoning + later.reasoning, answer,
                              self.resplit or later.resplit)


class _Trimmed:
    """Newlines trimmed as split_reasoning trims them, without looking back: leading ones are
    dropped; with hold_end, trailing ones are held until more text shows they are inner ones
    (end() then drops them, or flush() gives them: an unclosed block keeps them)."""

    def __init__(self, *, hold_end: bool):
        self.hold_end = hold_end
        self.started = False
        self.newlines = 0  # held at the end

    def add(self, text: str) -> str:
        if not self.started:
            text = text.lstrip("\n")
            self.started = bool(text)
            if not text:
                return ""
        if not self.hold_end:
            return text
        body = text.rstrip("\n")
        if not body:
            self.newlines += len(text)
            return ""
        out = "\n" * self.newlines + body
        self.newlines = len(text) - len(body)
        return out

    def flush(self) -> str:
        out, self.newlines = "\n" * self.newlines, 0
        return out


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest ending of `text` that is a proper beginning of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ReasoningSplitter:
    """Reply pieces in, ReasoningDelta out. `opened`: the prompt already opened the think block
    (prompt_opens_thinking), so the reply starts in the reasoning.

    `scanned` is how many characters the last feed looked at: the piece, plus what was held."""

    _START, _REASONING, _UNTAGGED, _ANSWER = "start", "reasoning", "untagged", "answer"

    def __init__(self, *, opened: bool = False):
        self._state = self._REASONING if opened else self._START
        self._held = ""  # undecided text: an opening tag's start, or a closing tag's
        self._blank: list[str] = []  # whitespace before the first text (split_reasoning lstrips)
        self._reasoning = _Trimmed(hold_end=True)
        self._answer = _Trimmed(hold_end=False)
        self._untagged: list[str] = []  # the answer shown without a tag (for a late </think>)
        self._tail = ""  # its last characters: a </think> split over two pieces
        self._after_close = False  # the answer's last text was a stray </think>: blanks go
        self.scanned = 0

    def feed(self, piece: str) -> ReasoningDelta:
        text, self._held = self._held + piece, ""
        self.scanned = len(text) + len(self._tail)
        if self._state == self._START:
            stripped = text.lstrip()
            if len(stripped) < len(text):  # kept apart: looked at once, however long
                self._blank.append(text[:len(text) - len(stripped)])
            if stripped.startswith(THINK_OPEN):
                self._state, text = self._REASONING, stripped[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(stripped):  # blank so far, or "<thi": wait and see
                self._held = stripped
                return ReasoningDelta()
            else:
                self._state = self._UNTAGGED
                return self._first_untagged(stripped)
            self._blank = []
        if self._state == self._REASONING:
            return self._in_reasoning(text)
        if self._state == self._UNTAGGED:
            return self._in_untagged(text)
        return ReasoningDelta(answer=self._in_answer(text))

    def finish(self) -> ReasoningDelta:
        """The end of the reply: what was held back is what it is."""
        held, self._held = self._held, ""
        if self._state == self._REASONING:  # never closed: the held text is reasoning
            if not self._reasoning.started:
                return ReasoningDelta(reasoning=self._reasoning.add(held))
            return ReasoningDelta(reasoning=self._reasoning.flush() + held)
        blank, self._blank = "".join(self._blank), []
        return ReasoningDelta(answer=blank + held)

    def _in_reasoning(self, text: str) -> ReasoningDelta:
        at = text.find(THINK_CLOSE)
        if at < 0:
            keep = _partial_tag(text, THINK_CLOSE)
            if keep:
                text, self._held = text[:-keep], text[-keep:]
            return ReasoningDelta(reasoning=self._reasoning.add(text))
        reasoning = self._reasoning.add(text[:at])
        self._reasoning.newlines = 0  # a closed block ends without its newlines
        self._state = self._ANSWER
        return ReasoningDelta(reasoning=reasoning,
                              answer=self._in_answer(text[at + len(THINK_CLOSE):]))

    def _in_answer(self, text: str) -> str:
        """Answer text with stray </think> tags and the blanks after them dropped, as
        drop_stray_closes drops them from the whole text: a tag split over two pieces is held
        until the next shows what it is, and blanks after a tag are dropped however the
        pieces fall."""
        if self._after_close:
            stripped = text.lstrip()
            self._after_close = not stripped
            text = stripped
        cleaned = drop_stray_closes(text)
        if cleaned != text and text.rstrip().endswith(THINK_CLOSE):
            self._after_close = True
        keep = _partial_tag(cleaned, THINK_CLOSE)
        if keep:
            cleaned, self._held = cleaned[:-keep], cleaned[-keep:]
        return self._answer.add(cleaned)

    def _first_untagged(self, text: str) -> ReasoningDelta:
        """The reply's first text, not a tag: the answer, after the blank before it (which
        holds no tag, so it is not searched again)."""
        blank, self._blank = "".join(self._blank), []
        self._untagged.append(blank)
        delta = self._in_untagged(text)
        if self._state == self._ANSWER:  # a </think> in it: split whole (nothing was shown)
            return replace(delta, resplit=False)
        return ReasoningDelta(answer=blank + delta.answer)

    def _in_untagged(self, text: str) -> ReasoningDelta:
        if THINK_CLOSE not in self._tail + text:
            self._untagged.append(text)
            self._tail = (self._tail + text)[-(len(THINK_CLOSE) - 1):]
            return ReasoningDelta(answer=text)
        # Once per reply at most: the whole text is split again, as split_reasoning reads it.
        shown = "".join(self._untagged)
        whole = shown + text
        self.scanned = len(whole)
        self._untagged, self._tail, self._state = [], "", self._ANSWER
        reasoning = split_reasoning(whole)[0]
        answer = self._in_answer(whole.split(THINK_CLOSE, 1)[1])
        return ReasoningDelta(reasoning=reasoning, answer=answer, resplit=bool(shown))


class ReplyText:
    """The reply's reasoning and answer so far, kept as the pieces that arrived: adding one
    costs its length; the whole text is joined only for a reader that wants it (TextSoFar)."""

    def __init__(self):
        self._reasoning: list[str] = []
        self._answer: list[str] = []

    def add(self, delta: ReasoningDelta) -> TextSoFar:
        if delta.resplit:  # new lists: earlier snapshots keep the text they saw
            self._reasoning, self._answer = [], []
        if delta.reasoning:
            self._reasoning.append(delta.reasoning)
        if delta.answer:
            self._answer.append(delta.answer)
        return TextSoFar(self._reasoning, len(self._reasoning), self._answer, len(self._answer))


class TextSoFar:
    """The text as of one update (the first `n` pieces of the lists, which only grow)."""

    def __init__(self, reasoning: list[str], n_reasoning: int, answer: list[str],
                 n_answer: int):
        self._r, self._nr, self._a, self._na = reasoning, n_reasoning, answer, n_answer

    @cached_property
    def reasoning(self) -> str:
        return "".join(self._r[:self._nr])

    @cached_property
    def answer(self) -> str:
        return "".join(self._a[:self._na])


EMPTY_TEXT = TextSoFar([], 0, [], 0)


class SeparatedReasoning:
    """The split for a server that may send the reasoning apart (vLLM's and SGLang's
    reasoning_content beside content): trimmed as split_reasoning trims a closed block (the
    reasoning without its surrounding newlines, the answer without leading ones), piece by
    piece. Until a reasoning piece arrives, content goes through a ReasoningSplitter: a server
    that does not parse the thinking leaves <think> in the text."""

    def __init__(self):
        self._splitter: ReasoningSplitter | None = ReasoningSplitter()
        self._reasoning = _Trimmed(hold_end=True)
        self._answer = _Trimmed(hold_end=False)

    def feed(self, reasoning: str, content: str) -> ReasoningDelta:
        if self._splitter is not None and not reasoning:
            delta = self._splitter.feed(content) if content else ReasoningDelta()
            self._answer.started |= bool(delta.answer)
            return delta
        before = ReasoningDelta()
        if self._splitter is not None:  # from now on the server says which is which
            before, self._splitter = self._splitter.finish(), None
            self._answer.started |= bool(before.answer)
        return before.then(ReasoningDelta(self._reasoning.add(reasoning),
                                          self._answer.add(content)))

    def finish(self) -> ReasoningDelta:
        return self._splitter.finish() if self._splitter is not None else ReasoningDelta()
