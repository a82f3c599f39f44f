"""Rollout orchestration: prompts -> groups of completions -> rewards -> (dynamic) filtering.

Each rank samples whole groups for its share of the prompts, so advantages never need another
rank's data. With dynamic sampling, groups whose rewards all agree (no learning signal under
group-relative advantages) are dropped and more prompts are drawn until the batch is full or the
round cap is reached; all ranks run the same number of rounds so their data sources stay in step.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable

from colocate import dist
from colocate.config import RolloutConfig
from colocate.rollout.protocol import Completion, RolloutEngine, SamplingParams
from colocate.rollout.rewards import RewardFn, RewardInput, compute_rewards
from colocate.rollout.sample import Sample


def stable_seed(*parts: int) -> int:
    """A seed that depends only on the given integers (not on Python's hash randomisation)."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x3FFFFFFF


@dataclass
class GroupStats:
    rounds: int = 0
    generated_groups: int = 0
    filtered_groups: int = 0
    topped_up_groups: int = 0
    reward_errors: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0


class RolloutManager:
    """Owns the engine calls of a rank: training rollouts and evaluation."""

    def __init__(self, engine: RolloutEngine, tokenizer, rollout_cfg: RolloutConfig, *, reward_fn: RewardFn,
                 strict: bool = False, overlong: tuple[int, float] | None = None,
                 custom_generate: Callable | None = None, seed: int = 0):
        """strict: a reward function that raises stops the run; overlong = (buffer_len, factor)."""
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, rollout_cfg
        self.reward_fn, self.strict = reward_fn, strict
        self.overlong, self.custom_generate, self.seed = overlong, custom_generate, seed
        self.info = dist.get_info()

    def sampling(self, *, n: int, temperature: float, top_p: float, max_new_tokens: int,
                 seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=c.top_k, min_p=c.min_p,
                              max_new_tokens=max_new_tokens, stop_token_ids=tuple(c.stop_token_ids),
                              seed=seed)

    def sample_groups(self, prompts, sampling: list[SamplingParams], reward_fn) -> tuple[list[list[Sample]], int]:
        """Generate one group per prompt and score it. Returns (groups, reward errors)."""
        if self.custom_generate is not None:
            samples = self.custom_generate(self.engine, prompts, sampling, self.tokenizer)
            expected = sum(s.n for s in sampling)
            if not isinstance(samples, list) or len(samples) != expected:
                raise ValueError(f"rollout.custom_generate returned {type(samples).__name__} of "
                                 f"{len(samples) if hasattr(samples, '__len__') else '?'} samples; expected a "
                                 f"list of {expected} Sample objects (n per prompt, prompt-major)")
        else:
            completions = self.engine.generate([p.prompt_ids for p in prompts], sampling)
            samples = [self._to_sample(prompts[c.prompt_index], c) for c in completions]
        self._check_versions(samples)
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        for s, text in zip(samples, texts):
            s.response_text = text
        inputs = [RewardInput(s.prompt_text, s.response_text, s.label, s.metadata) for s in samples]
        rewards, errors = compute_rewards(reward_fn, inputs, strict=self.strict)
        for s, r in zip(samples, rewards):
            s.raw_reward = s.reward = float(r)
        if self.overlong is not None:
            self._apply_overlong(samples)
        groups, i = [], 0
        for sp in sampling:
            groups.append(samples[i:i + sp.n])
            i += sp.n
        return groups, errors

    def _to_sample(self, prompt, c: Completion) -> Sample:
        return Sample(prompt_ids=list(prompt.prompt_ids), response_ids=c.output_ids,
                      rollout_logprobs=c.logprobs, loss_mask=[1] * len(c.output_ids),
                      group_index=prompt.index, sample_index=c.sample_index,
                      finish_reason=c.finish_reason, weight_version=c.weight_version,
                      prompt_text=prompt.prompt_text, label=prompt.label, metadata=prompt.metadata)

    def _check_versions(self, samples: list[Sample]):
        want = self.engine.weight_version
        bad = [s for s in samples if s.weight_version != want]
        if bad:
            raise RuntimeError(f"{len(bad)} completions were generated with weight version "
                               f"{bad[0].weight_version}, but the engine's current version is {want}: "
                               f"the weights changed during generation")

    def _apply_overlong(self, samples: list[Sample]):
        from colocate.algo.advantages import dapo_overlong_penalty
        import torch

        buffer_len, factor = self.overlong
        lengths = torch.tensor([s.response_len for s in samples], dtype=torch.float32)
        penalty = dapo_overlong_penalty(lengths, self.cfg.max_response_len, buffer_len, factor)
        for s, p in zip(samples, penalty.tolist()):
            s.reward = s.raw_reward + p

    def generate(self, data, rollout_id: int, on_progress: Callable[[int], None] | None = None
                 ) -> tuple[list[Sample], dict[str, float]]:
        """This rank's training samples for one rollout step, and rollout/* metrics (global).

        `on_progress(n)` is called with the number of groups newly accepted after each round."""
        c = self.cfg
        world = self.info.world_size
        target = c.rollout_batch_size // world
        per_round = (c.over_sampling_batch_size or c.rollout_batch_size) if c.dynamic_sampling else c.rollout_batch_size
        stats, kept, dropped = GroupStats(), [], []
        start = time.perf_counter()
        while True:
            prompts = data.next_batch(per_round)
            sampling = [self.sampling(n=c.n_samples_per_prompt, temperature=c.temperature, top_p=c.top_p,
                                      max_new_tokens=c.max_response_len,
                                      seed=stable_seed(self.seed, rollout_id, stats.rounds, p.index))
                        for p in prompts]
            groups, errors = self.sample_groups(prompts, sampling, self.reward_fn)
            stats.rounds += 1
            stats.reward_errors += errors
            stats.generated_groups += len(groups)
            before = len(kept)
            for g in groups:
                stats.generated_tokens += sum(s.response_len for s in g)
                varied = len({round(s.reward, 6) for s in g}) > 1
                (kept if varied or not c.dynamic_sampling else dropped).append(g)
            if on_progress is not None:
                on_progress(min(len(kept), target) - min(before, target))
            short = int(len(kept) < target and stats.rounds < c.max_sampling_rounds)
            if not c.dynamic_sampling or not dist.all_reduce_max(short):
                break
        stats.filtered_groups = len(dropped)
        if len(kept) < target:  # round cap reached: top up with uninformative groups, counted
            stats.topped_up_groups = min(target - len(kept), len(dropped))
            kept += dropped[:stats.topped_up_groups]
        kept = kept[:target]
        stats.seconds = time.perf_counter() - start
        samples = [s for g in kept for s in g]
        return samples, self._metrics(samples, stats)

    def _metrics(self, samples: list[Sample], st: GroupStats) -> dict[str, float]:
        n = len(samples)
        lens = [s.response_len for s in samples]
        sums = dist.all_reduce_sum([
            n, sum(s.raw_reward for s in samples), sum(s.reward for s in samples), sum(lens),
            sum(s.finish_reason == "length" for s in samples), st.generated_groups, st.filtered_groups,
            st.topped_up_groups, st.reward_errors, st.generated_tokens,
        ]).tolist()
        total = max(sums[0], 1)
        return {
            "rollout/raw_reward": sums[1] / total,
            "rollout/rewards": sums[2] / total,
            "rollout/response_len/mean": sums[3] / total,
            "rollout/response_len/max": float(dist.all_reduce_max(max(lens, default=0))),
            "rollout/truncated_ratio": sums[4] / total,
            "rollout/num_samples": sums[0],
            "rollout/sampling_rounds": float(st.rounds),
            "rollout/generated_groups": sums[5],
            "rollout/dynamic_filtered_groups": sums[6],
            "rollout/topped_up_groups": sums[7],
            "rollout/reward_errors": sums[8],
            "perf/rollout_tokens_per_s": sums[9] / max(st.seconds, 1e-9),
        }

    def evaluate(self, eval_sets, rollout_id: int, eval_cfg) -> dict[str, float]:
        """avg@k and pass@k per eval dataset; eval_sets: [(name, prompts of this rank, reward_fn)]."""
        out = {}
        k = eval_cfg.n_samples_per_eval_prompt
        for name, prompts, reward_fn in eval_sets:
            sampling = [self.sampling(n=k, temperature=eval_cfg.temperature, top_p=eval_cfg.top_p,
                                      max_new_tokens=eval_cfg.max_response_len or self.cfg.max_response_len,
                                      seed=stable_seed(self.seed, -1, p.index)) for p in prompts]
            groups, errors = self.sample_groups(prompts, sampling, reward_fn) if prompts else ([], 0)
            rewards = [[s.raw_reward for s in g] for g in groups]
            sums = dist.all_reduce_sum([
                len(groups), sum(sum(r) / k for r in rewards), sum(max(r) >= 1.0 for r in rewards),
                sum(s.response_len for g in groups for s in g), errors,
            ]).tolist()
            total = max(sums[0], 1)
            out[f"eval/{name}/avg@{k}"] = sums[1] / total
            out[f"eval/{name}/pass@{k}"] = sums[2] / total
            out[f"eval/{name}/response_len"] = sums[3] / (total * k)
            out[f"eval/{name}/reward_errors"] = sums[4]
        return out
