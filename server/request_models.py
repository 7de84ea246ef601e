"""What each API request may contain, as pydantic models: the OpenAI chat request and the named
gradio endpoints' parameters. Types and shapes are checked here, at the door, with messages that
name the field. The generation settings' fields (names, types, ranges, refusals) are built
from their one declaration (model_utils/runtime/generation_settings.py), so a value out of
range is refused here too, named as the client sent it (`max_tokens: must be ...`).

Bodies are parsed by `parse_json`, pydantic's Rust parser: it refuses lone UTF-16 surrogates
("\\ud800", which no tokenizer can encode), NaN/Infinity, and nesting deeper than 200 levels
(where the standard library's parser recurses until RecursionError).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import pydantic_core
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

from model_utils.runtime.generation_settings import SETTINGS, Setting, public

from .errors import ClientError

MAX_JSON_BYTES = 16 * 2**20  # a 2000-message history of long messages fits with room to spare


def parse_json(body: bytes) -> Any:
    if len(body) > MAX_JSON_BYTES:
        raise ClientError(413, f"the body is larger than {MAX_JSON_BYTES // 2**20} MB")
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as error:
        # pydantic_core's own words ("recursion limit exceeded at line 1 column 202"), plain.
        raise ClientError(400, f"the body is not JSON (or not valid UTF-8 text): {error}") from None


def check_text(value: str) -> str:
    """Text a tokenizer can take: valid UTF-8 (no lone surrogates) and no NUL characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("contains a lone UTF-16 surrogate, which is not text") from None
    return value


Text = Annotated[str, AfterValidator(check_text)]


def content_text(value: Any, where: str = "content") -> str:
    """Message content: a string, or a list of text parts [{"type": "text", "text": "..."}]
    (the standard form many clients send); other part types (images, audio) are refused."""
    if value is None:
        return ""
    if isinstance(value, str):
        return check_text(value)
    if isinstance(value, list):
        pieces = []
        for i, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"part {i} must be {{\"type\": \"text\", \"text\": \"...\"}}; "
                                 f"only text parts are supported (got {str(kind)[:40]!r})")
            pieces.append(check_text(part["text"]))
        return "".join(pieces)
    raise ValueError(f"{where} must be a string or a list of text parts")


class _Strict(BaseModel):
    # strict: "5" is not a number and 1 is not a bool; floats accept integers.
    model_config = ConfigDict(strict=True, extra="forbid")


# -- the OpenAI chat request ------------------------------------------------------------------
class _Lenient(BaseModel):
    # Strict types; fields of the client's own (name, description, ...) ignored, not refused.
    model_config = ConfigDict(strict=True, extra="ignore")


class FunctionCall(_Lenient):
    name: Text
    arguments: Any = "{}"  # JSON text (OpenAI) or an object (some clients)


