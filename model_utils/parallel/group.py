"""The engine's side of the tensor-parallel workers: start N processes, talk to them, stop them.

The engine's own process is not a rank: it holds the tokenizer and the prompts, and stays out
of the collectives, so a worker that dies can never leave it blocked in one. It watches every
worker's process sentinel while it waits for rank 0's tokens; when one is gone it stops the
others and says so (WorkerLost), and the next load starts a fresh group.

Workers are never left behind: stop() terminates and then kills them; an atexit hook does the
same at interpreter exit; a SIGTERM to the engine's process runs stop() and exits with status 143
(where nobody else installed a handler); and each worker leaves by itself when its parent
process is gone (worker._exit_with_parent), which covers a SIGKILL of the engine too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import tempfile
import threading
import time
import weakref
from multiprocessing import connection, get_context

from ..errors import LoadError, WorkerLost

STOP_WAIT_S = 5.0
# How long a failed rank's peers get to show that one of them died first.
FAILED_PEER_WAIT_S = 2.0
_groups: weakref.WeakSet = weakref.WeakSet()


def _stop_all() -> None:
    for group in list(_groups):
        group.stop()


def _on_sigterm(signum, frame) -> None:
    _stop_all()
    # Exit the way a shell reports a SIGTERM (143), through the interpreter's own shutdown, so
    # that multiprocessing's resources are released rather than reported as leaked.
    raise SystemExit(128 + signum)


def _install_handlers() -> None:
    atexit.register(_stop_all)
    # Only where the process kept the default action (the CLI); the app has its own graceful
    # shutdown, which unloads the model and so stops the workers through stop().
    if threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _on_sigterm)


class WorkerGroup:
    """N worker processes holding one model between them (worker.run_worker)."""

    def __init__(self, world_size: int, *, path: str, dtype_name: str,
                 trust_remote_code: bool = False, load_timeout_s: float = 600.0):
        from .worker import run_worker

        context = get_context("spawn")  # no fork: the engine's process has threads and torch
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="qwen-chat-tp-")
        self.stop_event = context.Event()
        self.processes, self.conns = [], []
        self._lock = threading.Lock()  # one reply at a time on the group
        threads = max(1, (os.cpu_count() or 1) // world_size)
        if not _groups:
            _install_handlers()
        _groups.add(self)
        try:
            for rank in range(world_size):
                ours, theirs = context.Pipe()
                process = context.Process(
                    target=run_worker, name=f"tp-worker-{rank}", daemon=True,
                    args=(rank, world_size, os.path.join(self._dir, "init"), theirs,
                          self.stop_event, os.getpid(), path, dtype_name, trust_remote_code,
                          threads))
                process.start()
                theirs.close()
                self.processes.append(process)
                self.conns.append(ours)
            self.shards = [self._ready(rank, load_timeout_s) for rank in range(world_size)]
        except BaseException:
            self.stop()
            raise

    def _ready(self, rank: int, timeout_s: float) -> dict:
        kind, payload = self._receive(rank, timeout_s, during="loading the model")
        if kind == "error":
            raise LoadError(f"tensor-parallel worker {rank} could not load the model: {payload}")
        return payload

    def _dead(self) -> list:
        """Workers that have exited. Their sentinel is ready as soon as their files are closed,
        a moment before waitpid can reap them (is_alive() still says True then)."""
        dead = [p for p in self.processes if connection.wait([p.sentinel], 0)]
        for process in dead:
            process.join(STOP_WAIT_S)  # reaped: exitcode is known
        return dead

    def _lost(self, during: str, dead: list | None = None) -> WorkerLost:
        gone = [f"{p.name} (exit code {p.exitcode})" for p in
                (self._dead() if dead is None else dead)]
        self.stop()
        what = ", ".join(gone) or "a worker"
        then = ("the load did not happen" if during.startswith("loading")
                else "the model is unloaded, load it again")
        return WorkerLost(f"{what} stopped while {during}; {then}")

    def _failed(self, message: str) -> WorkerLost:
        """Rank 0's decode failed: most often in a collective, because another worker died
        (then that one is named), else for its own reason."""
        connection.wait([p.sentinel for p in self.processes[1:]], FAILED_PEER_WAIT_S)
        if dead := [p for p in self._dead() if p is not self.processes[0]]:
            return self._lost("replying", dead)  # rank 0's own exit follows from theirs
        self.stop()
        return WorkerLost(f"tensor-parallel worker 0 failed while replying ({message}); the "
                          "workers were stopped, load the model again")

    def _receive(self, rank: int, timeout_s: float | None, *, during: str):
        """The next message from `rank`, or WorkerLost as soon as any worker has died."""
        conn = self.conns[rank]
        sentinels = [p.sentinel for p in self.processes]
        ready = connection.wait([conn, *sentinels], timeout_s)
        if conn in ready:
            try:
                return conn.recv()
            except (EOFError, OSError):
                pass
        elif not ready:
            self.stop()
            raise WorkerLost(f"tensor-parallel workers did not answer within {timeout_s:.0f} s "
                             f"while {during}; they were stopped")
        raise self._lost(during)

    def alive(self) -> bool:
        return bool(self.processes) and not self._dead()

    def generate(self, input_ids: list[int], settings, eos_ids: set[int], stop: threading.Event,
                 reply_timeout_s: float = 600.0):
        """Yield the reply's token ids, then return rank 0's stats dict."""
        with self._lock:
            if not self.alive():
                raise self._lost("idle")
            self.stop_event.clear()
            message = ("generate", list(input_ids), settings, set(eos_ids))
            for conn in self.conns:
                conn.send(message)
            finished = False
            try:
                while True:
                    if stop.is_set():
                        self.stop_event.set()
                    kind, payload = self._receive(0, reply_timeout_s, during="replying")
                    if kind == "error":
                        raise self._failed(payload)
                    if kind == "done":
                        finished = True
                        self._check_agreement(payload["digest"])
                        return payload["stats"]
                    yield payload
            finally:
                if not finished and self.alive():
                    # The consumer left mid-reply: end it on the workers and drain the rest,
                    # so the pipe holds nothing of this reply when the next one starts.
                    self.stop_event.set()
                    try:
                        while True:
                            kind, payload = self._receive(0, reply_timeout_s, during="stopping")
                            if kind == "done":
                                self._check_agreement(payload["digest"])
                                break
                            if kind == "error":
                                self.stop()
                                break
                    except WorkerLost:
                        pass

    def _check_agreement(self, digest: str) -> None:
        """Every rank must have sampled rank 0's tokens; a rank that did not has decoded on
        another sequence's KV cache, and the group cannot be trusted any more."""
        from .worker import COLLECTIVE_TIMEOUT_S

        for rank in range(1, self.world_size):
            # In step with rank 0, a rank is done a moment after it; out of step, it fails
            # its next collective after COLLECTIVE_TIMEOUT_S and says so.
            kind, payload = self._receive(rank, COLLECTIVE_TIMEOUT_S + 30,
                                          during="finishing the reply")
            if kind != "done" or payload["digest"] != digest:
                self.stop()
                raise WorkerLost(f"tensor-parallel worker {rank} sampled other tokens than "
                                 "worker 0; the workers were stopped, load the model again")

    def stop(self) -> None:
        """Stop every worker (politely, then by force) and free the group's files."""
        self.stop_event.set()  # a reply in progress ends at its next step
        for conn in self.conns:
            try:
                conn.send(("exit",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(STOP_WAIT_S)
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()
        self.processes, self.conns = [], []
        shutil.rmtree(self._dir, ignore_errors=True)
        _groups.discard(self)
