"""The server's and the page's settings are built from the settings' one declaration: a setting
added there is an OpenAI request field and a /chat setting, with its range, and, given its
Control (the page's own label and range, ui/chat_settings.py), a widget."""

from __future__ import annotations

import gradio as gr
import pytest
from pydantic import ValidationError

from model_utils.runtime.generation_settings import SETTINGS, Setting, public
from server.errors import client_error
from server.replies import SETTING_NAMES
from server.request_models import ChatCompletionRequest, request_model
from ui.chat_settings import CONTROLS, Control, context_bounded, setting_controls

MIN_P = Setting("min_p", float, 0.0, 1.0, off=0.0, help="drop tokens below min_p x the top one",
                model_default=lambda gc, _: 0.0)
EXTENDED = (*SETTINGS, MIN_P)
MESSAGES = [{"role": "user", "content": "hi"}]


def test_a_new_setting_is_an_openai_field_checked_against_its_range():
    model = request_model(EXTENDED)
    body = model.model_validate({"messages": MESSAGES, "min_p": 0.1, "max_tokens": 5})
    assert body.setting_values()["min_p"] == 0.1
    assert body.setting_values()["max_new_tokens"] == 5
    with pytest.raises(ValidationError) as caught:
        model.model_validate({"messages": MESSAGES, "min_p": 1.5})
    error = client_error(caught.value)
    assert (error.status, error.param) == (400, "min_p")
    assert error.message == "min_p: must be >= 0 and <= 1, got 1.5"
    # Without it in the schema the field is not there (and, as any unknown field, ignored).
    assert "min_p" not in ChatCompletionRequest.model_fields


def test_a_new_setting_is_a_widget():
    with gr.Blocks():
        controls = setting_controls(4096, EXTENDED, {
            **CONTROLS, "min_p": Control("min_p (0 = off)", 0.0, 0, 1, step=0.01)})
    assert list(controls) == [*SETTING_NAMES, "min_p"]
    slider = controls["min_p"]
    assert isinstance(slider, gr.Slider)
    assert (slider.minimum, slider.maximum, slider.step, slider.label) == (0, 1, 0.01,
                                                                          "min_p (0 = off)")


def test_the_widgets_are_the_settings_as_before():
    with gr.Blocks():
        controls = setting_controls(300)
    assert list(controls) == [s.name for s in public()] == list(SETTING_NAMES)
    tokens = controls["max_new_tokens"]
    assert (tokens.minimum, tokens.maximum, tokens.value) == (1, 300, 300)  # up to the context
    assert context_bounded(SETTING_NAMES) == ["max_new_tokens"]
    assert controls["temperature"].label == "temperature (0 = greedy)"
    seed = controls["seed"]
    assert isinstance(seed, gr.Number) and seed.value == -1 and seed.precision == 0


def test_openai_names_of_the_reply_length():
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 7,
                                                "max_completion_tokens": 9})
    assert body.setting_values()["max_new_tokens"] == 9  # the newer name wins
    assert body.max_tokens_field() == "max_completion_tokens"
    with pytest.raises(ValidationError) as caught:
        ChatCompletionRequest.model_validate({"messages": MESSAGES, "max_tokens": 0})
    error = client_error(caught.value)
    assert error.param == "max_tokens" and error.message.startswith("max_tokens: must be")
