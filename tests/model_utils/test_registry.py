"""Which models can be chosen: the demo, models_dir folders, the HF cache; nothing outside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_utils.demo_model import DEMO_NAME
from model_utils.registry import ModelNotFound, ModelRegistry


@pytest.fixture
def layout(tmp_path, demo_path):
    """tmp/models/{good, no-config}, tmp/outside/secret, an empty HF cache, the demo cache."""
    models = tmp_path / "models"
    (models / "good").mkdir(parents=True)
    (models / "good" / "config.json").write_text("{}")
    (models / "no-config").mkdir()
    outside = tmp_path / "outside" / "secret"
    outside.mkdir(parents=True)
    (outside / "config.json").write_text("{}")
    hub = tmp_path / "hub"
    hub.mkdir()
    registry = ModelRegistry(models, cache_dir=demo_path.parent, hub_cache=hub)
    return registry, models, outside, hub


def test_demo_resolves_to_the_built_checkpoint(layout, demo_path):
    registry = layout[0]
    for name in ("demo", "", None, "  demo  "):
        source = registry.resolve(name)
        assert source.is_demo and source.path == demo_path and source.name == DEMO_NAME
    assert (demo_path / "model.safetensors").is_file()


def test_models_dir_folders_are_choices(layout):
    registry, models, _outside, _hub = layout
    choices = registry.choices()
    assert choices[0][1] == DEMO_NAME
    assert ("good (folder)", str(models / "good")) in choices
    assert not any("no-config" in name for _label, name in choices)
    assert registry.resolve("good").path == models / "good"
    assert registry.resolve(str(models / "good")).path == models / "good"


@pytest.mark.parametrize("name", [
    "../outside/secret",
    "good/../../outside/secret",
    "./../outside/secret",
    "/etc",
    "/",
    "~",
    "~/../../etc",
])
def test_paths_outside_the_roots_are_refused(layout, name, monkeypatch):
    registry, models, _outside, _hub = layout
    monkeypatch.chdir(models)  # relative names resolve from here
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve(name)


def test_absolute_path_outside_is_refused_even_with_a_config(layout):
    registry, _models, outside, _hub = layout
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve(str(outside))
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve(str(outside.parent / ".." / "models" / ".." / "outside" / "secret"))


def test_symlink_out_of_the_models_dir_is_refused(layout):
    registry, models, outside, _hub = layout
    (models / "link").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve("link")
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve(str(models / "link"))


def test_missing_and_incomplete_folders_say_why(layout):
    registry, models, _outside, _hub = layout
    with pytest.raises(ModelNotFound, match="does not exist"):
        registry.resolve("missing")
    with pytest.raises(ModelNotFound, match="no config.json"):
        registry.resolve("no-config")
    with pytest.raises(ModelNotFound, match="no config.json"):
        registry.resolve(str(models))  # the root itself is not a model


def test_uncached_hub_id_says_nothing_is_downloaded(layout):
    registry, _models, _outside, hub = layout
    with pytest.raises(ModelNotFound) as caught:
        registry.resolve("Qwen/Qwen3-8B")
    message = str(caught.value)
    assert "'Qwen/Qwen3-8B' is not in the local Hugging Face cache" in message
    assert str(hub) in message and "does not download" in message


def test_name_that_is_nothing_says_so(tmp_path):
    registry = ModelRegistry(None, cache_dir=tmp_path, hub_cache=tmp_path / "hub")
    with pytest.raises(ModelNotFound, match="neither a folder path, a hub id nor 'demo'"):
        registry.resolve("qwen")


def test_cached_hub_snapshot_is_a_choice_and_resolves(layout):
    registry, _models, _outside, hub = layout
    repo = hub / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    assert ("acme/tiny-chat (HF cache)", "acme/tiny-chat") in registry.choices()
    source = registry.resolve("acme/tiny-chat")
    assert Path(source.path).resolve() == snapshot.resolve()
    assert not source.is_demo


def test_operator_root_is_allowed_explicitly(layout):
    registry, _models, outside, _hub = layout
    registry.allow_root(outside)
    assert registry.resolve(str(outside)).path == outside
    assert (f"{outside.name} (folder)", str(outside)) in registry.choices()


def test_roots_are_resolved(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    os.symlink(real, tmp_path / "alias")
    registry = ModelRegistry(tmp_path / "alias", cache_dir=tmp_path, hub_cache=tmp_path / "hub")
    assert registry.models_dir == real
