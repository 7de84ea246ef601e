"""Memory snapshots on a machine without a GPU, and the bounded history behind the plots."""

from __future__ import annotations

import psutil
import pytest
import torch

from model_utils.memory import GB, MemoryHistory, take_snapshot

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU snapshot")


@no_gpu
def test_snapshot_without_gpu_says_so_and_reports_cpu_figures():
    snap = take_snapshot()
    assert snap.gpus == []
    assert "no CUDA GPU" in snap.note
    total = psutil.virtual_memory().total / GB
    assert snap.cpu_total_gb == pytest.approx(total)
    assert 0 < snap.cpu_used_gb <= snap.cpu_total_gb
    # This process: more than the interpreter alone, and what psutil says (within 64 MB).
    rss = psutil.Process().memory_info().rss / GB
    assert 0.05 < snap.process_rss_gb < snap.cpu_total_gb
    assert snap.process_rss_gb == pytest.approx(rss, abs=64 / 1024)
    assert snap.as_dict()["note"] == snap.note


@no_gpu
def test_engine_snapshot_is_recorded(engine):
    before = len(engine.memory.points())
    snap = engine.memory_snapshot()
    assert engine.memory.points()[-1] is snap
    assert len(engine.memory.points()) == min(before + 1, engine.memory.max_points)
    assert snap.gpus == [] and snap.note


def test_history_is_bounded_and_keeps_the_newest():
    history = MemoryHistory(max_points=5)
    recorded = [history.record() for _ in range(12)]
    points = history.points()
    assert len(points) == 5
    assert points == recorded[-5:]
    assert [p.time for p in points] == sorted(p.time for p in points)
    points.clear()  # a copy: the caller cannot empty the history
    assert len(history.points()) == 5


def test_the_largest_live_tensors_name_what_is_still_referenced():
    from model_utils.loading.memory_accounting import largest_live_tensors

    # 128 MB: larger than anything else the tests keep alive (the demo model, its caches)
    kept = torch.zeros(8192, 8192, dtype=torch.bfloat16)
    view = kept[:10]  # the same storage: named once, by the tensor it is cut from
    assert largest_live_tensors("cpu", top=1) == ["bfloat16 [8192, 8192] 0.125 GB on cpu"]
    assert "bfloat16 [10, 8192]" not in " ".join(largest_live_tensors("cpu", top=50))
    del kept, view


def test_fake_tensors_left_by_tracing_are_not_counted_and_raise_no_warning():
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    from model_utils.loading.memory_accounting import largest_live_tensors

    with FakeTensorMode():  # what torch.compile's tracing leaves behind: no memory of its own
        fake = torch.empty(16384, 16384, dtype=torch.bfloat16)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        listed = " ".join(largest_live_tensors("cpu", top=50))
    assert "[16384, 16384]" not in listed
    assert not [w for w in warned if "FakeTensor" in str(w.message)]  # its data_ptr warns
    del fake


def test_an_unload_is_reported_in_the_status_until_the_next_load(demo_path):
    from model_utils.engine import Engine
    from model_utils.loading.loaded_model import LoadRequest
    from model_utils.loading.placement import Placement

    engine = Engine()  # its own: the session's engine stays loaded for the tests after this
    engine.load(LoadRequest(model="demo", mode="fp32", placement=Placement("cpu")))
    assert "last_unload" not in engine.status()
    unloaded = engine.unload()["unloaded"]
    assert unloaded["model"].startswith("demo") and unloaded["leftover"] == {}
    assert engine.status()["last_unload"] == unloaded
