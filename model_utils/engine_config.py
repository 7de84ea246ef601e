"""The engine's own options, declared once: EngineConfig, its command-line flags and their help.

app.py, the CLI (`python -m model_utils`) and the benchmark (`python -m model_utils.bench`)
each take the flags that apply to them from here (`EngineConfig.add_cli_args(parser,
only=...)`), read them back with `EngineConfig.from_args(args)` and build the engine with
`engine_factory.build_engine(config)`, which hands the config whole to the engine; the defaults
live here only, and a value no engine can serve with is refused as the config is made. The
model-choice flags shared by the three (--model, --mode, --placement)
are `add_model_args`. So the help texts cannot drift apart between the tools.

No torch here: `python app.py --help` and refused flags answer without importing it.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from typing import Any

# torch.compile modes offered for the fast path's decode step (cuda_graphs.GraphedBatchStep
# compiles in one of them). The autotuned one benchmarks matmul kernels for each shape while
# warming up; see the help text below.
COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
MAX_BATCH_LIMIT = 64  # rows of one decode step (the scheduler's and the CUDA graphs' bound)


def _flag(help: str, **argparse_kwargs) -> Any:
    """Field metadata: the flag's help (its default is appended) and argparse's options."""
    return {"help": help, "argparse": argparse_kwargs}


@dataclass(frozen=True)
class EngineConfig:
    """What the engine is built with (the keyword arguments of model_utils.engine.Engine)."""

    models_dir: str | None = field(default=None, metadata=_flag(
        "folder whose model subfolders are offered in the model list and may be loaded",
        metavar="PATH"))
    trust_remote_code: bool = field(default=False, metadata=_flag(
        "let model repos run their own Python code; command line only, no UI or API can turn "
        "it on"))
    log_prompts: bool = field(default=False, metadata=_flag(
        "also write prompts and replies to the log"))
    max_batch: int = field(default=8, metadata=_flag(
        "most chat replies decoded together as one batch, 1-64", metavar="N"))
    max_queue: int = field(default=64, metadata=_flag(
        "most chat requests waiting for a place in the batch; one more is refused with "
        "\"busy, try again shortly\"", metavar="N"))
    compile: bool = field(default=True, metadata=_flag(
        "decode on the eager path: no torch.compile, no CUDA graphs", flag="--no-compile"))
    compile_mode: str = field(default="default", metadata=_flag(
        "torch.compile mode of the GPU decode step; max-autotune-no-cudagraphs benchmarks "
        "kernels at load (about a minute slower) and was not reliably faster on an H200 "
        "(BENCHMARKS.md)", choices=COMPILE_MODES))
    compiled_rows: int | None = field(default=None, metadata=_flag(
        "batched steps of up to this many rows are torch.compile'd before capture, larger "
        "ones capture the plain forward (64: compile all; rows 2 and up share one "
        "compilation)", metavar="N", shown="every batch size: the compiled step was faster "
        "than the plain forward's graph at every row count measured, for Qwen3.5 and the 7B "
        "shape, bf16 and int4-wo (BENCHMARKS.md)"))
    compile_while_idle: bool = field(default=False, metadata=_flag(
        "a load whose decode step was not compiled in this process yet is ready before the "
        "compiling: replies decode on CUDA graphs of the plain forward at first, and the "
        "compiled step is built and captured while no reply decodes (a reply, a load, an "
        "unload or a fit estimate that comes meanwhile waits for it to end), then kept where "
        "it is faster"))
    park_gb: int = field(default=0, metadata=_flag(
        "host memory (GB) where a mode switch keeps the model it replaces, so that switching "
        "back takes its weights from there instead of reading the checkpoint again; not "
        "LLM.int8 (int8); an unload frees them; 0: off", metavar="GB"))
    tp: int = field(default=1, metadata=_flag(
        "split the model over N worker processes that the engine starts itself (tensor "
        "parallelism: attention heads and MLP columns; gloo on the CPU, NCCL with one GPU per "
        "worker); fp32/bf16/fp16 only, one reply at a time on the eager path", metavar="N"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                     only: Iterable[str] | None = None,
                     defaults: dict[str, tuple[Any, str]] | None = None) -> None:
        """Add the flags of the fields named in `only` (all by default). `defaults` gives a
        tool its own default for a field, as (value, how --help shows it)."""
        names = [f.name for f in fields(cls)] if only is None else list(only)
        by_name = {f.name: f for f in fields(cls)}
        for name in names:
            spec = by_name[name]  # KeyError: not an engine option
            options = dict(spec.metadata["argparse"])
            flag = options.pop("flag", "--" + name.replace("_", "-"))
            own_shown = options.pop("shown", None)
            value, shown = (defaults or {}).get(name, (spec.default, own_shown))
            if spec.type in (bool, "bool"):
                # Off unless given (--trust-remote-code), or on unless turned off (--no-compile).
                help = spec.metadata["help"]
                if value and not flag.startswith("--no-"):  # a tool's own default: on
                    flag, help = "--no-" + flag[2:], f"turn off what is on by default: {help}"
                elif not value and flag.startswith("--no-"):  # its help says what --no- does
                    raise ValueError(f"{name}: a tool default of off needs a flag of its own")
                action = "store_false" if flag.startswith("--no-") else "store_true"
                parser.add_argument(flag, dest=name, action=action, default=bool(value),
                                    help=help)
                continue
            kind = int if spec.type in (int, "int", "int | None") else str
            shown = shown or ("none" if value is None else str(value))
            parser.add_argument(flag, dest=name, type=kind, default=value,
                                help=f"{spec.metadata['help']} (default: {shown})".replace(
                                    "%", "%%"), **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config from parsed flags; fields the parser did not declare keep their
        defaults, and `overrides` win over both."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    def __post_init__(self):
        """Refuse limits no engine can serve with, before anything is loaded."""
        from .errors import InvalidParameter

        if not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= MAX_BATCH_LIMIT:
            raise InvalidParameter("max_batch", f"must be between 1 and {MAX_BATCH_LIMIT}, "
                                                f"got {self.max_batch}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise InvalidParameter("max_queue", f"must be 0 or more, got {self.max_queue}")
        if not isinstance(self.park_gb, int) or self.park_gb < 0:
            raise InvalidParameter("park_gb", f"must be 0 (off) or more GB, got {self.park_gb}")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise InvalidParameter("tp", f"must be 1 or more worker processes, got {self.tp}")
        if self.compile_mode not in COMPILE_MODES:
            raise InvalidParameter("compile_mode", f"must be one of {', '.join(COMPILE_MODES)}, "
                                                   f"got {self.compile_mode!r}")

def add_model_args(parser: argparse.ArgumentParser, *, what: str = "model to load",
                   note: str = "", mode: bool = True,
                   placement_default: str = "auto with a GPU, else cpu",
                   context: bool = True, context_default: int | None = None) -> None:
    """--model, --mode, --placement and --context-tokens, with one help text for every tool."""
    from .loading.modes import MODES  # the one table of modes (no torch), so the help cannot drift

    parser.add_argument("--model", default="demo", help=(
        f"{what}: 'demo', a folder under --models-dir or another allowed folder, or a hub id "
        f"already in the local Hugging Face cache (default: demo){note}"))
    if mode:
        parser.add_argument("--mode", default="bf16", type=mode_name,
                            help=f"precision mode: {', '.join(MODES)} (default: bf16)")
    parser.add_argument("--placement", default=None, type=placement_name, help=(
        f"cpu, cuda:N, auto, balanced, balanced_low_0 or sequential (default: "
        f"{placement_default})"))
    if context:
        shown = context_default or "the model's own, or the most that fits beside its weights"
        parser.add_argument("--context-tokens", type=positive_int, metavar="N",
                            default=context_default,
                            help=f"context window in tokens (default: {shown})")


def mode_name(text: str) -> str:
    """argparse's type for --mode: a mode's name. Refused here, a typo would have started the
    app serving no model (the start-up load fails, and the app serves on without one)."""
    from .loading.modes import MODES

    if text not in MODES:
        raise argparse.ArgumentTypeError(
            f"unknown mode {text!r}; choose one of: {', '.join(MODES)}")
    return text


def placement_name(text: str) -> str:
    """argparse's type for --placement: the name of a placement (cpu, cuda:N or a strategy).
    Whether this machine has that GPU is the load's business, which says so on the page."""
    from .loading.placement import STRATEGIES

    index = text.removeprefix("cuda:")
    if text != "cpu" and text not in STRATEGIES and not (text != index and index.isdigit()):
        raise argparse.ArgumentTypeError(
            f"unknown placement {text!r}; choose cpu, cuda:N (N: the GPU's number) or one of: "
            f"{', '.join(STRATEGIES)}")
    return text


def positive_int(text: str) -> int:
    """argparse's type for a count of 1 or more."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value
