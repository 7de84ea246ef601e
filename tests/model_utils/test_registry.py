"""Which models can be chosen: the demo, models_dir folders, the HF cache; nothing outside."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from model_utils.errors import ModelNotFound
from model_utils.loading.demo_model import DEMO_NAME
from model_utils.loading.registry import ModelRegistry


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
    assert str(hub) not in message and "does not download" in message  # no server paths


def test_a_relative_path_to_a_folder_is_that_folder_not_a_hub_id(layout, monkeypatch):
    """"models/good" reads as a hub id too; a folder that exists there is what it names (the
    fine-tuning guide's `--model models/my-adapter`), under the same roots as any folder."""
    registry, models, outside, hub = layout
    monkeypatch.chdir(models.parent)
    assert registry.resolve("models/good").path.resolve() == (models / "good").resolve()
    with pytest.raises(ModelNotFound, match="outside the allowed model folders"):
        registry.resolve("outside/secret")  # a folder, but not under a root
    with pytest.raises(ModelNotFound, match="not in the local Hugging Face cache"):
        registry.resolve("models/missing")  # no such folder: still a hub id


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


# -- every file the loader opens, not only the folder -------------------------------------------
def test_a_weights_file_linking_outside_is_refused(layout, demo_path):
    registry, models, outside, _hub = layout
    folder = models / "linked-weights"
    folder.mkdir()
    for item in demo_path.iterdir():
        if item.is_file() and item.suffix != ".safetensors":
            (folder / item.name).write_bytes(item.read_bytes())
    secret = outside / "model.safetensors"
    secret.write_bytes((demo_path / "model.safetensors").read_bytes())
    os.symlink(secret, folder / "model.safetensors")
    with pytest.raises(ModelNotFound, match="'model.safetensors' links outside the allowed"):
        registry.resolve("linked-weights")
    with pytest.raises(ModelNotFound, match="links outside") as caught:
        registry.resolve(str(folder))
    assert str(outside) not in str(caught.value)  # where it points stays in the log
    # A link that stays inside the allowed folders is fine (and so is a plain file).
    (folder / "model.safetensors").unlink()
    inside = models / "shared-weights.safetensors"
    inside.write_bytes(secret.read_bytes())
    os.symlink(inside, folder / "model.safetensors")
    assert registry.resolve("linked-weights").path == folder.resolve()


def test_a_linked_subfolder_outside_is_refused(layout):
    registry, models, outside, _hub = layout
    os.symlink(outside, models / "good" / "tokenizer")
    with pytest.raises(ModelNotFound, match="'tokenizer' links outside"):
        registry.resolve("good")


def _hub_snapshot(hub: Path, files: dict[str, Path | str]) -> Path:
    """models--acme--tiny-chat as huggingface_hub lays it out: snapshot files are links to
    ../../blobs/<name>, or, for a Path value, to that path."""
    repo = hub / "models--acme--tiny-chat"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name, target in files.items():
        if isinstance(target, Path):
            os.symlink(target, snapshot / name)
        else:
            (repo / "blobs" / name).write_text(target)
            os.symlink(Path("..", "..", "blobs", name), snapshot / name)
    return snapshot


def test_a_hub_snapshot_linking_into_its_blobs_resolves(layout):
    registry, _models, _outside, hub = layout
    snapshot = _hub_snapshot(hub, {"config.json": "{}", "model.safetensors": "weights"})
    assert (snapshot / "model.safetensors").is_symlink()
    assert registry.resolve("acme/tiny-chat").path.resolve() == snapshot.resolve()


def test_a_hub_snapshot_linking_outside_the_cache_is_refused(layout):
    registry, _models, outside, hub = layout
    secret = outside / "stolen.safetensors"
    secret.write_text("weights from elsewhere")
    _hub_snapshot(hub, {"config.json": "{}", "model.safetensors": secret})
    with pytest.raises(ModelNotFound, match="'model.safetensors' links outside the allowed"):
        registry.resolve("acme/tiny-chat")
    # Nor does the snapshot folder itself get to live elsewhere.
    snapshots = hub / "models--acme--tiny-chat" / "snapshots"
    for item in (snapshots / ("0" * 40)).iterdir():
        item.unlink()
    (snapshots / ("0" * 40)).rmdir()
    (outside / "moved-snapshot").mkdir()
    (outside / "moved-snapshot" / "config.json").write_text("{}")
    os.symlink(outside / "moved-snapshot", snapshots / ("0" * 40))
    with pytest.raises(ModelNotFound, match="snapshot lies outside the allowed"):
        registry.resolve("acme/tiny-chat")
