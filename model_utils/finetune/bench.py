"""Training speed and memory: this project's loop against the tutorial way, same batch and length.

    python -m model_utils.finetune.bench --config benchmarks/configs/qwen2.5-7b-instruct.config.json \\
        --methods lora,qlora --batch 4 --seq 1024 --steps 10 --out "$OUT"
    python -m model_utils.finetune.bench --tiny --out /tmp/bench      # a CPU check of the script

The model is the config's shape with random weights (saved once, loaded by every variant). The
data are random token sequences of 1/4 to all of --seq tokens, the first quarter of each a
prompt (no loss). Each variant runs in its own process, so peak memory is its own:

  tutorial  peft get_peft_model + transformers Trainer with default TrainingArguments (bf16 on),
            each example padded to --seq (the tutorials' tokenizer(padding="max_length")),
            the loss from the model's own forward; for qlora, prepare_model_for_kbit_training
            with its defaults (gradient checkpointing on)
  ours      model_utils.training.train.run: examples packed back to back into rows of --seq
            tokens (no pads), flash varlen attention over each example where CUDA has it
            (packed_attention), the loss over assistant tokens in chunks (no full logits), the
            same gradient checkpointing choice as the tutorial for each method
  ours-sdpa the same with transformers' sdpa and its block-diagonal mask (--variants adds it)

Both train the same LoRA (rank 16, alpha 32, every linear layer, no dropout) on --batch rows of
--seq tokens a step. tokens/s counts the examples' own tokens (pads are not training data);
slots/s counts every position computed. JSON and a markdown table go to --out; --profile adds
each variant's top kernels (torch.profiler over a short run) as OUT/profile-VARIANT-METHOD.txt.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
VARIANTS = ("tutorial", "ours", "ours-sdpa")
TINY_CONFIG = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64,
               "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
               "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def random_examples(n: int, seq: int, vocab: int, seed: int = 0):
    from model_utils.training.data import IGNORE, Example

    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        length = rng.randint(seq // 4, seq)
        ids = [rng.randrange(vocab) for _ in range(length)]
        prompt = length // 4
        examples.append(Example(ids, [IGNORE] * prompt + ids[prompt:]))
    return examples


def build_model_folder(config_path: Path | None, folder: Path, device: str) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").exists():
        return json.loads((folder / "config.json").read_text())
    config = AutoConfig.for_model(**TINY_CONFIG) if config_path is None else \
        AutoConfig.from_pretrained(config_path)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds for 7B, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder, safe_serialization=True)
    del model
    return json.loads((folder / "config.json").read_text())


# -- the variants (each in its own process) --------------------------------------------------------
def run_ours(args, examples) -> dict:
    from model_utils.training.train import TrainConfig, run

    out = Path(args.work) / f"{args.variant}-{args.method}"
    config = TrainConfig(model_path=args.model_dir, data=str(Path(args.model_dir) / "config.json"),
                         out=str(out), method=args.method, steps=args.warmup + args.steps,
                         batch_size=args.batch, max_len=args.seq, lr=2e-4, packing=True,
                         gradient_checkpointing=args.method == "qlora", progress=False,
                         handle_signals=False, warmup_steps=0,
                         attention="sdpa" if args.variant == "ours-sdpa" else "auto")
    run(config, examples, tokenizer=None)
    rows = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    timed = rows[args.warmup:]
    seconds = timed[-1]["elapsed_s"] - rows[args.warmup - 1]["elapsed_s"]
    tokens = sum(r["tokens"] for r in timed)
    return {"tok_s": tokens / seconds, "slots_s": len(timed) * args.batch * args.seq / seconds,
            "s_per_step": seconds / len(timed), "final_loss": rows[-1]["loss"]}


def run_tutorial(args, examples) -> dict:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import (
        AutoModelForCausalLM,
        BitsAndBytesConfig,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    cuda = torch.cuda.is_available()
    kwargs = {"dtype": torch.bfloat16 if cuda else torch.float32}
    if args.method == "qlora":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16)
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, **kwargs)
    if args.method == "qlora":
        model = prepare_model_for_kbit_training(model)
    model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **LORA))
    pad = 0
    rows = []
    for e in examples:  # padding="max_length", as the tutorials tokenize
        n = len(e.input_ids)
        rows.append({"input_ids": e.input_ids + [pad] * (args.seq - n),
                     "attention_mask": [1] * n + [0] * (args.seq - n),
                     "labels": e.labels + [-100] * (args.seq - n)})
    times: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, *_args, **_kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    training_args = TrainingArguments(
        output_dir=str(Path(args.work) / f"tutorial-{args.method}"),
        per_device_train_batch_size=args.batch, max_steps=args.warmup + args.steps,
        learning_rate=2e-4, bf16=cuda, use_cpu=not cuda, logging_steps=1, report_to=[],
        save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=rows,
                      callbacks=[Clock()])
    trainer.train()
    seconds = times[-1] - times[args.warmup - 1]
    steps = len(times) - args.warmup
    real = sum(len(e.input_ids) for e in examples) / len(examples)  # mean tokens an example
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tok_s": steps * args.batch * real / seconds,
            "slots_s": steps * args.batch * args.seq / seconds,
            "s_per_step": seconds / steps, "final_loss": losses[-1] if losses else None}


def worker(args) -> None:
    vocab = json.loads((Path(args.model_dir) / "config.json").read_text())["vocab_size"]
    examples = random_examples(args.examples, args.seq, vocab)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    variant = run_tutorial if args.variant == "tutorial" else run_ours
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            result = variant(args, examples)
        table = prof.key_averages().table(
            sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=40)
        (Path(args.out) / f"profile-{args.variant}-{args.method}.txt").write_text(table)
    else:
        result = variant(args, examples)
    if torch.cuda.is_available():
        result["peak_gb"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    else:
        import resource

        result["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    result.update(variant=args.variant, method=args.method, batch=args.batch, seq=args.seq)
    Path(args.result).write_text(json.dumps(result))


# -- the driver ----------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m model_utils.finetune.bench",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, help="a model config.json (random weights)")
    p.add_argument("--tiny", action="store_true", help="a tiny Qwen2 shape (CPU check)")
    p.add_argument("--methods", default="lora,qlora")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default="tutorial,ours",
                   help="of tutorial, ours, ours-sdpa (default: tutorial,ours)")
    p.add_argument("--profile", action="store_true",
                   help="also write each variant's top kernels (slows the timed steps)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, help="where the random model goes (default: OUT/work)")
    # worker mode (one variant, one process)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--examples", type=int, help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.variant:
        worker(args)
        return 0
    if not args.tiny and args.config is None:
        p.error("give --config (a model shape) or --tiny")
    if args.tiny:
        args.batch, args.seq, args.steps, args.warmup = 2, 128, 4, 2
    cuda = torch.cuda.is_available()
    methods = [m for m in args.methods.split(",") if m and (cuda or m != "qlora")]
    variants = [v for v in args.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS):
        p.error(f"unknown --variants {', '.join(sorted(unknown))}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or args.out / "work"
    started = time.perf_counter()
    model_dir = work / "random-model"
    build_model_folder(None if args.tiny else args.config, model_dir, "cuda" if cuda else "cpu")
    print(f"random model ready in {time.perf_counter() - started:.0f} s", flush=True)
    # Enough examples for every step of either variant (packing needs ~1.6x as many).
    examples = 2 * args.batch * (args.steps + args.warmup) + 8
    results = []
    for method in methods:
        for variant in variants:
            result_file = work / f"{variant}-{method}.json"
            command = [sys.executable, "-m", "model_utils.finetune.bench", "--variant", variant,
                       "--method", method, "--model-dir", str(model_dir), "--work", str(work),
                       "--batch", str(args.batch), "--seq", str(args.seq), "--steps",
                       str(args.steps), "--warmup", str(args.warmup), "--examples",
                       str(examples), "--result", str(result_file), "--out", str(args.out)]
            command += ["--profile"] if args.profile else []
            t0 = time.perf_counter()
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                print(f"{variant} {method} failed:\n{done.stderr[-2000:]}", file=sys.stderr)
                results.append({"variant": variant, "method": method, "error":
                                done.stderr.strip().splitlines()[-1] if done.stderr else "?"})
                continue
            result = json.loads(result_file.read_text())
            result["wall_s"] = round(time.perf_counter() - t0, 1)
            results.append(result)
            print(f"{variant:9} {method:5} {result['tok_s']:10.1f} tok/s "
                  f"({result['wall_s']} s)", flush=True)
    summary = _summary(results)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu",
              "config": str(args.config) if not args.tiny else "tiny", "batch": args.batch,
              "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
              "results": results, "summary": summary,
              "total_s": round(time.perf_counter() - started, 1)}
    (args.out / "train_bench.json").write_text(json.dumps(report, indent=2))
    table = _table(results, summary)
    (args.out / "train_bench.md").write_text(table + "\n")
    print(table)
    return 0 if all("error" not in r for r in results) else 1


def _summary(results: list[dict]) -> dict:
    out = {}
    by = {(r["variant"], r["method"]): r for r in results if "error" not in r}
    for method in {r["method"] for r in results}:
        ours, tutorial = by.get(("ours", method)), by.get(("tutorial", method))
        if ours and tutorial:
            memory = "peak_gb" if "peak_gb" in ours else "peak_rss_gb"
            out[method] = {"speedup": round(ours["tok_s"] / tutorial["tok_s"], 3),
                           "memory_ratio": round(ours[memory] / tutorial[memory], 3)}
    return out


def _table(results: list[dict], summary: dict) -> str:
    lines = ["| method | variant | tokens/s | slots/s | s/step | peak GB | final loss |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | {r['variant']} | failed: {r['error'][:80]} | | | | |")
            continue
        peak = r.get("peak_gb", r.get("peak_rss_gb", 0))
        lines.append(f"| {r['method']} | {r['variant']} | {r['tok_s']:.1f} | {r['slots_s']:.1f} "
                     f"| {r['s_per_step']:.3f} | {peak:.2f} | {r['final_loss']} |")
    for method, s in summary.items():
        lines.append(f"\n{method}: ours / tutorial tokens/s = {s['speedup']}x, "
                     f"peak memory ratio {s['memory_ratio']}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
