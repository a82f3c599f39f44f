"""Partial rollout's pure parts: staleness, the checkpoint form of the groups in flight, the
stale-token mask and the config."""

from __future__ import annotations

import json
import re

import pytest
import torch

from colocate.config import Config
from colocate.config_checks import validate
from colocate.rollout.partial import (
    InFlightGroup,
    by_urgency,
    group_state,
    load_group,
    restart_stale,
    schedulable,
    split_trained,
    stale_tokens,
    staleness,
    staleness_counts,
)
from colocate.rollout.prompts import PromptSample
from colocate.rollout.sample import Sample
from colocate.trainer.batch import RolloutBatch

PROMPT = PromptSample(index=7, prompt_ids=[3, 4, 5], prompt_text="c d e", label="f", metadata={"k": 1})


def finished(j: int, versions: list[int], reason: str = "stop") -> Sample:
    n = len(versions)
    return Sample(
        prompt_ids=[3, 4, 5],
        response_ids=list(range(10, 10 + n)),
        rollout_logprobs=[-0.5 - j] * n,
        loss_mask=[1] * n,
        group_index=7,
        sample_index=j,
        finish_reason=reason,
        weight_version=versions[-1] if versions else 0,
        token_versions=versions,
        reward=0.25 * j,
        raw_reward=0.25 * j,
        response_text=f"r{j}",
        prompt_text="c d e",
        label="f",
        metadata={"k": 1},
    )


def test_sample_token_versions_match_the_response_or_are_empty():
    assert finished(0, [2, 2, 3]).versions == [2, 2, 3]
    plain = finished(0, [])
    plain.response_ids, plain.rollout_logprobs, plain.loss_mask, plain.weight_version = [9, 9], [0.0, 0.0], [1, 1], 4
    assert plain.versions == [4, 4]
    with pytest.raises(ValueError, match=r"token_versions \(1, or 0\) differ in length"):
        Sample([1], [2, 3], [0.0, 0.0], [1, 1], group_index=0, token_versions=[1])


def test_staleness_restarts_only_samples_past_the_bound():
    group = InFlightGroup(
        PROMPT, seed=11, samples=[finished(0, [1, 2]), finished(1, [2, 2], "abort"), finished(2, [], "abort"), finished(3, [3])]
    )
    assert [staleness(s, 3) for s in group.samples] == [2, 1, 0, 0]
    assert restart_stale([group], version=3, max_staleness=1) == 1
    restarted = group.samples[0]
    assert (restarted.finish_reason, restarted.response_ids, restarted.sample_index) == ("abort", [], 0)
    assert restarted.prompt_ids == [3, 4, 5] and restarted.metadata == {"k": 1}
    assert not group.complete and not group.unstarted
    assert [s.sample_index for s in group.unfinished()] == [0, 1, 2]
    assert restart_stale([group], version=3, max_staleness=1) == 0


def test_groups_train_stalest_first_and_carried_ones_must_fit_the_bound():
    def group(index: int, versions: list[int], done: bool = True) -> InFlightGroup:
        prompt = PromptSample(index=index, prompt_ids=[3], prompt_text="c", label="f")
        return InFlightGroup(prompt, seed=0, samples=[finished(0, versions, "stop" if done else "abort"), finished(1, [])])

    fresh, old, older, oldest = group(0, []), group(1, [4, 5]), group(2, [3]), group(3, [2, 5], done=False)
    assert [g.prompt.index for g in by_urgency([fresh, old, older, oldest], 5)] == [3, 2, 1, 0]
    assert [g.prompt.index for g in by_urgency([old, fresh, group(4, [4])], 5)] == [1, 4, 0]  # ties: as drawn
    trained, carried = split_trained([oldest, older, old, fresh], lambda g: g.prompt.index != 3, 2)
    assert [g.prompt.index for g in trained] == [2, 1] and [g.prompt.index for g in carried] == [3, 0]
    # carried staleness now, stalest first; 2 train a step; each must train at staleness <= 3
    assert schedulable([2, 2, 1, 1, 0, 0], per_step=2, max_staleness=3)
    assert not schedulable([3], per_step=2, max_staleness=3)  # it would train at 4
    assert not schedulable([2, 2, 2], per_step=2, max_staleness=3)  # the third waits two steps
    assert not schedulable([0] * 7, per_step=2, max_staleness=3)  # the seventh trains in the fourth step
    assert schedulable([], per_step=2, max_staleness=1)


def test_staleness_histogram_and_stale_tokens():
    samples = [finished(0, [5, 5]), finished(1, [4, 5]), finished(2, [3, 4, 5]), finished(3, [1, 5])]
    assert staleness_counts(samples, 5) == [1, 1, 1, 1]
    assert stale_tokens(samples, 5) == 4


def test_new_group_is_unstarted():
    group = InFlightGroup.new(PROMPT, seed=3, n=2)
    assert group.unstarted and not group.complete
    assert [(s.sample_index, s.group_index, s.finish_reason) for s in group.samples] == [(0, 7, "abort"), (1, 7, "abort")]


def test_group_state_round_trips_through_json():
    group = InFlightGroup(PROMPT, seed=11, samples=[finished(0, [1, 2]), finished(1, [2, 2], "abort")])
    group.samples[0].rollout_logprobs = [-0.1234567890123, -3.0e-9]
    state = json.loads(json.dumps(group_state(group)))
    back = load_group(state, {7: PROMPT})
    assert back.prompt is PROMPT and back.seed == 11
    for a, b in zip(group.samples, back.samples):
        assert a == b


def test_stale_tokens_leave_the_mask_only_when_asked():
    samples = [finished(0, [1, 2, 2]), finished(1, [2])]
    samples[0].loss_mask = [1, 1, 0]
    plain = RolloutBatch.from_samples(samples, torch.device("cpu"))
    masked = RolloutBatch.from_samples(samples, torch.device("cpu"), stale_before=2)
    assert plain.mask.tolist() == [1, 1, 0, 1]
    assert masked.mask.tolist() == [0, 1, 0, 1]
    assert masked.mask_sums == [1.0, 1.0]
    assert masked.rollout_logprobs.tolist() == plain.rollout_logprobs.tolist()


def _partial_config(**rollout) -> Config:
    cfg = Config()
    cfg.rollout.partial_rollout = True
    cfg.rollout.over_sampling_batch_size = 32
    for name, value in rollout.items():
        setattr(cfg.rollout, name, value)
    return cfg


@pytest.mark.parametrize(
    "rollout, message",
    [
        (dict(over_sampling_batch_size=None), "rollout.over_sampling_batch_size must be set (>= rollout.rollout_batch_size"),
        (dict(over_sampling_batch_size=8), "rollout.over_sampling_batch_size must be >= rollout.rollout_batch_size (16)"),
        (dict(max_staleness=0), "rollout.max_staleness must be >= 1, got 0"),
        (
            dict(over_sampling_batch_size=48),
            "rollout.over_sampling_batch_size must be <= (rollout.max_staleness + 1) x rollout.rollout_batch_size = 32",
        ),
        (dict(engine="sglang"), "rollout.partial_rollout is not supported by rollout.engine=sglang"),
        (dict(custom_generate="m:f"), "rollout.partial_rollout cannot be combined with rollout.custom_generate"),
        (dict(dynamic_sampling=True), "rollout.partial_rollout cannot be combined with rollout.dynamic_sampling"),
    ],
)
def test_partial_rollout_config_is_validated(rollout, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        validate(_partial_config(**rollout))


def test_partial_rollout_config_accepts_the_defaults():
    validate(_partial_config())
    assert Config().rollout.partial_rollout is False and Config().rollout.max_staleness == 1
