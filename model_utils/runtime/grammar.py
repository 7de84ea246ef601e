"""Constrained decoding: a reply that must follow a format (JSON, a JSON schema, a tool call)
is sampled only among the tokens that keep it valid.

xgrammar (the library vLLM and SGLang use) compiles the format against the tokenizer's
vocabulary once per request; its matcher follows the reply token by token and fills a bitmask
of the tokens allowed next, which is applied to that row's logits before sampling. The formats
themselves come from xgrammar's structural tags: its "qwen_3" builder is the Qwen2.5 / Qwen3 /
Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>` syntax with an optional
reasoning block, and a JSON reply is the same reasoning block (where the model thinks) then
the schema. Imported on first use: a server that never constrains a reply never loads it.

A row's next mask needs its last token, so a batch with a constrained row reads each step's
tokens before launching the next (scheduler._may_go_on); the others in that batch lose the
overlap of host and device for as long as it runs (BENCHMARKS.md).
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from model_utils.errors import InvalidParameter

if TYPE_CHECKING:
    import torch

Reasoning = Literal["enabled", "disabled", "auto"]
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Whitespace allowed between JSON tokens: enough for ", " and a newline with some indent,
# too little for a small model to fill its whole reply with blanks.
MAX_WHITESPACE = 2


@dataclass(frozen=True)
class OutputFormat:
    """What a reply must be. response_format: None (free text), "json_object" or
    "json_schema" (with `schema`); tool_choice "required" or a function's name force a call
    of one of `tools` (OpenAI's function tools); "auto" and "none" constrain nothing."""

    response_format: str | None = None
    schema: dict | None = None
    tools: tuple[dict, ...] = ()
    tool_choice: str | dict = "auto"
    parallel_tool_calls: bool = True
    param: str = "response_format"  # the request field a refusal names

    @property
    def rendered_tools(self) -> list[dict] | None:
        """The tools the chat template describes to the model (none for tool_choice "none")."""
        return list(self.tools) if self.tools and self.tool_choice != "none" else None

    @property
    def constrained(self) -> bool:
        return self.response_format is not None or (
            bool(self.tools) and self.tool_choice not in ("auto", "none"))


def reasoning_mode(thinking: bool, prompt_opens_thinking: bool) -> Reasoning:
    """How the format treats a reasoning block: the prompt opened one ("enabled": the reply
    starts inside it), the model may write one ("auto"), or there is none ("disabled")."""
    if not thinking:
        return "disabled"
    return "enabled" if prompt_opens_thinking else "auto"


def structural_tag(fmt: OutputFormat, reasoning: Reasoning):
    """The xgrammar StructuralTag of `fmt`."""
    import xgrammar as xgr
    from xgrammar import structural_tag as st

    if fmt.response_format is None:
        tag = xgr.get_model_structural_tag("qwen_3", tools=list(fmt.tools),
                                           tool_choice=fmt.tool_choice, reasoning=reasoning,
                                           max_whitespace_cnt=MAX_WHITESPACE,
                                           parallel_tool_calls=fmt.parallel_tool_calls)
        return _calls_only(tag) if fmt.tool_choice == "required" else tag
    schema = fmt.schema if fmt.response_format == "json_schema" else {"type": "object"}
    # No `excludes` of the think tags here: xgrammar then drops the schema's string lengths;
    # a reply without a reasoning block is not split at "</think>" (chat/reply_stream.py).
    body = st.JSONSchemaFormat(json_schema=schema, max_whitespace_cnt=MAX_WHITESPACE)
    if reasoning == "disabled":
        return st.StructuralTag(format=body)
    excludes = [THINK_OPEN, THINK_CLOSE]
    block = st.TagFormat(begin="" if reasoning == "enabled" else THINK_OPEN,
                         content=st.AnyTextFormat(excludes=excludes), end=THINK_CLOSE)
    thought = st.SequenceFormat(elements=[block, st.ConstStringFormat(value="\n\n")])
    if reasoning == "auto":
        thought = st.OptionalFormat(content=thought)
    return st.StructuralTag(format=st.SequenceFormat(elements=[thought, body]))


def _calls_only(tag):
    """qwen_3's "required" format with nothing but the calls after the reasoning block.

    xgrammar's builder allows free text before, between and after the calls (a
    TriggeredTagsFormat with at_least_one); a model may then write on after its last call up to
    the token limit, and the reply ends "length" instead of "tool_calls". The same tool tags,
    one call or more, joined by the newline Qwen's chat template puts between calls, and then
    only the end of the turn."""
    from xgrammar import structural_tag as st

    body = tag.format
    head = body.elements[:-1] if isinstance(body, st.SequenceFormat) else []
    calls = body.elements[-1] if isinstance(body, st.SequenceFormat) else body
    if not isinstance(calls, st.TriggeredTagsFormat):
        raise TypeError(f"xgrammar's qwen_3 tool format changed: {type(calls).__name__}")
    calls = st.TagsWithSeparatorFormat(tags=calls.tags, separator="\n", at_least_one=True,
                                       stop_after_first=calls.stop_after_first)
    return st.StructuralTag(format=st.SequenceFormat(elements=[*head, calls]) if head else calls)


class Grammars:
    """The compiler for one loaded model's tokenizer (built at the first constrained reply)."""

    def __init__(self, tokenizer, vocab_size: int, stop_ids: set[int]):
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self._compiler = None
        self._lock = threading.Lock()

    def fits(self, tokenizer, vocab_size: int, stop_ids: set[int]) -> bool:
        """Whether this compiler serves a model of this tokenizer (the very object), vocabulary
        size and stop tokens: a mode switch of one model keeps all three."""
        return (tokenizer is self.tokenizer and vocab_size == self.vocab_size
                and stop_ids == self.stop_ids)

    def constraint(self, fmt: OutputFormat, reasoning: Reasoning) -> Constraint:
        """A fresh matcher for one reply; InvalidParameter naming fmt.param for a format
        that cannot be compiled (a schema xgrammar does not take, an unknown tool)."""
        import xgrammar as xgr

        try:
            tag = structural_tag(fmt, reasoning)
            compiled = self._compile(tag)
        except (ValueError, RuntimeError, TypeError) as error:
            raise InvalidParameter(fmt.param, format_problem(error)) from None
        return Constraint(xgr.GrammarMatcher(compiled), self.vocab_size)

    def _compile(self, tag):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.tokenizer, vocab_size=self.vocab_size,
                    stop_token_ids=sorted(self.stop_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        return self._compiler.compile_structural_tag(tag)


@dataclass(eq=False)
class Constraint:
    """One reply's place in its grammar."""

    matcher: Any  # xgrammar.GrammarMatcher
    vocab_size: int
    rejected: int = field(default=0)  # tokens the matcher refused (a bug if ever > 0)

    def accept(self, token: int) -> None:
        if not self.matcher.is_terminated() and not self.matcher.accept_token(token):
            self.rejected += 1

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def mask_logits(logits: torch.Tensor, constraints: list[Constraint | None]) -> torch.Tensor:
    """logits [n, V] with every token a row's constraint forbids at -inf (float32 rows)."""
    rows = [i for i, c in enumerate(constraints) if c is not None]
    if not rows:
        return logits
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(constraints), logits.shape[-1])
    for i in rows:
        constraints[i].fill(bitmask, i)
    logits = logits.float().contiguous()
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=constraints[rows[0]].vocab_size, indices=rows)
    return logits


# xgrammar's C++ errors begin with its log prefix: "[04:12:10] /project/cpp/file.cc:5082: ".
_LIBRARY_PREFIX = re.compile(r"^(\[[\d:.]+\]\s*)?([^\s:]*\.(cc|cpp|cxx|h|hpp):\d+:\s*)?")


def format_problem(error: BaseException) -> str:
    """What a client is told about a format that cannot be compiled: the first line of the
    library's error without its log prefix (the time and the library's source file), e.g.
    'Unsupported type "nonsense"'."""
    lines = str(error).strip().splitlines()
    text = _LIBRARY_PREFIX.sub("", lines[0]).strip() if lines else ""
    return (text or "the format cannot be compiled")[:300]


def schema_of(response_format: dict) -> dict:
    """OpenAI's json_schema response_format -> the schema (its "schema" under "json_schema")."""
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise InvalidParameter("response_format",
                               'json_schema must be {"name": ..., "schema": {...}}')
    schema = spec.get("schema", {})
    json.dumps(schema)  # a schema is JSON (pydantic parsed it from JSON already)
    return schema if isinstance(schema, dict) else {}
