"""torch.compile's cache, kept where the app points it: a later process finds what an earlier
one compiled, and a changed graph misses. (On the GPU this is what makes a second switch to a
compiled mode warm; here inductor's CPU backend compiles a small function the same way.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

SCRIPT = r"""
import json, sys, torch
from model_utils.runtime import compile_cache
compile_cache.use_compile_cache(sys.argv[1])
size = int(sys.argv[2])
step = torch.compile(lambda x: torch.nn.functional.silu(x) * 2 + x.mean(), dynamic=False)
step(torch.randn(size))
print(json.dumps(compile_cache.counts()))
"""

needs_a_compiler = pytest.mark.skipif(
    shutil.which("g++") is None
    or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists(),
    reason="inductor's CPU backend needs g++ and Python's headers")


def compile_in_a_new_process(cache: Path, size: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(cache), str(size)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_a_compiler
def test_a_later_process_reuses_the_compiled_graph_and_a_new_shape_misses(tmp_path):
    cache = tmp_path / "compile-cache"
    assert compile_in_a_new_process(cache, 64) == {"hits": 0, "misses": 1}
    assert (cache / "fxgraph").is_dir()  # inductor wrote into the folder it was given
    assert compile_in_a_new_process(cache, 64) == {"hits": 1, "misses": 0}
    assert compile_in_a_new_process(cache, 96) == {"hits": 0, "misses": 1}


TUNE = r"""
import logging, os, sys
logging.basicConfig()
from model_utils import process_tuning
process_tuning.tune_process(compile_cache=None if sys.argv[1] == "-" else sys.argv[1])
print(os.environ.get("TORCHINDUCTOR_CACHE_DIR", "unset"))
"""


def test_a_folder_that_cannot_be_made_is_said_in_the_log_and_the_process_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", TUNE, str(blocker / "cache")], env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "unset"  # torch's own default
    assert "cannot keep torch.compile's cache in" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("given", ["-", "off", "mine"])
def test_the_app_keeps_the_cache_under_the_users_cache_folder_unless_told(tmp_path, given):
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "xdg")
    arg = str(tmp_path / "mine") if given == "mine" else given
    done = subprocess.run([sys.executable, "-c", TUNE, arg], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    expected = {"-": str(tmp_path / "xdg" / "qwen-chat" / "torch-compile"),
                "off": "unset", "mine": str(tmp_path / "mine")}[given]
    assert done.stdout.strip() == expected
    if given != "off":
        assert Path(expected).is_dir()
