"""Start the chat app: flags -> logging -> engine -> initial model -> UI -> launch.

    python app.py                          # the demo model on http://127.0.0.1:7860
    python app.py --model /models/Qwen2.5-7B-Instruct --mode nf4
    python app.py --share --auth me:secret --admin me
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import logging.handlers
import socket
import sys
from pathlib import Path

from model_utils.backends.flags import add_backend_flags, check_backend_flags, remote_engine
from model_utils.backends.urls import redact
from model_utils.engine_config import EngineConfig, add_model_args
from model_utils.engine_factory import build_engine

log = logging.getLogger("app")

LOOPBACK_NAMES = {"localhost"}
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# The engine's options this app takes (the bench's --no-compile / --compiled-rows are not).
# What names the local model: left out of the start line with --backend.
LOCAL_MODEL_FLAGS = ("model", "mode", "placement", "context_tokens", "compile_cache",
                     "compile_mode", "models_dir", "trust_remote_code")
APP_ENGINE_FLAGS = ("models_dir", "log_prompts", "trust_remote_code", "max_queue", "max_batch",
                    "compile_mode", "compile_while_idle", "park_gb")
# The app's own defaults for engine options. Compiling while idle: a switch is ready in seconds
# instead of waiting for torch.compile (BENCHMARKS.md, "Switching modes"); the engine's own
# default (a library user's, the tests') compiles at load.
APP_ENGINE_DEFAULTS = {"compile_while_idle": (True, None)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Local chat app for Qwen / Hugging Face causal LMs.")
    add_model_args(p, what="model to load at start",
                   note="; a folder named here may be loaded even outside those")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind; anything but loopback needs --auth")
    p.add_argument("--port", type=port_number, default=7860, help="port to serve on")
    p.add_argument("--share", action="store_true",
                   help="also open a public gradio.live link (needs --auth)")
    p.add_argument("--auth", action="append", default=[], metavar="USER:PASSWORD",
                   help="a login for the page and the API; repeat for more users")
    p.add_argument("--auth-file", metavar="PATH",
                   help="file of logins, one user:password per line (# comments allowed)")
    p.add_argument("--admin", metavar="USER",
                   help="only this logged-in user may load, unload or switch models")
    p.add_argument("--log-file", default="server.log",
                   help="rotating log file (default server.log)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="without logins, also answer requests for this Host name (besides "
                        "localhost, 127.0.0.1, ::1 and --host); repeat for more")
    p.add_argument("--shutdown-grace", type=float, default=5.0, metavar="SECONDS",
                   help="on SIGTERM/SIGINT, how long open replies may go on before they are "
                        "ended with an error (default 5)")
    p.add_argument("--compile-cache", metavar="DIR|off",
                   help="folder for torch.compile's caches, so that a mode compiled once loads "
                        "faster in later runs (default: $TORCHINDUCTOR_CACHE_DIR, else "
                        "torch-compile in $QWEN_CHAT_CACHE, else ~/.cache/qwen-chat/torch-compile; "
                        "off: torch's own, in the temp folder); unused without a CUDA GPU")
    p.add_argument("--chat-store", metavar="PATH",
                   help="with logins, the SQLite file that keeps each user's chats and presets "
                        "(default: chats.sqlite3 in $QWEN_CHAT_CACHE, else ~/.cache/qwen-chat); "
                        "without logins each browser keeps its own")
    EngineConfig.add_cli_args(p, only=APP_ENGINE_FLAGS, defaults=APP_ENGINE_DEFAULTS)
    add_backend_flags(p)
    return p


def port_number(text: str) -> int:
    """argparse's type for --port: a TCP port, 1-65535 (the socket's bind refused any other
    with a traceback, after the model had loaded)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number from 1 to 65535, got {port}")
    return port


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def read_logins(args: argparse.Namespace, parser_error):
    """The logins of --auth and --auth-file (server.logins.Logins: the file is read again
    whenever it changes); a bad line at start is a flag error."""
    from server.logins import Logins, parse_logins

    fixed, problems = parse_logins("\n".join(args.auth), "--auth")
    problems = ["--auth: expected user:password" for _ in problems]
    from_file = []
    if args.auth_file:
        try:
            text = Path(args.auth_file).read_text(encoding="utf-8")
        except OSError as error:
            parser_error(f"--auth-file: cannot read {args.auth_file}: {error.strerror}")
        from_file, file_problems = parse_logins(text, "--auth-file")
        problems += file_problems
    if problems:
        parser_error(problems[0])
    return Logins(fixed, args.auth_file, from_file)


