"""OUT/run.json: which process is training into OUT, written by the run itself.

A server that died (SIGKILL, a crash) or an operator's own `python -m model_utils.finetune`
leaves a training process the next server knows nothing of; without this file the Train tab
said idle and a second run could start into the same folder beside it. The file holds the
process's pid and its start time as the kernel counts it (/proc/PID/stat), so that a pid
reused by another process after a reboot or a long uptime is not taken for the run.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

RUN_LOCK = "run.json"


@dataclass(frozen=True)
class RunLock:
    folder: Path
    pid: int
    start_ticks: int | None  # None where /proc is not there (then the pid alone is trusted)

    def alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: not ours
            return False
        if _process_state(self.pid) == "Z":  # ended, not yet reaped by its parent
            return False
        return self.start_ticks is None or process_start_ticks(self.pid) == self.start_ticks

    def end(self, wait_s: float) -> str:
        """SIGTERM (the run saves a checkpoint), SIGKILL after wait_s; how it ended."""
        try:
            os.kill(self.pid, signal.SIGTERM)
        except ProcessLookupError:
            return "ended"
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if not self.alive():
                return "stopped"
            time.sleep(0.1)
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            return "stopped"
        return "killed"


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 on (None without /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: count from the last ")".
    return stat[stat.rindex(")") + 2:].split()


def _process_state(pid: int) -> str | None:
    fields = _stat_fields(pid)
    return fields[0] if fields else None


def process_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (field 22 of /proc/PID/stat)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else None


def write(folder: Path) -> Path:
    """Claim FOLDER for this process."""
    path = Path(folder) / RUN_LOCK
    pid = os.getpid()
    tmp = path.with_name(RUN_LOCK + ".tmp")
    tmp.write_text(json.dumps({"pid": pid, "start_ticks": process_start_ticks(pid),
                               "started": time.time()}) + "\n")
    os.replace(tmp, path)
    return path


def release(folder: Path) -> None:
    """Drop the claim, if it is this process's."""
    found = read(folder)
    if found is not None and found.pid == os.getpid():
        (Path(folder) / RUN_LOCK).unlink(missing_ok=True)


def read(folder: Path) -> RunLock | None:
    try:
        data = json.loads((Path(folder) / RUN_LOCK).read_text())
        return RunLock(Path(folder), int(data["pid"]),
                       None if data.get("start_ticks") is None else int(data["start_ticks"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def live_run(folder: Path) -> RunLock | None:
    """The process training into FOLDER now, or None (a stale file is removed)."""
    found = read(folder)
    if found is None:
        return None
    if found.alive():
        return found
    (Path(folder) / RUN_LOCK).unlink(missing_ok=True)
    return None


def live_runs(parent: Path) -> list[RunLock]:
    """Every run training into a folder under PARENT now."""
    try:
        folders = [p for p in Path(parent).iterdir() if (p / RUN_LOCK).is_file()]
    except OSError:
        return []
    return [lock for folder in sorted(folders) if (lock := live_run(folder)) is not None]
