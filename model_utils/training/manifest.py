"""The manifest a fine-tuning run writes beside its result (OUT/finetune.json). The checkpoint
writes it; the registry reads it (to list a trained model and label an adapter with its base
model), which is why it imports nothing but the standard library."""

from __future__ import annotations

import json
from pathlib import Path

MANIFEST = "finetune.json"
MANIFEST_FORMAT = "qwen-chat-finetune/1"


def read_manifest(folder: str | Path) -> dict | None:
    """The manifest of a trained output folder, or None if it is not one."""
    path = Path(folder) / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):  # a crafted one: nested too deeply
        return None
    return manifest if isinstance(manifest, dict) and manifest.get("format") == \
        MANIFEST_FORMAT else None
