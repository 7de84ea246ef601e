"""The generation settings, each declared once: type, range, where its default comes from, help
text, CLI flag and API names.

GenerationSettings is the frozen dataclass the engine and the sampler read, declared below with
one field per setting (checked against SETTINGS as this module is imported, so the two cannot
drift apart). The other consumers are derived from SETTINGS: the command-line flags
(add_setting_flags: the CLI's and the load test's), the OpenAI request model
(server/request_models.py), the /chat endpoint's settings dict (`from_values`), the chat panel's
widgets (ui/chat_settings.py, which keeps each widget's label and range) and the benchmark's
greedy replies (`greedy`). A new sampling knob is one `Setting` and one field here, its use in
sampling.py, and its widget in ui/chat_settings.py.

No torch and no gradio here: `python app.py --help` and the CLI's refusals import this.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, make_dataclass, replace
from typing import Any, ClassVar

from model_utils.errors import InvalidParameter

# Below this a temperature is greedy (sampling.py says why): dividing float32 logits by a
# smaller one overflows to inf.
GREEDY_TEMPERATURE = 1e-5
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer


@dataclass(frozen=True)
class Setting:
    """One generation setting. The ranges are those the sampler is known to handle
    (sampling.py): a value that passes cannot make it produce NaN probabilities or raise."""

    name: str
    type: type  # int or float
    low: float
    high: float | None = None  # None: no upper bound
    help: str = ""
    # (generation_config, context_tokens) -> the value used when none is given; None: the
    # setting stays unset (seed: a random draw). `default_text` says where it comes from.
    model_default: Callable[[Any, int], Any] | None = None
    default_text: str = "the model's generation_config"
    low_open: bool = False  # (low, high] rather than [low, high]
    api_names: tuple[str, ...] = ()  # OpenAI's names for it, the preferred one first
    unset: Any = None  # what a widget or a flag sends for "not set" (seed: -1)
    off: Any = None  # the value at which it changes nothing in a greedy reply (`greedy`)
    public: bool = True  # False: for the engine's own callers only (no flag, API or widget)
    fixed_default: Any = None  # the dataclass default of a setting that is never unset

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def optional(self) -> bool:
        """Whether it may stay unset once resolved (seed: a random draw)."""
        return self.model_default is None and self.fixed_default is None

    @property
    def request_names(self) -> tuple[str, ...]:
        """The names an OpenAI request may give it by (the first one given is read)."""
        return self.api_names or (self.name,)

    @property
    def openai_name(self) -> str:
        """The name to send it by to an OpenAI-compatible server: the one all of them know
        (max_tokens rather than the newer max_completion_tokens)."""
        return self.request_names[-1]

    def problem(self, value: Any) -> str | None:
        """Why `value` cannot be used (the refusal, without the name), or None."""
        if self.type is int:
            if not isinstance(value, int) or isinstance(value, bool):
                return f"must be an integer, got {shown(value)}"
            bounds = f"at least {self.low:g}" if self.high is None \
                else f">= {int(self.low)} and <= {int(self.high)}"
        else:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or \
                    not math.isfinite(value):
                return f"must be a finite number, got {shown(value)}"
            bounds = f"in ({self.low:g}, {self.high:g}]" if self.low_open \
                else f">= {self.low:g} and <= {self.high:g}"
        below = value <= self.low if self.low_open else value < self.low
        if below or (self.high is not None and value > self.high):
            return f"must be {bounds}, got {shown(value)}"
        return None

    def check(self, value: Any) -> None:
        if (problem := self.problem(value)) is not None:
            raise InvalidParameter(self.name, problem)


def shown(value: Any) -> str:
    """A value as a refusal quotes it: short, whatever was sent (a megabyte string, 2**4000)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:24]}... ({len(text)} characters)"


def _sampling(gc) -> bool:
    return bool(getattr(gc, "do_sample", False))


SETTINGS: tuple[Setting, ...] = (
    Setting("temperature", float, 0.0, 100.0, off=0.0,
            help="0 (or below 1e-5) = greedy",
            model_default=lambda gc, _: (getattr(gc, "temperature", None) or 1.0)
            if _sampling(gc) else 0.0,
            default_text="the model's generation_config; 0 when it does not sample"),
    Setting("top_p", float, 0.0, 1.0, low_open=True, off=1.0,
            help="nucleus sampling: keep the most likely tokens up to this probability mass",
            model_default=lambda gc, _: getattr(gc, "top_p", None) or 1.0),
    Setting("top_k", int, 0, 1_000_000, off=0,  # more than any vocabulary: "all tokens"
            help="keep only the k most likely tokens; 0 = off",
            model_default=lambda gc, _: getattr(gc, "top_k", None) or 0),
    Setting("max_new_tokens", int, 1,
            help="reply length limit; a longer one than the context window leaves after the "
                 "prompt is limited to that",
            # Without one, a reply may take what the context leaves (Qwen's generation_config
            # sets none, and Qwen3's reasoning often needs thousands of tokens).
            model_default=lambda gc, context: min(getattr(gc, "max_new_tokens", None) or context,
                                                  context),
            default_text="the model's generation_config, else what the context window leaves",
            api_names=("max_completion_tokens", "max_tokens")),
    Setting("repetition_penalty", float, 0.01, 10.0, off=1.0,
            help="penalize tokens already in the prompt or the reply (as transformers "
                 "does); 1 = off",
            model_default=lambda gc, _: getattr(gc, "repetition_penalty", None) or 1.0),
    Setting("seed", int, 0, MAX_SEED,
            help="0 to 2**63-1: the same seed and settings give the same reply",
            default_text="random", unset=-1),
    # Benchmarks only: random weights emit EOS at random, so replies are held to a length.
    Setting("min_new_tokens", int, 0, public=False, fixed_default=0),
)


