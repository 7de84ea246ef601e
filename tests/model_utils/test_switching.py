"""Switching modes through one engine: memory comes back, and a failed switch loses nothing."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import weakref
from pathlib import Path

import pytest

from model_utils import process_tuning
from model_utils.engine import Engine
from model_utils.errors import LoadError
from model_utils.loading.loaded_model import LoadRequest
from model_utils.loading.placement import Placement

from .helpers import (
    FEW_TOKENS,
    HELLO,
    REPO_ROOT,
    copy_demo,
    copy_demo_with_other_shapes,
    cpu_request,
    submitted_together,
)

MB = 1024**2

# How far process RSS after an unload may sit above the RSS after the first unload of the
# chain (run by switch_chain in a process of its own). Measured on this model, after the
# chain's warm-up: at most 5 MB (first use of some bf16
# kernels; page and allocator noise). 12 MB is below the smallest model of the chain (nf4,
# 15.7 MB; int8 30 MB, bf16 59 MB, fp32 118 MB), so a model that was not given back fails the
# test, and well above the noise, so the test is not flaky.
RSS_BOUND_MB = 12


@pytest.fixture(scope="module")
def wide_models_dir(tmp_path_factory, demo_path):
    """A models folder holding "wide": the demo tokenizer and a 31M-parameter random Qwen3.

    The demo model itself (1M parameters, 4 MB in fp32) is smaller than the allocator noise of
    a process, so RSS could not tell a freed demo model from a leaked one.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    root = tmp_path_factory.mktemp("models")
    folder = copy_demo(demo_path, root / "wide", weights=False)
    config = AutoConfig.from_pretrained(demo_path).to_dict()
    config.pop("layer_types", None)  # sized for the demo's layers; rebuilt for 8
    config.update(hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**config), dtype=torch.bfloat16)
    model.generation_config = AutoModelForCausalLM.from_pretrained(demo_path).generation_config
    model.save_pretrained(folder)
    return root


