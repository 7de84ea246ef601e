"""What a mode costs in accuracy: its next-token distributions against the fp32 model's.

Teacher-forced: the same token sequences go through both models in one forward each, and at
every position the fp32 model's distribution P is compared with the mode's Q:
- kl_vs_fp32: mean over positions of KL(P || Q) in nats (0 = the same distributions);
- top1_vs_fp32: the share of positions where both put the same token first.
Speed does not depend on the weights' values, accuracy does: on a checkpoint with random weights
these figures say how much the quantization perturbs that model, not how a trained one fares.
"""

from __future__ import annotations

import gc

import torch

# A natural-language passage, so that a real checkpoint is measured on text it can predict.
PASSAGE = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps "
    "as his father had taught him. At the top he trimmed the wick, polished the great lens and "
    "watched the first ships turn toward the harbour. Storms came often in the autumn, and on "
    "those nights he stayed awake until morning, listening to the wind and writing in the log "
    "what he had seen: the height of the waves, the names of the vessels, the hour the fog "
    "lifted. Years later a historian read those pages and found in them a record of the coast "
    "more careful than any map, because a man who has nothing to do but watch learns to see. "
)


def sequences(tokenizer, positions: int, length: int = 128) -> list[list[int]]:
    """Token sequences of `length` with `positions` next-token predictions in all: the passage,
    repeated as needed, cut into windows. Ids past the tokenizer's vocabulary never occur."""
    ids = tokenizer(PASSAGE)["input_ids"]
    per_sequence = length - 1  # predictions per window
    count = max(1, -(-positions // per_sequence))
    stream = ids * (count * length // max(len(ids), 1) + 1)
    return [stream[i * length:(i + 1) * length] for i in range(count)]


@torch.inference_mode()
def next_token_logprobs(model, token_sequences: list[list[int]]) -> torch.Tensor:
    """log-softmax of the next-token logits at every position but the last of each sequence,
    in fp32 on the CPU: [positions, vocab]. One plain forward per sequence, no cache."""
    device = model.get_input_embeddings().weight.device
    out = []
    for seq in token_sequences:
        ids = torch.tensor([seq], device=device)
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        out.append(torch.log_softmax(logits.float(), dim=-1).cpu())
    return torch.cat(out)


def compare(reference: torch.Tensor, candidate: torch.Tensor) -> dict[str, float]:
    """{kl_vs_fp32, top1_vs_fp32} of candidate log-probabilities against the reference's."""
    if reference.shape != candidate.shape:
        raise ValueError(f"log-probabilities of different shapes: {tuple(reference.shape)} "
                         f"and {tuple(candidate.shape)}")
    kl = (reference.exp() * (reference - candidate)).sum(-1)
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).float()
    return {"kl_vs_fp32": round(kl.mean().item(), 6), "top1_vs_fp32": round(top1.mean().item(), 4)}


def fp32_reference(path, token_sequences: list[list[int]], *, device: str = "cpu",
                   **from_pretrained_kwargs) -> torch.Tensor:
    """The fp32 model's log-probabilities, loaded from the checkpoint and freed again."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 device_map={"": device},
                                                 **from_pretrained_kwargs)
    model.eval()
    try:
        return next_token_logprobs(model, token_sequences)
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
