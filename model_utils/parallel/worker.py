"""One tensor-parallel worker process: join the group, load and shard the model, decode.

Started by group.WorkerGroup (spawn), never by the user. Every rank runs the same decode loop
(runtime.generation.decode_tokens on an EagerDecoder) on its shard; the all_reduces inside the
forward keep them in step, and every rank samples the same token from the same logits with the
same seed. Only rank 0 sends the tokens back to the engine's process.

Messages on the pipe from the engine: ("generate", input_ids, settings, eos_ids) and
("exit",). To the engine: ("ready", info), ("error", message), ("token", id) (rank 0
only), ("done", {stats, digest}) (every rank: a digest of the tokens it sampled).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import re
import sys
import threading
import time

PARENT_POLL_S = 0.5
COLLECTIVE_TIMEOUT_S = 60.0


def _exit_with_parent(parent_pid: int) -> None:
    """Leave at once when the engine's process is gone (killed, crashed), even while this
    process is blocked in a collective: no worker outlives its engine."""
    def watch():
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


class SyncedStop:
    """The engine's stop signal as rank 0 sees it, shared by every rank at each check.

    decode_tokens checks its stop signal at fixed points of every step; each check here is a
    broadcast from rank 0, so all ranks stop at the same step (a rank that ran one forward more
    than the others would wait in its all_reduce forever).
    """

    def __init__(self, event, rank: int, device):
        import torch

        self.event, self.rank = event, rank
        self.flag = torch.zeros(1, dtype=torch.int32, device=device)

    def is_set(self) -> bool:
        import torch.distributed as dist

        self.flag.fill_(1 if self.rank == 0 and self.event.is_set() else 0)
        dist.broadcast(self.flag, src=0)
        return bool(self.flag.item())

    def set(self) -> None:  # decode_tokens never sets it; here for the Event interface
        self.event.set()


def _setup(rank: int, world_size: int, init_file: str, threads: int):
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        # Untested here (no GPU): one GPU per rank, NCCL between them.
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(threads)
    # A collective that waits this long means the ranks fell out of step (one stopped at EOS
    # while another goes on): it fails, and the engine reports it instead of waiting forever.
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank,
                            world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return device


def _load(path: str, dtype_name: str, trust_remote_code: bool, rank: int, world_size: int,
          device):
    from transformers import AutoModelForCausalLM

    from ..loading.modes import torch_dtype
    from .sharding import shard_model

    # Each rank reads the whole checkpoint on the CPU and keeps its slices; a GPU build would
    # then move its shard to its device (the full model passes through host memory once per
    # rank, which a 14B model in bf16 can afford on the GPU hosts).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype(dtype_name),
                                                 use_safetensors=True,
                                                 trust_remote_code=trust_remote_code)
    model.eval()
    shard_model(model, rank, world_size)
    model.to(device)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return model, params


def run_worker(rank: int, world_size: int, init_file: str, conn, stop_event, parent_pid: int,
               path: str, dtype_name: str, trust_remote_code: bool, threads: int) -> None:
    _exit_with_parent(parent_pid)
    import signal

    # Ctrl-C in a terminal reaches the whole process group: the engine decides what happens
    # (it stops the workers), a worker must not die on its own in the middle of a collective.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import warnings

    warnings.simplefilter("ignore")
    from transformers.utils import logging as hf_logging

    # Loading bars and notices from N processes would only repeat the engine's own output.
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    code = 1
    try:
        code = _run(rank, world_size, init_file, conn, stop_event, path, dtype_name,
                    trust_remote_code, threads)
    finally:
        # Leave without the interpreter's shutdown: C++ destructors of torch's and gloo's
        # threads at that point sometimes abort ("terminate called without an active
        # exception") on the user's terminal, which shares this process's stderr.
        with contextlib.suppress(OSError, ValueError):
            conn.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _one_line(error: BaseException) -> str:
    # Without the C++ source location gloo and NCCL put first ("[/path/x.cc:129] Timed out").
    text = re.sub(r"\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", str(error))
    return " ".join(text.split())[:300] or type(error).__name__


def _run(rank, world_size, init_file, conn, stop_event, path, dtype_name, trust_remote_code,
         threads) -> int:
    try:
        device = _setup(rank, world_size, init_file, threads)
        model, shard_bytes = _load(path, dtype_name, trust_remote_code, rank, world_size, device)
    except Exception as error:  # noqa: BLE001 - reported to the engine as one line
        conn.send(("error", _one_line(error)))
        return 1
    conn.send(("ready", {"rank": rank, "shard_bytes": shard_bytes, "device": str(device)}))
    try:
        _serve(model, rank, conn, stop_event, device)
    except Exception as error:  # noqa: BLE001 - a peer that died fails the next collective
        # Said once, by the engine, in one line; this process's stderr is the user's terminal.
        with contextlib.suppress(OSError, ValueError):
            conn.send(("error", _one_line(error)))
        return 1
    return 0


def _digest(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()


def _serve(model, rank: int, conn, stop_event, device) -> None:
    import torch.distributed as dist

    from model_utils.runtime.reply_stats import ReplyStats

    from ..runtime.decoders import EagerDecoder
    from ..runtime.generation import decode_tokens

    while True:
        try:
            message = conn.recv()
        except EOFError:  # the engine closed the pipe: it is going away
            break
        if message[0] == "exit":
            break
        _, input_ids, settings, eos_ids = message
        stats = ReplyStats()
        stop = SyncedStop(stop_event, rank, device)
        tokens = []
        for token in decode_tokens(EagerDecoder(model), input_ids, settings, eos_ids=eos_ids,
                                   stop=stop, stats=stats):
            tokens.append(token)
            if rank == 0:
                conn.send(("token", token))
        # Every rank says what it sampled, so that the engine can check they agreed.
        conn.send(("done", {"stats": stats.as_dict(), "digest": _digest(tokens)}))
    dist.destroy_process_group()