def run_switch_chain(models_dir, *modes: tuple[str, ...]) -> dict:
    """tests/model_utils/switch_chain.py in a process of its own (`modes`: its warm-up and
    chain, else its own): what it read, after checking that every switch answered and freed."""
    done = subprocess.run([sys.executable, "-m", "tests.model_utils.switch_chain",
                           str(models_dir), *(",".join(m) for m in modes)], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    chain = json.loads(done.stdout.splitlines()[-1])
    assert chain["problems"] == []
    return chain


def assert_unloads_give_memory_back(unloads: list[dict], baseline: float) -> None:
    """Each unload's RSS after is within RSS_BOUND_MB of `baseline`, and each gave back at least
    half of the model it unloaded (switch_chain's readings, in bytes)."""
    for unload in unloads:
        above = unload["rss_after"] - baseline
        assert above <= RSS_BOUND_MB * MB, (
            f"RSS after unloading {unload['model']} is {above / MB:.1f} MB above the baseline "
            f"(bound {RSS_BOUND_MB} MB)")
        given_back = unload["rss_before"] - unload["rss_after"]
        assert given_back > unload["footprint"] / 2, (
            f"unloading {unload['model']} gave back {given_back / MB:.1f} MB, less than half "
            f"of its {unload['footprint'] / MB:.1f} MB")


def test_switch_chain_answers_and_gives_memory_back(wide_models_dir):
    chain = run_switch_chain(wide_models_dir)
    assert_unloads_give_memory_back(chain["unloads"], baseline=chain["unloads"][0]["rss_after"])


def test_a_loaded_model_skips_full_gc_passes_and_is_still_freed_on_unload():
    process_tuning.tune_process()  # the freeze after a load is part of the app's tuning
    engine = Engine()
    engine.load(cpu_request("fp32"))
    assert gc.get_freeze_count() > 10_000  # the model, its tokenizer, and all before them
    model = weakref.ref(engine.manager.loaded.model)
    engine.unload()
    assert gc.get_freeze_count() == 0
    assert model() is None


def test_an_unload_after_batched_replies_drops_every_reference_the_engine_made():
    engine = Engine(max_batch=4)
    engine.load(cpu_request("fp32"))
    replies = submitted_together(engine, [lambda: engine.generate_text(HELLO, FEW_TOKENS)] * 3)
    assert max(r.stats.batched_with for r in replies) == 3
    serving = engine.serving
    runner = serving.scheduler.runner
    alive = {"model": weakref.ref(serving.loaded.model), "scheduler": weakref.ref(serving.scheduler),
             "runner": weakref.ref(runner), "kv cache": weakref.ref(runner.kv),
             "first key pool": weakref.ref(runner.kv.keys[0]),
             "tokenizer": weakref.ref(serving.loaded.tokenizer)}
    del serving, runner
    engine.unload()
    assert engine.manager.last_unload.model_kept_by == []
    assert [name for name, ref in alive.items() if ref() is not None] == []


def test_an_unload_names_what_still_keeps_the_model():
    engine = Engine()
    engine.load(cpu_request("fp32"))
    kept = engine.manager.loaded  # what a caller forgetting to let go would hold
    engine.unload()
    report = engine.manager.last_unload
    assert len(report.model_kept_by) == 1, report.model_kept_by
    assert report.model_kept_by[0].startswith(
        "kept, a local variable of test_an_unload_names_what_still_keeps_the_model (")
    assert report.model_kept_by[0].endswith("-> a LoadedModel -> it")
    assert report.as_dict()["model_kept_by"] == report.model_kept_by
    model = weakref.ref(kept.model)
    del kept
    gc.collect()
    assert model() is None


# -- a failed switch keeps the previous model -------------------------------------------------
@pytest.fixture
def models_dir(tmp_path):
    folder = tmp_path / "models"
    folder.mkdir()
    return folder


def _assert_still_serving(engine, mode: str) -> None:
    status = engine.status()
    assert status["loaded"] and status["is_demo"]
    assert (status["mode"], status["placement"]) == (mode, "cpu")
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4


def test_switch_to_a_missing_folder_keeps_the_model(models_dir):
    engine = Engine(models_dir=models_dir)
    engine.load(cpu_request("fp32"))
    model = engine.manager.loaded.model
    with pytest.raises(LoadError, match="does not exist"):
        engine.load(cpu_request("fp32", model=str(models_dir / "missing")))
    # Refused before the current model was touched: the very same object still serves.
    assert engine.manager.loaded.model is model
    _assert_still_serving(engine, "fp32")


def test_switch_to_weights_that_fail_to_load_restores_the_model(models_dir, demo_path):
    # Sound files, config and tokenizer: only the load itself finds the shapes wrong.
    copy_demo_with_other_shapes(demo_path, models_dir / "broken")
    engine = Engine(models_dir=models_dir)
    engine.load(cpu_request("nf4"))
    with pytest.raises(LoadError) as caught:
        engine.load(cpu_request("bf16", model="broken"))
    message = str(caught.value)
    assert "do not match the model's config.json" in message  # why, in words
    assert "RuntimeError" not in message and "ignore_mismatched_sizes" not in message
    assert "previous model" in message and "serving again" in message
    _assert_still_serving(engine, "nf4")


def test_load_that_does_not_fit_is_refused_with_the_numbers(models_dir):
    engine = Engine(models_dir=models_dir)
    engine.load(cpu_request("bf16"))
    capped = Placement("cpu", max_memory_gb={"cpu": 0.001})
    with pytest.raises(LoadError) as caught:
        engine.load(LoadRequest(model="demo", mode="fp32", placement=capped))
    message = str(caught.value)
    assert "does not fit" in message and "needs" in message and "free" in message
    assert "capped at 0.001 GB" in message
    _assert_still_serving(engine, "bf16")

    # A context window beyond the model's positions is refused by its range, before the fit.
    with pytest.raises(LoadError, match=r"context_tokens must be between 16 and 4096"):
        engine.load(cpu_request("fp32", context_tokens=10**9))
    _assert_still_serving(engine, "bf16")


def test_estimate_orders_the_modes_by_size(engine):
    sizes = {mode: engine.estimate(cpu_request(mode)).weights_gb
             for mode in ("fp32", "bf16", "int8", "nf4")}
    assert sizes["fp32"] > sizes["bf16"] > sizes["int8"] > sizes["nf4"] > 0
    kv = engine.estimate(cpu_request("bf16", context_tokens=2048)).kv_cache_gb
    assert engine.estimate(cpu_request("bf16", context_tokens=4096)).kv_cache_gb == 2 * kv


def test_the_unload_report_counts_what_stayed_over_the_memory_before_the_load():
    from model_utils.loading.memory_accounting import leftover_after

    # A 7B unload as measured on a GPU: 17.8 GB freed, 0.034 GB more than before the load.
    before_load = {"rss_gb": 2.0, "cuda:0_allocated_gb": 0.104, "cuda:0_reserved_gb": 0.2}
    after = {"rss_gb": 2.3, "cuda:0_allocated_gb": 0.138, "cuda:0_reserved_gb": 0.15}
    assert leftover_after(before_load, after) == {"cuda:0_allocated_gb": 0.034}
    assert leftover_after(after, after) == {}


def test_an_unload_report_is_never_negative():
    from model_utils.engine import Engine
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.loading.placement import Placement

    engine = Engine()
    engine.load(LoadRequest("demo", "fp32", Placement("cpu")))
    report = engine.unload()["unloaded"]
    assert all(v > 0 for v in report["leftover"].values()), report
    assert report["freed"] and all(v >= 0 for v in report["freed"].values()), report


def test_the_recommended_settings_are_read_at_once_during_a_switch(load_demo):
    """A page opened while a switch runs gets its settings now, not after the switch."""
    import threading

    engine = load_demo("fp32")
    got: dict = {}
    with engine.manager._switch():  # what a load holds while it swaps the model
        reader = threading.Thread(target=lambda: got.update(engine.default_settings().as_dict()))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive(), "the page load waited for the switch"
    assert got["top_k"] == 20  # the demo model's generation_config


# -- a switch within one model keeps its tokenizer --------------------------------------------
def _stage_names(engine) -> list[str]:
    return [stage.name for stage in engine.manager.loaded.stages]


def test_a_mode_switch_keeps_the_tokenizer_until_its_files_change(models_dir, demo_path):
    copy_demo(demo_path, models_dir / "mine")
    engine = Engine(models_dir=models_dir)
    engine.load(cpu_request("fp32", model="mine"))
    first = engine.manager.loaded.tokenizer
    assert any(name.startswith("loading tokenizer") for name in _stage_names(engine))

    engine.load(cpu_request("bf16", model="mine"))
    assert engine.manager.loaded.tokenizer is first
    assert any(name.startswith("keeping the tokenizer") for name in _stage_names(engine))
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4

    # An edited chat template is read again, and so is everything after an unload.
    template = models_dir / "mine" / "chat_template.jinja"
    template.write_text(template.read_text() + "{# edited #}")
    engine.load(cpu_request("fp32", model="mine"))
    assert engine.manager.loaded.tokenizer is not first
    second = engine.manager.loaded.tokenizer
    engine.unload()
    engine.load(cpu_request("fp32", model="mine"))
    assert engine.manager.loaded.tokenizer is not second
    engine.unload()


@pytest.fixture
def tokenizer_reads(monkeypatch):
    """The folders AutoTokenizer.from_pretrained read a tokenizer from, in order (the real
    read runs: only counted)."""
    from transformers import AutoTokenizer

    read, folders = AutoTokenizer.from_pretrained, []

    def counted(folder, *args, **kwargs):
        folders.append(Path(folder).name)
        return read(folder, *args, **kwargs)

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", counted)
    return folders


def test_mode_switches_read_the_tokenizer_once_and_another_model_reads_its_own(
        models_dir, demo_path, tokenizer_reads):
    copy_demo(demo_path, models_dir / "mine")
    other = copy_demo(demo_path, models_dir / "other")
    # The other model's template says so in every prompt: its prompts show whose it is.
    template = other / "chat_template.jinja"
    template.write_text("{{- 'OTHER TEMPLATE\\n' }}" + template.read_text())
    engine = Engine(models_dir=models_dir)

    for mode in ("fp32", "bf16", "int8-wo", "fp32"):
        engine.load(cpu_request(mode, model="mine"))
    assert tokenizer_reads == ["mine"]
    mine = engine.manager.loaded.tokenizer

    engine.load(cpu_request("bf16", model="other"))
    assert tokenizer_reads == ["mine", "other"]
    assert engine.render_prompt(HELLO).startswith("OTHER TEMPLATE")
    engine.load(cpu_request("fp32", model="other"))
    assert tokenizer_reads == ["mine", "other"]

    engine.load(cpu_request("fp32", model="mine"))  # the one kept is the other's: read again
    assert tokenizer_reads == ["mine", "other", "mine"]
    assert engine.manager.loaded.tokenizer is not mine
    assert not engine.render_prompt(HELLO).startswith("OTHER TEMPLATE")
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4


def test_a_failed_switch_restores_the_model_with_its_tokenizer_unread(
        models_dir, demo_path, tokenizer_reads):
    copy_demo(demo_path, models_dir / "mine")
    copy_demo_with_other_shapes(demo_path, models_dir / "broken")
    engine = Engine(models_dir=models_dir)
    engine.load(cpu_request("fp32", model="mine"))
    tokenizer = engine.manager.loaded.tokenizer
    with pytest.raises(LoadError, match="serving again"):
        engine.load(cpu_request("bf16", model="broken"))
    # The broken model's own tokenizer was read (another folder); the restore read none.
    assert tokenizer_reads == ["mine", "broken"]
    assert engine.manager.loaded.tokenizer is tokenizer
    assert engine.generate_text(HELLO, FEW_TOKENS).stats.new_tokens == 4


def test_a_mode_switch_keeps_the_grammar_compiler_of_its_tokenizer(models_dir, demo_path):
    from model_utils.runtime.generation_settings import GenerationSettings
    from model_utils.runtime.grammar import OutputFormat

    copy_demo(demo_path, models_dir / "mine")
    copy_demo(demo_path, models_dir / "other")
    engine = Engine(models_dir=models_dir)
    settings = GenerationSettings(max_new_tokens=48, temperature=0.0)

    def forced_reply() -> object:
        """A reply forced into JSON; the compiler it was made with."""
        final = engine.generate_text(HELLO, settings, thinking=False,
                                     output_format=OutputFormat("json_object"))
        assert final.answer.lstrip().startswith("{"), final.answer
        return engine._grammar_cache[1]

    engine.load(cpu_request("fp32", model="mine"))
    compiler = forced_reply()
    engine.load(cpu_request("bf16", model="mine"))
    assert forced_reply() is compiler  # the same tokenizer: its compiler goes on
    engine.load(cpu_request("fp32", model="other"))
    assert forced_reply() is not compiler  # another model's tokenizer: a compiler of its own
    engine.unload()
    assert engine._kept_grammars is None and engine._grammar_cache is None
