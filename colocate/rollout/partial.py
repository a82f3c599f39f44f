"""Partial rollout's bookkeeping: the groups in flight across steps, and their checkpoint form.

With rollout.partial_rollout a rank keeps over_sampling_batch_size / world groups in flight, and a
step's generation ends as soon as rollout_batch_size / world of them are complete. Unfinished
samples are aborted (finish reason 'abort') and kept with their tokens, log-probs and the weight
version of every token; they continue first in the next step, under the new weights. A group
trains once, when all its samples are complete (group-relative advantages need the whole group);
its finished samples wait with it. Every rank trains the same number of groups per step, so every
rank carries the same number into the next one and all ranks draw the same number of new prompts.

Staleness of a sample: the engine's weight version minus that of its oldest token; of a group, that
of its stalest sample. A group must train within rollout.max_staleness versions of its first token,
so a step's generation also goes on until the groups it carries can all still make it, each later
step training rollout_batch_size of them, the stalest first (`schedulable`): a group at its bound
is finished this step rather than restarted, and no sample is thrown away in a run whose version
grows by one a step. A sample past the bound all the same (the bound lowered on resume) restarts
from its prompt (its tokens are dropped and counted; its group stays whole, so every drawn prompt
is still trained exactly once).

Pure bookkeeping: no engine, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from colocate.rollout.prompts import PromptSample
from colocate.rollout.sample import Sample

ABORT = "abort"
STALENESS_BUCKETS = 4
"""rollout/partial/staleness_{0,1,2} and staleness_3_or_more: shares of a step's trained samples."""
_SAVED_FIELDS = (
    "sample_index",
    "response_ids",
    "rollout_logprobs",
    "token_versions",
    "finish_reason",
    "weight_version",
    "reward",
    "raw_reward",
    "response_text",
)


@dataclass
class InFlightGroup:
    """One drawn prompt's group: its samples in sample order, finished ones and aborted ones."""

    prompt: PromptSample
    seed: int
    """Sampling seed of the group (sample j draws with seed + j), kept across steps."""
    samples: list[Sample]

    @classmethod
    def new(cls, prompt: PromptSample, seed: int, n: int) -> "InFlightGroup":
        return cls(prompt, seed, [blank_sample(prompt, j) for j in range(n)])

    @property
    def complete(self) -> bool:
        return all(s.finish_reason != ABORT for s in self.samples)

    @property
    def unstarted(self) -> bool:
        """No sample has a token yet: the group can run as one request sharing its prompt's prefill."""
        return all(s.finish_reason == ABORT and not s.response_ids for s in self.samples)

    def unfinished(self) -> list[Sample]:
        return [s for s in self.samples if s.finish_reason == ABORT]


def blank_sample(prompt: PromptSample, sample_index: int) -> Sample:
    """A sample with no token yet (aborted before it started)."""
    return Sample(
        prompt_ids=list(prompt.prompt_ids),
        response_ids=[],
        rollout_logprobs=[],
        loss_mask=[],
        group_index=prompt.index,
        sample_index=sample_index,
        finish_reason=ABORT,
        prompt_text=prompt.prompt_text,
        label=prompt.label,
        metadata=prompt.metadata,
    )


def staleness(sample: Sample, version: int) -> int:
    """How many weight versions the sample's oldest token lags behind `version` (0 without tokens)."""
    return version - min(sample.versions) if sample.response_ids else 0


def group_staleness(group: InFlightGroup, version: int) -> int:
    return max(staleness(s, version) for s in group.samples)


def by_urgency(groups: list[InFlightGroup], version: int) -> list[InFlightGroup]:
    """The groups in the order they train: stalest first, then as drawn."""
    return sorted(groups, key=lambda g: -group_staleness(g, version))


def split_trained(
    groups: list[InFlightGroup], is_complete: Callable[[InFlightGroup], bool], target: int
) -> tuple[list[InFlightGroup], list[InFlightGroup]]:
    """(trained, carried): the first `target` complete groups in the given order, and the rest."""
    trained, carried = [], []
    for g in groups:
        (trained if len(trained) < target and is_complete(g) else carried).append(g)
    return trained, carried


def schedulable(carried_staleness: list[int], per_step: int, max_staleness: int) -> bool:
    """Whether groups carried into the next step with these staleness values now (stalest first)
    can each train within `max_staleness` versions when every later step trains `per_step` of
    them, stalest first: the i-th trains at the (i // per_step + 1)-th next step at the latest."""
    return all(s + i // per_step + 1 <= max_staleness for i, s in enumerate(carried_staleness))


def restart_stale(groups: list[InFlightGroup], version: int, max_staleness: int) -> int:
    """Restart from its prompt every sample, finished or not, that lags more than `max_staleness`
    versions behind `version`; returns how many."""
    count = 0
    for group in groups:
        for j, s in enumerate(group.samples):
            if staleness(s, version) > max_staleness:
                group.samples[j] = blank_sample(group.prompt, s.sample_index)
                count += 1
    return count


def staleness_counts(samples: list[Sample], version: int) -> list[int]:
    """Trained samples per staleness bucket: 0, 1, 2, 3 or more."""
    counts = [0] * STALENESS_BUCKETS
    for s in samples:
        counts[min(staleness(s, version), STALENESS_BUCKETS - 1)] += 1
    return counts


def stale_tokens(samples: list[Sample], version: int) -> int:
    """Response tokens sampled by weight versions older than `version`."""
    return sum(v < version for s in samples for v in s.versions)


def group_state(group: InFlightGroup) -> dict:
    """A JSON-able form of a group (its prompt by dataset index) for the checkpoint."""
    return {
        "prompt_index": group.prompt.index,
        "seed": group.seed,
        "samples": [{name: getattr(s, name) for name in _SAVED_FIELDS} for s in group.samples],
    }


def load_group(state: dict, dataset) -> InFlightGroup:
    """The group `group_state` saved; `dataset` (a PromptDataset) gives back its prompt."""
    prompt = dataset[state["prompt_index"]]
    samples = [
        Sample(
            prompt_ids=list(prompt.prompt_ids),
            loss_mask=[1] * len(saved["response_ids"]),
            group_index=prompt.index,
            prompt_text=prompt.prompt_text,
            label=prompt.label,
            metadata=prompt.metadata,
            **{name: saved[name] for name in _SAVED_FIELDS},
        )
        for saved in state["samples"]
    ]
    return InFlightGroup(prompt, state["seed"], samples)
