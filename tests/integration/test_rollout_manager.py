"""Rollout orchestration on the toy model with the native engine (CPU, one process)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from colocate import dist
from colocate.rollout.native import NativeEngine
from colocate.rollout.orchestrator import RolloutManager
from colocate.rollout.prompts import PromptDataset, PromptSampler
from colocate.rollout.rewards import load_reward_fn
from colocate.toy import ensure_toy
from colocate.user_code import load_function
from tests.multiturn_hook import TOOL_REPLY


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    dist.init()
    path = ensure_toy(tmp_path_factory.mktemp("toy") / "toy")
    yield path
    dist.destroy()


def rollout_cfg(**over):
    base = dict(
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        over_sampling_batch_size=None,
        dynamic_sampling=False,
        max_sampling_rounds=3,
        temperature=1.0,
        top_p=1.0,
        top_k=-1,
        min_p=0.0,
        max_response_len=6,
        stop_token_ids=[],
        max_running_requests=256,
        partial_rollout=False,
        max_staleness=1,
        partial_mask_stale_tokens=True,
    )
    return SimpleNamespace(**{**base, **over})


def manager(toy, reward="toy", **over):
    tok = AutoTokenizer.from_pretrained(toy / "model")
    engine = NativeEngine(toy / "model", dtype=torch.float32, device="cpu", max_kv_tokens=4096)
    strict = over.pop("strict", False)
    hook = over.pop("custom_generate", None)

    data = PromptSampler(PromptDataset(toy / "train.jsonl", tok), seed=0)
    fn = reward if callable(reward) else load_reward_fn(reward)
    return RolloutManager(engine, tok, rollout_cfg(**over), reward_fn=fn, strict=strict, seed=1, custom_generate=hook), data


def test_groups_rewards_and_metrics(toy):
    rm, data = manager(toy)
    samples, m = rm.generate(data, rollout_id=0)
    assert len(samples) == 16 and [s.group_index for s in samples[:4]] == [samples[0].group_index] * 4
    assert all(s.weight_version == 0 and len(s.rollout_logprobs) == s.response_len for s in samples)
    assert m["rollout/raw_reward"] == pytest.approx(sum(s.raw_reward for s in samples) / 16)
    assert m["rollout/num_samples"] == 16 and m["rollout/sampling_rounds"] == 1
    # One prefill per group (its samples share the prompt's), no preemption in a cache this large.
    assert m["rollout/prefill_tokens"] == sum(len(s.prompt_ids) for s in samples[::4])
    assert m["rollout/preemptions"] == 0 and m["perf/engine_prefill_time"] > 0 and m["perf/engine_decode_time"] > 0
    again, _ = manager(toy)[0].generate(manager(toy)[1], rollout_id=0)
    assert [s.response_ids for s in again] == [s.response_ids for s in samples]  # seeded


def test_a_runs_rollouts_carry_the_configured_overlong_penalty(toy, tmp_path):
    """algorithm.overlong_buffer_len and overlong_penalty_factor, set in the config of a whole run
    (colocate.train.Loop), shape the rewards of its rollouts: reward = raw_reward - factor *
    clamp((L - (max_response_len - buffer_len)) / buffer_len, 0, 1) for a response of L tokens."""
    from colocate.config import Config
    from colocate.train import Loop

    cfg = Config()
    cfg.output_dir, cfg.model.path, cfg.logging.console = str(tmp_path / "run"), str(toy / "model"), False
    r, a = cfg.rollout, cfg.algorithm
    r.prompt_data, r.rollout_batch_size, r.n_samples_per_prompt = str(toy / "train.jsonl"), 4, 4
    r.max_response_len, r.max_kv_tokens = 10, 4096
    a.overlong_buffer_len, a.overlong_penalty_factor = 5, 0.3
    loop = Loop(cfg, dist.get_info())
    try:
        loop.build()
        samples, m = loop.rollout.generate(loop.inputs.data, rollout_id=0)
    finally:
        loop.close()
    penalties = [0.3 * min(max((s.response_len - 5) / 5, 0.0), 1.0) for s in samples]
    assert len({round(p, 6) for p in penalties}) >= 2 and max(penalties) > 0  # lengths inside the buffer too
    assert [s.reward for s in samples] == pytest.approx([s.raw_reward - p for s, p in zip(samples, penalties)])
    assert m["rollout/rewards"] == pytest.approx(m["rollout/raw_reward"] - sum(penalties) / len(samples))


def test_dynamic_sampling_drops_uniform_groups_and_tops_up(toy):
    # A reward that is 1 for every sample of even-indexed prompts: those groups carry no signal.
    def reward(prompts, responses, labels, metadata):
        return [float(len(r) % 2) if int(m["start"] == "a") else 1.0 for r, m in zip(responses, metadata)]

    rm, data = manager(toy, reward=reward, dynamic_sampling=True, over_sampling_batch_size=8)
    samples, m = rm.generate(data, rollout_id=0)
    assert len(samples) == 16
    assert m["rollout/dynamic_filtered_groups"] >= 1
    assert m["rollout/generated_groups"] == 8 * m["rollout/sampling_rounds"]
    varied = [len({s.reward for s in samples[i : i + 4]}) > 1 for i in range(0, 16, 4)]
    assert sum(varied) == 4 - m["rollout/topped_up_groups"]


def test_raising_reward_counted_and_strict_fatal(toy):
    def reward(prompts, responses, labels, metadata):
        if any("a" in r for r in responses):
            raise RuntimeError("grader crashed")
        return [1.0] * len(responses)

    rm, data = manager(toy, reward=reward)
    samples, m = rm.generate(data, rollout_id=0)
    failed = [s for s in samples if "a" in s.response_text]
    assert m["rollout/reward_errors"] == len(failed) and all(s.raw_reward == 0 for s in failed)
    rm, data = manager(toy, reward=reward, strict=True)
    with pytest.raises(ValueError, match="failed on sample .* RuntimeError: grader crashed$"):
        rm.generate(data, rollout_id=0)


def test_custom_generate_hook_masks_tool_tokens(toy):
    hook = load_function("tests.multiturn_hook:two_turns", "rollout.custom_generate")
    rm, data = manager(toy, custom_generate=hook)
    samples, _ = rm.generate(data, rollout_id=0)
    assert len(samples) == 16
    for s in samples:
        assert s.response_ids[3:5] == TOOL_REPLY and s.loss_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    with pytest.raises(ValueError, match="rollout.custom_generate"):
        load_function("tests.multiturn_hook:nope", "rollout.custom_generate")


def test_weight_version_mismatch_fails_loudly(toy):
    rm, data = manager(toy)
    rm.engine.weight_version = 5  # the engine moved on while completions still carry version 0

    def stale_generate(prompt_ids, sampling, _orig=rm.engine.generate):
        out = _orig(prompt_ids, sampling)
        for c in out:
            c.weight_version = 4
        return out

    rm.engine.generate = stale_generate
    with pytest.raises(RuntimeError, match="weight version 4"):
        rm.generate(data, rollout_id=0)


def test_evaluate_averages_rewards_and_counts_prompts_with_a_success(toy):
    """avg@k is the mean reward over each prompt's k samples and the prompts; pass@k the share of
    prompts with at least one reward of 1. Half the prompts score 0, the others vary within their
    groups, so the two differ."""
    scored: dict[str, list[float]] = {}
    rm, data = manager(toy)
    prompts = [data.dataset[i] for i in range(6)]
    solvable = {p.prompt_text for p in prompts[:3]}

    def reward(prompts, responses, labels, metadata):
        out = [float(p in solvable and sum(map(ord, r)) % 2 == 1) for p, r in zip(prompts, responses)]
        for p, r in zip(prompts, out):
            scored.setdefault(p, []).append(r)
        return out

    cfg = SimpleNamespace(n_samples_per_eval_prompt=4, temperature=1.0, top_p=1.0, max_response_len=None)
    out = rm.evaluate([("held", prompts, reward)], 0, cfg)
    groups = list(scored.values())
    assert len(groups) == 6 and all(len(g) == 4 for g in groups)
    avg, passed = sum(sum(g) / 4 for g in groups) / 6, sum(max(g) >= 1 for g in groups) / 6
    assert out["eval/held/avg@4"] == pytest.approx(avg) and out["eval/held/pass@4"] == pytest.approx(passed)
    assert 0 < avg < passed <= 0.5
