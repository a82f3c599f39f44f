"""Rollout orchestration: prompts -> groups of completions -> rewards -> (dynamic) filtering.

Each rank samples whole groups for its share of the prompts, so advantages never need another
rank's data. With dynamic sampling, groups whose rewards all agree (no learning signal under
group-relative advantages) are dropped and more prompts are drawn until the batch is full or the
round cap is reached; all ranks run the same number of rounds so their data sources stay in step.
With partial rollout (colocate/rollout/partial.py), generation ends once enough groups are complete
and the unfinished samples continue in the next step.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from colocate import dist
from colocate.config import RolloutConfig
from colocate.rollout.partial import (
    ABORT,
    STALENESS_BUCKETS,
    InFlightGroup,
    by_urgency,
    group_staleness,
    group_state,
    load_group,
    restart_stale,
    schedulable,
    split_trained,
    stale_tokens,
    staleness,
    staleness_counts,
)
from colocate.rollout.protocol import Completion, Request, RolloutEngine, SamplingParams
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
    num_seqs: int = 0
    """Most samples handed to the engine at once."""


def _split(samples: list[Sample], sampling: list[SamplingParams]) -> list[list[Sample]]:
    """Prompt-major samples cut into groups of each prompt's n."""
    groups, i = [], 0
    for sp in sampling:
        groups.append(samples[i : i + sp.n])
        i += sp.n
    return groups


