"""Every test gets one kind marker, from what it uses, so that a run can pick a kind:

- browser: drives Chromium through Playwright (against the app server it starts);
- app: runs the app server or one of the project's commands (app.py, python -m model_utils,
  the bench, tools/load_test.py) as a separate process;
- unit: the rest, in this process (the engine on the demo model, the UI's code);
- gpu: needs CUDA; set by hand, and skipped with the reason on a machine without a GPU.

    ./test.sh -m unit                  # the quick ones
    ./test.sh -m "not browser"
"""

from __future__ import annotations

import functools
import logging
import types

import pytest

# Fixtures that start the app server, and names whose use by a test, its fixtures or the
# helpers they call means it starts a browser or another process.
APP_FIXTURES = {"start_app", "app_url"}
APP_NAMES = {"RunningApp", "subprocess", "Popen"}
BROWSER_NAMES = {"open_browser"}


def _names_used(function, seen: set | None = None) -> set[str]:
    """Global names a function refers to, with those of the test helpers it calls."""
    seen = set() if seen is None else seen
    code = getattr(function, "__code__", None)
    if code is None or code in seen:
        return set()
    seen.add(code)
    names: set[str] = set()
    stack = [code]
    while stack:  # the function and the functions nested in it (lambdas, comprehensions)
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    for name in list(names):
        helper = function.__globals__.get(name)
        if isinstance(helper, types.FunctionType) and helper.__module__.startswith("tests."):
            names |= _names_used(helper, seen)
    return names


def _functions(item: pytest.Item):
    if getattr(item, "function", None) is not None:
        yield item.function
    for defs in item._fixtureinfo.name2fixturedefs.values():
        for fixture_def in defs:
            yield fixture_def.func


@functools.cache
def _gpu_missing() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA GPU (none here)"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set().union(*(_names_used(f) for f in _functions(item)))
        if used & BROWSER_NAMES:
            item.add_marker(pytest.mark.browser)
        elif used & APP_NAMES or set(item.fixturenames) & APP_FIXTURES:
            item.add_marker(pytest.mark.app)
        else:
            item.add_marker(pytest.mark.unit)


def _without_capture_on_torch_trace() -> None:
    """pytest attaches its log capture to every logger that does not propagate, torch's
    structured-trace logger among them, which is always at DEBUG: torch.compile then builds
    every trace event (stacks included) and the capture keeps them for the whole test, hundreds
    per model load on a GPU (test_switch_memory's RSS grew by them: BENCHMARKS.md). The app
    attaches nothing there; the tests do as the app does."""
    trace = logging.getLogger("torch.__trace")
    for handler in list(trace.handlers):
        if type(handler).__module__.startswith("_pytest"):
            trace.removeHandler(handler)


# Innermost (trylast), so that pytest's logging wrapper has attached its handlers already.
@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_setup(item: pytest.Item):
    _without_capture_on_torch_trace()
    if item.get_closest_marker("gpu") and (reason := _gpu_missing()):
        pytest.skip(reason)
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_call(item: pytest.Item):
    _without_capture_on_torch_trace()
    return (yield)


@pytest.hookimpl(wrapper=True, trylast=True)
def pytest_runtest_teardown(item: pytest.Item):
    _without_capture_on_torch_trace()
    return (yield)


@pytest.fixture(scope="session", autouse=True)
def compile_cache_of_the_run(tmp_path_factory):
    """torch.compile's cache for this run (the app's default is under the user's home, which
    a test run leaves alone); the processes the tests start inherit it."""
    import os

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("torch-compile"))
    yield