def open_chat_store(args: argparse.Namespace, logins, parser_error):
    """With logins, the store of every user's chats (a file that cannot be read is refused
    here, before anything is served, and left as it is); without logins, None: each browser
    keeps its own chats."""
    from server.chat_store import ChatStore, ChatStoreError, default_store_path

    if not logins:
        if args.chat_store:
            log.info("--chat-store is used with logins only: without them each browser "
                     "keeps its own chats")
        return None
    try:
        return ChatStore(args.chat_store or default_store_path())
    except ChatStoreError as error:
        parser_error(f"--chat-store: {error}")


def engine_config_of(args: argparse.Namespace, parser_error) -> EngineConfig:
    """The engine's options from the flags, refused by flag name (--max-batch 0) at once."""
    from model_utils.errors import InvalidParameter

    try:
        return EngineConfig.from_args(args)
    except InvalidParameter as error:
        parser_error(f"--{error.name.replace('_', '-')}: {error.message}")


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: assume it is reachable from outside


def check_exposure(args: argparse.Namespace, logins: list, parser_error) -> None:
    """A page reachable from other machines is never open without a login."""
    if (args.share or not is_loopback(args.host)) and not logins:
        what = "--share" if args.share else f"--host {args.host}"
        parser_error(f"{what} makes the app reachable from other machines: add --auth "
                     "USER:PASSWORD (or --auth-file) so that it is not open to anyone")
    if args.admin and not logins:
        parser_error("--admin needs logins: add --auth USER:PASSWORD (or --auth-file)")
    if args.admin and args.admin not in {user for user, _ in logins}:
        parser_error(f"--admin {args.admin}: no such user among the --auth logins")


