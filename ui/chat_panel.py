"""The chat panel: a streaming chatbot with Stop, Regenerate, Undo, Clear, settings, the
thinking switch, export/import, and a conversation and settings kept in the browser across
reloads (a reply cut short by a reload is kept as far as it got). A user message can be edited
in place; the edit and Regenerate start a new version and keep the old one to page back to
(server/branches.py, ui/branch_controls.py). The chat list beside it (ui/chat_list.py) holds
every chat, each with its preset (ui/presets.py) and Thinking switch; export and import of one
chat or all of them in ui/chat_transfer.py.

While a reply streams, Send and Regenerate are disabled and Stop is the red, enabled button;
afterwards (done, stopped, failed or cancelled) they change back."""

from __future__ import annotations

import logging
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr

from model_utils.errors import InvalidParameter
from server.branches import fork, reply_point
from server.common import DEMO_NOTICE, reply_concurrency, user_error
from server.conversation import (
    ConversationError,
    chatbot_messages,
    engine_messages,
    turn_of_view,
    validate_history,
    without_last_turn,
)
from server.queue_gone import SESSIONS
from server.replies import StopSignals, make_settings, stats_line, stream, waiting_notice

from .branch_controls import build_branch_controls, wire_branch_controls
from .chat_list import build_chat_list, wire_chat_list
from .chat_settings import (
    context_bounded,
    keep_settings,
    left_to_the_server,
    setting_controls,
)
from .chat_transfer import build_transfer, wire_transfer
from .content_change import content_change
from .context_budget import build_budget_line, wire_context_budget
from .presets import build_presets, wire_presets

if TYPE_CHECKING:
    from model_utils.engine import Engine
    from server.chat_store import ChatStore

# Stats line of a reply the page stopped seeing (a reload, a closed tab): the conversation in
# the browser is saved while the reply streams, and this is what such a turn ends with.
INTERRUPTED = "interrupted: the page was reloaded or closed during the reply"
SAVE_INTERVAL_S = 1.0  # how often a streaming reply is written to the browser's storage
DEFAULT_CONTEXT = 8192  # the slider's range before any model is loaded
STORAGE_KEYS = ("qwen-chat-conversation", "qwen-chat-settings")
STORAGE_OWNER_KEY = "qwen-chat-owner"


def buttons(generating: bool) -> tuple:
    """(Send, Stop, Regenerate) for the two states of the panel."""
    if generating:
        return (gr.update(interactive=False), gr.update(interactive=True, variant="stop"),
                gr.update(interactive=False))
    return (gr.update(interactive=True), gr.update(interactive=False, variant="secondary"),
            gr.update(interactive=True))

log = logging.getLogger("ui")


def build_chat_panel(engine: Engine, *, demo: gr.Blocks, status: gr.State,
                     chat_store: ChatStore | None = None) -> dict:
    """Components of the chat panel. `status` is the page's copy of engine.status(); when it
    changes (a load, an unload) the thinking switch and the demo notice follow. `chat_store`:
    with logins, where each user's chats are kept (None: in the browser)."""
    signals = StopSignals()
    # Exported files are written here; gradio serves files from the temp dir.
    export_dir = Path(tempfile.mkdtemp(prefix="qwen-chat-export-"))
    c: dict = {}
    with gr.Row(equal_height=False):
        with gr.Column(scale=1, min_width=220):
            c.update(build_chat_list())
        with gr.Column(scale=3):
            c["demo_notice"] = gr.Markdown(f"⚠ **{DEMO_NOTICE}**", elem_id="demo-notice",
                                           visible=bool(engine.status().get("is_demo")))
            c["chatbot"] = gr.Chatbot(label="Conversation", height=480, elem_id="chatbot",
                                      buttons=["copy", "copy_all"], feedback_options=None,
                                      editable="user",
                                      placeholder="Say something to the model.")
            c.update(build_branch_controls())
            c["notice"] = gr.Markdown("", elem_id="chat-notice")
            with gr.Row():
                # Opened by the page load, once the saved conversation and settings are back.
                c["message"] = gr.Textbox(show_label=False, scale=8, elem_id="message",
                                          placeholder="Loading…", interactive=False)
                c["send"] = gr.Button("Send", variant="primary", scale=1, elem_id="send")
            c.update(build_budget_line())
            with gr.Row():
                c["stop"] = gr.Button("Stop", elem_id="stop", size="sm", interactive=False)
                c["regenerate"] = gr.Button("Regenerate", elem_id="regenerate", size="sm")
                c["undo"] = gr.Button("Undo last turn", elem_id="undo", size="sm")
                c["clear"] = gr.Button("Clear", elem_id="clear", size="sm")
        with gr.Column(scale=1, min_width=260):
            _settings_controls(c, engine)
            with gr.Accordion("Export / import", open=False):
                c.update(build_transfer())
    # The conversation and the settings, in the browser's localStorage: they survive a reload.
    c["conversation"] = gr.BrowserState([], storage_key=STORAGE_KEYS[0])
    # Listen to this one's change, not the conversation's (which also fires unchanged).
    c["conversation_changed"] = content_change(c["conversation"], "conversation-changed")
    c["saved_settings"] = gr.BrowserState({}, storage_key=STORAGE_KEYS[1])
    # Whose they are: with logins, the next user of the same browser must not get (and send
    # the model) the previous user's conversation and system prompt.
    c["owner"] = gr.BrowserState("", storage_key=STORAGE_OWNER_KEY)
    _wire(c, engine, signals, export_dir, demo, status, chat_store)
    return c


