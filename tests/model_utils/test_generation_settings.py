"""The generation settings' one declaration (runtime/generation_settings.py) and what is built
from it without a model: GenerationSettings, its refusals, the CLI's flags; and EngineConfig,
whose flags app.py, the CLI and the bench share."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

import pytest

from model_utils.engine_config import COMPILE_MODES, EngineConfig
from model_utils.errors import InvalidParameter
from model_utils.runtime.generation_settings import (
    MAX_SEED,
    SETTINGS,
    GenerationSettings,
    Setting,
    add_setting_flags,
    public,
    settings_class,
    settings_from_args,
)

from .helpers import REPO_ROOT

# A knob the engine does not have: declared here only, it must reach every consumer.
MIN_P = Setting("min_p", float, 0.0, 1.0, off=0.0, help="drop tokens below min_p x the top one",
                model_default=lambda gc, _: getattr(gc, "min_p", None) or 0.0)
EXTENDED = (*SETTINGS, MIN_P)


@pytest.mark.parametrize(("name", "value", "message"), [
    ("temperature", -1.0, "temperature: must be >= 0 and <= 100, got -1.0"),
    ("temperature", float("nan"), "temperature: must be a finite number, got nan"),
    ("temperature", "hot", "temperature: must be a finite number, got 'hot'"),
    ("top_p", 0.0, "top_p: must be in (0, 1], got 0.0"),
    ("top_p", 1.5, "top_p: must be in (0, 1], got 1.5"),
    ("top_k", -1, "top_k: must be >= 0 and <= 1000000, got -1"),
    ("top_k", 2.5, "top_k: must be an integer, got 2.5"),
    ("max_new_tokens", 0, "max_new_tokens: must be at least 1, got 0"),
    ("max_new_tokens", -5, "max_new_tokens: must be at least 1, got -5"),
    ("repetition_penalty", 0.0, "repetition_penalty: must be >= 0.01 and <= 10, got 0.0"),
    ("seed", -5, f"seed: must be >= 0 and <= {MAX_SEED}, got -5"),
    ("seed", True, "seed: must be an integer, got True"),
    ("min_new_tokens", -1, "min_new_tokens: must be at least 0, got -1"),
])
def test_each_setting_is_refused_by_name_with_its_range(name, value, message):
    given = GenerationSettings(**{name: value})  # the others unset: the model's defaults
    complete = GenerationSettings.greedy(**{"max_new_tokens": 1, name: value})
    for check in (given.check_given, complete.validate):
        with pytest.raises(InvalidParameter) as caught:
            check()
        assert caught.value.name == name and str(caught.value) == message


def test_a_huge_value_is_quoted_short():
    with pytest.raises(InvalidParameter, match=r"got '\\x00xxx.*\(\d+ characters\)$"):
        GenerationSettings(temperature="\0" + "x" * 10**6).check_given()


def test_unset_values_come_from_the_generation_config_and_tiny_temperatures_are_greedy():
    class Config:  # the fields transformers' GenerationConfig has
        do_sample, temperature, top_p, top_k, repetition_penalty, max_new_tokens = (
            True, 0.6, 0.95, 20, None, 9000)

    settings = GenerationSettings(seed=3).resolved(Config(), context_tokens=4096)
    assert (settings.temperature, settings.top_p, settings.top_k, settings.repetition_penalty,
            settings.max_new_tokens, settings.seed) == (0.6, 0.95, 20, 1.0, 4096, 3)
    Config.do_sample = False
    assert GenerationSettings().resolved(Config(), context_tokens=64).temperature == 0.0
    assert GenerationSettings(temperature=2.28e-39).resolved(
        Config(), context_tokens=64).temperature == 0.0
    assert GenerationSettings().resolved(Config(), context_tokens=64).seed is None


def test_values_from_widgets_and_json():
    settings = GenerationSettings.from_values({"temperature": 0.5, "top_k": 40.0,
                                               "max_new_tokens": 64.0, "seed": -1})
    assert (settings.top_k, settings.max_new_tokens, settings.seed) == (40, 64, None)
    assert type(settings.top_k) is int
    with pytest.raises(InvalidParameter, match="unknown setting.*bogus; known: temperature"):
        GenerationSettings.from_values({"bogus": 1})
    with pytest.raises(InvalidParameter, match="unknown setting.*min_new_tokens"):
        GenerationSettings.from_values({"min_new_tokens": 5})  # the engine's own, not a user's
    with pytest.raises(InvalidParameter, match="top_k: must be an integer, got 2.5"):
        GenerationSettings.from_values({"top_k": 2.5})


def test_greedy_turns_every_knob_off():
    settings = GenerationSettings.greedy(max_new_tokens=8)
    assert settings.as_dict() == {"temperature": 0.0, "top_p": 1.0, "top_k": 0,
                                  "max_new_tokens": 8, "repetition_penalty": 1.0, "seed": None,
                                  "min_new_tokens": 0}
    assert settings_class(EXTENDED).greedy().min_p == 0.0


def test_the_declared_fields_are_the_schemas():
    from model_utils.runtime.generation_settings import _check_declared

    assert [f.name for f in fields(GenerationSettings)] == [s.name for s in SETTINGS]
    with pytest.raises(TypeError, match="min_p"):  # a setting without its field is caught
        _check_declared(GenerationSettings, EXTENDED)


def test_a_new_setting_is_a_field_a_check_and_a_flag():
    settings_type = settings_class(EXTENDED)
    assert "min_p" in {f.name for f in fields(settings_type)}
    assert settings_type.from_values({"min_p": 0.1}).min_p == 0.1
    with pytest.raises(InvalidParameter, match=r"^min_p: must be >= 0 and <= 1, got 2"):
        settings_type.from_values({"min_p": 2})
    assert settings_type().resolved(object(), context_tokens=64).min_p == 0.0

    parser = argparse.ArgumentParser()
    add_setting_flags(parser, schema=EXTENDED)
    assert "--min-p" in parser.format_help() and "drop tokens below" in parser.format_help()
    args = parser.parse_args(["--min-p", "0.05", "--top-k", "3"])
    settings = settings_from_args(args, settings_type)
    assert (settings.min_p, settings.top_k, settings.temperature) == (0.05, 3, None)
    with pytest.raises(InvalidParameter, match="min_p"):
        settings_from_args(parser.parse_args(["--min-p", "-1"]), settings_type)


def test_the_cli_has_a_flag_for_every_public_setting():
    from model_utils.cli_args import build_parser

    chat = build_parser().parse_args(["chat", "--prompt", "hi"])
    for setting in public():
        assert hasattr(chat, setting.name), setting.flag
    assert not hasattr(chat, "min_new_tokens")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["chat", "--prompt", "hi", "--min-new-tokens", "3"])


# -- EngineConfig --------------------------------------------------------------------------------
def test_the_engine_takes_the_config_whole_and_refuses_what_it_does_not_declare():
    from model_utils.engine import Engine

    config = EngineConfig(max_batch=3, max_queue=5, log_prompts=True)
    engine = Engine(config)  # no model: nothing is loaded or compiled
    assert engine.config is config and (engine.max_batch, engine.max_queue) == (3, 5)
    assert Engine(max_batch=2).config == EngineConfig(max_batch=2)
    with pytest.raises(TypeError, match="max_batches"):
        Engine(max_batches=2)  # a typo is refused, not dropped


@pytest.mark.parametrize(("option", "value"), [("max_batch", 0), ("max_batch", 65),
                                               ("max_queue", -1), ("tp", 0),
                                               ("compile_mode", "fastest")])
def test_a_config_no_engine_can_serve_with_is_refused_as_it_is_made(option, value):
    with pytest.raises(InvalidParameter, match=option):
        EngineConfig(**{option: value})


def test_engine_config_from_flags():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_args(parser.parse_args(
        ["--max-batch", "4", "--no-compile", "--compile-mode", COMPILE_MODES[1],
         "--models-dir", "/m", "--trust-remote-code"]))
    assert config == EngineConfig(models_dir="/m", trust_remote_code=True, max_batch=4,
                                  compile=False, compile_mode=COMPILE_MODES[1])
    assert EngineConfig.from_args(parser.parse_args([])) == EngineConfig()
    assert EngineConfig.from_args(argparse.Namespace(), max_queue=3).max_queue == 3
    with pytest.raises(SystemExit):
        parser.parse_args(["--compile-mode", "fastest"])


def test_a_tool_that_turns_an_option_on_by_default_offers_the_flag_that_turns_it_off():
    sys.path.insert(0, str(REPO_ROOT))
    import app

    assert EngineConfig().compile_while_idle is False  # the engine's own: compile at load
    assert EngineConfig.from_args(app.parse_args([])).compile_while_idle is True
    config = EngineConfig.from_args(app.parse_args(["--no-compile-while-idle"]))
    assert config.compile_while_idle is False
    with pytest.raises(SystemExit):  # the flag of the engine's default is not the app's
        app.parse_args(["--compile-while-idle"])
    # The other way round has no flag whose help says what it does: refused, not a dead flag.
    with pytest.raises(ValueError, match="compile"):
        EngineConfig.add_cli_args(argparse.ArgumentParser(), only=("compile",),
                                  defaults={"compile": (False, None)})


def _helps(parser: argparse.ArgumentParser) -> dict[str, str]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(_helps(sub))
        for flag in action.option_strings:
            out[flag] = action.help
    return out


def test_app_cli_and_bench_share_their_flags_help():
    sys.path.insert(0, str(REPO_ROOT))
    import app
    from model_utils.bench.run import build_parser as bench_parser
    from model_utils.cli_args import build_parser as cli_parser

    parsers = {"app": _helps(app.build_parser()), "cli": _helps(cli_parser()),
               "bench": _helps(bench_parser())}
    shared = {"--models-dir", "--trust-remote-code", "--compile-mode", "--placement"}
    for flag in shared:
        texts = {name: helps[flag] for name, helps in parsers.items() if flag in helps}
        assert len(texts) >= 2, flag
        if flag == "--placement":  # the bench's default placement is cuda:0, not auto
            texts = {k: v.split(" (default")[0] for k, v in texts.items()}
        assert len(set(texts.values())) == 1, texts
    # True to BENCHMARKS.md: the autotuned mode was not reliably faster.
    assert "not reliably faster" in parsers["app"]["--compile-mode"]
    assert "4 %" not in parsers["app"]["--compile-mode"]
    assert parsers["app"]["--mode"] == parsers["cli"]["--mode"]
