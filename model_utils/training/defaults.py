"""The settings a run uses where the user gave none: steps from the data's size, the learning
rate from the method and the model's size.

Three epochs of a dozen rows are nine optimizer steps: far too few to learn anything, so a run
takes at least MIN_STEPS. The usual LoRA rate (2e-4) is made for models of billions of weights;
a model under SMALL_MODEL weights (an earlier 4-layer demo model: 1.3M) moved its loss only from
7.2 to 6.9 with it in that many steps, and learned ten new facts exactly at 5e-3 in 120 steps
(1e-2 already turned replies to noise); full fine-tuning learned them at 1e-3 in 120 steps. The
2-layer demo model, trained longer, recalled 7 of them at 5e-3 in 120 steps (7 at 7e-3, 2 at
1e-2) and all 10 in 200. Imports neither torch nor gradio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_STEPS = 200
SMALL_MODEL = 100_000_000  # parameters
DEFAULT_EPOCHS = 3.0
_LR = {  # (method, small model?) -> learning rate
    ("lora", False): 2e-4, ("qlora", False): 2e-4, ("full", False): 2e-5,
    ("lora", True): 5e-3, ("qlora", True): 5e-3, ("full", True): 1e-3,
}


def default_lr(method: str, parameters: int) -> float:
    return _LR[(method, parameters < SMALL_MODEL)]


def epoch_steps(n_examples: int, *, batch_size: int, grad_accum: int = 1, world: int = 1,
                epochs: float = DEFAULT_EPOCHS) -> int:
    """Optimizer steps of `epochs` passes over the data."""
    micro_per_epoch = max(1, math.ceil(n_examples / (batch_size * world)))
    return max(1, math.ceil(epochs * micro_per_epoch / grad_accum))


@dataclass(frozen=True)
class Plan:
    """What a run will use, and why (for the form and the run's first line)."""

    steps: int | None  # None: the data is not known yet
    lr: float
    steps_reason: str
    lr_reason: str

    def describe(self) -> str:
        steps = f"{self.steps} steps ({self.steps_reason})" if self.steps else self.steps_reason
        return f"{steps}, learning rate {self.lr:g} ({self.lr_reason})"


def plan(*, method: str, parameters: int, n_examples: int | None, batch_size: int,
         grad_accum: int = 1,
         world: int = 1, steps: int | None = None, epochs: float | None = None,
         lr: float | None = None) -> Plan:
    """The steps and learning rate of a run; `steps` and `lr` as given where they are."""
    if steps:
        steps_reason = "as given"
    elif n_examples is None:
        steps_reason = f"steps: {epochs or DEFAULT_EPOCHS:g} epochs of the data, at least {MIN_STEPS}"
    else:
        epochs = epochs or DEFAULT_EPOCHS
        from_epochs = epoch_steps(n_examples, batch_size=batch_size, grad_accum=grad_accum,
                                  world=world, epochs=epochs)
        steps = max(MIN_STEPS, from_epochs)
        steps_reason = f"{epochs:g} epochs of {n_examples} examples"
        if steps > from_epochs:
            steps_reason += f" are {from_epochs}; at least {MIN_STEPS}"
    if lr:
        lr_reason = "as given"
    else:
        lr = default_lr(method, parameters)
        size = "under" if parameters < SMALL_MODEL else "of at least"
        lr_reason = f"{method} on a model {size} {SMALL_MODEL // 1_000_000}M parameters"
    return Plan(steps, lr, steps_reason, lr_reason)
