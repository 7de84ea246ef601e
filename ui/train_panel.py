"""The Train tab: fine-tune a model on a JSONL chat file, watch the loss, chat with the result.

The run is a subprocess (model_utils.finetune.runner): Stop ends it after saving a checkpoint
(Continue, or Start with the same name, resumes it), and nothing it does can take the server or
the served model down. Steps and learning rate left empty follow the data's and the model's size
(model_utils.training.defaults); the form shows what they will be before the run starts. Chat keeps serving during a run. With --admin only the admin may start or stop a
run, checked here on the server for clicks and API calls alike.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import gradio as gr
import pandas as pd

from model_utils.errors import ModelNotFound
from model_utils.finetune.runner import TrainingRunner, TrainRefused, TrainRequest
from model_utils.loading.demo_model import DEMO_LABEL
from model_utils.training.models import METHODS
from server import model_actions as actions
from server.common import require_admin, user_error
from server.shutdown import on_shutdown

if TYPE_CHECKING:
    from model_utils.engine import Engine

REFRESH_S = 2.0


def build_train_panel(engine: Engine, *, status: gr.State, admin: str | None = None,
                      tab: gr.Tab | None = None) -> dict:
    """The Train tab. `tab`: its gr.Tab, whose selection reads the base-model list again."""
    runner = TrainingRunner(engine.registry, output_dir=engine.registry.trained_dir)
    on_shutdown(runner.shutdown)  # a run never outlives the server
    c: dict = {}
    first_plan, first_lr = _first_plan(runner)
    bases = actions.model_picks(engine.registry, bases_only=True)  # labels: no server path
    with gr.Row(equal_height=False):
        with gr.Column(scale=1):
            with gr.Row(equal_height=True):
                # Custom values: an API client names a base by "demo", a folder or a hub id.
                c["model"] = gr.Dropdown(bases, value=DEMO_LABEL, label="Base model",
                                         elem_id="train-model", scale=8,
                                         allow_custom_value=True)
                c["refresh_models"] = gr.Button("↻ Refresh", size="sm", scale=1, min_width=90,
                                                elem_id="train-refresh-models")
            c["upload"] = gr.File(label="Data (JSONL: one {\"messages\": [...]} per line)",
                                  file_types=[".jsonl"], type="filepath", elem_id="train-upload")
            c["data_path"] = gr.Textbox(label="…or a data file path under an allowed folder",
                                        elem_id="train-data-path")
            c["name"] = gr.Textbox(value="my-adapter", label="Output name (a folder in "
                                   f"{engine.registry.trained_dir.name}/)", elem_id="train-name")
            c["method"] = gr.Dropdown(list(METHODS), value="lora", label="Method",
                                      info="qlora needs a CUDA GPU", elem_id="train-method")
            with gr.Row():
                c["epochs"] = gr.Number(3, label="Epochs", minimum=0.1, elem_id="train-epochs")
                # Text, not numbers: an empty number field shows 0, which read as "0 steps".
                c["steps"] = gr.Textbox(label="Steps (empty: from epochs)",
                                        placeholder="from epochs", elem_id="train-steps")
                c["lr"] = gr.Textbox(label="Learning rate (empty: by model size)",
                                     placeholder=first_lr, elem_id="train-lr")
            with gr.Row():
                c["batch_size"] = gr.Number(4, precision=0, minimum=1, label="Batch size")
                c["grad_accum"] = gr.Number(1, precision=0, minimum=1, label="Grad accumulation")
                c["max_len"] = gr.Number(1024, precision=0, minimum=16, label="Max tokens")
                c["lora_r"] = gr.Number(16, precision=0, minimum=1, label="LoRA rank")
            c["plan"] = gr.Markdown(first_plan, elem_id="train-plan")
            c["packing"] = gr.Checkbox(
                False, label="Pack examples into rows of Max tokens",
                info="no pads computed; on a GPU each example attends to itself only (flash "
                     "varlen): 1.7-1.8x the tokens/s of padded batches on a 7B model "
                     "(BENCHMARKS.md). Batch size then counts rows.", elem_id="train-packing")
        with gr.Column(scale=1):
            with gr.Row():
                c["start"] = gr.Button("Start training", variant="primary", elem_id="train-start")
                c["stop"] = gr.Button("Stop", elem_id="train-stop")
                c["continue"] = gr.Button("Continue", visible=False, elem_id="train-continue")
                c["use"] = gr.Button("Load the result", elem_id="train-use")
            c["admin_note"] = gr.Markdown(
                f"Only the admin user (**{admin}**) may train." if admin else "")
            c["message"] = gr.Markdown(elem_id="train-message")
            c["progress"] = gr.Markdown(_progress_text(runner.progress()),
                                        elem_id="train-progress")
            c["plot"] = gr.LinePlot(_loss_frame([]), x="step", y="loss", title="Training loss",
                                    elem_id="train-plot", height=260)
    c["timer"] = gr.Timer(REFRESH_S)
    _wire(c, engine, runner, status, admin)
    _follow_models(c, engine, tab)
    return c


def _follow_models(c: dict, engine: Engine, tab: gr.Tab | None) -> None:
    """The base-model list as the models folder holds it now (a model copied there, a
    training result): read again on Refresh and whenever the tab is opened."""

    def list_bases(picked: str | None):
        bases = actions.model_picks(engine.registry, bases_only=True)
        values = {value for _, value in bases}
        return gr.update(choices=bases, value=picked if picked in values else DEMO_LABEL)

    triggers = [c["refresh_models"].click] + ([tab.select] if tab is not None else [])
    gr.on(triggers, list_bases, c["model"], c["model"], api_name="train_models",
          api_visibility="private", show_progress="hidden")


def _first_plan(runner: TrainingRunner) -> tuple[str, str]:
    """(the plan line, the learning rate) of the form's defaults before any data is chosen,
    so that the page opens with the values a run would use."""
    try:
        plan = runner.plan(TrainRequest(model="demo", data=None, name=""))
    except (ModelNotFound, OSError, ValueError):
        return "", ""
    return f"Will use {plan.describe()}.", f"{plan.lr:g}"


def _wire(c: dict, engine: Engine, runner: TrainingRunner, status: gr.State,
          admin: str | None) -> None:
    fields = ["model", "upload", "data_path", "name", "method", "epochs", "steps", "lr",
              "batch_size", "grad_accum", "max_len", "lora_r", "packing"]

    def request_of(model, upload, data_path, name, method, epochs, steps, lr, batch_size,
                   grad_accum, max_len, lora_r, packing) -> TrainRequest:
        data = upload or (data_path or "").strip()
        return TrainRequest(
            model=actions.model_named(engine.registry, model) or "demo", data=Path(data) if data else None,
            name=(name or "").strip(), method=method, steps=_int(steps, "steps"),
            epochs=epochs, lr=_float(lr, "the learning rate"),
            batch_size=_int(batch_size, "batch size"),
            grad_accum=_int(grad_accum, "grad accumulation"),
            max_len=_int(max_len, "max tokens"), lora_r=_int(lora_r, "LoRA rank"),
            packing=bool(packing))

    def start(model, upload, data_path, name, method, epochs, steps, lr, batch_size,
              grad_accum, max_len, lora_r, packing, request: gr.Request):
        require_admin(admin, request, "train models")
        train_request = request_of(model, upload, data_path, name, method, epochs, steps, lr,
                                   batch_size, grad_accum, max_len, lora_r, packing)
        if train_request.data is None:
            raise user_error("give a data file: upload one or type its path")
        try:
            job = runner.start(train_request)
        except (TrainRefused, ModelNotFound) as error:
            raise user_error(str(error)) from error
        return f"Training **{job.request.name}** ({job.request.method} on {job.request.model})…"

    def resume(request: gr.Request):
        require_admin(admin, request, "train models")
        try:
            job = runner.resume()
        except TrainRefused as error:
            raise user_error(str(error)) from error
        return f"Continuing **{job.request.name}** from its checkpoint…"

    def show_plan(*values):
        """What the run would use with the form as it is; the empty fields' values as hints."""
        try:
            plan = runner.plan(request_of(*values))
        except (gr.Error, ModelNotFound, OSError, ValueError) as error:
            return f"Cannot plan the run yet: {error}", gr.update(), gr.update()
        return (f"Will use {plan.describe()}.",
                gr.update(placeholder=f"{plan.steps}" if plan.steps else "from epochs"),
                gr.update(placeholder=f"{plan.lr:g}"))

    def stop(request: gr.Request):
        require_admin(admin, request, "stop training")
        return "Stopping: the run saves a checkpoint first." if runner.stop() else \
            "No run is going."

    def refresh(message: str):
        progress = runner.progress()
        # The run's start line is stale once it ended (the progress line says how); any other
        # message is left as it is, not written back (a handler may be setting a new one).
        stale = progress["state"] != "running" and (message or "").startswith(
            ("Training **", "Continuing **"))
        return (_progress_text(progress), _loss_frame(progress["rows"]),
                gr.update(visible=bool(progress.get("resumable"))),
                gr.update(value="") if stale else gr.update())

    def status_api() -> dict:
        return {k: v for k, v in runner.progress().items() if k != "out"}

    def use(current: dict, request: gr.Request):
        progress = runner.progress()
        if progress["state"] != "finished":
            raise user_error("no finished run to load yet")
        mode = current.get("mode") or "bf16"
        loaded = actions.load(engine, actions.make_request(
            model=progress["out"], mode=mode, placement=None), admin=admin, who=request)
        return f"Loaded {loaded['model']} in {loaded['mode']}: chat with it in the Chat tab.", \
            loaded

    inputs = [c[f] for f in fields]
    c["start"].click(start, inputs, c["message"], api_name="train_start",
                     concurrency_id="train", concurrency_limit=1)
    c["stop"].click(stop, None, c["message"], api_name="train_stop")
    c["continue"].click(resume, None, c["message"], api_name="train_continue",
                        concurrency_id="train", concurrency_limit=1)
    plan_outputs = [c["plan"], c["steps"], c["lr"]]
    for field_name in ("model", "upload", "data_path", "method", "epochs", "steps", "lr",
                       "batch_size", "grad_accum", "packing"):
        c[field_name].change(show_plan, inputs, plan_outputs, api_visibility="private",
                             show_progress="hidden")
    c["use"].click(use, status, [c["message"], status], api_name=False,
                   concurrency_id="model", concurrency_limit=1)
    c["timer"].tick(refresh, c["message"], [c["progress"], c["plot"], c["continue"], c["message"]],
                    api_visibility="private",
                    show_progress="hidden")
    gr.api(status_api, api_name="train_status")


