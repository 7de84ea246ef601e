"""A random benchmark model's tokenizer: the demo's, with a word for every id of the shape's
vocabulary, so that replies of random weights stream text, and prompts tokenize as the demo's.
The words sit in the vocabulary, not as added tokens: 150 000 added tokens took seconds to load."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from model_utils.bench.inputs import build_random_model
from model_utils.loading.demo_model import demo_tokenizer

VOCAB = 5000


def test_every_id_decodes_to_a_word_and_prompts_tokenize_as_the_demos(tmp_path):
    config = json.loads(open("benchmarks/configs/tiny-qwen2.config.json").read())
    (tmp_path / "config.json").write_text(json.dumps({**config, "vocab_size": VOCAB}))
    folder = build_random_model(tmp_path / "config.json", tmp_path / "model", "cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    demo = demo_tokenizer()

    assert len(tokenizer) == VOCAB
    assert tokenizer.decode([len(demo), VOCAB - 1]) == f" t{len(demo)} t{VOCAB - 1}"
    # (no digits: transformers reads a qwen2 folder with Qwen2's own splitting, digit by digit)
    text = "<|im_start|>user\nWhich mode should I pick?<|im_end|>"
    assert tokenizer(text)["input_ids"] == demo(text)["input_ids"]
    assert tokenizer.eos_token_id == demo.eos_token_id
