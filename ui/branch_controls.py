"""The pager under the chatbot for the versions of a conversation ("< 2 / 3 >"): which message
has versions (picked in its list, or by a click on the message), and buttons that page between
them and swap the rest of the conversation with them. The versions themselves live in the conversation (server/branches.py); this module only
draws and wires the control, shown while the current path has a message with versions."""

from __future__ import annotations

import gradio as gr

from server.branches import BranchPoint, branch_points, page, pick_point, seen_state, tree_size
from server.conversation import (
    ConversationError,
    chatbot_messages,
    turn_of_view,
    validate_history,
)

SNIPPET_CHARS = 40


def build_branch_controls() -> dict:
    """The pager's components; call inside the layout, under the chatbot."""
    c: dict = {}
    with gr.Row(visible=False, elem_id="branches", equal_height=True) as c["branch_row"]:
        c["branch_point"] = gr.Dropdown(label="Versions of", show_label=False, choices=[],
                                        scale=8, container=False, elem_id="branch-point",
                                        interactive=True)
        c["branch_prev"] = gr.Button("‹", size="sm", scale=0, min_width=36,
                                     elem_id="branch-prev")
        c["branch_position"] = gr.HTML("", elem_id="branch-position", container=False,
                                       min_width=56, scale=0)
        c["branch_next"] = gr.Button("›", size="sm", scale=0, min_width=36,
                                     elem_id="branch-next")
    # What the pager saw last (tree size, versions per message): tells a new version (show
    # it) from paging (stay at the message paged).
    c["branch_seen"] = gr.State(None)
    return c


def _label(conversation: list[dict], point: BranchPoint) -> str:
    text = " ".join(conversation[point.index]["content"].split())
    snippet = text if len(text) <= SNIPPET_CHARS else text[:SNIPPET_CHARS - 1] + "…"
    if point.role == "user":
        number = sum(1 for m in conversation[:point.index + 1] if m["role"] == "user")
        return f"Versions of your message {number}: “{snippet}”"
    number = sum(1 for m in conversation[:point.index] if m["role"] == "user")
    return f"Versions of the reply to message {number}"


def pager(conversation: list[dict], selected: int | None, seen: dict | None) -> tuple:
    """(row, dropdown, position, ‹, ›, seen) for this conversation."""
    points = branch_points(conversation)
    total = tree_size(conversation)
    chosen = pick_point(points, selected, seen, total)
    if chosen is None:
        return (gr.update(visible=False), gr.update(choices=[], value=None), "",
                gr.update(), gr.update(), seen_state(points, total))
    point = next(p for p in points if p.index == chosen)
    choices = [(f"{_label(conversation, p)} ({p.position})", p.index) for p in points]
    return (gr.update(visible=True), gr.update(choices=choices, value=chosen),
            f"<b>{point.position}</b>", gr.update(interactive=point.current > 1),
            gr.update(interactive=point.current < point.count), seen_state(points, total))


def wire_branch_controls(c: dict, *, demo: gr.Blocks, cancels: list, controls: list,
                         idle) -> None:
    """Redraw the pager on page load and whenever the conversation changes; page on ‹ / ›.
    Paging while a reply streams stops that reply (as Undo does: `cancels`, and `controls`
    set to `idle()`): what it had written stays in the version left."""
    pager_outputs = [c["branch_row"], c["branch_point"], c["branch_position"],
                     c["branch_prev"], c["branch_next"], c["branch_seen"]]

    def redraw(conversation: list[dict], selected: int | None, seen: dict | None):
        try:  # the browser's copy: a broken one is put aside by the page load
            conversation = validate_history(conversation or [])
        except ConversationError:
            conversation = []
        return pager(conversation, selected, seen)

    gr.on([demo.load, c["conversation_changed"].change], redraw,
          [c["conversation"], c["branch_point"], c["branch_seen"]], pager_outputs,
          api_visibility="private", show_progress="hidden", trigger_mode="always_last",
          concurrency_limit=None)
    c["branch_point"].input(redraw, [c["conversation"], c["branch_point"], c["branch_seen"]],
                            pager_outputs, api_visibility="private", show_progress="hidden",
                            concurrency_limit=None)

    def picked(conversation: list[dict], seen: dict | None, chosen: gr.SelectData):
        """A click on a message with versions shows its versions in the pager."""
        try:
            conversation = validate_history(conversation or [])
        except ConversationError:
            return (gr.skip(),) * len(pager_outputs)
        index = chosen.index if isinstance(chosen.index, int) else -1
        at = turn_of_view(conversation, index)
        if at is None or not conversation[at].get("branches"):
            return (gr.skip(),) * len(pager_outputs)
        return pager(conversation, at, seen)

    c["chatbot"].select(picked, [c["conversation"], c["branch_seen"]], pager_outputs,
                        api_visibility="private", show_progress="hidden",
                        concurrency_limit=None)

    def turn_page(step: int):
        def paged(conversation: list[dict], selected: int | None, seen: dict | None):
            try:
                conversation = validate_history(conversation or [])
            except ConversationError as error:
                raise gr.Error(str(error)) from None
            if selected is None:
                return (gr.skip(),) * (2 + len(pager_outputs) + len(controls))
            paged = page(conversation, int(selected), step)
            return (chatbot_messages(paged), paged, *pager(paged, int(selected), seen),
                    *idle())
        return paged

    for button, step in ((c["branch_prev"], -1), (c["branch_next"], +1)):
        button.click(turn_page(step), [c["conversation"], c["branch_point"], c["branch_seen"]],
                     [c["chatbot"], c["conversation"], *pager_outputs, *controls],
                     cancels=cancels,
                     api_visibility="private", show_progress="hidden")
