"""The long-context bench runs end to end on the CPU (a tiny random model): every row it promises
is there, the next turn finds its start in the cache, and --peer-only runs the peer alone."""

from __future__ import annotations

import json
import logging

from model_utils.bench import long_context

TINY = ["--random-from-config", "benchmarks/configs/tiny-qwen2.config.json",
        "--context-tokens", "512", "--lengths", "32,300", "--new-tokens", "8"]


def test_the_sweep_the_mixed_and_capacity_cases_and_the_next_turns(tmp_path, capsys, caplog):
    out = tmp_path / "long.json"
    caplog.set_level(logging.WARNING, "model_utils.loading.manager")
    assert long_context.main(TINY + ["--streams", "1,2", "--mixed-long", "300",
                                     "--mixed-short", "2", "--capacity", "3,1,300",
                                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [(r["prompt_tokens"], r["streams"]) for r in result["engine"]] == [
        (32, 1), (32, 2), (300, 1), (300, 2)]
    assert all(r["tok_s"] > 0 for r in result["engine"])
    assert result["mixed"]["long_prompt_tokens"] == 300 and result["mixed"]["ratio"] > 0
    capacity = result["capacity"]  # 3 short chats and one of 300 tokens together
    assert capacity["replies_whole"] == capacity["replies"] == 4
    assert capacity["preemptions"] == 0
    # sampled every 20 ms: a measurement, which a short run on the CPU may catch at any point
    assert 0 <= capacity["peak_blocks_used"] <= capacity["blocks_total"]
    turns = {t["prompt_tokens"]: t for t in result["next_turns"]}
    assert turns[300]["cached_tokens"] >= 256  # the conversation so far, found in the cache
    assert turns[32]["cached_tokens"] == 0  # under MIN_REUSE_TOKENS: computed again
    assert [p["prompt_tokens"] for p in result["peer"]] == [32, 300]
    assert all(p.get("tok_s", 0) > 0 for p in result["peer"]), result["peer"]
    assert "| 300 | 1 |" in capsys.readouterr().out
    # The peer ran with the engine's model gone: nothing of the bench kept it past its unload.
    assert not [r for r in caplog.records if "still alive" in r.getMessage()], caplog.text


def test_the_peer_alone(tmp_path, capsys):
    out = tmp_path / "peer.json"
    assert long_context.main(TINY + ["--peer-only", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert "engine" not in result and len(result["peer"]) == 2
    assert all(p["tok_s"] > 0 for p in result["peer"]), result["peer"]
    assert "| 300 |" in capsys.readouterr().out