def _int(value, what: str) -> int | None:
    number = _float(value, what)
    if number is None:
        return None
    if not math.isfinite(number) or not number.is_integer():
        raise user_error(f"{what} must be a whole number, got {value}")
    return int(number)


def _float(value, what: str) -> float | None:
    """A number from a field; None when it is empty."""
    if value is None or str(value).strip() == "":
        return None
    try:
        number = float(str(value).strip())
    except ValueError:
        raise user_error(f"{what} must be a number, got {value!r}") from None
    if not math.isfinite(number):
        raise user_error(f"{what} must be a finite number, got {value!r}")
    return number


def _progress_text(progress: dict) -> str:
    state = progress["state"]
    if state == "idle":
        return "No training run yet." + (f"\n\n{progress['message']}"
                                         if progress.get("message") else "")
    line = f"**{progress['name']}**: {state} · step {progress['step']}/{progress['total'] or '?'}"
    if progress.get("loss") is not None:
        line += f" · loss {progress['loss']:.4f} · {progress['tok_s']:,.0f} tokens/s"
    if state == "finished":
        line += " · in the model list now (press **Load the result**, or pick it in Model)"
    if progress.get("message"):
        line += f"\n\n{progress['message']}"
    return line


def _loss_frame(rows: list[dict]) -> pd.DataFrame:
    return pd.DataFrame({"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows]})
