"""python -m model_utils.finetune: fine-tune a causal LM on a JSONL chat file.

    python -m model_utils.finetune --model demo --data chats.jsonl --out models/my-adapter
    accelerate launch --num_processes 2 -m model_utils.finetune --model demo --data ... --out ...

The data file is checked in full before anything loads (a bad line is refused with file:line).
Exit status: 0 done; 2 refused (bad flag, bad data, unknown model, a method this machine cannot
run); 1 an unexpected error; 130 interrupted by Ctrl-C or SIGTERM after saving a checkpoint that
--resume continues.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

from model_utils.training import defaults
from model_utils.training.data import DataError, read_conversations, tokenize_conversations
from model_utils.training.models import METHODS, MethodUnavailable, qlora_unavailable_reason

from . import run_lock

EXIT_REFUSED, EXIT_ERROR, EXIT_INTERRUPTED = 2, 1, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m model_utils.finetune",
                description="Fine-tune a causal LM (LoRA, QLoRA or full) on JSONL chats.")
    p.add_argument("--model", default="demo",
                   help="'demo' (the embedded demo model), a model folder, or a hub id in the "
                        "local HF cache (default: demo)")
    p.add_argument("--data", required=True, type=Path,
                   help='JSONL file, one {"messages": [{"role", "content"}, ...]} per line')
    p.add_argument("--out", required=True, type=Path, help="output folder (adapter or model)")
    p.add_argument("--method", default="lora", choices=METHODS,
                   help="lora (default), qlora (4-bit base, CUDA only) or full")
    length = p.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int, help="optimizer steps")
    length.add_argument("--epochs", type=float,
                        help=f"passes over the data (default: 3, and at least "
                             f"{defaults.MIN_STEPS} steps)")
    p.add_argument("--lr", type=float,
                   help="learning rate (default: 2e-4 lora/qlora and 2e-5 full on a model of "
                        "100M+ parameters; 5e-3 and 1e-3 on a smaller one)")
    p.add_argument("--batch-size", type=int, default=4, help="examples per process and "
                   "micro-step (default: 4)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--max-len", type=int, default=1024, help="tokens per example (default 1024)")
    p.add_argument("--lora-r", type=int, default=16, help="LoRA rank (default: 16)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-steps", type=int, help="default: 5 %% of the steps")
    p.add_argument("--save-every", type=int, default=0,
                   help="checkpoint every N steps (default: only on Ctrl-C / SIGTERM)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--stop-after", type=int, metavar="N",
                   help="stop after N steps as Ctrl-C would (checkpoint; --resume goes on)")
    p.add_argument("--packing", action="store_true",
                   help="lay examples back to back in rows of --max-len tokens (no pads; "
                        "--batch-size then counts rows)")
    p.add_argument("--attention", default="auto", choices=("auto", "sdpa", "varlen"),
                   help="packed rows on a GPU: flash varlen over each example (auto, varlen) "
                        "or sdpa with a block mask")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute activations in backward (less memory, ~30 %% slower)")
    p.add_argument("--mixed-precision", default="auto", choices=("auto", "no", "bf16", "fp16"),
                   help="default: bf16 on a GPU that has it, else none")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("-v", "--verbose", action="store_true", help="library logs and tracebacks")
    return p


def resolve_model(name: str) -> tuple[str, Path]:
    """(name as given, folder) for 'demo', a folder path or a cached hub id."""
    from model_utils.loading.registry import ModelRegistry

    registry = ModelRegistry()
    if name not in ("", "demo") and Path(name).expanduser().exists():
        registry.allow_root(name)  # the operator named it: any folder is allowed
        return name, registry.resolve(str(Path(name).expanduser().resolve())).path
    return name or "demo", registry.resolve(name).path


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.verbose:
        _quiet()
    from model_utils.training.train import Interrupted, TrainConfig, run

    try:
        if args.method == "qlora":
            import torch

            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            if reason := qlora_unavailable_reason(device):
                raise MethodUnavailable(reason)
        conversations = read_conversations(args.data)  # refuses bad lines before any load
        name, path = resolve_model(args.model)
        config = TrainConfig(
            model_path=str(path), model_name=name, data=str(args.data), out=str(args.out),
            method=args.method, steps=args.steps, epochs=args.epochs or 3.0, lr=args.lr,
            batch_size=args.batch_size, grad_accum=args.grad_accum, max_len=args.max_len,
            lora_r=args.lora_r, seed=args.seed, warmup_steps=args.warmup_steps,
            save_every=args.save_every, resume=args.resume, packing=args.packing,
            attention=args.attention,
            stop_after=args.stop_after,
            gradient_checkpointing=args.gradient_checkpointing,
            mixed_precision=args.mixed_precision, progress=not args.no_progress)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
        examples = tokenize_conversations(tokenizer, conversations, max_len=args.max_len,
                                          source=str(args.data))
        args.out.mkdir(parents=True, exist_ok=True)
        if _is_main():  # whoever looks at OUT later can tell that this process trains into it
            run_lock.write(args.out)
        try:
            result = run(config, examples, tokenizer)
        finally:
            if _is_main():
                run_lock.release(args.out)
    except Interrupted as stopped:
        print(f"interrupted: {stopped}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (DataError, MethodUnavailable, ValueError, OSError) as error:
        if args.verbose:
            logging.getLogger(__name__).exception("refused")
        print(f"error: {_first_line(error)}", file=sys.stderr)
        return EXIT_REFUSED
    except KeyboardInterrupt:
        print("interrupted before training started", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as error:
        if args.verbose:
            logging.getLogger(__name__).exception("fine-tuning failed")
        print(f"error: {type(error).__name__}: {_first_line(error)}", file=sys.stderr)
        return EXIT_ERROR
    if _is_main():
        print(f"done: {result.steps} steps, loss {result.losses[0]:.4f} -> "
              f"{result.final_loss:.4f}; saved to {result.out}", flush=True)
    return 0


def _is_main() -> bool:
    return os.environ.get("RANK", "0") == "0"


def _quiet() -> None:
    """Library chatter off the console: the progress bar and our lines are what matter."""
    logging.basicConfig(level=logging.ERROR)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars: the training bar is the one


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
