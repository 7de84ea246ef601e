"""The fine-tuning loop as a library: LoRA, QLoRA (bitsandbytes 4-bit) or full, with accelerate.

It loads its base model from a folder itself and imports nothing of loading or runtime, so the
loading layer can use it (the demo model is built by it) and model_utils.finetune runs it as a
process of its own.

data.py              the JSONL file: checked line by line, tokenized through the chat template
models.py            the base model loaded for a method (peft for adapters), the token loss
train.py             the accelerate loop (accumulation, clipping, checkpoints, resume)
checkpoint.py        the output folder, the resumable checkpoint, the step log
manifest.py          OUT/finetune.json's format, which the registry reads to list trained models
defaults.py          the settings a run takes when the form leaves them empty
packed_attention.py  packed rows: flash varlen over each example on a GPU
"""
