"""The rollout-engine protocol that both backends (native and SGLang) implement.

Log-prob definition, shared with the trainer: for each sampled token, the log-prob is
`log_softmax(logits / temperature)[token]` computed on the full vocabulary, before top-p, top-k
or min-p truncation. With temperature 0 (greedy) the logits are used unscaled.

Abort and continue (partial rollout): an engine that implements `PartialRolloutEngine` can stop a
generation early, when its caller says enough has finished, and hands back every unfinished sample
with finish reason 'abort' and the tokens and log-probs it had so far. Such a sample continues later
as a `Request` carrying those tokens: the engine computes the prompt and the kept tokens, then
samples on from there with the sample's own seed and positions, so under unchanged weights it draws
the tokens the uninterrupted sample would have drawn (the kept tokens' K/V now come from a prefill
instead of decode steps, which may round differently in the last bits).
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol, Sequence

import torch

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")
FINISH_REASONS = ("stop", "length", "abort")


@dataclass(frozen=True)
class SamplingParams:
    """How to sample the completions of one prompt."""

    n: int = 1
    """Completions per prompt; they come back consecutively, in sample order."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) means the whole vocabulary."""
    min_p: float = 0.0
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    """Extra stop ids, on top of the tokenizer's eos ids (unless ignore_eos)."""
    ignore_eos: bool = False
    seed: int | None = None
    """Sample j of a prompt uses seed + j; the same seed gives the same output."""

    def __post_init__(self):
        checks = [
            ("n", self.n >= 1, "must be >= 1"),
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", self.top_k >= -1, "must be -1 (all) or a positive count"),
            ("min_p", 0 <= self.min_p < 1, "must be in [0, 1)"),
            ("max_new_tokens", self.max_new_tokens >= 1, "must be >= 1"),
            ("min_new_tokens", 0 <= self.min_new_tokens <= self.max_new_tokens, "must be in [0, max_new_tokens]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")


@dataclass
class Completion:
    """One sampled completion of one prompt."""

    prompt_index: int
    sample_index: int
    output_ids: list[int]
    logprobs: list[float]
    """One per output token; see the module docstring for the definition."""
    finish_reason: str
    """'stop' (a stop or eos token, included in output_ids), 'length' or 'abort'."""
    weight_version: int = 0
    """The engine's weight version when this completion was generated."""
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Request:
    """One prompt's `sampling.n` samples, or one aborted sample to continue after its kept tokens."""

    prompt_ids: Sequence[int]
    sampling: SamplingParams
    output_ids: Sequence[int] = ()
    """Tokens the sample generated before it was aborted; they count towards max_new_tokens and come
    back at the front of the completion (continuing needs sampling.n == 1)."""
    logprobs: Sequence[float] = ()
    """The log-probs of output_ids, returned in front of the new ones."""
    sample_index: int = 0
    """Index of the first sample: sample j of this request is sample sample_index + j of its
    prompt, with seed sampling.seed + sample_index + j (a continued sample keeps its own)."""

    def __post_init__(self):
        checks = [
            (
                "output_ids",
                not self.output_ids or self.sampling.n == 1,
                f"continue one sample at a time, got sampling.n={self.sampling.n}",
            ),
            (
                "output_ids",
                len(self.output_ids) < self.sampling.max_new_tokens,
                f"has {len(self.output_ids)} tokens, none left of max_new_tokens={self.sampling.max_new_tokens}",
            ),
            (
                "logprobs",
                len(self.logprobs) == len(self.output_ids),
                f"has {len(self.logprobs)} entries for {len(self.output_ids)} output_ids",
            ),
            ("sample_index", self.sample_index >= 0, f"must be >= 0, got {self.sample_index}"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"Request.{name} {why}")


@dataclass(frozen=True)
class TurnEnd:
    """A multi-turn sample that ended a turn; the engine keeps its KV cache until it is answered."""

    prompt_index: int
    sample_index: int
    output_ids: list[int]
    """Everything after the prompt so far: sampled tokens and the observations appended."""
    turn_ids: list[int]
    """The tokens sampled in this turn (the stop token included when it ended on one)."""
    finish_reason: str
    """'stop' or 'length' (the turn's max_new_tokens)."""


@dataclass(frozen=True)
class Continue:
    """The answer to a `TurnEnd` that goes on: tokens appended to the sample, then another turn."""

    observation_ids: Sequence[int]
    max_new_tokens: int
    """The next turn's budget of sampled tokens."""


class RolloutEngine(Protocol):
    """What the loop needs from a rollout engine. Every method runs on the calling rank only."""

    weight_version: int
    casts_on_update: bool
    """update_weights takes tensors in any floating dtype and casts them while copying (so the
    weight sync can hand over fp32 masters as they are); False: tensors arrive in the engine dtype."""

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Sample `n` completions per prompt; returned prompt-major, samples consecutive."""

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """Give the memory of these tags (default: all) back to the device. Refused while busy."""

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """Take the memory of these tags back (weights content is stale until updated)."""

    def begin_weight_update(self, partial: bool = False) -> None:
        """Open a weight-update session; update_weights may be called once per bucket. A
        `partial` session writes some parameters and keeps the others as they are; it is refused
        unless the engine holds a complete set of weights (loaded, or completed by a full session,
        and not released since: released weights come back without their content)."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named full tensors into the engine's weights."""

    def end_weight_update(self, version: int) -> None:
        """Close the session: every engine parameter must have been written (in a partial session,
        those written are the new ones); record `version`."""

    def flush_cache(self) -> None:
        """Drop cached prefixes so that no stale KV survives a weight update."""

    def shutdown(self) -> None:
        """Free everything the engine holds."""


class PartialRolloutEngine(RolloutEngine, Protocol):
    """An engine that can abort a generation midway and continue aborted samples later."""

    def generate_requests(
        self, requests: Sequence[Request], stop: Callable[[list[Completion]], bool] | None = None
    ) -> list[Completion]:
        """Run the requests, admitted in order. After each engine step, `stop` is called with the
        completions that finished in it; once it returns True, every unfinished sample is aborted
        and returned with finish_reason 'abort' and its output so far (kept tokens included).
        Completions come back sorted by (request index as prompt_index, sample_index)."""


class MultiTurnEngine(RolloutEngine, Protocol):
    """An engine that runs multi-turn episodes in one continuous batch, keeping each one's KV cache
    across turns (engines without it are driven turn by turn, their context submitted again)."""

    def generate_turns(
        self, requests: Sequence[Request], next_turn: Callable[[TurnEnd], "Future[Continue | None]"]
    ) -> list[Completion]:
        """Run the requests (as generate_requests); each time a sample ends a turn, `next_turn` is
        called with it and returns a future: a `Continue` appends its observation and samples on,
        None ends the sample. The other samples keep decoding meanwhile. Completions carry the
        whole episode in output_ids, 0.0 log-probs on observation tokens and
        extra['loss_mask'] (1 on sampled tokens)."""


def check_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """Normalise a tag list (None or empty means all) and reject unknown tags."""
    if not tags:
        return MEMORY_TAGS
    bad = [t for t in tags if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown memory tags {bad}; expected a subset of {list(MEMORY_TAGS)}")
    return tuple(tags)
