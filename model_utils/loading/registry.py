"""Which models can be chosen, and where each one's files are.

Sources: the embedded demo model, model folders under a models directory, snapshots in the local
Hugging Face cache, and hub ids (which must already be in that cache: nothing is downloaded).
A path typed by a user is resolved (symlinks and ../ included) and must lie under an allowed root,
and so must every file in the folder the loader may open: a model.safetensors inside an allowed
folder that links elsewhere is refused like a folder elsewhere. Hub-cache snapshots link their
files into the cache's own blobs/, which is under the cache root, so they pass the same rule.
Refusals name what the user typed, never the server's folders (the log has those).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from model_utils.errors import ModelNotFound
from model_utils.training.manifest import read_manifest

from .demo_model import DEMO_LABEL, DEMO_NAME, default_cache_dir, demo_model_path
from .load_stages import Progress

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user picked or typed
    path: Path  # a folder with config.json, ready for from_pretrained
    label: str
    is_demo: bool = False
    adapter: Path | None = None  # a trained LoRA/QLoRA folder loaded on top of `path`


def hf_hub_cache() -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


class ModelRegistry:
    def __init__(self, models_dir: str | Path | None = None, *, cache_dir: Path | None = None,
                 hub_cache: Path | None = None):
        self.models_dir = Path(models_dir).expanduser().resolve() if models_dir else None
        self.cache_dir = cache_dir or default_cache_dir()
        self.hub_cache = hub_cache or hf_hub_cache()
        self._extra_roots: list[Path] = []

    # -- what can be picked ---------------------------------------------------------------
    def allow_root(self, path: str | Path) -> None:
        """Allow one more folder (the --model the operator named on the command line)."""
        self._extra_roots.append(Path(path).expanduser().resolve())

    def allow_named_folder(self, model: str) -> None:
        """The operator named `model` on the command line: if it is a folder (not a registry
        name or hub id), it may be loaded, from the UI too."""
        if model.startswith(("/", ".", "~")) or Path(model).expanduser().is_dir():
            self.allow_root(model)

    @property
    def roots(self) -> list[Path]:
        roots = [self.cache_dir.resolve(), self.hub_cache.resolve(), *self._extra_roots]
        if self.models_dir:
            roots.append(self.models_dir)
        return roots

    @property
    def trained_dir(self) -> Path:
        """Where the Train tab writes its runs: --models-dir, else a folder of the cache."""
        return self.models_dir or self.cache_dir.resolve() / "trained"

    def choices(self) -> list[tuple[str, str]]:
        """(label, name) pairs for a dropdown: demo, local folders, cached hub models."""
        items = [(DEMO_LABEL, DEMO_NAME)]
        if self.trained_dir.is_dir():  # --models-dir, or where the Train tab writes
            for folder in sorted(self.trained_dir.iterdir()):
                if (folder / "config.json").is_file():
                    items.append((f"{folder.name} (folder)", str(folder)))
                elif trained_adapter(folder):
                    items.append((_adapter_label(folder), str(folder)))
        for root in self._extra_roots:
            if (root / "config.json").is_file():
                items.append((f"{root.name} (folder)", str(root)))
        for hub_id in self._cached_hub_ids():
            items.append((f"{hub_id} (HF cache)", hub_id))
        return list(dict.fromkeys(items))

    def _cached_hub_ids(self) -> list[str]:
        if not self.hub_cache.is_dir():
            return []
        ids = []
        for entry in sorted(self.hub_cache.glob("models--*")):
            if any((snap / "config.json").exists() for snap in (entry / "snapshots").glob("*")):
                ids.append(entry.name.removeprefix("models--").replace("--", "/"))
        return ids

    # -- resolving one name ---------------------------------------------------------------
    def resolve(self, name: str | None, progress: Progress | None = None) -> ModelSource:
        """`progress`: a load's callback, told the demo model's build steps on its first use."""
        name = (name or "").strip()
        if name in ("", DEMO_NAME):
            return ModelSource(DEMO_NAME, demo_model_path(self.cache_dir, progress), DEMO_LABEL,
                               True)
        # A relative path to a folder that exists ("models/my-adapter") is that folder, before
        # the hub id it also reads as, as from_pretrained takes it.
        if name.startswith(("/", ".", "~")) or ("/" in name and Path(name).is_dir()):
            return self._folder(Path(name).expanduser(), name)
        if _HUB_ID.match(name):
            local = self._hub_snapshot(name)
            if local is not None:
                # The same rule as a folder: the snapshot and every file in it (links into
                # the cache's blobs/) must resolve under an allowed root.
                if not self._allowed(local.resolve()):
                    log.warning("refused %s: its snapshot %s resolves outside the allowed roots",
                                name, local)
                    raise ModelNotFound(f"{name!r}: its Hugging Face cache snapshot lies outside "
                                        "the allowed model folders")
                self.check_files(local, name)
                return ModelSource(name, local, f"{name} (HF cache)")
            if self.models_dir and (self.models_dir / name).is_dir():
                return self._folder(self.models_dir / name, name)
            raise ModelNotFound(
                f"{name!r} is not in the local Hugging Face cache and this app does not "
                f"download: fetch it first (hf download {name}) or give a folder")
        if self.models_dir is None:
            raise ModelNotFound(f"{name!r} is neither a folder path, a hub id nor 'demo'")
        return self._folder(self.models_dir / name, name)

    def check_under_roots(self, path: str | Path, what: str = "") -> Path:
        """The resolved path, if it lies under an allowed root (symlinks and ../ resolved)."""
        resolved = Path(path).expanduser().resolve()
        if not self._allowed(resolved):
            log.warning("refused %s %s: resolves to %s, outside the allowed roots %s", what,
                        path, resolved, ", ".join(str(r) for r in self.roots))
            raise ModelNotFound(
                f"{what + ' ' if what else ''}{str(path)!r} is outside the allowed model folders "
                "(the models folder, the Hugging Face cache and folders named at start-up; "
                "start the app with --models-dir FOLDER to allow another)")
        return resolved

    def _allowed(self, resolved: Path) -> bool:
        return any(resolved == root or resolved.is_relative_to(root) for root in self.roots)

    def check_files(self, folder: Path, name: str) -> None:
        """Refuse a model folder holding an entry that resolves outside the allowed roots (a
        symlink to elsewhere). The loader opens the folder's own files only (config, tokenizer,
        weights, their index), so those are what is resolved: one look per entry, however
        large a tree may lie below."""
        for path in folder.iterdir():
            if path.is_symlink() and not self._allowed(path.resolve()):
                log.warning("refused %s: %s links to %s, outside the allowed roots", name,
                            path, path.resolve())
                raise ModelNotFound(
                    f"{name!r}: its file {path.name!r} links outside the allowed model "
                    "folders; copy the file into the folder instead")

    def _folder(self, path: Path, name: str) -> ModelSource:
        resolved = self.check_under_roots(path)
        if not resolved.is_dir():
            raise ModelNotFound(f"model folder {name!r} does not exist")
        if not (resolved / "config.json").is_file() and trained_adapter(resolved):
            return self._adapter(resolved, name)
        if not (resolved / "config.json").is_file():
            raise ModelNotFound(f"{name!r} has no config.json: not a Hugging Face model folder")
        self.check_files(resolved, name)
        return ModelSource(name, resolved, f"{resolved.name} (folder)")

    def _adapter(self, folder: Path, name: str) -> ModelSource:
        """An adapter folder written by model_utils.finetune: its base (named in the manifest)
        resolved the usual way, so the base too must lie under an allowed root."""
        manifest = trained_adapter(folder)
        base_name, base_path = manifest.get("base_model"), manifest.get("base_path")
        if base_name != "demo" and not isinstance(base_path, str):
            raise ModelNotFound(f"adapter {folder.name}: its finetune.json names no base model "
                                "folder")
        base = self.resolve("demo" if base_name == "demo" else base_path)
        return ModelSource(name, base.path, _adapter_label(folder), adapter=folder)

    def _hub_snapshot(self, hub_id: str) -> Path | None:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            path = snapshot_download(hub_id, cache_dir=self.hub_cache, local_files_only=True)
        except (LocalEntryNotFoundError, OSError, ValueError):
            return None
        return Path(path) if (Path(path) / "config.json").exists() else None


def trained_adapter(folder: Path) -> dict | None:
    """The manifest of an adapter folder that model_utils.finetune wrote, else None."""
    if not (folder / "adapter_config.json").is_file():
        return None
    return read_manifest(folder)


def _adapter_label(folder: Path) -> str:
    manifest = trained_adapter(folder) or {}
    return f"{folder.name} ({manifest.get('method', 'lora')} adapter on " \
           f"{manifest.get('base_model', '?')})"
