"""Each stage of a load is timed and named: in the progress messages as it goes, and in the
status afterwards (what a switch's seconds went to)."""

from __future__ import annotations

import pytest

from model_utils.loading.load_stages import StageClock, stage_name

from .helpers import cpu_request

pytestmark = pytest.mark.unit


def test_a_stage_closes_when_the_next_begins():
    ticks = iter([0.0, 1.0, 1.5, 4.0, 4.5, 10.0])
    seen = []
    clock = StageClock(lambda f, m: seen.append(m), clock=lambda: next(ticks))
    clock(0.1, "reading weights (one GPU)")            # t = 1.0
    clock(0.3, "quantizing to int4: layer 1 of 64")    # t = 1.5: reading took 0.5 s
    clock(0.4, "quantizing to int4: layer 33 of 64")   # t = 4.0: same stage
    clock(0.6, "compiling the decode step")            # t = 4.5: quantizing took 3.0 s
    stages = clock.finish()                            # t = 10.0
    assert [(s.name, s.seconds) for s in stages] == [
        ("reading weights", 0.5), ("quantizing to int4", 3.0), ("compiling the decode step", 5.5)]
    assert seen[1].endswith("[reading weights: 0.5 s]")
    assert seen[3].endswith("[quantizing to int4: 3.0 s]")
    assert stage_name("capturing the prefill (4 rows)") == "capturing the prefill"


def test_the_status_keeps_the_breakdown(load_demo):
    messages = []
    engine = load_demo("fp32")
    engine.load(cpu_request("bf16"), lambda f, m: messages.append(m))
    status = engine.status()
    stages = status["load_stages"]
    names = [s["stage"] for s in stages]
    assert any(name.startswith("loading weights in bf16") for name in names), names
    assert all(s["s"] >= 0 for s in stages)
    assert sum(s["s"] for s in stages) == pytest.approx(status["ready_s"], abs=0.05)
    assert status["ready_s"] >= status["load_s"]
    assert messages[0].startswith("unloading") and "its load took" in messages[0]
    assert messages[-1].startswith("loaded") and "ready in" in messages[-1]


def test_the_status_says_what_the_last_switch_cost_and_took_from_caches(load_demo):
    from model_utils.loading.demo_model import DEMO_LABEL

    engine = load_demo("fp32")
    messages = []
    status = engine.load(cpu_request("int8-wo"), lambda f, m: messages.append(m))
    switch = status["last_switch"]
    assert switch["replaced"] == f"{DEMO_LABEL} (fp32)"
    assert switch["from_caches"] == ["tokenizer"]
    # The whole wait: the unload before the load and getting ready after it.
    assert switch["s"] >= status["ready_s"] + switch["unload_s"] - 0.01
    assert switch["unload_s"] > 0
    # The progress bar said how long the unload took, before the load's own stages.
    unloaded = [m for m in messages if m.startswith("unloaded ")]
    assert unloaded == [f"unloaded {DEMO_LABEL} (fp32) in {switch['unload_s']:.1f} s"]

    engine.unload()
    first = engine.load(cpu_request("fp32"))["last_switch"]
    assert "replaced" not in first and first["from_caches"] == [] and first["unload_s"] == 0


def test_a_model_restored_after_a_failed_switch_says_so(tmp_path, demo_path):
    from model_utils.engine import Engine
    from model_utils.errors import LoadError

    from .helpers import copy_demo_with_other_shapes

    broken = copy_demo_with_other_shapes(demo_path, tmp_path / "models" / "broken")
    engine = Engine(models_dir=tmp_path / "models")
    engine.load(cpu_request("fp32"))
    with pytest.raises(LoadError, match="serving again"):
        engine.load(cpu_request("bf16", model=str(broken)))
    status = engine.status()
    assert status["mode"] == "fp32"
    switch = status["last_switch"]
    # Named as the page may show it to anyone: the folder's name, not its server path.
    assert switch["failed"] == "broken in bf16"
    assert str(tmp_path) not in str(switch)
    assert switch["from_caches"] == ["tokenizer"]  # the restore kept the tokenizer too
    engine.unload()
