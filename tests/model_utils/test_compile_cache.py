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


def has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def tune_in_a_new_process(arg: str, env: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in env.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    done = subprocess.run([sys.executable, "-c", TUNE, arg], env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_a_folder_that_cannot_be_made_is_said_in_the_log_and_the_process_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    done = tune_in_a_new_process(str(blocker / "cache"), dict(os.environ))
    assert done.stdout.strip() == "unset"  # torch's own default
    # Without a GPU the app compiles nothing, and the folder is not even tried.
    assert ("cannot keep torch.compile's cache in" in done.stderr) == has_cuda()
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("given", ["-", "off", "mine"])
def test_the_app_keeps_the_cache_beside_its_other_data_unless_told(tmp_path, given):
    env = {k: v for k, v in os.environ.items() if k != "QWEN_CHAT_CACHE"}
    env["HOME"] = str(tmp_path / "home")
    arg = str(tmp_path / "mine") if given == "mine" else given
    done = tune_in_a_new_process(arg, env)
    folder = {"-": tmp_path / "home" / ".cache" / "qwen-chat" / "torch-compile",
              "off": None, "mine": tmp_path / "mine"}[given]
    if folder is not None and has_cuda():
        assert done.stdout.strip() == str(folder)
        assert folder.is_dir()
    else:  # off, or no GPU: torch's own default, and nothing made in the user's folders
        assert done.stdout.strip() == "unset"
        assert not (tmp_path / "home").exists() and not (tmp_path / "mine").exists()


def test_the_default_folder_follows_the_apps_data(tmp_path, monkeypatch):
    """$TORCHINDUCTOR_CACHE_DIR, else beside the demo model, trained models and chats:
    $QWEN_CHAT_CACHE, else ~/.cache/qwen-chat."""
    from model_utils.loading.demo_model import default_cache_dir
    from model_utils.runtime.compile_cache import default_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("QWEN_CHAT_CACHE", raising=False)
    assert default_dir() == tmp_path / "home" / ".cache" / "qwen-chat" / "torch-compile"
    assert default_dir().parent == default_cache_dir()
    monkeypatch.setenv("QWEN_CHAT_CACHE", str(tmp_path / "app-data"))
    assert default_dir() == tmp_path / "app-data" / "torch-compile"
    assert default_dir().parent == default_cache_dir()  # the demo model's folder's
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch's"))
    assert default_dir() == tmp_path / "torch's"
