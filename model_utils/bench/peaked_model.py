"""A small Qwen3-architecture model trained briefly on the project's own documents, so that its
next-token distributions are peaked: a test model on which greedy tokens mean something.

Random weights give near-uniform distributions, where the top two tokens are often within
rounding of each other and any change of kernel order flips the greedy choice. A model that has
seen the README, docs/ and BENCHMARKS.md for a few hundred steps predicts most of their next tokens with
a clear margin, so a bf16 fast path and plain generate should agree on it for many tokens, and
where they do not, the margin at the parting token says whether it was a near-tie.

    python -m model_utils.bench.peaked_model --out /tmp/peaked --hidden 2048 --layers 8 --seconds 90

On the CPU the default shape (hidden 64, 2 layers) trains in seconds; on a GPU the real-width one
(hidden 2048, 8 layers, ~0.4 B parameters) in a minute or two. The checkpoint (bf16 weights, the
demo tokenizer) loads like any model folder.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
             "BENCHMARKS.md")


def training_text() -> str:
    return "\n\n".join((ROOT / name).read_text() for name in DOCUMENTS if (ROOT / name).exists())


def make_config(vocab: int, hidden: int, layers: int, eos: int, pad: int):
    from transformers import Qwen3Config

    head_dim = 128 if hidden >= 1024 else 16
    heads = max(2, hidden // head_dim)
    return Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=max(1, heads // 2), head_dim=head_dim,
                       max_position_embeddings=4096, tie_word_embeddings=False,
                       bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)


def train(out: Path, *, hidden: int = 64, layers: int = 2, seconds: float | None = 20.0,
          max_steps: int = 400, window: int = 128, batch: int = 16, lr: float | None = None,
          device: str | None = None, seed: int = 0) -> dict:
    """Train for max_steps or `seconds` (None: no time limit, for tests that must not depend
    on the machine's speed), save to `out` (bf16 safetensors + tokenizer), report."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from model_utils.loading.demo_model import demo_tokenizer

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = demo_tokenizer()
    tokenizer.model_max_length = 10**9  # the whole text at once, cut into windows below
    ids = torch.tensor(tokenizer(training_text())["input_ids"], dtype=torch.long)
    eos, pad = tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.pad_token_id
    config = make_config(len(tokenizer), hidden, layers, eos, pad)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    # Larger models take smaller steps; a short warm-up keeps the first ones from diverging.
    lr = lr or (3e-3 if hidden <= 256 else 6e-4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") \
        else torch.autocast("cpu", enabled=False)
    start, losses, step = time.perf_counter(), [], 0
    while step < max_steps and (seconds is None or time.perf_counter() - start < seconds):
        starts = torch.randint(0, len(ids) - window - 1, (batch,), generator=generator)
        x = torch.stack([ids[s:s + window] for s in starts]).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 20)
        with autocast:
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
    elapsed = time.perf_counter() - start
    model.eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=eos,
                                               pad_token_id=pad, bos_token_id=pad)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    report = {"folder": str(out), "device": device, "hidden": hidden, "layers": layers,
              "parameters": sum(p.numel() for p in model.parameters()), "steps": step,
              "seconds": round(elapsed, 1), "text_tokens": len(ids),
              "loss_first": round(losses[0], 3), "loss_last": round(
                  sum(losses[-10:]) / len(losses[-10:]), 3),
              "perplexity_last": round(math.exp(sum(losses[-10:]) / len(losses[-10:])), 2)}
    (out / "training.json").write_text(json.dumps(report, indent=2))
    return report


def sample_prompts(folder: Path, count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` tokens cut from the training text at spread-out places."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.model_max_length = 10**9
    ids = tokenizer(training_text())["input_ids"]
    step = max(1, (len(ids) - length) // (count + 1))
    return [ids[(i + 1) * step:(i + 1) * step + length] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model_utils.bench.peaked_model",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder to write the checkpoint to")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=20.0, help="training time budget")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", help="default: cuda when there is a GPU, else cpu")
    args = parser.parse_args(argv)
    report = train(Path(args.out), hidden=args.hidden, layers=args.layers,
                   seconds=args.seconds, max_steps=args.max_steps, batch=args.batch,
                   device=args.device)
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