def setup_logging(log_file: str) -> None:
    formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    file_handler = logging.handlers.RotatingFileHandler(
        log_file, maxBytes=10 * 2**20, backupCount=3, encoding="utf-8")
    console = logging.StreamHandler(sys.stderr)
    for handler in (file_handler, console):
        handler.setFormatter(formatter)
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    root.addHandler(file_handler)
    root.addHandler(console)
    # Every gradio_client or share-server request would be an INFO line; keep the log readable.
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def port_unavailable(host: str, port: int) -> str | None:
    """Why the app could not listen on host:port now, or None."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.create_server((host, port), family=family):
            return None
    except OSError as error:
        return error.strerror or str(error)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logins = read_logins(args, _parser_error)
    check_exposure(args, logins, _parser_error)
    if not 0 <= args.shutdown_grace <= 3600:  # also refuses nan
        _parser_error(f"--shutdown-grace must be between 0 and 3600 s, got {args.shutdown_grace}")
    check_backend_flags(args, _parser_error)
    engine_config = engine_config_of(args, _parser_error)
    setup_logging(args.log_file)
    chat_store = open_chat_store(args, logins, _parser_error)
    config = {k: v for k, v in vars(args).items() if k not in ("auth", "auth_file",
                                                                 "backend_key")}
    config["backend"] = args.backend and redact(args.backend)  # no user:password@ in the log
    if args.backend:  # the model server's model serves: this app loads none of its own
        config = {k: v for k, v in config.items() if k not in LOCAL_MODEL_FLAGS}
    config["logins"] = sorted(logins.users())  # user names only, never passwords
    log.info("starting with %s", config)

    if reason := port_unavailable(args.host, args.port):
        # Checked before the model loads: a 14B load is a long wait for a taken port.
        log.error("cannot serve on %s:%s: %s", args.host, args.port, reason)
        return 1

    from server.uploads import MAX_UPLOAD, private_upload_dir, remove_upload_dir

    upload_dir = private_upload_dir()  # before gradio is imported: it reads the folder then
    if upload_dir is not None:
        log.info("uploads are kept in %s (private to this user, removed at shutdown)",
                 upload_dir)
    # Heavy imports after the checks: --help and refused flags answer at once.
    from fastapi import APIRouter

    import ui
    from model_utils import process_tuning

    if not args.backend:  # allocator, GC, warnings and the compile cache of a local model
        process_tuning.tune_process(compile_cache=args.compile_cache)
    engine = remote_engine(args) if args.backend else build_engine(engine_config)
    if not args.backend:
        engine.registry.allow_named_folder(args.model)
    info = ui.AppInfo()
    if not args.backend:  # a model server's models are loaded there
        load_initial_model(engine, args, info)
    else:
        log_model_server(engine)
    engine.start_memory_sampler()  # one history for every page, however many are open

    demo = ui.build(engine, admin=args.admin, info=info, logout=bool(logins),
                    chat_store=chat_store)
    # gradio switches matplotlib's backend around every event; done first inside a request,
    # the import (and, on a new machine, building matplotlib's font cache) stalled that
    # request's server for 0.4-0.9 s. Pay it here, before serving.
    import matplotlib.pyplot  # noqa: F401
    # The engine keeps its own bounded queue and answers "busy" past it, so gradio lets every
    # request through to it (the reply handlers' concurrency is max_batch + max_queue).
    reply_slots = ui.reply_concurrency(engine)
    demo.queue(max_size=reply_slots + 16, default_concurrency_limit=1)
    # The OpenAI-compatible routes are handed to the FastAPI app that launch() builds, so they
    # exist before the port opens; added after launch(), a client that came at once got 404.
    openai_routes = APIRouter()
    ui.register_openai_api(openai_routes, engine, logins)
    try:
        _, local_url, share_url = demo.launch(
            server_name=args.host, server_port=args.port, share=args.share,
            auth=logins.check if logins else None, auth_message=ui.LOGIN_MESSAGE, prevent_thread_lock=True,
            ssr_mode=False, css=ui.CSS, max_threads=reply_slots + 40,
            # The guards (guards.py) run before any route; both are in place before the port
            # opens. The queue's event streams are watched for clients that leave mid-reply.
            app_kwargs={"routes": openai_routes.routes,
                        "middleware": [ui.request_guard(logins, served_hosts(args)),
                                       ui.queue_stream_watch()]},
            footer_links=["api", "settings"], max_file_size=MAX_UPLOAD,
            # gradio's own start lines repeat the URL logged below and advise share=True, which
            # this app allows only with --auth: the console shows this app's lines only.
            quiet=True)
    except OSError as error:  # the port is taken, or the address is not this machine's
        log.error("cannot serve on %s:%s: %s", args.host, args.port, error)
        remove_upload_dir(upload_dir)
        return 1
    log.info("serving on %s", local_url)
    process_tuning.serving_started()  # the web server's objects: no long GC pauses either
    if args.share:
        if share_url:
            log.info("public share link: %s", share_url)
            info.share_note = f"public link {share_url} (login required)"
        else:
            note = (f"the public share link could not be created (no connection to the "
                    f"gradio share server?); serving locally only at {local_url}")
            log.warning(note)  # the console handler shows it too
            info.share_note = note
    from server.shutdown import shut_down, wait_for_signal

    why = wait_for_signal()
    shut_down(engine, demo, why=why, grace_s=args.shutdown_grace)
    remove_upload_dir(upload_dir)
    return 0


def served_hosts(args: argparse.Namespace) -> set[str]:
    """The Host names answered without logins: loopback's, the bound host's, --allowed-host."""
    return {*LOOPBACK_HOSTS, args.host.lower(), *(h.lower() for h in args.allowed_host)}


def load_initial_model(engine, args, info) -> None:
    """Load --model before serving; on failure serve anyway and show the error on the page."""
    import gradio as gr

    from model_utils.errors import LoadError
    from server.model_actions import default_placement, make_request

    try:
        request = make_request(model=args.model, mode=args.mode,
                               placement=args.placement or default_placement(),
                               context_tokens=args.context_tokens)
        status = engine.load(request, progress=lambda f, msg: log.info("load %3.0f%% %s",
                                                                       f * 100, msg))
        log.info("initial model ready: %s %s on %s", status["model"], status["mode"],
                 status["placement"])
    except (LoadError, gr.Error) as error:  # gr.Error: make_request refused a flag
        message = getattr(error, "message", None) or str(error)
        info.startup_error = message
        log.error("initial model did not load: %s; serving without a model", message)


def log_model_server(engine) -> None:
    """The start line of --backend: the server and the model it serves (as the page names
    it), or why it does not yet."""
    status = engine.status()
    if status["loaded"]:
        log.info("serving %s from the model server %s (context %s tokens)", status["model"],
                 status["backend_url"], status["context_tokens"] or "not reported")
    else:
        log.warning("the model server %s serves nothing now (%s); serving anyway and checking "
                    "again", status["backend_url"], status["health"].get("error") or "down")


def _parser_error(message: str) -> None:
    """Like argparse's error: the message on stderr, exit status 2."""
    print(f"app.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


if __name__ == "__main__":
    sys.exit(main())
