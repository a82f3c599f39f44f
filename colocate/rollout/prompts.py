"""Prompt data: a tokenised prompt dataset and a resumable, sharded sampler.

The rows come from any prompt source of colocate/data.py (JSONL, Parquet, a `datasets`
directory or a Hub data set id).

Every rank loads the whole (small) prompt file and draws the same global order; each rank then
takes its own contiguous share of each global batch, so ranks never need to talk about data and
a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from colocate.data import read_rows


@dataclass
class PromptSample:
    """One prompt, ready for the engine."""

    index: int
    """Position in the dataset (after over-long prompts were dropped); stable across runs."""
    prompt_ids: list[int]
    prompt_text: str
    """The text whose tokens are prompt_ids (chat template applied when configured)."""
    label: Any
    metadata: dict = field(default_factory=dict)
    prompt: Any = None
    """The row's prompt as the data holds it (a string or chat messages): what an environment's
    `reset` gets."""


def render_chat(
    tokenizer: Any,
    prompt: str | list[dict],
    system_prompt: str | None = None,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> str:
    """The text of one prompt formatted by the tokenizer's chat template, ending with the
    assistant's generation prompt.

    A string is one user message. `system_prompt` goes first unless the messages begin with a
    system message of their own; `template_kwargs` reach the template (Qwen3's enable_thinking);
    `tools` are JSON schemas for the template's tool section.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False, **(template_kwargs or {})
    )


class PromptDataset:
    """Prompts of one prompt source, tokenised once, up front.

    A prompt is a string or a list of chat messages ({"role", "content"}); messages need the
    chat template, which `system_prompt` and `chat_template_kwargs` shape (see `render_chat`).
    Rows must hold `input_key` and `label_key`; `metadata_key` is optional and must be a mapping.
    A malformed row raises ValueError naming file and line (row for Parquet and data sets).
    Prompts longer than `max_prompt_len` tokens are dropped and counted in `num_dropped`.
    """

    def __init__(
        self,
        path: str | Path,
        tokenizer: Any,
        input_key: str = "prompt",
        label_key: str = "label",
        metadata_key: str = "metadata",
        apply_chat_template: bool = False,
        max_prompt_len: int | None = None,
        system_prompt: str | None = None,
        chat_template_kwargs: dict | None = None,
    ):
        self.path = str(path)
        self.input_key, self.label_key, self.metadata_key = input_key, label_key, metadata_key
        if apply_chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"{self.path}: apply_chat_template is set but the tokenizer has no chat template")
        texts, labels, metadata, raw = [], [], [], []
        for where, row in read_rows(self.path):
            prompt, label, meta = self._check_row(row, where, apply_chat_template)
            raw.append(prompt)
            if apply_chat_template:
                prompt = render_chat(tokenizer, prompt, system_prompt, chat_template_kwargs)
            texts.append(prompt)
            labels.append(label)
            metadata.append(meta)
        if not texts:
            raise ValueError(f"{self.path}: no prompts")
        # A chat template already carries the BOS token where the model wants one.
        all_ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"]
        self.samples: list[PromptSample] = []
        self.num_dropped = 0
        for text, ids, label, meta, prompt in zip(texts, all_ids, labels, metadata, raw):
            if max_prompt_len is not None and len(ids) > max_prompt_len:
                self.num_dropped += 1
                continue
            self.samples.append(PromptSample(len(self.samples), list(ids), text, label, meta, prompt))
        if not self.samples:
            raise ValueError(f"{self.path}: no prompts left ({self.num_dropped} dropped as longer than {max_prompt_len} tokens)")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> PromptSample:
        return self.samples[index]

    def _check_row(self, row: Any, where: str, chat: bool) -> tuple[Any, Any, dict]:
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for key in (self.input_key, self.label_key):
            if key not in row:
                raise ValueError(f"{where}: missing key {key!r} (has {sorted(row)})")
        prompt = row[self.input_key]
        if isinstance(prompt, list):
            ok = all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
            if not ok or not prompt:
                raise ValueError(
                    f"{where}: {self.input_key!r} must be a string or a non-empty "
                    "list of {'role': str, 'content': str} messages"
                )
            if not chat:
                raise ValueError(f"{where}: {self.input_key!r} is a chat message list; enable apply_chat_template to format it")
        elif not isinstance(prompt, str):
            raise ValueError(f"{where}: {self.input_key!r} must be a string or a message list, got {type(prompt).__name__}")
        meta = row.get(self.metadata_key)
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise ValueError(f"{where}: {self.metadata_key!r} must be a mapping, got {type(meta).__name__}")
        return prompt, row[self.label_key], meta


class PromptSampler:
    """Endless, seeded epochs over a dataset; each call hands this rank its share of a batch.

    The global order of epoch e is a permutation seeded by (seed, e), identical on all ranks.
    `next_batch(n)` consumes the next n prompts of that order, crossing into the next epoch when
    the current one runs out, and returns this rank's contiguous n / world_size of them.
    """

    def __init__(self, dataset: PromptDataset, rank: int = 0, world_size: int = 1, seed: int = 0, shuffle: bool = True):
        assert 0 <= rank < world_size, (rank, world_size)
        self.dataset, self.rank, self.world_size = dataset, rank, world_size
        self.seed, self.shuffle = seed, shuffle
        self.epoch, self.offset = 0, 0
        # Whether the last next_batch consumed the final prompt of an epoch.
        self.epoch_done = False
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_batch(self, num_prompts: int) -> list[PromptSample]:
        """This rank's share of the next `num_prompts` prompts (global count, across ranks)."""
        if num_prompts < 1 or num_prompts % self.world_size:
            raise ValueError(f"num_prompts={num_prompts} must be a positive multiple of the world size {self.world_size}")
        indices: list[int] = []
        self.epoch_done = False
        while len(indices) < num_prompts:
            take = min(num_prompts - len(indices), len(self._order) - self.offset)
            indices += self._order[self.offset : self.offset + take]
            self.offset += take
            if self.offset == len(self._order):
                self.epoch, self.offset = self.epoch + 1, 0
                self._order = self._epoch_order(self.epoch)
                self.epoch_done = True
        share = num_prompts // self.world_size
        mine = indices[self.rank * share : (self.rank + 1) * share]
        return [self.dataset[i] for i in mine]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed, "dataset_size": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["dataset_size"] != len(self.dataset):
            raise ValueError(
                f"cannot resume the prompt sampler: the checkpoint saw "
                f"{state['dataset_size']} prompts, the data now has "
                f"{len(self.dataset)}"
            )
        self.epoch, self.offset, self.seed = state["epoch"], state["offset"], state["seed"]
        self.epoch_done = False
        self._order = self._epoch_order(self.epoch)
