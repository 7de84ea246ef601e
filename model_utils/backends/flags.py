"""The --backend flags of app.py, and the RemoteEngine they describe.

Kept apart from remote.py so that app.py can declare the flags (and answer --help) without
importing torch or httpx.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "model server", "serve the models of an OpenAI-compatible server (vLLM, SGLang, TGI, "
        "Ollama, another instance of this app) instead of loading one here")
    group.add_argument("--backend", metavar="URL",
                       help="its base URL, e.g. http://gpu-node:8000/v1; --model, --mode and "
                            "--placement then do not apply")
    group.add_argument("--backend-key", metavar="KEY",
                       help="API key sent to it as a bearer token (visible in the process "
                            "list: prefer --backend-key-file)")
    group.add_argument("--backend-key-file", metavar="PATH",
                       help="file whose first line is that key")
    group.add_argument("--backend-model", metavar="NAME",
                       help="which of its models replies (default: the first it lists)")
    group.add_argument("--backend-connect-timeout", type=float, default=5.0, metavar="S",
                       help="seconds to reach it (default 5)")
    group.add_argument("--backend-read-timeout", type=float, default=120.0, metavar="S",
                       help="seconds it may go without sending a complete line within a "
                            "reply, the wait for the first token included; bytes trickled "
                            "without a newline do not count (default 120)")
    group.add_argument("--backend-reply-timeout", type=float, default=1800.0, metavar="S",
                       help="seconds one whole reply may take, held mid-line too "
                            "(default 1800)")


def backend_key(args: argparse.Namespace, parser_error) -> str | None:
    if args.backend_key and args.backend_key_file:
        parser_error("give --backend-key or --backend-key-file, not both")
    if args.backend_key_file:
        try:
            lines = Path(args.backend_key_file).read_text(encoding="utf-8").splitlines()
        except OSError as error:
            parser_error(f"--backend-key-file: cannot read {args.backend_key_file}: "
                         f"{error.strerror}")
        key = lines[0].strip() if lines else ""
        if not key:
            parser_error(f"--backend-key-file: {args.backend_key_file} is empty")
        return key
    return args.backend_key or None


def check_backend_flags(args: argparse.Namespace, parser_error) -> None:
    """Refuse what cannot work before anything starts (the key itself is read here too)."""
    if not args.backend:
        if args.backend_key or args.backend_key_file or args.backend_model:
            parser_error("--backend-key, --backend-key-file and --backend-model need --backend")
        return
    from .urls import normalize_url

    try:
        args.backend = normalize_url(args.backend)
    except ValueError as error:
        parser_error(f"--backend: {error}")
    for name in ("connect", "read", "reply"):
        if not getattr(args, f"backend_{name}_timeout") > 0:
            parser_error(f"--backend-{name}-timeout must be a number of seconds > 0")
    if args.max_batch < 1 or args.max_queue < 0:
        parser_error("--max-batch must be >= 1 and --max-queue >= 0")
    args.backend_key = backend_key(args, parser_error)


def remote_engine(args: argparse.Namespace):
    """The RemoteEngine for checked flags; with --backend, --max-batch + --max-queue bound
    the replies in flight to the server."""
    from .openai_client import ServerConfig
    from .remote import RemoteEngine

    config = ServerConfig(args.backend, key=args.backend_key,
                          connect_timeout_s=args.backend_connect_timeout,
                          read_timeout_s=args.backend_read_timeout,
                          reply_timeout_s=args.backend_reply_timeout)
    return RemoteEngine(config, model=args.backend_model, max_batch=args.max_batch,
                        max_queue=args.max_queue, log_prompts=args.log_prompts)
