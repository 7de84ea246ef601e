"""One fine-tuning run at a time, as a subprocess of the server (the Train tab's engine side).

The run is `python -m model_utils.finetune ...` in its own process: Stop sends it SIGTERM (it
saves a checkpoint and exits), a crash or an out-of-memory in training ends that process only,
and the served model is never touched. Progress is read from the run's OUT/train_log.jsonl.

While a run goes, chat keeps serving. On the CPU both share the cores (the run is niced, so
replies come first, and it uses one thread unless OMP_NUM_THREADS says otherwise). On a GPU a
run is refused when its estimated memory does not fit in what the GPU has free beside the
served model: unload the model or pick qlora first.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from model_utils.training import checkpoint as ckpt
from model_utils.training import defaults
from model_utils.training.data import DataError, count_examples, read_conversations
from model_utils.training.models import METHODS
from model_utils.training.train import PARENT_ENV

from . import run_lock

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
# Training memory per parameter, in bytes: the weights in their training dtype, plus for
# full fine-tuning fp32 gradients and Adam's two moments; activations come on top (margin).
_BYTES_PER_PARAM = {"lora": 2.0, "qlora": 0.56, "full": 16.0}
_ACTIVATION_MARGIN = 1.3
# Sizes beyond these are refused at the door: an optimizer step of 1e6 micro-batches never
# ends in practice. Per field, and tokens per optimizer step (accumulation x batch x max
# tokens) as a whole; 2**24 is 16 x 16 x 64k, far past any run this app serves.
LIMITS = {"batch_size": ("Batch size", 1024), "grad_accum": ("Grad accumulation", 4096),
          "max_len": ("Max tokens", 131072), "lora_r": ("LoRA rank", 1024)}
MAX_TOKENS_PER_STEP = 2**24
# After Stop (SIGTERM) the run saves a checkpoint within one micro-batch; one that has not
# ended after this long is killed, so that a stuck run can never block the next.
STOP_WAIT_S = 20.0
# A data file up to this size is read in the server at Start, so that a bad line is refused
# at once with its number; a bigger one is read by the run's own process, which refuses a bad
# line the same way before it loads a model (the Train tab shows its message). Parsed in the
# server, 300 MB took 25 s and 3.8 GB and slowed every reply tenfold meanwhile.
CHECK_IN_SERVER_BYTES = 4 * 2**20
# A leftover run of an earlier server gets this long to save its checkpoint at start-up.
LEFTOVER_WAIT_S = 15.0
# The loss curve sent to the page and the API: at most this many points (evenly spaced
# steps, the last one always in), so that a long run's refresh stays small.
MAX_CURVE_POINTS = 400
# What a run that ended before its first checkpoint leaves: such a folder may be reused.
_RUN_LEFTOVERS = {"console.txt", ckpt.TRAIN_LOG, run_lock.RUN_LOCK, "checkpoint.tmp",
                  "checkpoint.old"}


class TrainRefused(ValueError):
    """A run that cannot start (the message says why)."""


@dataclass
class TrainRequest:
    model: str  # what the registry resolves ("demo", a folder, a hub id)
    data: Path | None  # None only to plan a run before its data is chosen
    name: str  # the output folder's name under the trained-models folder
    method: str = "lora"
    steps: int | None = None
    epochs: float | None = 3.0
    lr: float | None = None
    batch_size: int = 4
    grad_accum: int = 1
    max_len: int = 1024
    lora_r: int = 16
    packing: bool = False  # examples packed into rows of max_len tokens (finetune --packing)

    def check(self) -> None:
        if not _NAME.match(self.name or ""):
            raise TrainRefused("the output name may use letters, digits, '.', '_' and '-' "
                               "(at most 64, starting with a letter or digit)")
        if self.method not in METHODS:
            raise TrainRefused(f"method must be one of {', '.join(METHODS)}")
        for key, low in (("batch_size", 1), ("grad_accum", 1), ("max_len", 16), ("lora_r", 1)):
            value = getattr(self, key)
            label, high = LIMITS[key]
            if not isinstance(value, int) or not low <= value <= high:
                raise TrainRefused(f"{label} ({key}) must be a whole number from {low} to "
                                   f"{high:,}")
        tokens = self.grad_accum * self.batch_size * self.max_len
        if tokens > MAX_TOKENS_PER_STEP:
            raise TrainRefused(
                f"Grad accumulation x Batch size x Max tokens is {tokens:,} tokens per "
                f"optimizer step; at most {MAX_TOKENS_PER_STEP:,}: lower Grad accumulation "
                f"(grad_accum, now {self.grad_accum:,})")
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise TrainRefused("steps must be a positive integer (or empty to use epochs)")
        if self.lr is not None and not 0 < self.lr < 1:
            raise TrainRefused("the learning rate must lie between 0 and 1")


@dataclass
class TrainJob:
    request: TrainRequest
    out: Path
    process: subprocess.Popen
    console: Path
    started: float = field(default_factory=time.time)
    stopped_by_user: bool = False
    killed_after_stop: bool = False

    @property
    def state(self) -> str:
        code = self.process.poll()
        if code is None:
            return "running"
        if code == 0:  # done, even when a Stop came after the last step
            return "finished"
        return "stopped" if self.stopped_by_user or code == 130 else "failed"


class TrainingRunner:
    def __init__(self, registry, *, output_dir: Path):
        self.registry = registry
        self.output_dir = output_dir
        self._lock = threading.Lock()
        self.job: TrainJob | None = None
        self.leftover_note = self._end_leftover_runs()

    def _end_leftover_runs(self) -> str:
        """Runs still training into our folders, left by an earlier server (killed outright)
        or started by hand: ended now (after a checkpoint), so that the tab's idle is true and
        no second run starts beside one nothing here could stop."""
        notes = []
        for lock in run_lock.live_runs(self.output_dir):
            how = lock.end(LEFTOVER_WAIT_S)
            log.warning("training: a run left by an earlier process (pid %d, %s) was %s at "
                        "start-up", lock.pid, lock.folder.name, how)
            resume = " (Start with the same name resumes it from its checkpoint)" \
                if ckpt.has_checkpoint(lock.folder) else ""
            notes.append(f"A run left by an earlier server, **{lock.folder.name}**, was {how} "
                         f"at start-up{resume}.")
        return " ".join(notes)

    def start(self, request: TrainRequest, *, served_model_gb: float = 0.0) -> TrainJob:
        request.check()
        with self._lock:
            if self.job is not None and self.job.state == "running":
                raise TrainRefused("a training run is already going: stop it first")
            source = self.registry.resolve(request.model)
            if source.adapter is not None:
                raise TrainRefused("train on a base model, not on an adapter")
            data = self._data_file(request.data)
            if not data.is_file():
                raise TrainRefused(f"data file {request.data.name!r} does not exist")
            if data.stat().st_size <= CHECK_IN_SERVER_BYTES:
                try:  # bad lines are refused now, with their line number, not after a load
                    read_conversations(data)
                except DataError as error:
                    raise TrainRefused(str(error).replace(str(data), data.name)) from None
            _check_gpu_room(source.path, request.method)
            if others := run_lock.live_runs(self.output_dir):
                other = others[0]
                raise TrainRefused(f"a run not started here trains into {other.folder.name!r} "
                                   f"(pid {other.pid}): press Stop to end it first")
            out = self.output_dir / request.name
            if out.exists() and not ckpt.has_checkpoint(out):
                if not _only_run_leftovers(out):
                    raise TrainRefused(f"{request.name!r} exists already: pick another name")
                # A run that ended before its first checkpoint: nothing in it to keep.
                shutil.rmtree(out)
            if ckpt.has_checkpoint(out):
                _check_resumable(out, request, source.path)
            out.mkdir(parents=True, exist_ok=True)
            console = out / "console.txt"
            # nice(1): replies come first on a shared CPU (a preexec_fn is unsafe in a
            # threaded server).
            niced = ["nice", "-n", "10"] if shutil.which("nice") else []
            argv = [*niced, sys.executable, "-m", "model_utils.finetune", "--model",
                    "demo" if source.is_demo else str(source.path), "--data", str(data),
                    "--out", str(out), "--method", request.method,
                    "--batch-size", str(request.batch_size), "--grad-accum",
                    str(request.grad_accum), "--max-len", str(request.max_len), "--lora-r",
                    str(request.lora_r), "--no-progress"]
            argv += ["--steps", str(request.steps)] if request.steps else \
                ["--epochs", str(request.epochs or 3.0)]
            if request.lr:
                argv += ["--lr", str(request.lr)]
            if request.packing:
                argv.append("--packing")
            if ckpt.has_checkpoint(out):
                argv.append("--resume")
            log.info("training: %s", " ".join(argv))
            with console.open("w") as stream:
                process = subprocess.Popen(
                    argv, stdout=stream, stderr=subprocess.STDOUT,
                    cwd=Path(__file__).resolve().parents[2],
                    env={"OMP_NUM_THREADS": "1", **os.environ, "PYTHONUNBUFFERED": "1",
                         PARENT_ENV: str(os.getpid())})
            self.job = TrainJob(request, out, process, console)
            return self.job

    def plan(self, request: TrainRequest) -> defaults.Plan:
        """The steps and learning rate `request` will run with (the data's examples counted
        where the file can be read; the packed rows are known only once tokenized)."""
        parameters = _parameters(self.registry.resolve(request.model).path)
        n_examples = None
        if request.data and not request.packing:
            try:
                data = self._data_file(request.data)
                if data.stat().st_size > CHECK_IN_SERVER_BYTES:  # counted by the run itself
                    raise TrainRefused("too big to count here")
                n_examples = count_examples(data)
            except (TrainRefused, DataError, OSError):
                pass
        return defaults.plan(method=request.method, parameters=parameters,
                             n_examples=n_examples, batch_size=request.batch_size,
                             grad_accum=request.grad_accum, steps=request.steps,
                             epochs=request.epochs, lr=request.lr)

    def resume(self) -> TrainJob:
        """Start the stopped run again from its checkpoint, with the settings it had."""
        job = self.job
        if job is None or job.state != "stopped" or not ckpt.has_checkpoint(job.out):
            raise TrainRefused("no stopped run to continue")
        return self.start(job.request)

    def _data_file(self, data: Path) -> Path:
        return self.registry.check_under_roots(data, "data file") \
            if not _is_upload(data) else Path(data).resolve()

    def stop(self) -> bool:
        """Ask the run to stop (it saves a checkpoint within one micro-batch; killed if it has
        not ended after STOP_WAIT_S); True if one was running."""
        job = self.job
        if job is None or job.state != "running":
            others = run_lock.live_runs(self.output_dir)
            for lock in others:  # a run not started here: ended in the background
                threading.Thread(target=lock.end, args=(STOP_WAIT_S,), daemon=True).start()
            return bool(others)
        if not job.stopped_by_user:
            job.stopped_by_user = True
            job.process.send_signal(signal.SIGTERM)
            threading.Thread(target=self._kill_if_still_running, args=(job, STOP_WAIT_S),
                             daemon=True).start()
        return True

    @staticmethod
    def _kill_if_still_running(job: TrainJob, wait_s: float) -> None:
        try:
            job.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            log.warning("training: %s did not stop within %.0f s of Stop; killed",
                        job.request.name, wait_s)
            job.killed_after_stop = True
            job.process.kill()

    def progress(self) -> dict:
        """{state, name, steps: [...], step, total, loss, tok_s, message} of the last run."""
        job = self.job
        if job is None:
            return {"state": "idle", "rows": [], "message": self.leftover_note}
        rows = ckpt.read_train_log(job.out)
        last = rows[-1] if rows else {}
        result = {"state": job.state, "name": job.request.name, "out": str(job.out),
                  "rows": curve(rows), "logged_steps": len(rows),
                  "step": last.get("step", 0), "total": last.get("steps"),
                  "loss": last.get("loss"), "tok_s": last.get("tok_s"),
                  "elapsed_s": round(time.time() - job.started, 1)}
        result["resumable"] = job.state == "stopped" and ckpt.has_checkpoint(job.out)
        if job.killed_after_stop:
            result["message"] = (f"the run did not stop within {STOP_WAIT_S:.0f} s of Stop and "
                                 "was ended without a new checkpoint"
                                 + ("; the last one is kept: press Continue to go on from it"
                                    if result["resumable"] else ""))
        elif result["resumable"]:
            result["message"] = (f"Stopped at step {result['step']}; its checkpoint is kept: "
                                 "press Continue to go on from there.")
        elif job.state in ("failed", "stopped"):
            # The run's last line says why; server paths stay in the log.
            result["message"] = _last_line(job.console).replace(str(self.output_dir), "")
        return result

    def shutdown(self, grace_s: float) -> None:
        """The server is closing: the run saves a checkpoint if it can within grace_s, and
        is killed after it, so that it never outlives the server."""
        job = self.job
        if job is None or job.state != "running":
            return
        job.stopped_by_user = True
        job.process.send_signal(signal.SIGTERM)
        try:
            job.process.wait(timeout=grace_s)
            log.info("training: %s stopped for the shutdown", job.request.name)
        except subprocess.TimeoutExpired:
            log.warning("training: %s had not stopped %.0f s into the shutdown; killed",
                        job.request.name, grace_s)
            job.process.kill()
            job.process.wait()


def _check_resumable(out: Path, request: TrainRequest, model_path: Path) -> None:
    """A Start under the name of a run with a checkpoint continues it: refused, saying what
    differs, when the form asks for another run (the data's content is compared by the run
    itself, which reads the file anyway)."""
    now = {"model_path": str(model_path), "method": request.method,
           "lora_r": request.lora_r, "max_len": request.max_len,
           "batch_size": request.batch_size, "grad_accum": request.grad_accum,
           "packing": request.packing}
    if differences := ckpt.resume_differences(ckpt.checkpoint_state(out), now):
        raise TrainRefused(f"{request.name!r} holds the checkpoint of another run, which Start "
                           f"would continue: {'; '.join(differences)}. Start with what it had "
                           "to continue it, or pick another name")


def curve(rows: list[dict], points: int = MAX_CURVE_POINTS) -> list[dict]:
    """At most `points` of the logged steps, evenly spaced, the last one always in."""
    if len(rows) <= points:
        return rows
    stride = len(rows) / (points - 1)
    picked = [rows[int(i * stride)] for i in range(points - 1)]
    return [*picked, rows[-1]]


def _only_run_leftovers(folder: Path) -> bool:
    try:
        return {p.name for p in folder.iterdir()} <= _RUN_LEFTOVERS
    except OSError:
        return False


def _is_upload(path: Path) -> bool:
    """A file gradio stored from an upload (its own temporary folder)."""
    import tempfile

    upload_root = Path(os.environ.get("GRADIO_TEMP_DIR") or
                       Path(tempfile.gettempdir()) / "gradio").resolve()
    return Path(path).resolve().is_relative_to(upload_root)


def _check_gpu_room(model_path: Path, method: str) -> None:
    import torch

    if not torch.cuda.is_available():
        return  # the CPU: chat and training share the cores
    need = _parameters(model_path) * _BYTES_PER_PARAM[method] * _ACTIVATION_MARGIN / 2**30
    free = torch.cuda.mem_get_info(0)[0] / 2**30
    if need > free:
        raise TrainRefused(f"training this model with {method} needs about {need:.1f} GB of "
                           f"GPU memory and {free:.1f} GB are free beside the served model: "
                           "unload it first (Model tab) or pick qlora")


def _parameters(model_path: Path) -> int:
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""
