"""The headless command line: chat with a model, or print the prompt it would receive.

    python -m model_utils chat --model demo --mode nf4 --placement cpu --prompt "Hello"
    python -m model_utils chat --model demo --prompt "Hello" --json
    python -m model_utils prompt --model demo --messages conv.json

`chat` streams the reply to stdout as it is generated; reasoning (Qwen3 thinking) comes first,
between <think> and </think>, the answer after it. With --json nothing is streamed: one JSON
object is printed at the end (text, reasoning, token counts, timings, mode, placement, model).
`prompt` prints exactly the text the chat path feeds the model for an OpenAI-style messages
list (a JSON list, or an object with a "messages" list); it loads only the tokenizer.

Exit status: 0 done; 2 refused, with one line on stderr (a bad flag, an unknown model or mode,
a folder that holds no model, a setting out of range, an unreadable messages file, a load that
failed or does not fit); 1 an unexpected error (one line; --verbose adds the
traceback); 130 interrupted. Library logs, warnings and loading bars are kept off stderr unless
--verbose is given.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import warnings
from dataclasses import replace

from .cli_args import (
    EXIT_REFUSED,
    UsageError,
    build_parser,
    read_messages,
    requested_placement,
    requested_settings,
)
from .engine_config import EngineConfig
from .engine_factory import build_engine

EXIT_ERROR = 1
EXIT_INTERRUPTED = 130
# After Ctrl-C, how long to wait for the decode worker to finish its step before exiting.
INTERRUPT_WAIT_S = 30.0

def _quiet_libraries(verbose: bool) -> None:
    """Keep stderr for our own one-line messages: no loading bars, library logs or warnings.

    Called before transformers is imported, so the environment variables take effect.
    """
    if verbose:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(levelname)s %(name)s: %(message)s")
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # A handler on the root logger stops Python's last-resort printing of WARNING records from
    # loggers nobody configured (bitsandbytes' "kernels" notice, the manager's load errors,
    # which the exception already reports).
    logging.getLogger().addHandler(logging.NullHandler())
    warnings.simplefilter("ignore")


def _quiet_transformers(verbose: bool) -> None:
    if verbose:
        return
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


# -- the commands -------------------------------------------------------------------------------
class StreamPrinter:
    """Writes each update's new text as it arrives: <think>\\nreasoning\\n</think>\\n\\nanswer.

    Trailing newlines of the reasoning are held back while it is open: split_reasoning strips
    them once </think> arrives, and text already printed cannot be taken back.
    """

    def __init__(self, out):
        self.out = out
        self.part = ""  # "" (nothing yet), "reasoning" or "answer"
        self.newlines = 0  # held at the reasoning's end
        self.wrote = False
        self.line_open = False  # the last character written was not a newline

    def update(self, reasoning: str = "", answer: str = "", done: bool = False, *,
               resplit: bool = False) -> None:
        new = []
        if resplit and self.wrote:
            # The answer printed so far was reasoning after all (a stray </think>): go on on
            # a new line with the split as it is now (the --json result has it too).
            new.append("\n")
            self.part, self.newlines = "", 0
        if reasoning:
            if not self.part:
                new.append("<think>\n")
                self.part = "reasoning"
            body = reasoning.rstrip("\n")
            if body:
                new.append("\n" * self.newlines + body)
                self.newlines = len(reasoning) - len(body)
            else:
                self.newlines += len(reasoning)
        if answer or (done and self.part == "reasoning"):
            if self.part == "reasoning":
                new.append("\n</think>\n\n")
                self.newlines = 0
            self.part = "answer"
            new.append(answer)
        text = "".join(new)
        if done and (not text.endswith("\n") if text else self.line_open):
            text += "\n"  # end the last line, when there is one
        if text:
            self.out.write(text)
            self.out.flush()
            self.wrote = True
            self.line_open = not text.endswith("\n")


def named_model_registry(args):
    """The registry with the folder named by --model allowed (the operator named it)."""
    from .loading.registry import ModelRegistry

    registry = ModelRegistry(args.models_dir)
    registry.allow_named_folder(args.model)
    return registry


def cmd_chat(args) -> int:
    from .chat.prompt import normalize_messages

    messages = read_messages(args)
    normalize_messages(messages, args.system)  # a malformed message is refused right away
    # An unknown model is refused here, before torch and transformers are imported
    # (seconds); the engine resolves the name again to load it. A folder named here is allowed.
    named_model_registry(args).resolve(args.model)
    settings = requested_settings(args)
    placement = requested_placement(args)
    _quiet_transformers(args.verbose)
    from model_utils.loading.loaded_model import LoadRequest

    engine = build_engine(EngineConfig.from_args(args))
    engine.registry.allow_named_folder(args.model)
    request = LoadRequest(model=args.model, mode=args.mode, placement=placement,
                          compute_dtype=args.compute_dtype, context_tokens=args.context_tokens)
    try:
        return _load_and_reply(engine, request, messages, settings, args)
    except KeyboardInterrupt:
        # The forward passes run on the engine's worker thread. Leaving now would shut the
        # interpreter down under a pass in progress, which crashes the process (SIGSEGV seen
        # in an int8 matmul). engine.chat set its stop signal on the way out, so the worker
        # ends the reply within one step; wait for that (a second Ctrl-C still exits at once),
        # at most INTERRUPT_WAIT_S, so that a worker busy with something else cannot hang us.
        worker = getattr(engine, "worker", None)
        if worker is not None:
            import threading

            waiter = threading.Thread(target=worker.call, args=(lambda: None,), daemon=True)
            waiter.start()
            waiter.join(INTERRUPT_WAIT_S)
        raise
    finally:
        close = getattr(engine, "close", None)  # --tp: stop the worker processes now
        if close is not None:
            close()


def _load_and_reply(engine, request, messages, settings, args) -> int:
    status = engine.load(request)
    # Fill the unset values from the model's generation_config here (rather than inside chat)
    # so that --json can report the settings the reply really used.
    defaults = engine.default_settings()
    settings = replace(settings, **{s.name: getattr(defaults, s.name) for s in settings.SCHEMA
                                    if getattr(settings, s.name) is None})
    printer = None if args.json else StreamPrinter(sys.stdout)
    final = None
    notice_shown = False
    for update in engine.chat(messages, settings, system_prompt=args.system,
                              thinking=not args.no_thinking):
        if update.notice and not notice_shown and not args.json:
            print(f"note: {update.notice}", file=sys.stderr, flush=True)
            notice_shown = True
        if printer:
            printer.update(update.reasoning_delta, update.answer_delta, update.done,
                           resplit=update.resplit)
        final = update
    if final is None or final.stats is None:  # chat ends early only when stopped
        raise RuntimeError("the reply ended without a result")
    stats = final.stats
    if args.json:
        result = {
            "text": final.answer,
            "reasoning": final.reasoning,
            "new_tokens": stats.new_tokens,
            "prompt_tokens": stats.prompt_tokens,
            "ttft_ms": round(stats.ttft_ms, 3),
            "tok_s": round(stats.tok_s, 3),
            "total_s": round(stats.total_s, 4),
            "finish_reason": stats.finish_reason,
            "decode_path": stats.decode_path,
            "mode": status["mode"],
            "placement": status["placement"],
            "model": args.model,
            "model_label": status["model"],
            "model_path": status["path"],
            "context_tokens": status["context_tokens"],
            "load_s": status["load_s"],
            "thinking": not args.no_thinking,
            "settings": settings.as_dict(),
            "notice": final.notice,
        }
        sys.stdout.write(json.dumps(result, ensure_ascii=False) + "\n")
        sys.stdout.flush()
    elif args.stats:
        print(f"[{stats.line()} · finish: {stats.finish_reason} · {status['mode']} on "
              f"{status['placement']}]", file=sys.stderr)
    return 0


def cmd_prompt(args) -> int:
    """The prompt text, through the same prepare_prompt the chat path uses (trimming included)."""
    from .chat.prompt import normalize_messages

    messages = read_messages(args)
    normalize_messages(messages, args.system)
    source = named_model_registry(args).resolve(args.model)
    _quiet_transformers(args.verbose)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    from model_utils.loading.loaded_model import LoadRequest

    from .chat.prompt import prepare_prompt
    from .loading.manager import ModelManager

    trust = args.trust_remote_code
    try:
        config = AutoConfig.from_pretrained(source.path, trust_remote_code=trust)
        tokenizer = AutoTokenizer.from_pretrained(source.path, trust_remote_code=trust)
    except (OSError, ValueError) as error:
        raise UsageError(f"cannot load the tokenizer of {source.label}: "
                         f"{str(error).strip().splitlines()[0]}") from None
    try:
        generation_config = GenerationConfig.from_pretrained(source.path)
    except OSError:  # no generation_config.json: from_pretrained derives it from the config
        generation_config = GenerationConfig.from_model_config(config)
    # The same context window and reply reserve as a loaded model would get.
    context = ModelManager._context_tokens(config, LoadRequest(context_tokens=args.context_tokens))
    settings = requested_settings(args).resolved(generation_config, context_tokens=context)
    open_ended = settings.max_new_tokens == context  # as in chat.reply_stream.prepare_reply
    prepared = prepare_prompt(tokenizer, messages, context_tokens=context,
                              reserve_tokens=None if open_ended else settings.max_new_tokens,
                              system_prompt=args.system, thinking=not args.no_thinking)
    if prepared.notice:
        print(f"note: {prepared.notice}", file=sys.stderr, flush=True)
    sys.stdout.write(prepared.text)
    sys.stdout.flush()
    return 0


COMMANDS = {"chat": cmd_chat, "prompt": cmd_prompt}


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def _is_refusal(error: BaseException) -> bool:
    """Whether an error is a refusal of the input (exit 2) rather than a failure (exit 1).
    model_utils.errors imports nothing, so a bad messages file is reported without first
    importing torch (seconds)."""
    if isinstance(error, UsageError):
        return True
    from . import errors  # the engine's error classes, in a module that imports nothing

    classes = (errors.ChatInputError, errors.InvalidParameter, errors.LoadError,
               errors.ModelBusy, errors.ModelNotFound)
    return isinstance(error, classes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _quiet_libraries(args.verbose)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `... | head`: the reader left; nothing more to say
        with contextlib.suppress(Exception):
            sys.stdout.close()
        return 0
    except Exception as error:  # noqa: BLE001 - one line for the user; details with -v
        if _is_refusal(error):
            print(f"error: {_one_line(error)}", file=sys.stderr)
            return EXIT_REFUSED
        if args.verbose:
            import traceback

            traceback.print_exc()
        print(f"error: {type(error).__name__}: {_one_line(error)}", file=sys.stderr)
        return EXIT_ERROR
