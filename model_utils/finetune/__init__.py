"""Fine-tuning: LoRA, QLoRA (bitsandbytes 4-bit) or full, on JSONL chat data, with accelerate.

data.py        the JSONL file: checked line by line, tokenized through the chat template
models.py      the base model loaded for a method (peft for adapters), the token loss
train.py       the accelerate loop (accumulation, clipping, checkpoints, resume)
checkpoint.py  the output folder, its manifest, the resumable checkpoint, the step log
cli.py         python -m model_utils.finetune (also under `accelerate launch`)
"""
