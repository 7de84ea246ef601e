"""The benchmark's inputs: random prompt tokens, and a checkpoint of a published shape with
random weights (speed and memory do not depend on the values)."""

from __future__ import annotations

import gc
import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    # Token ids from the low end of the vocabulary, which every tokenizer in use defines.
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 1000), (count, length), generator=g).tolist()


def build_random_model(config_file: Path, folder: Path, device: str) -> Path:
    """A checkpoint of the config's shape with random bf16 weights, plus the demo tokenizer
    with a word for every id of the shape's vocabulary.

    Random weights pick any id of the vocabulary, and the demo tokenizer knows only ~600: the
    rest would decode to no text at all, so a reply would stream nothing until its end and a
    client's time to first text would measure the wrong thing. Each id beyond the demo's gets
    a word of its own (" t1234"), so replies stream text the way a real model's do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from model_utils.loading.demo_model import demo_tokenizer

    config = AutoConfig.from_pretrained(config_file)
    start = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.do_sample = False
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer = demo_tokenizer()
    tokenizer.save_pretrained(folder)
    _words_for_every_id(folder / "tokenizer.json", len(tokenizer),
                        config.get_text_config(decoder=True).vocab_size)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info("built a random %s in %.1f s at %s", config_file.name, time.perf_counter() - start,
             folder)
    return folder


def _words_for_every_id(tokenizer_file: Path, first: int, vocab: int) -> None:
    """Give ids first..vocab-1 the words " t<id>" in the byte-level BPE's own vocabulary: as
    added tokens (tokenizer.add_tokens) 150 000 of them took seconds to load, a switch's
    tokenizer stage no real model has; in the vocabulary they load as fast as the rest. No
    merge produces them, so prompts tokenize as before: they only decode."""
    data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
    words = data["model"]["vocab"]
    # The added tokens (<think>, </think>) into the vocabulary at their ids too: an added token
    # missing from it is given the id after the vocabulary's last when the file is read.
    words.update({token["content"]: token["id"] for token in data["added_tokens"]})
    words.update({f"\u0120t{i}": i for i in range(first, vocab)})  # Ġ: byte-level's space
    tokenizer_file.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
