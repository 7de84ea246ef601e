"""Versions of a conversation: an edited message or a regenerated reply starts a new branch and
the replaced turns stay, to page back to ("< 2/3 >").

The conversation stays what it always was, the list of the current path's message dicts (what
the chatbot shows and the model is sent); the other versions ride along inside it, on the
message where they part:

    {"role": "user", "content": "new question", "branch": 1,
     "branches": [[{"role": "user", "content": "old question"}, {"role": "assistant", ...}]]}

`branches` holds every other version of that message with the turns that followed it (each a
list starting with a message of the same role, which may hold branches of its own further
down); `branch` is where the current version stands among all of them (0-based). So whatever
keeps or exports the list keeps the branches, and a message without them is as it was.

Pure functions on plain lists: no gradio, no engine; inputs are never changed in place.
"""

from __future__ import annotations

from dataclasses import dataclass

BRANCH_KEYS = ("branches", "branch")


@dataclass(frozen=True)
class BranchPoint:
    """A message of the current path that has other versions."""
    index: int      # its place in the conversation list
    role: str       # "user": an edited message; "assistant": a regenerated reply
    current: int    # 1-based position of the version shown
    count: int      # how many versions there are

    @property
    def position(self) -> str:
        return f"{self.current} / {self.count}"


def _plain(message: dict) -> dict:
    return {k: v for k, v in message.items() if k not in BRANCH_KEYS}


def current_path(conversation: list[dict]) -> list[dict]:
    """The messages shown and sent, without the other versions."""
    return [_plain(m) for m in conversation]


def versions(conversation: list[dict], index: int) -> list[list[dict]]:
    """Every version of the message at `index` with what followed it, in their order; the
    current one is conversation[index:]."""
    head = conversation[index]
    others = [list(tail) for tail in head.get("branches", [])]
    at = min(max(int(head.get("branch", len(others))), 0), len(others))
    current = [_plain(head), *conversation[index + 1:]]
    return [*others[:at], current, *others[at:]]


def _choose(before: list[dict], all_versions: list[list[dict]], chosen: int) -> list[dict]:
    tail = all_versions[chosen]
    others = all_versions[:chosen] + all_versions[chosen + 1:]
    head = _plain(tail[0])
    if others:
        head = {**head, "branches": others, "branch": chosen}
    return [*before, head, *tail[1:]]


def switch_branch(conversation: list[dict], index: int, to: int) -> list[dict]:
    """The conversation with version `to` (0-based, clamped) of the message at `index` and the
    turns that followed it in that version."""
    if not 0 <= index < len(conversation):
        return list(conversation)
    all_versions = versions(conversation, index)
    return _choose(conversation[:index], all_versions, min(max(to, 0), len(all_versions) - 1))


def fork(conversation: list[dict], index: int, tail: list[dict]) -> list[dict]:
    """conversation[:index] + `tail`, keeping conversation[index:] (and the versions already
    there) as the earlier versions of that message: what an edit (tail = the edited message)
    and Regenerate (tail = the new reply) do. The new version comes last and is current."""
    if not tail:
        raise ValueError("a new version needs at least one message")
    if index >= len(conversation):
        return [*conversation, *tail]
    all_versions = [*versions(conversation, index), list(tail)]
    return _choose(conversation[:index], all_versions, len(all_versions) - 1)


def branch_points(conversation: list[dict]) -> list[BranchPoint]:
    """The messages of the current path that have other versions, first to last."""
    return [BranchPoint(i, m["role"], int(m.get("branch", 0)) + 1, len(m["branches"]) + 1)
            for i, m in enumerate(conversation) if m.get("branches")]


def page(conversation: list[dict], index: int, step: int) -> list[dict]:
    """One version back (step -1) or on (+1) at `index`; at either end it stays."""
    if not 0 <= index < len(conversation) or not conversation[index].get("branches"):
        return list(conversation)
    return switch_branch(conversation, index, int(conversation[index].get("branch", 0)) + step)


def reply_point(conversation: list[dict]) -> int | None:
    """Where Regenerate puts the new reply: right after the last user message (None: there
    is no user message)."""
    users = [i for i, m in enumerate(conversation) if m["role"] == "user"]
    return users[-1] + 1 if users else None


def tree_size(conversation: list[dict]) -> int:
    """Messages in all versions together."""
    return sum(1 + sum(tree_size(tail) for tail in m.get("branches", ()))
               for m in conversation)


def pick_point(points: list[BranchPoint], selected: int | None, seen: dict | None,
               total: int) -> int | None:
    """Which branch point the page's pager should show after the conversation changed.

    `seen` is what the pager saw last ({"total": tree size, "counts": {index: versions}}).
    The conversation grew and a point has more versions than before: an edit or Regenerate
    just made one, show it. Otherwise the one shown stays if it is still on the path (paging
    at it changes what comes after, not it), else the last point, else none."""
    if not points:
        return None
    if seen is not None and total > seen.get("total", 0):
        counts = {int(k): v for k, v in seen.get("counts", {}).items()}
        grown = [p.index for p in points if p.count > counts.get(p.index, 1)]
        if grown:
            return grown[-1]
    indices = [p.index for p in points]
    return selected if selected in indices else indices[-1]


def seen_state(points: list[BranchPoint], total: int) -> dict:
    return {"total": total, "counts": {str(p.index): p.count for p in points}}