def _settings_controls(c: dict, engine: Engine) -> None:
    with gr.Accordion("Settings", open=True):
        c["system_prompt"] = gr.Textbox(label="System prompt", lines=2,
                                        placeholder="(none)", elem_id="system-prompt")
        c["thinking"] = gr.Checkbox(label="Thinking (reasoning shown apart from the answer)",
                                    value=True, visible=engine.supports_thinking(),
                                    elem_id="thinking")
        c.update(build_presets())
        # One widget per setting, from the settings' declarations; the ones ranging up to
        # the loaded model's context are redrawn on every load and switch.
        context = engine.status().get("context_tokens") or DEFAULT_CONTEXT
        c["setting_controls"] = setting_controls(context)
        c.update(c["setting_controls"])


def _wire(c: dict, engine: Engine, signals: StopSignals, export_dir: Path, demo: gr.Blocks,
          status: gr.State, chat_store: ChatStore | None) -> None:
    setting_names = list(c["setting_controls"])
    settings_inputs = [c["system_prompt"], c["thinking"], *c["setting_controls"].values()]
    controls = [c["send"], c["stop"], c["regenerate"]]
    stream_outputs = [c["chatbot"], c["conversation"], c["message"], c["notice"], *controls]

    def reply(turns: list[dict], finish, restore: list[dict], system_prompt: str,
              thinking: bool, values: dict, request: gr.Request | None, restore_box):
        """Stream one reply to `turns` (checked; they end with the user's message).
        finish(reply turn) is the conversation with the reply in it; `restore` is the one
        put back when the reply cannot be made. Yields (chatbot, conversation, message box,
        notice, Send, Stop, Regenerate). The conversation in the browser is written as the
        reply grows, so a reload keeps the turn as far as it got."""
        status = engine.status()
        try:  # bad values: gr.Error before anything changes
            settings = make_settings(left_to_the_server(values, status))
        except InvalidParameter as error:
            raise user_error(str(error)) from error
        mode = status.get("mode", "?")
        session = getattr(request, "session_hash", None)
        stop = signals.start(session)
        log.info("chat: session %s, %d earlier messages, new message of %d chars, settings %s",
                 (session or "-")[:8], len(turns) - 1, len(turns[-1]["content"]), values)

        def saved(pending: dict) -> list[dict]:
            return finish({"role": "assistant", **pending, "stats": INTERRUPTED})

        # A tab closed mid-reply sets `stop` as its event stream closes (queue_gone.py).
        SESSIONS.add(session, stop)
        try:
            # Said until the first token's update replaces it.
            yield (chatbot_messages(turns, {"content": ""}), saved({"content": ""}), "",
                   waiting_notice(status), *buttons(generating=True))
            update, last_save = None, time.monotonic()
            try:
                for update in stream(engine, engine_messages(turns), settings,
                                     system_prompt=system_prompt, thinking=thinking, stop=stop):
                    pending = {"content": update.answer, "reasoning": update.reasoning}
                    keep, controls_now = gr.skip(), (gr.skip(),) * 3
                    if time.monotonic() - last_save >= SAVE_INTERVAL_S:
                        # The buttons are said again with each save: an update of another
                        # event that reached the page late cannot leave Stop disabled.
                        keep, last_save = saved(pending), time.monotonic()
                        controls_now = buttons(generating=True)
                    yield (chatbot_messages(turns, pending), keep, gr.skip(), update.notice,
                           *controls_now)
            except gr.Error:
                # Nothing is lost: the conversation as it was, the message back in the box.
                yield chatbot_messages(restore), restore, restore_box, "", *(gr.skip(),) * 3
                raise
            if update is None:  # stopped before the first token
                done = finish({"role": "assistant", "content": "", "stats": "stopped"})
            else:
                done = finish({"role": "assistant", "content": update.answer,
                               "reasoning": update.reasoning,
                               "stats": stats_line(update.stats, mode, no_answer=bool(
                                   update.reasoning and not update.answer.strip())) or "stopped"})
            yield (chatbot_messages(done), done, gr.skip(), update.notice if update else "",
                   *buttons(generating=False))
        finally:
            SESSIONS.discard(session, stop)
            signals.finish(session, stop)

    # gr.Request comes before the settings' values: gradio passes it only to a parameter
    # ahead of *args, at that place among the inputs.
    def respond(message: str, conversation: list[dict], system_prompt: str, thinking: bool,
                request: gr.Request, *setting_values):
        if not (message or "").strip():  # an empty message sends nothing
            yield (gr.skip(),) * len(stream_outputs)
            return
        values = dict(zip(setting_names, setting_values, strict=True))
        before = checked(conversation)
        turns = [*before, {"role": "user", "content": message}]
        yield from reply(turns, lambda answer: [*turns, answer], before, system_prompt,
                         thinking, values, request, restore_box=message)

    def regenerate(conversation: list[dict], system_prompt: str, thinking: bool,
                   request: gr.Request, *setting_values):
        conversation = checked(conversation)
        at = reply_point(conversation)
        if at is None:
            raise user_error("nothing to regenerate: send a message first")
        values = dict(zip(setting_names, setting_values, strict=True))
        # The old reply stays as the earlier version, and as it was when the new one cannot
        # be made.
        yield from reply(conversation[:at], lambda answer: fork(conversation, at, [answer]),
                         conversation, system_prompt, thinking, values, request,
                         restore_box=gr.skip())

    def edit(conversation: list[dict], system_prompt: str, thinking: bool,
             request: gr.Request, edited: gr.EditData, *setting_values):
        """An earlier user message edited in the chatbot: a reply from there, the turns it
        replaces kept as the earlier version of that message."""
        conversation = checked(conversation)
        at = turn_of_view(conversation, edited.index if isinstance(edited.index, int) else -1)
        text = edited.value if isinstance(edited.value, str) else ""
        if at is None or conversation[at]["role"] != "user" or not text.strip():
            # Not a message of the conversation (or emptied): the chatbot as it was.
            yield chatbot_messages(conversation), *(gr.skip(),) * (len(stream_outputs) - 1)
            return
        turns = fork(conversation, at, [{"role": "user", "content": text}])
        values = dict(zip(setting_names, setting_values, strict=True))
        yield from reply(turns, lambda answer: [*turns, answer], conversation, system_prompt,
                         thinking, values, request, restore_box=gr.skip())

    def checked(conversation: list[dict] | None) -> list[dict]:
        try:  # the browser holds the conversation: the same checks as an API history
            return validate_history(conversation or [])
        except ConversationError as error:
            raise user_error(str(error)) from error

    def after_failure(request: gr.Request):
        """After a failed reply: the buttons back, and the chatbot and message box out of
        gradio's "error" state (a failed event leaves a red badge on its outputs until another
        event writes them; the error itself was shown as a toast). A reply that ends well
        restores the buttons in its own last update: a separate event after it would race the
        next message, and could disable the Stop button of a reply already streaming."""
        if signals.running(getattr(request, "session_hash", None)):
            return gr.skip(), gr.skip(), *(gr.skip(),) * 3
        return gr.skip(), gr.skip(), *buttons(generating=False)

    reply_events = []
    # One listener for Enter and Send: trigger_mode="once" ignores either while a reply of
    # this page is still running.
    sent = gr.on([c["message"].submit, c["send"].click], respond,
                 [c["message"], c["conversation"], *settings_inputs], stream_outputs,
                 concurrency_id="reply", concurrency_limit=reply_concurrency(engine),
                 api_visibility="private", show_progress="minimal", trigger_mode="once")
    regenerated = c["regenerate"].click(
        regenerate, [c["conversation"], *settings_inputs], stream_outputs,
        concurrency_id="reply", concurrency_limit=reply_concurrency(engine),
        api_visibility="private", show_progress="minimal", trigger_mode="once")
    # Editing cancels a reply in progress, as Undo does: what it wrote so far is kept in the
    # version the edit replaces.
    edited = c["chatbot"].edit(
        edit, [c["conversation"], *settings_inputs], stream_outputs, cancels=[sent, regenerated],
        concurrency_id="reply", concurrency_limit=reply_concurrency(engine),
        api_visibility="private", show_progress="minimal")
    for event in (sent, regenerated, edited):
        reply_events.append(event)
        event.failure(after_failure, None, [c["chatbot"], c["message"], *controls],
                      concurrency_limit=None, api_visibility="private", show_progress="hidden")

    def stop_reply(request: gr.Request) -> None:
        # Graceful: the engine ends the reply at the next decode step and the partial answer
        # is kept with its stats (a cancel would drop it).
        signals.stop(getattr(request, "session_hash", None))

    wire_branch_controls(c, demo=demo, cancels=reply_events, controls=controls,
                         idle=lambda: buttons(generating=False))
    c["stop"].click(stop_reply, None, None, concurrency_limit=None, api_visibility="private",
                    show_progress="hidden")

    # Undo and Clear cancel a reply in progress: gradio closes its generator, which closes
    # the engine's (the decode slot is freed within one step).
    def undo(conversation: list[dict]):
        turns, message = without_last_turn(conversation or [])
        return chatbot_messages(turns), turns, message, "", *buttons(generating=False)

    c["undo"].click(undo, [c["conversation"]], stream_outputs, cancels=reply_events,
                    api_visibility="private", show_progress="hidden")
    for trigger in (c["clear"].click, c["chatbot"].clear):  # the button and the bin icon
        trigger(lambda: ([], [], "", "", *buttons(generating=False)), None, stream_outputs,
                cancels=reply_events, api_visibility="private", show_progress="hidden")

    loaded = keep_settings(c, engine, demo, settings_inputs, setting_names,
                           default_context=DEFAULT_CONTEXT)
    chats = wire_chat_list(c, engine, chat_store, loaded=loaded, cancels=reply_events,
                           setting_names=setting_names, idle=lambda: buttons(generating=False))
    wire_presets(c, chats)
    wire_transfer(c, chats, export_dir)
    wire_context_budget(c, engine, demo=demo, status=status, settings_inputs=settings_inputs,
                        setting_names=setting_names)
    bounded = [c[name] for name in context_bounded(setting_names)]

    def on_model_change(current: dict, *values):
        context = current.get("context_tokens") or DEFAULT_CONTEXT
        # A value is touched only when it no longer fits: on page load this may run before
        # the saved settings are put back, and must not overwrite them with the default.
        sliders = [gr.update(maximum=context, value=context)
                   if value is not None and value > context else gr.update(maximum=context)
                   for value in values]
        return (gr.update(visible=bool(current.get("is_demo"))),
                gr.update(visible=engine.supports_thinking()), *sliders)

    status.change(on_model_change, [status, *bounded],
                  [c["demo_notice"], c["thinking"], *bounded],
                  api_visibility="private", show_progress="hidden")

    # A closed tab stops its reply at the next decode step (gradio also closes the generator).
    def on_tab_closed(request: gr.Request) -> None:
        signals.stop(getattr(request, "session_hash", None))

    demo.unload(on_tab_closed)
