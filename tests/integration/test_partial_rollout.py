"""Partial rollout on CPU: the native engine aborts samples and continues them, and the rollout
manager carries them across steps (toy model, one process)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from colocate.rollout.native import NativeEngine
from colocate.rollout.partial import staleness
from colocate.rollout.protocol import Request, SamplingParams
from tests.helpers import write_hf_model
from tests.integration.test_rollout_manager import manager, toy  # noqa: F401 (toy is a fixture)

PARTIAL = dict(partial_rollout=True, over_sampling_batch_size=8, max_response_len=40)
"""8 groups of 4 in flight, 4 trained per step; the untrained toy model stops after 1 to 40 tokens,
and its engine decodes 16 tokens per host round trip, so some samples are cut midway."""


def test_abort_returns_tokens_so_far_and_continuing_equals_the_uninterrupted_sample(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen3")
    engine = NativeEngine(str(path), device="cpu", block_size=4, max_kv_tokens=512)
    short = Request([3, 5, 7], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1))
    long = Request([2, 4, 6, 8, 10], SamplingParams(n=3, max_new_tokens=12, ignore_eos=True, seed=5))
    full = engine.generate_requests([short, long])
    assert [len(c.output_ids) for c in full] == [3, 12, 12, 12]

    seen = []
    cut = engine.generate_requests([short, long], stop=lambda done: seen.append(len(done)) or True)
    assert seen == [1]  # the short request finished first, then everything else was aborted
    assert [(c.prompt_index, c.sample_index, c.finish_reason) for c in cut] == [
        (0, 0, "length"),
        (1, 0, "abort"),
        (1, 1, "abort"),
        (1, 2, "abort"),
    ]
    for aborted, whole in zip(cut[1:], full[1:]):
        assert len(aborted.output_ids) == 3 == len(aborted.logprobs)
        assert aborted.output_ids == whole.output_ids[:3]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    resumed = engine.generate_requests(
        [
            Request(
                long.prompt_ids,
                SamplingParams(max_new_tokens=12, ignore_eos=True, seed=5),
                c.output_ids,
                c.logprobs,
                sample_index=c.sample_index,
            )
            for c in cut[1:]
        ]
    )
    for again, whole in zip(resumed, full[1:]):
        assert again.sample_index == whole.sample_index and again.finish_reason == "length"
        assert again.output_ids == whole.output_ids
        torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(whole.logprobs), atol=1e-5, rtol=0)
        assert again.logprobs[:3] == cut[1 + again.sample_index].logprobs  # kept ones are handed back as given


def _state(rm) -> dict:
    """(group, sample) -> (tokens, log-probs, versions, finish reason) of every sample in flight."""
    return {
        (g.prompt.index, s.sample_index): (list(s.response_ids), list(s.rollout_logprobs), s.versions, s.finish_reason)
        for g in rm.in_flight
        for s in g.samples
    }


def _check_whole_groups(samples, n=4):
    assert len(samples) % n == 0
    for i in range(0, len(samples), n):
        group = samples[i : i + n]
        assert {s.group_index for s in group} == {group[0].group_index}
        assert [s.sample_index for s in group] == list(range(n))
        assert all(s.finish_reason in ("stop", "length") for s in group)


@pytest.mark.slow
def test_carried_samples_keep_tokens_logprobs_and_versions(toy):  # noqa: F811
    rm, data = manager(toy, **PARTIAL)
    rm.engine.weight_version = 1
    first, m1 = rm.generate(data, rollout_id=0)
    _check_whole_groups(first)
    assert len(first) == 16 and m1["rollout/num_samples"] == 16
    carried = _state(rm)
    unfinished = [k for k, v in carried.items() if v[3] == "abort"]
    assert m1["rollout/partial/carried_groups"] == 4 == len({k[0] for k in carried})
    assert m1["rollout/partial/carried_samples"] == len(unfinished) > 0
    assert m1["rollout/partial/staleness_0"] == 1.0 and m1["rollout/partial/stale_token_ratio"] == 0.0
    assert 0 < m1["rollout/decode_utilization"] <= 1

    rm.engine.weight_version = 2
    prompt_len = {g.prompt.index: len(g.prompt.prompt_ids) for g in rm.in_flight}
    second, m2 = rm.generate(data, rollout_id=1)
    _check_whole_groups(second)
    # Every unfinished carried sample is prefilled again with its kept tokens, each new group once.
    new_groups = {s.group_index: len(s.prompt_ids) for s in second if s.group_index not in prompt_len}
    new_groups |= {g.prompt.index: len(g.prompt.prompt_ids) for g in rm.in_flight if g.prompt.index not in prompt_len}
    assert m2["rollout/prefill_tokens"] == sum(new_groups.values()) + sum(
        prompt_len[g] + len(carried[g, j][0]) for g, j in unfinished
    )
    assert m2["rollout/preemptions"] == 0
    assert m2["rollout/partial/resumed_samples"] == sum(1 for k in unfinished if carried[k][0])
    now = {(s.group_index, s.sample_index): s for s in second} | {k: None for k in _state(rm)}
    checked = 0
    for key, (tokens, logprobs, versions, reason) in carried.items():
        s = now[key]
        if s is None:  # still in flight
            tokens_now, logprobs_now, versions_now, _ = _state(rm)[key]
        else:
            tokens_now, logprobs_now, versions_now = s.response_ids, s.rollout_logprobs, s.versions
        assert tokens_now[: len(tokens)] == tokens and logprobs_now[: len(tokens)] == logprobs, key
        expected = versions if reason != "abort" else versions + [2] * (len(tokens_now) - len(tokens))
        assert versions_now == expected, key
        checked += bool(tokens) and reason == "abort" and len(tokens_now) > len(tokens)
    assert checked > 0  # some sample really was continued under version 2
    # The oldest complete groups train first: every group carried from step 0 that completed is in.
    done = {g for (g, _), v in carried.items()} - {g.prompt.index for g in rm.in_flight}
    assert done <= {s.group_index for s in second}
    assert m2["rollout/partial/staleness_0"] < 1.0 and m2["rollout/partial/staleness_max"] == 1.0


@pytest.mark.slow
def test_staleness_bound_restarts_old_samples(toy):  # noqa: F811
    rm, data = manager(toy, max_staleness=1, **PARTIAL)
    rm.engine.weight_version = 1
    rm.generate(data, rollout_id=0)
    with_tokens = sum(1 for v in _state(rm).values() if v[0])
    assert with_tokens > 0
    rm.engine.weight_version = 3  # two updates later: every kept token is 2 versions old
    samples, m = rm.generate(data, rollout_id=1)
    assert m["rollout/partial/dropped_stale_samples"] == with_tokens
    assert all(staleness(s, 3) == 0 for s in samples) and m["rollout/partial/staleness_0"] == 1.0

    lenient, data = manager(toy, max_staleness=2, **PARTIAL)
    lenient.engine.weight_version = 1
    lenient.generate(data, rollout_id=0)
    lenient.engine.weight_version = 3
    samples, m = lenient.generate(data, rollout_id=1)
    assert m["rollout/partial/dropped_stale_samples"] == 0
    assert max(staleness(s, 3) for s in samples) == 2 == m["rollout/partial/staleness_max"]
    assert m["rollout/partial/staleness_2"] > 0 and m["rollout/partial/stale_token_ratio"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("max_staleness, in_flight", [(1, 8), (3, 16)])
def test_a_run_never_exceeds_the_staleness_bound_nor_restarts(toy, max_staleness, in_flight):  # noqa: F811
    """One update a step, the most groups in flight the bound allows: the groups at their bound
    finish within the step (it is held open for them) instead of restarting."""
    rm, data = manager(
        toy, max_staleness=max_staleness, **{**PARTIAL, "over_sampling_batch_size": in_flight, "max_response_len": 64}
    )
    held = 0
    for step in range(8):
        rm.engine.weight_version = step + 1
        samples, m = rm.generate(data, rollout_id=step)
        _check_whole_groups(samples)
        assert m["rollout/partial/dropped_stale_samples"] == 0, step
        assert max(staleness(s, step + 1) for s in samples) == m["rollout/partial/staleness_max"] <= max_staleness
        assert all(staleness(s, step + 2) <= max_staleness for g in rm.in_flight for s in g.samples)
        held += m["rollout/partial/held_for_staleness"]
    assert held > 0  # the bound did hold a step open (the seeded toy run needs it)


@pytest.mark.slow
def test_every_drawn_group_trains_exactly_once(toy):  # noqa: F811
    rm, data = manager(toy, **PARTIAL)
    drawn = Counter()
    next_batch = data.next_batch

    def recorded(n):
        prompts = next_batch(n)
        drawn.update(p.index for p in prompts)
        return prompts

    data.next_batch = recorded
    trained = Counter()
    for step in range(5):
        rm.engine.weight_version = step + 1
        samples, m = rm.generate(data, rollout_id=step)
        _check_whole_groups(samples)
        trained.update(s.group_index for s in samples[::4])
        assert m["rollout/generated_groups"] == (8 if step == 0 else 4)
    assert sum(trained.values()) == 20 and max(trained.values()) == 1
    assert trained + Counter(g.prompt.index for g in rm.in_flight) == drawn
    assert sum(drawn.values()) == 24
