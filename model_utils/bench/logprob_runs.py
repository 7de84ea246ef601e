"""The runs that logprob_check compares: greedy replies with their top-k log-probabilities, and
teacher-forced next-token distributions, from the engine's own path and from the plain model.

The engine side goes through the loaded model's batch scheduler: greedy replies are ordinary
requests that record their logprobs (requests.Request.logprobs), and the teacher-forced run
drives the scheduler's own pieces (its prefill, padded prefill graphs where the model has them,
its batch cache, its step function: CUDA graphs of the fused q/k/v and packed-attention forward
on a GPU, the eager batched forward on the CPU) with given tokens instead of sampled ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from model_utils.engine import Engine, eos_ids
from model_utils.runtime.decoders import input_device
from model_utils.runtime.generation_settings import GenerationSettings
from model_utils.runtime.kv_blocks import blocks_for
from model_utils.runtime.kv_cache import bucket
from model_utils.runtime.reply_stats import ReplyStats

from .gate import Yielded, stopping_when
from .logprob_check import RECORDED_K, Steps, steps_from_logits, steps_from_topk


def greedy_settings(new_tokens: int) -> GenerationSettings:
    # min_new_tokens: EOS is masked on both sides, so every reply runs its full length.
    return GenerationSettings.greedy(max_new_tokens=new_tokens, min_new_tokens=new_tokens)


def engine_greedy(engine: Engine, prompts: list[list[int]], new_tokens: int,
                  at_once: int | None = None) -> list[Steps]:
    """Greedy replies through the scheduler, submitted together (decoded as one batch as far
    as they arrive together), `at_once` at most at a time, each with its tokens' top-k
    log-probabilities."""
    import threading

    scheduler = _scheduler(engine)
    eos = eos_ids(engine.serving.loaded)
    size = at_once or len(prompts)
    found = []
    for start in range(0, len(prompts), size):
        group = prompts[start:start + size]
        records = [[] for _ in group]
        streams = [scheduler.submit(p, greedy_settings(new_tokens), eos_ids=eos,
                                    stop=threading.Event(), stats=ReplyStats(), logprobs=r,
                                    logprob_k=RECORDED_K)
                   for p, r in zip(group, records)]
        tokens = [list(s) for s in streams]
        found += [steps_from_topk(t, r) for t, r in zip(tokens, records)]
    return found


@torch.inference_mode()
def plain_greedy(model, prompts: list[list[int]], new_tokens: int,
                 should_yield: Callable[[], bool] | None = None) -> list[Steps] | None:
    """Plain model.generate, greedy, on equal-length prompts at once (no padding), with the raw
    logits of every step; None when it stopped early because `should_yield()` (gate.py)."""
    criteria, criterion = stopping_when(should_yield or (lambda: False))
    ids = torch.tensor(prompts, device=input_device(model))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                         output_logits=True, return_dict_in_generate=True,
                         stopping_criteria=criteria)
    if criterion.yielded:
        return None
    tokens = out.sequences[:, ids.shape[1]:].tolist()
    return [steps_from_logits(t, [step[i] for step in out.logits]) for i, t in enumerate(tokens)]


def engine_teacher_forced(engine: Engine, sequences: list[list[int]], prompt_len: int, *,
                          should_yield: Callable[[], bool] | None = None) -> torch.Tensor:
    """[rows, positions, V] float32 log-probabilities (on the CPU) of the engine's path on the
    given equal-length sequences, prefilled as prompts of prompt_len tokens and then decoded one
    forced token per step, all rows in one batch (padded to the row bucket as replies are).

    Runs on the engine's decode worker, where no reply is decoding at that moment (the worker
    runs one thing at a time and the scheduler's loop returns only with no rows left); it uses
    the batch cache's rows and leaves them free. `should_yield` is asked between steps: when it
    says so, the run stops (Yielded) so that waiting replies are served first."""
    runner = _scheduler(engine).runner  # the batch runner: its cache, prefill and step
    return engine.worker.call(lambda: _teacher_forced(runner, sequences, prompt_len,
                                                      should_yield))


@torch.inference_mode()
def _teacher_forced(runner, sequences, prompt_len, should_yield) -> torch.Tensor:
    pool = runner.blocks()  # the cache's blocks, allocated on first use
    kv = runner.kv
    rows = len(sequences)
    if rows > kv.rows:
        raise ValueError(f"{rows} sequences, the batch cache has {kv.rows} rows")
    if len(sequences[0]) > kv.width * kv.block_tokens:
        raise ValueError("the sequences do not fit the context window")
    held: list[list[int]] = []
    try:
        for sequence in sequences:
            blocks = pool.allocate(blocks_for(len(sequence), pool.block_size))
            if blocks is None:
                raise ValueError("the KV cache has too few free blocks for these sequences")
            held.append(blocks)
        forced = torch.tensor(sequences, device=kv.device)
        first = [None] * rows
        for group, padded in _prefill_groups(runner, rows, prompt_len):
            # Each row is placed right after its prefill, as the scheduler does (a model with
            # linear attention prefills into one slot that the row then takes over).
            if padded:
                logits = runner.padded_prefill([sequences[i][:prompt_len] for i in group],
                                               [held[i] for i in group])
            for j, row in enumerate(group):
                if not padded:
                    logits = runner.forward_prompt(sequences[row][:prompt_len], held[row])
                # Padded, the row's linear-attention states are in the group's slot j.
                kv.place(row, held[row], prompt_len, sequences[row][prompt_len],
                         j if padded else 0)
                first[row] = torch.log_softmax(logits[j if padded else 0].float(), -1)
        out = [torch.stack(first).cpu()]
        length = prompt_len
        b = bucket(rows, kv.row_buckets)  # padded to the row bucket, as replies are
        for t in range(prompt_len, len(sequences[0]) - 1):
            if should_yield is not None and should_yield():
                raise Yielded
            kv.pad_rows(rows, b)
            kv.set_lengths(b, length + 1, rows * (length + 1))
            logits = runner.step_fn(kv, b)  # [b, V]; rows past `rows` are padding
            kv.advance(b)
            length += 1
            out.append(torch.log_softmax(logits[:rows].float(), -1).cpu())
            kv.ids[:rows, 0].copy_(forced[:, t + 1])
    finally:
        for row in range(min(rows, kv.rows)):  # every row free again, as the scheduler
            kv.clear_row(row)  # leaves them
        for blocks in held:
            pool.release(blocks)
    return torch.stack(out, 1)


def _prefill_groups(runner, rows: int, prompt_len: int):
    """(row indices, padded): the groups the scheduler would prefill these prompts in."""
    padded = runner.padded_prefill
    if runner.fits_padded(prompt_len):  # not a hybrid's prompt whose states are kept
        group: list[int] = []
        for row in range(rows):
            if group and not padded.fit_together([prompt_len] * (len(group) + 1)):
                yield group, True
                group = []
            group.append(row)
        yield group, True
    else:
        yield list(range(rows)), False  # each by itself, as the scheduler does


def _scheduler(engine: Engine):
    serving = engine.serving
    if serving is None or serving.scheduler is None:
        raise ValueError("logprob checks need a model the engine decodes in batches")
    return serving.scheduler
