"""The server layer's pure parts: stop strings, server paths for guests, the error mapping."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from model_utils.chat.reasoning import ReasoningSplitter, ReplyText, split_reasoning
from model_utils.chat.updates import ChatUpdate
from model_utils.errors import InvalidParameter, LoadError, ModelBusy
from server import replies
from server.errors import SERVER_FAILED, client_error, hide_paths, status_for
from server.request_models import ChatCompletionRequest, parse_json
from server.stop_strings import StopFollower, StopStrings

MODELS = Path("/srv/models")


def test_the_reply_is_cut_before_the_first_stop_string():
    stops = StopStrings(["END", "\n\n"])
    assert stops.cut("one\n\ntwo END") == ("one", True)
    assert stops.cut("one END two\n\n") == ("one ", True)
    assert stops.cut("no stop here") == ("no stop here", False)


@pytest.mark.parametrize(("text", "sent"), [
    ("hello E", "hello "),      # "E" may start "END"
    ("hello EN", "hello "),
    ("hello ENx", "hello ENx"),  # it did not
    ("a\n", "a"),               # "\n" may start "\n\n"
    ("", ""),
])
def test_what_may_start_a_stop_string_is_held_back(text, sent):
    assert StopStrings(["END", "\n\n"]).safe_prefix(text) == sent


@pytest.mark.parametrize("pieces", [
    ["one\n", "\ntwo END"],           # "\n\n" split over two pieces
    ["one E", "N", "D two"],            # "END" over three
    ["a E", "Nx E", "ND"],              # a false start, then the real one
    ["no stop", " here\n"],             # none: the held "\n" is released at the end
    ["EN", "", "D"],
])
def test_stop_strings_followed_piece_by_piece_cut_where_the_whole_text_is_cut(pieces):
    stops = StopStrings(["END", "\n\n"])
    follower = StopFollower(stops)
    sent = "".join(follower.feed(piece) for piece in pieces) + follower.finish()
    assert (sent, follower.hit) == stops.cut("".join(pieces))


def test_a_stop_follower_searches_only_the_new_piece():
    follower = StopFollower(StopStrings(["\n\nUser:", "###"]))
    for _ in range(20_000):
        follower.feed("a long reply goes on\n")
        assert follower.scanned <= len("a long reply goes on\n") + len("\n\nUser:")
    assert not follower.hit and follower.feed("\nUser: hi") == "" and follower.hit


def _updates(pieces: list[str]) -> list[ChatUpdate]:
    splitter, text, out = ReasoningSplitter(), ReplyText(), []
    for piece in pieces:
        delta = splitter.feed(piece)
        out.append(ChatUpdate.of(delta, text.add(delta)))
    delta = splitter.finish()
    out.append(ChatUpdate.of(delta, text.add(delta), done=True))
    return out


@pytest.mark.parametrize("pieces", [
    ["<think>\n", "Hm", "m.\n", "</think>", "\n\n", "Hi", " there."],
    ["abc", " def", "</think>", "ghi"],  # a resplit among the skipped updates
])
def test_paced_updates_carry_the_deltas_of_the_ones_they_skip(monkeypatch, pieces):
    monkeypatch.setattr(replies, "UPDATE_INTERVAL_S", 3600.0)  # only the first and the last
    sent = list(replies.paced(iter(_updates(pieces))))
    assert len(sent) == 2 and sent[-1].done
    reasoning = answer = ""
    for update in sent:
        if update.resplit:
            reasoning = answer = ""
        reasoning, answer = reasoning + update.reasoning_delta, answer + update.answer_delta
    assert (reasoning, answer) == (sent[-1].reasoning, sent[-1].answer) == \
        split_reasoning("".join(pieces))


@pytest.mark.parametrize("pieces, stop, expected", [
    (["<think>\nHm", "m.\n</think>", "\n\nHello ", "wor", "ld. END", " more"], ["END"],
     ("Hmm.", "Hello world. ", True)),
    (["abc", " d</thi", "nk>\n", "ghi E", "N"], ["END"], ("abc d", "ghi EN", False)),
])
def test_the_openai_reply_follows_deltas_with_stop_strings_and_a_resplit(pieces, stop, expected):
    """Reply (the /v1 endpoint's view of a stream): the answer cut at the stop string from
    pieces, the deltas it would send add up to what it holds, a late </think> starts the
    answer again (what was sent as content stays sent: the rest follows as reasoning)."""
    from server.openai_api import ChatCall, Reply

    call = ChatCall.parse({"messages": [{"role": "user", "content": "hi"}], "stop": stop})
    reply, sent = Reply(call), {"reasoning": "", "content": ""}
    for update in _updates(pieces):
        reply.follow(update)
        sent["reasoning"] += reply.new_reasoning
        sent["content"] = ("" if update.resplit else sent["content"]) + reply.new_answer
    assert (reply.reasoning, reply.answer, reply.hit_stop) == expected
    assert (sent["reasoning"], sent["content"]) == expected[:2]
    assert call.stop.is_set() == expected[2]  # a stop string frees the reply's place


def test_guests_see_paths_relative_to_the_models_folder():
    message = ("'/etc/x' is outside the allowed model folders (/root/.cache/qwen-chat, "
               "/srv/models); folder /srv/models/qwen/7b has no config.json.")
    assert hide_paths(message, MODELS) == (
        "'…/x' is outside the allowed model folders (…/qwen-chat, the models folder); folder "
        "qwen/7b has no config.json.")
    # Hub ids and markup are not paths.
    assert hide_paths("Qwen/Qwen3-8B and <b>x</b>", MODELS) == "Qwen/Qwen3-8B and <b>x</b>"
    status = {"path": "/srv/models/qwen-7b", "is_demo": False, "estimate": "fits"}
    assert status_for(status, full_paths=False, models_dir=MODELS)["model_path"] == "qwen-7b"
    assert status_for(status, full_paths=True, models_dir=MODELS)["model_path"] == \
        "/srv/models/qwen-7b"


def test_one_mapping_from_errors_to_statuses():
    assert client_error(InvalidParameter("top_p", "must be in (0, 1]")).param == "top_p"
    assert client_error(ModelBusy("busy")).status == 503
    assert client_error(LoadError("no model is loaded: load one")).status == 503
    assert client_error(LoadError("does not fit")).status == 400
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": 1}]})
    mapped = client_error(caught.value)
    assert mapped.status == 400 and mapped.message.startswith("messages.0.content:")
    bug = client_error(TypeError("secret internals at /srv/models"))
    assert bug.status == 500 and bug.message == SERVER_FAILED


@pytest.mark.parametrize("body", [b'"\\ud800"', b"[" * 100_000 + b"]" * 100_000, b"NaN",
                                  b"{oops"])
def test_bodies_that_cannot_be_parsed_safely_are_a_400(body):
    with pytest.raises(Exception) as caught:
        parse_json(body)
    assert getattr(caught.value, "status", None) == 400


def test_stop_signals_know_which_sessions_are_replying_and_stop_only_theirs():
    signals = replies.StopSignals()
    mine, theirs = signals.start("me"), signals.start("them")
    assert signals.running("me") and signals.running("them") and not signals.running("nobody")
    assert signals.stop("me") == 1
    assert mine.is_set() and not theirs.is_set()
    signals.finish("me", mine)
    assert not signals.running("me") and signals.running("them")


def test_the_status_says_how_many_graphs_came_from_the_compile_cache():
    from server.model_actions import status_markdown

    status = {"loaded": True, "model": "demo", "mode": "bf16", "placement": "cuda:0",
              "load_stages": [{"stage": "compiling the batched decode step", "s": 3.5}],
              "ready_s": 9.0, "compiled_graphs": {"hits": 3, "misses": 1}}
    text = status_markdown(status)
    assert "compiling the batched decode step 3.5 s" in text
    assert "3 from the compile cache, 1 compiled afresh" in text
    assert "compile cache" not in status_markdown({**status, "compiled_graphs": {}})


def test_the_status_says_what_the_last_switch_cost_and_took_from_caches():
    from server.model_actions import status_markdown

    status = {"loaded": True, "model": "demo", "mode": "bf16", "placement": "cuda:0",
              "load_stages": [{"stage": "compiling the batched decode step", "s": 3.5}],
              "ready_s": 9.0, "compiled_graphs": {"hits": 3, "misses": 1},
              "last_switch": {"s": 10.2, "unload_s": 0.8, "replaced": "demo (nf4)",
                              "from_caches": ["tokenizer"]}}
    text = status_markdown(status)
    assert ("the last switch took 10.2 s, unloading demo (nf4) 0.8 s of it; from caches: the "
            "tokenizer (kept from the mode before), 3 of 4 compiled graphs "
            "(torch.compile's cache)") in text
    cold = {**status, "compiled_graphs": {"hits": 0, "misses": 4},
            "last_switch": {"s": 30.0, "unload_s": 0.0, "from_caches": []}}
    assert "the load took 30.0 s; from caches: nothing" in status_markdown(cold)
    failed = {**status, "last_switch": {"s": 12.0, "unload_s": 0.8, "replaced": "demo (bf16)",
                                        "from_caches": ["tokenizer"], "failed": "mine in nf4"}}
    assert ("the last switch, to mine in nf4, failed: this model was loaded again in 12.0 s"
            in status_markdown(failed))
    kept = {**status, "compiled_graphs": {"hits": 0, "misses": 0, "kept": 1}}
    text = status_markdown(kept)
    assert "the decode step's code compiled for an earlier load of this mode" in text
    assert ("from caches: the tokenizer (kept from the mode before), the compiled decode step "
            "(kept from an earlier load of this mode)") in text
    parked = {**kept, "last_switch": {"s": 2.1, "unload_s": 0.3, "replaced": "demo (bf16)",
                                      "from_caches": ["parked weights"]},
              "parked": {"models": ["demo (bf16)"], "gb": 0.004, "limit_gb": 8}}
    text = status_markdown(parked)
    assert ("from caches: the weights (parked in host memory by an earlier switch, "
            "--park-gb), the compiled decode step") in text
    assert "parked in host memory for a switch back: demo (bf16) (0.00 of 8 GB)" in text
