"""`bench/e2e.py --tail`: the GRPO step with long-tailed response lengths, partial rollout off and on.

Model: a Qwen3-4B shape (random weights), one GPU, offload on, gradient checkpointing on; 16
prompts of 256 tokens x 8 samples a step. Every sample's length comes from the lognormal of
`bench/rollout_throughput.py --cases tail` (median 1536, capped at 8192), fixed by its prompt and sample
index, with ignore_eos: `TailLengths` sits between the rollout manager and the engine and splits
each request into one request per sample with that sample's max_new_tokens, so a sample continued
in a later step keeps its length. Partial rollout on keeps 64 groups in flight (four times the
step's, `--over-sampling 4`: with twice, steps 2 and 3 on the H200 took as long as without
partial rollout; on an H100, four times slowed step after step, 59, 63, 90 and over 170 s, while
the scheduler readmitted preempted sequences at once: carried samples' contexts are prefilled again
after every offload and outgrow half the H200's KV cache. With admission backing off after a
preemption, steps 2-5 generated in 41-57 s there; rollout/prefill_tokens and rollout/preemptions
show each step's),
with max_staleness 8: a group then trains about three versions after its first token, and a sample at
the 8192-token cap needs several steps of a full batch to finish; a bound that close would hold
steps open for it (validation wants at least 3 for four steps' groups in flight).
Reported next to the step times: how many groups were drawn, trained and left in flight, and
whether every drawn prompt's group trained exactly once (the others still in flight at the end).
`--cpu-smoke` runs a tiny shape on CPU.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from bench.rollout_throughput import TAIL_RUNS, TAIL_SHAPES, tail_length
from colocate.rollout.orchestrator import stable_seed
from colocate.rollout.protocol import Request, SamplingParams

SHAPES = {"4b": {**TAIL_SHAPES["4b"], "attention_bias": False}, "tiny_tail": {**TAIL_SHAPES["tiny"], "attention_bias": False}}
BATCHES = {
    "4b": dict(prompts=16, samples_per_prompt=8, prompt_tokens=256, response_tokens=TAIL_RUNS["4b"]["max_tokens"]),
    "tiny_tail": dict(prompts=4, samples_per_prompt=4, prompt_tokens=16, response_tokens=TAIL_RUNS["tiny"]["max_tokens"]),
}
RUNS = {"4b": TAIL_RUNS["4b"], "tiny_tail": TAIL_RUNS["tiny"]}
TIMEOUT_S = 1500.0
"""Per variant: the 4B shape compiles, captures graphs and trains ~0.3M tokens a step."""


def tail_config(cfg: dict, shape: str, partial: bool, over_sampling: int = 4) -> dict:
    """e2e.py's config of one variant, turned into the tail run's: with partial rollout,
    `over_sampling` times the step's groups in flight."""
    rollout = cfg["rollout"]
    del rollout["custom_generate"]  # TailLengths fixes the lengths; partial rollout refuses a custom one
    rollout["partial_rollout"] = partial
    if partial:
        rollout["over_sampling_batch_size"] = over_sampling * BATCHES[shape]["prompts"]
        rollout["max_staleness"] = 8
    rollout["gpu_memory_fraction"] = 0.75  # the whole tail in flight must fit without preemption
    cfg["model"]["gradient_checkpointing"] = shape == "4b"
    cfg["offload"] = {"offload_rollout": True, "offload_train": True}
    return cfg


class TailLengths:
    """The engine as the rollout manager sees it, every sample with its own tail length."""

    def __init__(self, engine, shape: str):
        self.engine, self.run = engine, RUNS[shape]

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def length(self, prompt_ids, sample_index: int) -> int:
        r = self.run
        return tail_length(stable_seed(*prompt_ids, sample_index), r["median_tokens"], r["sigma"], r["max_tokens"])

    def generate(self, prompt_ids, sampling):
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompt_ids)
        return self.generate_requests([Request(p, sp) for p, sp in zip(prompt_ids, sampling)])

    def generate_requests(self, requests, stop=None):
        split, origin = [], []
        for i, r in enumerate(requests):
            for j in range(r.sample_index, r.sample_index + r.sampling.n):  # seed + j as before the split
                sampling = dataclasses.replace(r.sampling, n=1, ignore_eos=True, max_new_tokens=self.length(r.prompt_ids, j))
                split.append(Request(r.prompt_ids, sampling, r.output_ids, r.logprobs, j))
                origin.append(i)

        def back(completions):
            return [dataclasses.replace(c, prompt_index=origin[c.prompt_index]) for c in completions]

        out = self.engine.generate_requests(split, None if stop is None else (lambda done: stop(back(done))))
        return sorted(back(out), key=lambda c: (c.prompt_index, c.sample_index))


def install(loop, shape: str) -> dict:
    """Put TailLengths in front of the loop's engine and count, from now on, the prompts drawn
    and the groups trained (by dataset index)."""
    loop.rollout.engine = TailLengths(loop.engine, shape)
    data, rollout = loop.inputs.data, loop.rollout
    next_batch, generate = data.next_batch, rollout.generate
    record = {"drawn": Counter(), "trained": Counter()}

    def drawn(n):
        prompts = next_batch(n)
        record["drawn"].update(p.index for p in prompts)
        return prompts

    def generated(*args, **kwargs):
        samples, metrics = generate(*args, **kwargs)
        record["trained"].update(s.group_index for s in samples if s.sample_index == 0)
        return samples, metrics

    data.next_batch, rollout.generate = drawn, generated
    return record


def groups_report(record: dict, loop) -> dict:
    """Drawn = trained + still in flight, each trained group once: nothing lost, nothing twice."""
    in_flight = Counter(g.prompt.index for g in loop.rollout.in_flight)
    drawn, trained = record["drawn"], record["trained"]
    return {
        "drawn": sum(drawn.values()),
        "trained": sum(trained.values()),
        "in_flight_at_end": sum(in_flight.values()),
        "trained_beyond_drawn": sum((trained - drawn).values()),
        "nothing_lost": trained + in_flight == drawn,
    }


def summary(run: dict) -> list[str]:
    """The tail's part of e2e.py's summary line for one variant (nothing for other runs)."""
    g = run.get("groups")
    if not g:
        return []
    return [
        f"[utilization {run['decode_utilization']:.2f}; groups {g['trained']} trained, "
        f"{g['in_flight_at_end']} in flight, {'nothing lost' if g['nothing_lost'] else 'LOST'}]"
    ]
