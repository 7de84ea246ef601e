"""The safetensors files a checkpoint's weights are read from, and whether each one's header can
be read.

A download cut short or a damaged file used to pass every check made before a switch and fail
only in from_pretrained, after the model that was serving had been unloaded (and had to be
loaded again). Reading the headers costs a few milliseconds: safetensors' `safe_open` reads the
header only (through a memory map), and checks that the file covers every tensor it lists, so
a truncated file is caught too, without reading a byte of the weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
SHARD_INDEX = "model.safetensors.index.json"


def damaged_message(file_name: str | None = None) -> str:
    """What a user is told about a weights file that cannot be read, named by its name only
    (the message may reach guests, who never see server paths), or not at all when unknown."""
    what = f"the weights file {file_name}" if file_name else "a .safetensors weights file"
    return f"{what} is damaged or incomplete (a download cut short?): download or copy it again"


def weight_files(folder: Path) -> list[Path]:
    """The files from_pretrained reads, in its order: model.safetensors, else the shards the
    index names (an index beside a single file, left from an earlier upload, is not read),
    else (a folder with neither) every .safetensors file in it."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    index = folder / SHARD_INDEX
    if index.is_file():
        return [folder / name for name in sorted(set(_shard_names(index)))]
    return sorted(folder.glob("*.safetensors"))


def unreadable_weights(folder: Path) -> str | None:
    """Why the weights in `folder` cannot be loaded (missing shard, damaged file), in words
    for a user; None when every header reads."""
    from safetensors import safe_open

    try:
        files = weight_files(folder)
    except ValueError as error:
        return str(error)
    for file in files:
        if not file.is_file():
            return (f"the weights file {file.name}, named in {SHARD_INDEX}, is missing: "
                    "download or copy it again")
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as error:  # noqa: BLE001 - SafetensorError, OSError: the file is bad
            log.warning("weights file %s cannot be read: %s", file, error)
            return damaged_message(file.name)
    return None


def _shard_names(index: Path) -> list[str]:
    try:
        names = list(json.loads(index.read_text())["weight_map"].values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) \
            as error:
        log.warning("shard index %s cannot be read: %s", index, error)
        raise ValueError(damaged_message(index.name)) from error
    # A name is a file beside the index; anything else (a path) is not a shard of this folder.
    if not all(isinstance(name, str) and name == Path(name).name for name in names):
        raise ValueError(damaged_message(index.name))
    return names
