"""The memory cards as they render for a GPU machine (this machine has none, so the snapshot is
built by hand from the engine's own dataclasses) and for a CPU-only one."""

from __future__ import annotations

from model_utils.memory import GpuMemory, MemorySnapshot
from ui.memory_panel import fmt_gb, memory_cards

STATUS = {"loaded": True, "model": "Qwen2.5-7B-Instruct (folder)", "mode": "nf4",
          "footprint_gb": 5.44, "device_map": {"cuda:0": {"layers": "0-27", "gb": 5.44}}}


def test_one_card_per_gpu_with_nvml_and_torch_figures():
    gpus = [GpuMemory(0, "NVIDIA H200", 20.5, 139.8, 5.5, 6.0),
            GpuMemory(1, "NVIDIA H200", None, 139.8, 0.0, 0.0)]
    html = memory_cards(MemorySnapshot(0.0, gpus, 12.0, 128.0, 3.2), STATUS)
    assert html.count("mem-card") == 4  # two GPUs, the CPU, the model
    assert "cuda:0 NVIDIA H200" in html and "20.50 GB / 139.80 GB" in html
    assert "torch allocated" in html and "5.50 GB" in html and "6.00 GB" in html
    assert "n/a / 139.80 GB" in html  # NVML unavailable for that device
    assert "5.44 GB (cuda:0 5.44 GB)" in html and "(nf4)" in html


def test_the_model_card_shows_its_caches_and_what_serving_holds():
    status = {**STATUS, "kv_cache_gb": 1.8047,
              "memory_stages": {"weights": {"allocated_gb": 5.451, "reserved_gb": 5.631,
                                            "peak_allocated_gb": 5.563},
                                "ready": {"allocated_gb": 7.43, "reserved_gb": 7.881,
                                          "peak_allocated_gb": 7.658}}}
    status["kv_blocks"] = {"total": 1000, "used": 10, "cached": 5, "free": 985,
                           "block_tokens": 16, "reused_tokens": 320, "preemptions": 0}
    html = memory_cards(MemorySnapshot(0.0, [], 12.0, 128.0, 3.2), status)
    assert "KV cache" in html and "1.80 GB" in html
    assert "160 in use, 80 cached for reuse, 15,760 free of 16,000" in html
    assert "320 prompt tokens reused" in html
    assert "ready to serve (allocated / reserved)" in html and "7.43 GB / 7.88 GB" in html
    assert "KV cache" not in memory_cards(MemorySnapshot(0.0, [], 12.0, 128.0, 3.2), STATUS)


def test_cpu_only_says_so():
    snapshot = MemorySnapshot(0.0, [], 1.5, 23.5, 0.45, note="no CUDA GPU on this machine")
    html = memory_cards(snapshot, {"loaded": False})
    assert "no CUDA GPU" in html and "none loaded" in html and "0.45 GB" in html


def test_small_sizes_in_megabytes():
    assert fmt_gb(0.0018) == "1.8 MB" and fmt_gb(2.5) == "2.50 GB" and fmt_gb(None) == "n/a"


def test_after_an_unload_the_model_card_says_whether_the_memory_came_back():
    snapshot = MemorySnapshot(0.0, [], 1.5, 23.5, 0.45)
    clean = {"loaded": False, "last_unload": {"model": "demo (bf16)", "leftover": {}}}
    assert "after unloading demo (bf16): <b>all memory came back" in memory_cards(snapshot, clean)
    held = {"loaded": False, "last_unload": {
        "model": "demo (nf4)", "leftover": {"cuda:0_allocated_gb": 0.034},
        "held_by": ["bfloat16 [4096, 4096] 0.031 GB on cuda:0"]}}
    html = memory_cards(snapshot, held)
    assert "cuda:0_allocated_gb 0.034 GB" in html and "[4096, 4096] 0.031 GB on cuda:0" in html
