"""Memory snapshots: per GPU (NVML used/total, torch allocated/reserved) and CPU RAM/process RSS.

NVML sees what the driver has handed out to every process (what nvidia-smi shows); torch sees
what this process's caching allocator holds. Both matter: "reserved" that NVML still counts after
an unload is memory the cache kept, and empty_cache gives it back.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import psutil
import torch

GB = 1024**3


@dataclass(frozen=True)
class GpuMemory:
    index: int
    name: str
    used_gb: float | None  # NVML: every process on the device
    total_gb: float
    allocated_gb: float  # torch: tensors of this process
    reserved_gb: float  # torch: allocator cache of this process


@dataclass(frozen=True)
class MemorySnapshot:
    time: float
    gpus: list[GpuMemory]
    cpu_used_gb: float
    cpu_total_gb: float
    process_rss_gb: float
    note: str = ""

    def as_dict(self) -> dict:
        return asdict(self)


def _nvml_usage() -> dict[int, tuple[float, float]]:
    """index -> (used GB, total GB) from NVML; empty when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: NVML raises its own error types
        return {}
    usage = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i))
            usage[i] = (info.used / GB, info.total / GB)
    finally:
        pynvml.nvmlShutdown()
    return usage


def torch_cuda_gb() -> dict[str, float]:
    """This process's CUDA memory over every device: tensors (allocated), what the allocator
    holds including CUDA-graph pools (reserved), and the allocated peak since the last reset.
    Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    devices = range(torch.cuda.device_count())
    return {"allocated_gb": round(sum(torch.cuda.memory_allocated(i) for i in devices) / GB, 3),
            "reserved_gb": round(sum(torch.cuda.memory_reserved(i) for i in devices) / GB, 3),
            "peak_allocated_gb": round(sum(torch.cuda.max_memory_allocated(i)
                                           for i in devices) / GB, 3)}


def take_snapshot() -> MemorySnapshot:
    gpus = []
    note = ""
    if torch.cuda.is_available():
        # NVML numbers devices physically; with CUDA_VISIBLE_DEVICES set they may not match
        # torch's order, so NVML figures are only attached when the two counts agree.
        nvml = _nvml_usage()
        if len(nvml) != torch.cuda.device_count():
            nvml = {}
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            used, total = nvml.get(i, (None, props.total_memory / GB))
            gpus.append(GpuMemory(
                index=i,
                name=props.name,
                used_gb=used,
                total_gb=total,
                allocated_gb=torch.cuda.memory_allocated(i) / GB,
                reserved_gb=torch.cuda.memory_reserved(i) / GB,
            ))
    else:
        note = "no CUDA GPU on this machine: only CPU memory is shown"
    vm = psutil.virtual_memory()
    return MemorySnapshot(
        time=time.time(),
        gpus=gpus,
        cpu_used_gb=(vm.total - vm.available) / GB,
        cpu_total_gb=vm.total / GB,
        process_rss_gb=psutil.Process().memory_info().rss / GB,
        note=note,
    )


@dataclass
class MemoryHistory:
    """A bounded history of snapshots for the plots (oldest dropped first)."""

    max_points: int = 300
    _points: deque = field(default_factory=deque)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self) -> MemorySnapshot:
        snap = take_snapshot()
        with self._lock:
            self._points.append(snap)
            while len(self._points) > self.max_points:
                self._points.popleft()
        return snap

    def points(self) -> list[MemorySnapshot]:
        with self._lock:
            return list(self._points)
