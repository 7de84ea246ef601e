"""Training data: a JSONL file of chat conversations, checked line by line, then tokenized through
the model's own chat template with labels on the assistant's tokens only.

One line: {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} (the
format TRL and OpenAI fine-tuning take). Every assistant turn becomes one example: the prompt is
the conversation before it rendered with add_generation_prompt=True (exactly what the chat path
feeds the model at inference), the completion is what the template adds for that turn. Prompt
tokens get label -100, so the loss is on what the assistant says and nothing else.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

ROLES = ("system", "user", "assistant")
IGNORE = -100  # the label torch's cross_entropy skips


class DataError(ValueError):
    """The data file cannot be trained on; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    input_ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens
    # Packed rows only: position ids restarting at each example the row holds.
    positions: list[int] | None = None

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_conversations(path: str | Path) -> list[list[dict]]:
    """Every conversation of the file, or DataError naming the first bad line (file:line)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"{path}: cannot read the data file ({error})") from error
    conversations = []
    # JSONL lines end at "\n" only: str.splitlines also splits at U+2028, U+0085 and other
    # characters that valid JSON may hold unescaped inside a string.
    for number, line in enumerate(text.split("\n"), start=1):
        line = line.removesuffix("\r")
        if not line.strip():
            continue
        conversations.append(_parse_line(line, f"{path}:{number}"))
    if not conversations:
        raise DataError(f"{path}: the data file has no conversations (it is empty)")
    return conversations


def _parse_line(line: str, where: str) -> list[dict]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise DataError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
    except RecursionError:
        raise DataError(f"{where}: nested too deeply to read") from None
    except ValueError:  # json refuses integers of more than 4300 digits
        raise DataError(f"{where}: holds a number too long to read (over 4300 digits)") from None
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f'{where}: expected an object with a non-empty "messages" list')
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(f"{where}: message {i} is not an object")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise DataError(f"{where}: message {i} has unknown role {role!r} "
                            f"(expected one of {', '.join(ROLES)})")
        if not isinstance(content, str):
            raise DataError(f"{where}: message {i} ({role}) has no text content")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: no assistant turn, so nothing to learn from this line")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _render(tokenizer, messages: list[dict], *, generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def count_examples(path: str | Path) -> int:
    """How many examples tokenize_conversations makes of the file: one per assistant turn."""
    return sum(m["role"] == "assistant" for c in read_conversations(path) for m in c)


def tokenize_conversations(tokenizer, conversations: list[list[dict]], *, max_len: int,
                           source: str = "data") -> list[Example]:
    """One Example per assistant turn, truncated to max_len tokens (the prompt's start is kept
    only as far as it fits; a completion longer than max_len is cut at its end)."""
    if tokenizer.chat_template is None:
        raise DataError("the model's tokenizer has no chat template to render the data with")
    examples = []
    for index, messages in enumerate(conversations):
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = _render(tokenizer, messages[:turn], generation_prompt=True) if turn else ""
            full = _render(tokenizer, messages[:turn + 1], generation_prompt=False)
            if not full.startswith(prompt):
                raise DataError(f"{source}: conversation {index + 1}: the chat template does not "
                                "render the reply after its prompt; cannot mask the prompt")
            prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            reply_ids = tokenizer(full[len(prompt):], add_special_tokens=False)["input_ids"]
            # Keep the end of a long prompt (the question), never drop the reply entirely.
            keep_prompt = max(0, min(len(prompt_ids), max_len - len(reply_ids)))
            prompt_ids = prompt_ids[len(prompt_ids) - keep_prompt:]
            ids = (prompt_ids + reply_ids)[:max_len]
            labels = ([IGNORE] * len(prompt_ids) + reply_ids)[:max_len]
            examples.append(Example(ids, labels))
    return examples


def epoch_order(n: int, *, seed: int, epoch: int) -> list[int]:
    """The order examples are seen in one epoch: a function of (seed, epoch) only, so a resumed
    run and every process of a distributed one agree on it without sharing any state."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(n, generator=generator).tolist()


@dataclass(frozen=True)
class Schedule:
    """Which examples each process uses in micro-step k. A global micro-batch is
    batch_size x world examples; process `rank` takes its batch_size-long slice. So one process
    with batch 2B sees exactly the examples two processes with batch B see together."""

    n_examples: int
    batch_size: int
    world: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world

    @property
    def micro_steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.n_examples / self.global_batch))

    def micro_batch(self, micro_step: int, rank: int) -> list[int]:
        epoch, within = divmod(micro_step, self.micro_steps_per_epoch)
        order = epoch_order(self.n_examples, seed=self.seed, epoch=epoch)
        start = within * self.global_batch
        chunk = order[start:start + self.global_batch]
        # The last micro-batch of an epoch wraps around to a full size, so that every
        # process gets the same number of rows (DDP needs every rank to step).
        if len(chunk) < self.global_batch:
            chunk += order[:self.global_batch - len(chunk)]
        return chunk[rank * self.batch_size:(rank + 1) * self.batch_size]


def pad_batch(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded rows (pads carry label IGNORE and attention 0)."""
    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        n = len(example.input_ids)
        ids[row, :n] = torch.tensor(example.input_ids)
        labels[row, :n] = torch.tensor(example.labels)
        mask[row, :n] = 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def pack_examples(examples: list[Example], *, max_len: int, seed: int) -> list[Example]:
    """Examples laid back to back in rows of at most max_len tokens, each row's position ids
    restarting at every example. A batch of packed rows computes no pads where a padded batch
    would spend the rest of each row on them.

    Rows are filled best-fit decreasing (longest example first, each into the fullest row that
    still has room): laying examples in their shuffled order instead left 28 % of each row
    empty on examples of 1/4 to all of max_len tokens, best-fit leaves a few percent. The seeded
    shuffle breaks ties between equal lengths; the training schedule shuffles the rows."""
    order = epoch_order(len(examples), seed=seed, epoch=-1)
    order.sort(key=lambda i: -len(examples[i].input_ids))  # stable: ties keep the shuffle
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (free tokens, row), ascending: best fit = first that fits
    for index in order:
        n = len(examples[index].input_ids)
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            free, row = room.pop(at)
        else:
            free, row = max_len, len(rows)
            rows.append([])
        rows[row].append(index)
        if free - n > 0:
            bisect.insort(room, (free - n, row))
    packed = []
    for members in rows:
        ids, labels, positions = [], [], []
        for index in members:
            ids += examples[index].input_ids
            labels += examples[index].labels
            positions += range(len(examples[index].input_ids))
        packed.append(Example(ids, labels, positions))
    return packed


def pack_batch(examples: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """Packed rows, right-padded, with position ids and no attention mask: transformers sees the
    restarts (masking_utils.find_packed_sequence_indices) and keeps each example from attending
    to the others. The pads form one more sequence of their own, with label IGNORE."""
    width = max(len(e.input_ids) for e in examples)
    batch = pad_batch(examples, pad_id)
    positions = torch.zeros((len(examples), width), dtype=torch.long)
    for row, example in enumerate(examples):
        own = example.positions or list(range(len(example.input_ids)))
        positions[row, :len(own)] = torch.tensor(own)
        positions[row, len(own):] = torch.arange(width - len(own))
    return {"input_ids": batch["input_ids"], "labels": batch["labels"], "position_ids": positions}