class ToolCallIn(_Lenient):
    """A tool call of an earlier assistant turn, as the client sends it back."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    # Clients add fields of their own (name...): ignored, not refused.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # validate_default: a message without the key is checked as one with null ("" here), so
    # a user message without content is refused as empty (an assistant turn with tool_calls
    # may have none).
    content: Any = Field(default=None, validate_default=True)
    reasoning_content: Any = Field(default=None, validate_default=True)
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def engine_message(self) -> dict:
        """The message as the engine takes it (chat/prompt.py normalises it further)."""
        role = "system" if self.role == "developer" else self.role
        message = {"role": role, "content": self.content}
        if self.reasoning_content:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": c.function.model_dump()}
                                     for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message

    @field_validator("content", "reasoning_content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> str:
        return content_text(value)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class ChatTemplateKwargs(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    enable_thinking: bool | None = None


class FunctionTool(_Lenient):
    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionTool


class NamedFunction(_Lenient):
    name: Text


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaSpec(_Lenient):
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: Text | None = None


class ResponseFormat(_Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


# Fields of OpenAI's request this server refuses when they ask for something (a 400 naming the
# field) rather than ignore: a client that sends them relies on them.
UNSUPPORTED_WHEN_SET = ("logit_bias", "prediction", "audio", "frequency_penalty",
                        "presence_penalty")


class _ChatCompletionFields(BaseModel):
    # Fields other servers accept and this one does not use (user, store, metadata, ...) are
    # ignored rather than refused, as common clients send some of them by default; those of
    # UNSUPPORTED_WHEN_SET are refused when given a value that asks for something (a penalty
    # of 0 asks for nothing).
    model_config = ConfigDict(strict=True, extra="ignore")
    SETTINGS: ClassVar[tuple[Setting, ...]] = SETTINGS  # the schema the fields were built from

    model: str | None = None  # the loaded model answers whatever is named
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    stop: Any = None
    enable_thinking: bool | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    logit_bias: Any = None
    prediction: Any = None
    audio: Any = None
    frequency_penalty: Any = None
    presence_penalty: Any = None
    # + one field per generation setting (by its OpenAI names): request_model below

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name in UNSUPPORTED_WHEN_SET:
            if getattr(self, name) not in (None, False, {}, []):
                raise ClientError(400, f"{name} is not supported by this server", param=name)
        if self.top_logprobs is not None and not self.logprobs:
            raise ClientError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return self

    def logprob_alternatives(self) -> int | None:
        """Alternatives per token when logprobs are asked for (0: the token's own only)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> list[str]:
        """A string or a list of strings (at most 16, none empty) -> a list."""
        if value is None:
            return []
        values = [value] if isinstance(value, str) else value
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise ValueError("must be a string or a list of strings")
        if len(values) > 16:
            raise ValueError(f"at most 16 stop strings, got {len(values)}")
        if any(not v for v in values):
            raise ValueError("a stop string may not be empty")
        return [check_text(v) for v in values]

    def setting_values(self) -> dict[str, Any]:
        """{setting name: the value given} for GenerationSettings.from_values; a setting given
        by two names (max_completion_tokens, max_tokens) takes the first one given."""
        values = {}
        for setting in public(self.SETTINGS):
            given = [getattr(self, name) for name in setting.request_names
                     if getattr(self, name) is not None]
            values[setting.name] = given[0] if given else None
        return values

    def field_name(self, setting: str) -> str:
        """The name the client used for a setting (for messages about it)."""
        names = next(s.request_names for s in self.SETTINGS if s.name == setting)
        return next((n for n in names if getattr(self, n) is not None), names[-1])

    def max_tokens_field(self) -> str:
        """The name the client used for the reply's length, for messages about it."""
        return self.field_name("max_new_tokens")


def setting_type(setting: Setting):
    """A request field's type for a generation setting: a strict int or float, checked against
    the setting's range, so that every endpoint refuses a value in the same words."""
    def check(value):
        if (problem := setting.problem(value)) is not None:
            raise ValueError(problem)
        return value

    return Annotated[setting.type, AfterValidator(check)]


def _setting_field(setting: Setting):
    return setting_type(setting) | None, None


def request_model(schema: tuple[Setting, ...] = SETTINGS) -> type[_ChatCompletionFields]:
    """The OpenAI chat request with a field for each public setting, under each of its
    OpenAI names (a strict int or float, checked against the setting's range)."""
    fields = {name: _setting_field(s) for s in public(schema) for name in s.request_names}
    model = create_model("ChatCompletionRequest", __base__=_ChatCompletionFields, **fields)
    model.SETTINGS = schema
    return model


ChatCompletionRequest = request_model()


# -- the named gradio endpoints ---------------------------------------------------------------
class ChatParams(_Strict):
    message: Text
    history: Any = None  # checked by conversation.validate_history, which names the message
    settings: dict[str, Any] | None = None  # names and ranges: GenerationSettings.from_values
    system_prompt: Text | None = ""
    thinking: bool = True

    @field_validator("message")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("the message is empty")
        return value


class CountParams(_Strict):
    """/count_tokens: as /chat, and the message may be empty (what the history takes)."""
    message: Text = ""
    history: Any = None
    settings: dict[str, Any] | None = None
    system_prompt: Text | None = ""
    thinking: bool = True


class LoadParams(_Strict):
    model: Text | None = "demo"
    mode: Text = "bf16"
    placement: Text | None = None
    max_memory_gb: dict[Text, Annotated[float, Field(ge=0, allow_inf_nan=False)]] | None = None
    offload_folder: Text | None = None
    compute_dtype: Text = "bf16"
    context_tokens: Annotated[int, Field(ge=0)] | None = None