BY_NAME: dict[str, Setting] = {s.name: s for s in SETTINGS}


def public(schema: Iterable[Setting] = SETTINGS) -> tuple[Setting, ...]:
    """The settings users may give (flags, API fields, widgets), in the panel's order."""
    return tuple(s for s in schema if s.public)


class _Settings:
    """Methods of GenerationSettings; its fields are the schema's (settings_class)."""

    SCHEMA: tuple[Setting, ...] = ()

    def resolved(self, generation_config, *, context_tokens: int):
        """Fill unset values from the model's generation_config, then validate. A temperature
        below GREEDY_TEMPERATURE comes back as 0 (greedy), which is what it means."""
        defaults = {s.name: s.model_default(generation_config, context_tokens)
                    for s in self.SCHEMA
                    if s.model_default is not None and getattr(self, s.name) is None}
        filled = replace(self, **defaults)
        filled.validate(context_tokens=context_tokens)
        temperature = getattr(filled, "temperature", None)
        if temperature is not None and temperature < GREEDY_TEMPERATURE and temperature != 0:
            filled = replace(filled, temperature=0.0)
        return filled

    def validate(self, *, context_tokens: int | None = None) -> None:
        """Refuse, by name, a value the sampler cannot use; only a setting without a model
        default (seed) may be unset. A max_new_tokens longer than what the context leaves is
        not refused: the engine clamps it to what fits (with a notice) once the prompt's
        length is known; `context_tokens` is kept for the callers' sake."""
        for setting in self.SCHEMA:
            value = getattr(self, setting.name)
            if value is not None or not setting.optional:
                setting.check(value)

    def check_given(self) -> None:
        """Refuse a given value the sampler cannot use; unset ones are the model's defaults,
        known only once it is loaded (the CLI and a remote backend check this early)."""
        for setting in self.SCHEMA:
            if (value := getattr(self, setting.name)) is not None:
                setting.check(value)

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def greedy(cls, **values):
        """Plain greedy decoding: every setting that has an `off` value at it (the
        benchmarks' replies, compared token by token with plain generate's), then `values`."""
        return cls(**{**{s.name: s.off for s in cls.SCHEMA if s.off is not None}, **values})

    @classmethod
    def from_values(cls, values: Mapping[str, Any] | None):
        """{name: value} from a widget or a JSON body -> checked settings; None or a missing
        key is the model's default. Sliders and JSON both deliver 40.0 for 40, and the engine
        wants ints for counts; a non-integral count is left as is, for the check to name."""
        values = dict(values or {})
        known = {s.name: s for s in public(cls.SCHEMA)}
        if unknown := sorted(set(values) - set(known), key=str):
            raise InvalidParameter("settings", f"unknown setting(s) "
                                   f"{', '.join(map(str, unknown))}; known: {', '.join(known)}")
        for name, value in values.items():
            setting = known[name]
            if setting.type is int and isinstance(value, float) and value.is_integer():
                values[name] = value = int(value)
            if setting.unset is not None and value == setting.unset and \
                    not isinstance(value, bool):
                values[name] = None
        settings = cls(**{k: v for k, v in values.items() if v is not None})
        settings.check_given()
        return settings


# -- command-line flags ---------------------------------------------------------------------------
def add_setting_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                      schema: tuple[Setting, ...] = SETTINGS, only: Iterable[str] | None = None,
                      defaults: Mapping[str, Any] | None = None) -> None:
    """One flag per public setting (--max-new-tokens ...; `only`: these names), typed int or
    float; unset (None) means the model's default unless `defaults` gives the tool's own."""
    chosen = public(schema) if only is None else [s for s in public(schema) if s.name in only]
    defaults = defaults or {}
    for setting in chosen:
        default = defaults.get(setting.name)
        shown = setting.default_text if default is None else default
        parser.add_argument(setting.flag, dest=setting.name, type=setting.type, default=default,
                            help=f"{setting.help} (default: {shown})".replace("%", "%%"))


def settings_from_args(args: argparse.Namespace, settings_type: type | None = None):
    """GenerationSettings from the flags add_setting_flags declared, the given values checked
    (InvalidParameter); the others are the model's defaults, known once it is loaded."""
    settings_type = settings_type or GenerationSettings
    settings = settings_type(**{s.name: getattr(args, s.name) for s in settings_type.SCHEMA
                                if s.public and getattr(args, s.name, None) is not None})
    settings.check_given()
    return settings


def settings_class(schema: tuple[Setting, ...], name: str = "GenerationSettings") -> type:
    """A frozen dataclass with one field per setting of `schema` (a schema with a setting of
    its own, as a test or an experiment adds one); None (for a setting with a model default)
    means "the model's default"."""
    fields = [(s.name, s.type | None, field(default=s.fixed_default)) for s in schema]
    return make_dataclass(name, fields, bases=(_Settings,), frozen=True, namespace={
        "SCHEMA": schema, "__module__": __name__,
        "__doc__": "Generation settings; None means the model's generation_config default."})


@dataclass(frozen=True)
class GenerationSettings(_Settings):
    """Generation settings; None means the model's generation_config default (SETTINGS says
    what each one is, its range and its default)."""

    SCHEMA: ClassVar[tuple[Setting, ...]] = SETTINGS

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_new_tokens: int | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    min_new_tokens: int = 0


def _check_declared(settings_type: type, schema: tuple[Setting, ...]) -> None:
    """The declared fields are the schema's, in its order, with its defaults."""
    declared = [(f.name, f.default) for f in fields(settings_type)]
    expected = [(s.name, s.fixed_default) for s in schema]
    if declared != expected:
        raise TypeError(f"GenerationSettings' fields {declared} are not SETTINGS' {expected}")


_check_declared(GenerationSettings, SETTINGS)
