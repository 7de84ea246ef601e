"""The command line of `python -m model_utils` (cli.py): its flags, and the input they give,
checked before anything heavy is imported.

The engine's flags (--models-dir, --trust-remote-code), the model flags (--model, --mode,
--placement) and the sampling flags (--temperature ...) are declared once, in engine_config.py
and runtime/generation_settings.py, and shared with app.py and the benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .engine_config import EngineConfig, add_model_args
from .runtime.generation_settings import add_setting_flags, settings_from_args

EXIT_REFUSED = 2


class UsageError(Exception):
    """Bad input caught by the CLI itself (flags, files); exits 2 with the message."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own: usage block + message; here one line
        self.exit(EXIT_REFUSED, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m model_utils",
                     description="Headless chat with a local causal LM through the engine.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{chat,prompt}")

    def common_flags(p, *, mode: bool):
        add_model_args(p, mode=mode, note="; a folder named here may be read even outside those")
        EngineConfig.add_cli_args(p, only=("models_dir", "trust_remote_code"))
        given = p.add_mutually_exclusive_group(required=True)
        given.add_argument("--prompt", help="one user message")
        given.add_argument("--messages", type=Path,
                           help="JSON file: a list of {role, content} messages, or an object "
                                "with a 'messages' list")
        p.add_argument("--system", help="system prompt (replaces any system message in the list)")
        p.add_argument("--no-thinking", action="store_true",
                       help="Qwen3: answer without a reasoning block (enable_thinking=False)")
        p.add_argument("-v", "--verbose", action="store_true",
                       help="show library logs, warnings and tracebacks on stderr")

    chat = commands.add_parser("chat", help="stream one reply", description=(
        "Load a model and stream one reply to stdout (reasoning between <think> and </think>)."))
    common_flags(chat, mode=True)
    chat.add_argument("--max-memory", action="append", default=[], metavar="DEVICE=GB",
                      help="cap for one device, e.g. cuda:0=20 or cpu=64 (repeatable)")
    chat.add_argument("--offload-folder", help="let weights that fit nowhere go to this folder")
    chat.add_argument("--compute-dtype", default="bf16", choices=("bf16", "fp16", "fp32"),
                      help="compute dtype of the 4-bit and weight-only modes (default: bf16)")
    EngineConfig.add_cli_args(chat, only=("tp",))
    add_setting_flags(chat.add_argument_group("sampling"))
    chat.add_argument("--json", action="store_true",
                      help="print one JSON object at the end instead of streaming text")
    chat.add_argument("--stats", action="store_true",
                      help="after the reply, one line of stats on stderr")

    prompt = commands.add_parser("prompt", help="print the prompt text the model would receive",
                                 description="Print exactly the prompt the chat path renders "
                                             "(loads the tokenizer only).")
    common_flags(prompt, mode=False)
    # The reply's length decides how much of a long conversation is kept.
    add_setting_flags(prompt, only=("max_new_tokens",))
    return parser


# -- reading the input --------------------------------------------------------------------------
def read_messages(args) -> list[dict]:
    if args.prompt is not None:
        return [{"role": "user", "content": args.prompt}]
    path: Path = args.messages
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise UsageError(f"cannot read messages file {str(path)!r}: "
                         f"{error.strerror or error}") from None
    except UnicodeDecodeError:
        raise UsageError(f"messages file {str(path)!r} is not UTF-8 text") from None
    except json.JSONDecodeError as error:
        raise UsageError(f"messages file {str(path)!r} is not valid JSON: {error.msg} "
                         f"(line {error.lineno}, column {error.colno})") from None
    if isinstance(data, dict) and "messages" in data:
        data = data["messages"]
    if not isinstance(data, list) or not data:
        raise UsageError(f"messages file {str(path)!r} must hold a non-empty JSON list of "
                         "messages, or an object with a 'messages' list")
    return data


def requested_settings(args):
    """GenerationSettings from the flags, the given values checked before any model loads
    (InvalidParameter). Unset values are the model's defaults, known only once it is loaded.
    A max_new_tokens longer than the context window leaves is not an error: the engine limits
    the reply to what fits, with a note on stderr."""
    return settings_from_args(args)


def requested_placement(args):
    from .loading.placement import Placement

    caps = {}
    for item in args.max_memory:
        device, sep, gb = item.partition("=")
        try:
            value = float(gb)
        except ValueError:
            value = float("nan")
        if not sep or not device.strip() or not value > 0 or value == float("inf"):
            raise UsageError(f"--max-memory {item!r}: expected DEVICE=GB with GB > 0, "
                             "e.g. cuda:0=20 or cpu=64")
        caps[device.strip()] = value
    target = args.placement
    if not target:
        import torch

        target = "auto" if torch.cuda.is_available() else "cpu"
    return Placement(target=target, max_memory_gb=caps, offload_folder=args.offload_folder)