class RolloutManager:
    """Owns the engine calls of a rank: training rollouts and evaluation."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        rollout_cfg: RolloutConfig,
        *,
        reward_fn: RewardFn,
        strict: bool = False,
        overlong: tuple[int, float] | None = None,
        custom_generate: Callable | None = None,
        episodes=None,
        seed: int = 0,
    ):
        """strict: a reward function that raises stops the run; overlong = (buffer_len, factor);
        episodes: the EpisodeRunner of rollout.env (colocate/envs/episodes.py), whose rewards replace
        reward_fn's."""
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, rollout_cfg
        self.reward_fn, self.strict = reward_fn, strict
        self.overlong, self.custom_generate, self.seed = overlong, custom_generate, seed
        self.episodes = episodes
        self.info = dist.get_info()
        self.in_flight: list[InFlightGroup] = []
        """Partial rollout: this rank's groups not trained yet, oldest first."""

    def sampling(self, *, n: int, temperature: float, top_p: float, max_new_tokens: int, seed: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            n=n,
            temperature=temperature,
            top_p=top_p,
            top_k=c.top_k,
            min_p=c.min_p,
            max_new_tokens=max_new_tokens,
            stop_token_ids=tuple(c.stop_token_ids),
            seed=seed,
        )

    def sample_groups(self, prompts, sampling: list[SamplingParams], reward_fn) -> tuple[list[list[Sample]], int]:
        """Generate one group per prompt and score it. Returns (groups, reward errors)."""
        if self.episodes is not None:
            samples = self.episodes.run(self.engine, prompts, sampling)
            self._check_versions(samples)
            texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            for s, text in zip(samples, texts):
                s.response_text = text
            return _split(samples, sampling), 0
        if self.custom_generate is not None:
            samples = self.custom_generate(self.engine, prompts, sampling, self.tokenizer)
            expected = sum(s.n for s in sampling)
            if not isinstance(samples, list) or len(samples) != expected:
                raise ValueError(
                    f"rollout.custom_generate returned {type(samples).__name__} of "
                    f"{len(samples) if hasattr(samples, '__len__') else '?'} samples; expected a "
                    f"list of {expected} Sample objects (n per prompt, prompt-major)"
                )
        else:
            completions = self.engine.generate([p.prompt_ids for p in prompts], sampling)
            samples = [self._to_sample(prompts[c.prompt_index], c) for c in completions]
        self._check_versions(samples)
        errors = self._score(samples, reward_fn)
        return _split(samples, sampling), errors

    def _score(self, samples: list[Sample], reward_fn) -> int:
        """Decode the responses and set rewards (with the over-long shaping); returns reward errors."""
        texts = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        for s, text in zip(samples, texts):
            s.response_text = text
        inputs = [RewardInput(s.prompt_text, s.response_text, s.label, s.metadata) for s in samples]
        rewards, errors = compute_rewards(reward_fn, inputs, strict=self.strict)
        for s, r in zip(samples, rewards):
            s.raw_reward = s.reward = float(r)
        if self.overlong is not None:
            self._apply_overlong(samples)
        return errors

    def _to_sample(self, prompt, c: Completion, kept_versions: Sequence[int] = ()) -> Sample:
        """`kept_versions`: weight versions of the tokens a continued sample kept from before."""
        versions = [*kept_versions, *[c.weight_version] * (len(c.output_ids) - len(kept_versions))]
        return Sample(
            prompt_ids=list(prompt.prompt_ids),
            response_ids=c.output_ids,
            rollout_logprobs=c.logprobs,
            loss_mask=[1] * len(c.output_ids),
            group_index=prompt.index,
            sample_index=c.sample_index,
            finish_reason=c.finish_reason,
            weight_version=c.weight_version,
            token_versions=versions,
            prompt_text=prompt.prompt_text,
            label=prompt.label,
            metadata=prompt.metadata,
        )

    def _check_versions(self, samples: list[Sample]):
        want = self.engine.weight_version
        bad = [s for s in samples if s.weight_version != want]
        if bad:
            raise RuntimeError(
                f"{len(bad)} completions were generated with weight version "
                f"{bad[0].weight_version}, but the engine's current version is {want}: "
                f"the weights changed during generation"
            )

    def _apply_overlong(self, samples: list[Sample]):
        import torch

        from colocate.algo.advantages import dapo_overlong_penalty

        buffer_len, factor = self.overlong
        lengths = torch.tensor([s.response_len for s in samples], dtype=torch.float32)
        penalty = dapo_overlong_penalty(lengths, self.cfg.max_response_len, buffer_len, factor)
        for s, p in zip(samples, penalty.tolist()):
            s.reward = s.raw_reward + p

    def generate(
        self, data, rollout_id: int, on_progress: Callable[[int], None] | None = None
    ) -> tuple[list[Sample], dict[str, float]]:
        """This rank's training samples for one rollout step, and rollout/* metrics (global).

        `on_progress(n)` is called with the number of groups newly accepted (or completed)."""
        engine_before = self._engine_counts()
        if self.episodes is not None:
            self.episodes.take()  # episodes of an evaluation since the last step
        if self.cfg.partial_rollout:
            samples, stats, partial_metrics = self._generate_partial(data, rollout_id, on_progress)
        else:
            samples, stats = self._generate_groups(data, rollout_id, on_progress)
            partial_metrics = {}
        metrics = self._metrics(samples, stats)
        metrics.update(partial_metrics)
        if engine_before is not None:
            metrics.update(self._engine_metrics(engine_before, stats.num_seqs))
        if self.episodes is not None:
            metrics.update(self._episode_metrics(rollout_id))
        return samples, metrics

    def _episode_metrics(self, rollout_id: int) -> dict[str, float]:
        """env/* metrics of the step's episodes (collective); a step whose every episode failed is
        an error (on every rank: the share is global), not a step that trains nothing."""
        episodes = self.episodes.take()
        metrics = self.episodes.metrics(episodes)
        if metrics["env/end/error"] == 1.0:
            example = next((e.error for e in episodes if e.error), "see the other ranks")
            raise ValueError(f"rollout.env: every episode of step {rollout_id} failed, e.g. {example}")
        return metrics

    def _generate_groups(self, data, rollout_id: int, on_progress) -> tuple[list[Sample], GroupStats]:
        """Whole groups, in rounds when dynamic sampling refills."""
        c = self.cfg
        world = self.info.world_size
        target = c.rollout_batch_size // world
        per_round = (c.over_sampling_batch_size or c.rollout_batch_size) if c.dynamic_sampling else c.rollout_batch_size
        stats, kept, dropped = GroupStats(), [], []
        start = time.perf_counter()
        while True:
            prompts = data.next_batch(per_round)
            sampling = [
                self._train_sampling(c.n_samples_per_prompt, stable_seed(self.seed, rollout_id, stats.rounds, p.index))
                for p in prompts
            ]
            stats.num_seqs = max(stats.num_seqs, len(prompts) * c.n_samples_per_prompt)
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
            kept += dropped[: stats.topped_up_groups]
        kept = kept[:target]
        stats.seconds = time.perf_counter() - start
        return [s for g in kept for s in g], stats

    def _train_sampling(self, n: int, seed: int) -> SamplingParams:
        c = self.cfg
        return self.sampling(n=n, temperature=c.temperature, top_p=c.top_p, max_new_tokens=c.max_response_len, seed=seed)

    def _generate_partial(self, data, rollout_id: int, on_progress) -> tuple[list[Sample], GroupStats, dict[str, float]]:
        """Continue the groups in flight (stalest first) and start new ones until this rank has
        over_sampling_batch_size / world in flight; stop once rollout_batch_size / world are
        complete and the groups carried can still train within rollout.max_staleness, and train
        the stalest complete ones. See colocate/rollout/partial.py."""
        c, world = self.cfg, self.info.world_size
        target, num_in_flight = c.rollout_batch_size // world, c.over_sampling_batch_size // world
        version = self.engine.weight_version
        stats = GroupStats(rounds=1)
        start = time.perf_counter()
        num_dropped = restart_stale(self.in_flight, version, c.max_staleness)
        need = num_in_flight - len(self.in_flight)
        if need > 0:  # every rank carries as many groups as the others: all draw alike
            for p in data.next_batch(need * world):
                seed = stable_seed(self.seed, rollout_id, 0, p.index)
                self.in_flight.append(InFlightGroup.new(p, seed, c.n_samples_per_prompt))
            stats.generated_groups = need
        self.in_flight = by_urgency(self.in_flight, version)
        stale = {id(g): group_staleness(g, version) for g in self.in_flight}
        requests, owners = self._requests()
        missing = {id(g): len(g.unfinished()) for g in self.in_flight}
        num_complete = sum(g.complete for g in self.in_flight)
        held = False

        def may_end() -> bool:
            nonlocal held
            trained, carried = split_trained(self.in_flight, lambda g: missing[id(g)] == 0, target)
            if len(trained) < target:
                return False
            ok = schedulable([stale[id(g)] for g in carried], target, c.max_staleness)
            held = held or not ok
            return ok

        def enough(finished: list[Completion]) -> bool:
            nonlocal num_complete
            before = num_complete
            for comp in finished:
                owner = id(owners[comp.prompt_index])
                missing[owner] -= 1
                num_complete += missing[owner] == 0
            if on_progress is not None:
                on_progress(min(num_complete, target) - min(before, target))
            return may_end()

        completions = []
        if not may_end():
            stats.num_seqs = sum(r.sampling.n for r in requests)
            completions = self.engine.generate_requests(requests, enough)
        fresh = []
        for comp in completions:
            group = owners[comp.prompt_index]
            old = group.samples[comp.sample_index]
            assert comp.output_ids[: old.response_len] == old.response_ids, "a continued sample lost its tokens"
            group.samples[comp.sample_index] = new = self._to_sample(group.prompt, comp, old.versions)
            stats.generated_tokens += new.response_len - old.response_len
            fresh.append(new)
        self._check_versions(fresh)
        finished = [s for s in fresh if s.finish_reason != ABORT]
        if finished:
            stats.reward_errors = self._score(finished, self.reward_fn)
        trained, self.in_flight = split_trained(self.in_flight, lambda g: g.complete, target)
        assert len(trained) == target, (len(trained), target)
        stats.seconds = time.perf_counter() - start
        samples = [s for g in trained for s in g.samples]
        resumed = sum(bool(r.output_ids) for r in requests) if completions else 0
        return samples, stats, self._partial_metrics(samples, version, num_dropped, resumed, held)

    def _requests(self) -> tuple[list[Request], list[InFlightGroup]]:
        """The engine requests that advance the unfinished groups in flight, and each one's group."""
        n = self.cfg.n_samples_per_prompt
        requests, owners = [], []
        for g in self.in_flight:
            if g.unstarted:  # one request: its samples share the prompt's prefill
                requests.append(Request(g.prompt.prompt_ids, self._train_sampling(n, g.seed)))
                owners.append(g)
                continue
            for s in g.unfinished():
                requests.append(
                    Request(
                        g.prompt.prompt_ids, self._train_sampling(1, g.seed), s.response_ids, s.rollout_logprobs, s.sample_index
                    )
                )
                owners.append(g)
        return requests, owners

    def _partial_metrics(
        self, samples: list[Sample], version: int, num_dropped: int, num_resumed: int, held: bool
    ) -> dict[str, float]:
        carried = [s for g in self.in_flight for s in g.unfinished()]
        counts = staleness_counts(samples, version)
        sums = dist.all_reduce_sum(
            [
                len(self.in_flight),
                len(carried),
                num_resumed,
                num_dropped,
                stale_tokens(samples, version),
                sum(s.response_len for s in samples),
                len(samples),
                *counts,
                held,
                sum(staleness(s, version) for s in samples),
            ]
        ).tolist()
        num_samples = max(sums[6], 1)
        metrics = {
            "rollout/partial/carried_groups": sums[0],
            "rollout/partial/carried_samples": sums[1],
            "rollout/partial/resumed_samples": sums[2],
            "rollout/partial/dropped_stale_samples": sums[3],
            "rollout/partial/held_for_staleness": sums[-2] / self.info.world_size,
            "rollout/partial/stale_token_ratio": sums[4] / max(sums[5], 1),
            "rollout/partial/staleness_mean": sums[-1] / num_samples,
            "rollout/partial/staleness_max": float(dist.all_reduce_max(max((staleness(s, version) for s in samples), default=0))),
        }
        for k in range(STALENESS_BUCKETS):
            name = f"staleness_{k}" if k < STALENESS_BUCKETS - 1 else f"staleness_{k}_or_more"
            metrics[f"rollout/partial/{name}"] = sums[7 + k] / num_samples
        return metrics

    def _engine_counts(self) -> dict[str, float] | None:
        """The engine's cumulative counters so far (the native engine's `stats`), or None for an
        engine that keeps none."""
        counters = getattr(self.engine, "stats", None)
        return None if counters is None else dict(counters)

    def _engine_metrics(self, before: dict[str, float], num_seqs: int) -> dict[str, float]:
        """The engine's work since `before`, over all ranks:
        - rollout/prefill_tokens: prompts, plus what continued samples and preempted sequences
          recompute (with partial rollout under offload, every carried sample's context again);
        - rollout/preemptions: sequences preempted for want of KV-cache blocks;
        - perf/engine_prefill_time, perf/engine_decode_time: the engine's seconds in each (mean
          over ranks);
        - rollout/decode_utilization: the mean decode batch over the batch the engine could have
          run (the samples handed to it, up to its running limit): how far the step's tail of few
          long samples left it empty. Not with custom generation, whose batches are its own."""
        d = {k: v - before.get(k, 0) for k, v in self._engine_counts().items()}
        seats = min(num_seqs, self.cfg.max_running_requests)
        keys = (
            "prefill_tokens",
            "preemptions",
            "prefill_seconds",
            "decode_seconds",
            "decode_tokens",
            "decode_steps",
            "env_wait_seconds",
            "history_tokens",
            "reused_history_tokens",
            "evictions",
        )
        values = [d.get(k, 0) for k in keys]
        values[5] *= seats
        sums = dist.all_reduce_sum(values).tolist()
        world = self.info.world_size
        metrics = {
            "rollout/prefill_tokens": sums[0],
            "rollout/preemptions": sums[1],
            "perf/engine_prefill_time": sums[2] / world,
            "perf/engine_decode_time": sums[3] / world,
        }
        if self.custom_generate is None:
            metrics["rollout/decode_utilization"] = sums[4] / max(sums[5], 1)
        if self.episodes is not None:
            # How much of the episodes' history stayed cached across turns, and how long the engine
            # sat with nothing to decode while environments and tools ran.
            metrics["rollout/kv_reuse"] = sums[8] / max(sums[7], 1)
            metrics["rollout/env_wait_fraction"] = sums[6] / max(sums[2] + sums[3] + sums[6], 1e-9)
            metrics["rollout/parked_evictions"] = sums[9]
        return metrics

    def state_dict(self) -> list[list[dict]]:
        """Every rank's groups in flight, in rank order (collective): a checkpoint's partial rollout."""
        return dist.all_gather_object([group_state(g) for g in self.in_flight])

    def load_state_dict(self, state: list[list[dict]], dataset) -> None:
        """Restore this rank's groups in flight; `dataset` (the PromptDataset) holds their prompts."""
        world = self.info.world_size
        if len(state) != world:
            raise ValueError(
                f"the checkpoint carries the partial rollouts of {len(state)} ranks; resume it "
                f"with that many, not {world} (or set rollout.partial_rollout: false)"
            )
        self.in_flight = [load_group(g, dataset) for g in state[self.info.rank]]

    def _metrics(self, samples: list[Sample], st: GroupStats) -> dict[str, float]:
        n = len(samples)
        lens = [s.response_len for s in samples]
        sums = dist.all_reduce_sum(
            [
                n,
                sum(s.raw_reward for s in samples),
                sum(s.reward for s in samples),
                sum(lens),
                sum(s.finish_reason == "length" for s in samples),
                st.generated_groups,
                st.filtered_groups,
                st.topped_up_groups,
                st.reward_errors,
                st.generated_tokens,
            ]
        ).tolist()
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
            sampling = [
                self.sampling(
                    n=k,
                    temperature=eval_cfg.temperature,
                    top_p=eval_cfg.top_p,
                    max_new_tokens=eval_cfg.max_response_len or self.cfg.max_response_len,
                    seed=stable_seed(self.seed, -1, p.index),
                )
                for p in prompts
            ]
            groups, errors = self.sample_groups(prompts, sampling, reward_fn) if prompts else ([], 0)
            rewards = [[s.raw_reward for s in g] for g in groups]
            sums = dist.all_reduce_sum(
                [
                    len(groups),
                    sum(sum(r) / k for r in rewards),
                    sum(max(r) >= 1.0 for r in rewards),
                    sum(s.response_len for g in groups for s in g),
                    errors,
                ]
            ).tolist()
            total = max(sums[0], 1)
            out[f"eval/{name}/avg@{k}"] = sums[1] / total
            out[f"eval/{name}/pass@{k}"] = sums[2] / total
            out[f"eval/{name}/response_len"] = sums[3] / (total * k)
            out[f"eval/{name}/reward_errors"] = sums[4]
        return out
