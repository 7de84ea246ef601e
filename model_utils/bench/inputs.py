"""The benchmark's inputs: random prompt tokens, and a checkpoint of a published shape with
random weights (speed and memory do not depend on the values)."""

from __future__ import annotations

import gc
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
    vocab = config.get_text_config(decoder=True).vocab_size
    tokenizer.add_tokens([f" t{i}" for i in range(len(tokenizer), vocab)])
    tokenizer.save_pretrained(folder)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log.info("built a random %s in %.1f s at %s", config_file.name, time.perf_counter() - start,
             folder)
    return folder
