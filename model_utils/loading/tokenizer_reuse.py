"""A mode switch within one model keeps its tokenizer: the tokenizer does not depend on the
precision, and loading a large vocabulary again costs seconds on every switch.

The previous load's tokenizer is taken again only when it was read from the same folder, with
the same trust_remote_code, and none of that folder's files changed since (names, sizes and
modification times of the files a tokenizer is read from): an edited chat template or a
replaced checkpoint in the same folder loads afresh. The chat template is the tokenizer's, so it
is kept with it. The config is read again on every load: AutoConfig took about 1 ms for the
Qwen2.5-7B config.json (a 2-core CPU), less than comparing what a key of it would hold."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

# The files transformers reads a tokenizer from (tokenizer_config.json carries the chat
# template; chat_template.jinja / .json where a checkpoint keeps it apart).
_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens_map", "added_tokens",
                    "chat_template", "spiece", "sentencepiece")


@dataclass(frozen=True)
class TokenizerKey:
    folder: str
    trust_remote_code: bool
    files: tuple[tuple[str, int, int], ...]  # (name, size, mtime_ns) of each tokenizer file


def tokenizer_key(folder: Path, *, trust_remote_code: bool) -> TokenizerKey:
    folder = Path(folder)
    files = []
    if folder.is_dir():
        for path in sorted(folder.iterdir()):
            if path.is_file() and path.name.lower().startswith(_TOKENIZER_FILES):
                stat = path.stat()
                files.append((path.name, stat.st_size, stat.st_mtime_ns))
    return TokenizerKey(str(folder.resolve()), trust_remote_code, tuple(files))


@dataclass(frozen=True)
class KeptTokenizer:
    """The tokenizer of the model a switch is replacing, and what it was read from."""

    key: TokenizerKey
    tokenizer: object

    def for_key(self, key: TokenizerKey):
        """The kept tokenizer when `key` is the one it was read with, else None."""
        return self.tokenizer if key == self.key else None
