"""The training loop: accelerate for devices, processes and mixed precision; AdamW with warm-up
and cosine decay; gradient accumulation; clipping at 1.0; a checkpoint every N steps and on
Ctrl-C / SIGTERM.

Run as one process or under `accelerate launch --num_processes N` (data parallel; gloo on the
CPU). Every process computes the same data order from the seed (data.Schedule) and takes its
slice of each global micro-batch, and the loss is normalised by the token count of the whole
global micro-batch, so N processes with batch B follow the loss curve of one with batch N*B.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from . import checkpoint as ckpt
from . import defaults, packed_attention
from .data import Example, Schedule, file_sha256, pack_batch, pack_examples, pad_batch
from .models import METHODS, TokenLoss, count_parameters, keep_input_dtype, load_for_training

log = logging.getLogger(__name__)
# Set by the server for the runs it starts: its pid (see _StopFlag).
PARENT_ENV = "QWEN_CHAT_TRAIN_PARENT"


@dataclass
class TrainConfig:
    model_path: str
    data: str
    out: str
    model_name: str = ""  # what the user named ("demo" or a path), for the manifest
    method: str = "lora"
    steps: int | None = None  # optimizer steps; None: from epochs
    epochs: float = 3.0
    lr: float | None = None  # None: from the method and the model's size (defaults.py)
    batch_size: int = 4  # per process
    grad_accum: int = 1
    max_len: int = 1024
    lora_r: int = 16
    seed: int = 1234
    warmup_steps: int | None = None  # None: 5 % of the run
    save_every: int = 0  # 0: only on interrupt
    resume: bool = False
    packing: bool = False  # one row per micro-batch, no pads (data.pack_batch)
    attention: str = "auto"  # packed rows: auto/varlen = packed_attention where CUDA has it
    gradient_checkpointing: bool = False
    mixed_precision: str = "auto"  # auto: bf16 on a GPU that has it, else none
    progress: bool = True
    keep_checkpoint: bool = False
    cpu: bool = False  # train on the CPU even with a GPU (the demo build: same result anywhere)
    # AdamW's fused kernel on the CPU as well (it is always used on CUDA): the same update in
    # one pass over the weights. Off by default so that a CPU run keeps the numbers it had.
    fused_cpu_adamw: bool = False
    stop_after: int | None = None  # stop as if interrupted after this many steps
    handle_signals: bool = True  # Ctrl-C / SIGTERM save a checkpoint (off inside a server)
    extra_manifest: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"--method must be one of {', '.join(METHODS)}")
        if self.attention not in ("auto", "sdpa", "varlen"):
            raise ValueError("--attention must be auto, sdpa or varlen")
        for name in ("batch_size", "grad_accum", "max_len", "lora_r"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.steps is not None and self.steps < 1:
            raise ValueError("--steps must be at least 1")
        if self.steps is None and not self.epochs > 0:
            raise ValueError("--epochs must be above 0")
        if self.lr is not None and not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError("--lr must be a positive number")


class Interrupted(Exception):
    """Ctrl-C or SIGTERM arrived; a checkpoint was saved at the step named in the message."""


@dataclass
class RunResult:
    steps: int
    final_loss: float
    losses: list[float]
    out: Path
    interrupted: bool = False


class _StopFlag:
    """Turns SIGINT/SIGTERM into a flag the loop checks after each micro-batch. A run started
    by the server (QWEN_CHAT_TRAIN_PARENT: the server's pid) also stops when that server is
    gone: a server killed outright leaves its run re-parented, and nothing would stop it."""

    def __init__(self, enabled: bool = True):
        self._raised = False
        self.enabled = enabled
        self._previous = {}
        parent = os.environ.get(PARENT_ENV, "")
        self._parent = int(parent) if parent.isdigit() else None

    @property
    def raised(self) -> bool:
        if self._parent is not None and os.getppid() != self._parent:
            self._raised = True
        return self._raised

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM) if self.enabled else ():
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (the demo build in a server thread)
                pass
        return self

    def _handle(self, signum, frame):
        self._raised = True

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _mixed_precision(choice: str) -> str:
    if choice != "auto":
        return choice
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


def run(config: TrainConfig, examples: list[Example], tokenizer,
        on_step: Callable[[int, int, float], None] | None = None) -> RunResult:
    """Train; `on_step(done, steps, loss)` after each optimizer step (main process only), for
    a caller that shows the progress somewhere other than the console's bar."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from transformers import get_scheduler

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    # cpu=True on a machine without CUDA is what makes several launched processes form a gloo
    # group (accelerate otherwise runs each one alone).
    accelerator = Accelerator(mixed_precision=_mixed_precision(config.mixed_precision),
                              gradient_accumulation_steps=config.grad_accum,
                              cpu=config.cpu or not torch.cuda.is_available())
    main = accelerator.is_main_process
    set_seed(config.seed)  # the same initial LoRA matrices in every process and every run
    model = load_for_training(config.model_path, config.method, device=accelerator.device,
                              lora_r=config.lora_r,
                              gradient_checkpointing=config.gradient_checkpointing)
    trained, total = count_parameters(model)
    if config.packing:  # from here on an "example" is a packed row of max_len tokens
        examples = pack_examples(examples, max_len=config.max_len, seed=config.seed)
    schedule = Schedule(len(examples), config.batch_size, accelerator.num_processes, config.seed)
    micro_per_step = config.grad_accum
    run_plan = defaults.plan(method=config.method, parameters=total,
                             n_examples=len(examples), batch_size=config.batch_size,
                             grad_accum=config.grad_accum, world=accelerator.num_processes,
                             steps=config.steps, epochs=config.epochs, lr=config.lr)
    steps, config.lr = run_plan.steps, run_plan.lr
    warmup = config.warmup_steps if config.warmup_steps is not None else int(0.05 * steps)
    if accelerator.mixed_precision != "no":
        keep_input_dtype(model)
    varlen = _use_varlen(config, accelerator.device)
    if varlen:
        packed_attention.use_packed_varlen(model)
    loss_module = TokenLoss(model, varlen=varlen)
    device = accelerator.device.type
    fused = device == "cuda" or (device == "cpu" and config.fused_cpu_adamw)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=config.lr, weight_decay=0.0, fused=fused)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=warmup,
                              num_training_steps=steps)
    loss_module, optimizer, scheduler = accelerator.prepare(loss_module, optimizer, scheduler)
    # The scheduler steps once per optimizer step in every process; accelerate's wrapper
    # would step it num_processes times (it assumes a dataloader split over processes).
    scheduler.split_batches = True

    start_step, losses = 0, []
    data_sha256 = file_sha256(Path(config.data))
    if config.resume and ckpt.has_checkpoint(out):
        if differences := ckpt.resume_differences(ckpt.checkpoint_state(out), {
                **asdict(config), "data_sha256": data_sha256}):
            raise ValueError(f"--resume: the checkpoint in {out.name} was written for another "
                             f"run: {'; '.join(differences)}. Continue with what it had, or "
                             "train under another name")
        state = ckpt.load_checkpoint(out, model=accelerator.unwrap_model(loss_module).model,
                                     optimizer=optimizer, scheduler=scheduler)
        if state.get("steps") != steps or state.get("world") != accelerator.num_processes:
            raise ValueError("--resume: the checkpoint was written for another run shape "
                             f"(steps {state.get('steps')}, processes {state.get('world')}); "
                             "resume with the flags it was started with")
        start_step, losses = state["step"], state["losses"]
        if main:
            ckpt.trim_train_log(out, start_step)
            print(f"resuming at step {start_step}/{steps}", flush=True)
    elif main:
        (out / ckpt.TRAIN_LOG).unlink(missing_ok=True)

    if main:
        print(f"fine-tuning {config.model_name or config.model_path} ({config.method}): "
              f"{trained:,} of {total:,} parameters train; {len(examples)} examples, "
              f"{steps} steps of {schedule.global_batch * micro_per_step} examples on "
              f"{accelerator.num_processes} process(es), {accelerator.device}, "
              f"mixed precision {accelerator.mixed_precision}"
              f"{', flash varlen attention' if varlen else ''}; {run_plan.describe()}",
              flush=True)
    pad_id = getattr(tokenizer, "pad_token_id", None) or 0
    collate = pack_batch if config.packing else pad_batch
    bar = None
    if main and config.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=steps, initial=start_step, desc="training", unit="step",
                   dynamic_ncols=True)
    started, tokens_seen, step = time.perf_counter(), 0, start_step
    loss_module.train()
    # Signals are caught until the result is written: a Stop arriving after the last step
    # lets the run finish its save (it is done) instead of killing it half-written.
    stop = _StopFlag(config.handle_signals).__enter__()
    try:
        try:
            with (out / ckpt.TRAIN_LOG).open("a") as train_log:
                for step in range(start_step, steps):
                    step_loss = torch.zeros((), device=accelerator.device)
                    step_tokens = 0
                    for micro in range(micro_per_step):
                        index = step * micro_per_step + micro
                        picked = schedule.micro_batch(index, accelerator.process_index)
                        rows = [examples[i] for i in picked]
                        batch = {k: v.to(accelerator.device) for k, v in collate(rows, pad_id).items()}
                        with accelerator.accumulate(loss_module):
                            loss_sum, count = loss_module(**batch)
                            # Normalise by every process's tokens: DDP averages the gradients over
                            # processes, hence the factor num_processes.
                            global_count = accelerator.reduce(count.detach().float(), "sum")
                            loss = loss_sum * accelerator.num_processes / global_count.clamp(min=1)
                            accelerator.backward(loss)
                            if accelerator.sync_gradients:
                                accelerator.clip_grad_norm_(loss_module.parameters(), 1.0)
                            optimizer.step()
                            scheduler.step()
                            optimizer.zero_grad(set_to_none=True)
                        step_loss += loss.detach() / accelerator.num_processes / micro_per_step
                        # Tokens of the examples themselves, not the pads.
                        step_tokens += sum(len(row.input_ids) for row in rows)
                        if micro + 1 < micro_per_step and _agree(accelerator, stop.raised):
                            # A long accumulation must not hold a Stop until its step ends: the
                            # checkpoint is the last whole step (this step's gradients are dropped).
                            _save(accelerator, out, loss_module, optimizer, scheduler,
                                  {"step": step, "steps": steps, "losses": losses,
                                   "world": accelerator.num_processes, "config": asdict(config),
                                   "data_sha256": data_sha256})
                            raise Interrupted(f"stopped during step {step + 1}/{steps}; checkpoint "
                                              f"of step {step} saved in {out / ckpt.CHECKPOINT} "
                                              "(continue with --resume)")
                    value = accelerator.reduce(step_loss, "sum").item()
                    tokens = int(accelerator.reduce(torch.tensor(step_tokens,
                                                                 device=accelerator.device), "sum"))
                    losses.append(value)
                    tokens_seen += tokens
                    elapsed = time.perf_counter() - started
                    tok_s = tokens_seen / elapsed if elapsed > 0 else 0.0
                    if main:
                        train_log.write(json.dumps({
                            "step": step + 1, "steps": steps, "loss": round(value, 6),
                            "lr": scheduler.get_last_lr()[0], "tokens": tokens,
                            "tok_s": round(tok_s, 1), "elapsed_s": round(elapsed, 3)}) + "\n")
                        train_log.flush()
                        if bar is not None:
                            bar.set_postfix(loss=f"{value:.4f}", tok_s=f"{tok_s:,.0f}")
                            bar.update(1)
                        if on_step is not None:
                            on_step(step + 1, steps, value)
                    done = step + 1
                    interrupted = _agree(accelerator, stop.raised or done == config.stop_after)
                    if interrupted or (config.save_every and done % config.save_every == 0
                                       and done < steps):
                        _save(accelerator, out, loss_module, optimizer, scheduler,
                              {"step": done, "steps": steps, "losses": losses,
                               "world": accelerator.num_processes, "config": asdict(config),
                               "data_sha256": data_sha256})
                    if interrupted:
                        raise Interrupted(f"stopped at step {done}/{steps}; checkpoint saved in "
                                          f"{out / ckpt.CHECKPOINT} (continue with --resume)")
        finally:
            if bar is not None:
                bar.close()

        model = accelerator.unwrap_model(loss_module).model
        if main:
            manifest = {
                "base_model": config.model_name or config.model_path,
                "base_path": str(Path(config.model_path).resolve()),
                "method": config.method, "data_file": str(config.data),
                "data_sha256": data_sha256, "steps": steps,
                "final_loss": losses[-1], "first_loss": losses[0], "lr": config.lr,
                "batch_size": config.batch_size, "grad_accum": config.grad_accum,
                "processes": accelerator.num_processes, "max_len": config.max_len,
                "lora_r": config.lora_r if config.method != "full" else None, "seed": config.seed,
                "examples": len(examples), "tokens": tokens_seen,
                "duration_s": round(time.perf_counter() - started, 2), **config.extra_manifest}
            ckpt.save_output(out, model=model, tokenizer=tokenizer, manifest=manifest)
            if not config.keep_checkpoint:
                ckpt.remove_checkpoint(out)
        accelerator.wait_for_everyone()
        return RunResult(steps, losses[-1], losses, out)
    finally:
        stop.__exit__()


def _use_varlen(config: TrainConfig, device: torch.device) -> bool:
    if not config.packing or config.attention == "sdpa":
        return False
    if packed_attention.available(device):
        return True
    if config.attention == "varlen":
        raise ValueError("--attention varlen needs a CUDA GPU and a torch with "
                         "torch.nn.attention.varlen; use --attention sdpa")
    return False


def _agree(accelerator, flag: bool) -> bool:
    """True on every process if any process was told to stop (all must save the same step)."""
    if accelerator.num_processes == 1:
        return flag
    value = torch.tensor(float(flag), device=accelerator.device)
    return bool(accelerator.reduce(value, "sum").item() > 0)


def _save(accelerator, out, loss_module, optimizer, scheduler, state) -> None:
    if accelerator.is_main_process:
        ckpt.save_checkpoint(out, model=accelerator.unwrap_model(loss_module).model,
                             optimizer=optimizer, scheduler=scheduler, state=state)
    accelerator.wait_for_everyone()
