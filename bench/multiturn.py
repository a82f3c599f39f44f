"""Multi-turn rollout on one GPU: episodes in one continuous batch against turn-by-turn resubmission.

Workload per shape (0.5B, Qwen2.5-shaped; 4B, Qwen3-shaped; random bf16 weights): 32 prompts of 128
tokens x 8 samples = 256 episodes, 4 turns each of 128 sampled tokens (ignore_eos: every turn runs
to its budget), a 64-token observation after each of the first three turns, produced by a tool that
sleeps `--tool-ms` (50 and 500 by default) in a worker thread. Sampled tokens per second, wall time
of the whole rollout (prefills, tool waits and all), for:

- ours: `NativeEngine.generate_turns`, every episode in one continuous batch; a sequence whose turn
  ends is parked with its KV cache while its tool sleeps, then only the observation is prefilled;
- turn_by_turn: what a `rollout.custom_generate` hook does: one prompt's group after another, each
  turn a new generate call with the whole history as its prompt (prefilled again every turn).
  Timed on the first `--sequential-groups` groups (its tokens/s does not depend on how many);
- resubmit: a continuous-batching server without prefix cache, as an HTTP client loop sees one:
  every episode on its own, its next turn submitted (whole context) as soon as its tool returns,
  all episodes batched together;
- single_turn: the same 256 samples with 512 sampled tokens each in one generate call.

Ratios: ratio_vs_single_turn = ours / single_turn (targets >= 0.85 at 50 ms tools); ratio_vs_turn_by_turn
= ours / turn_by_turn (target >= 3); ratio_vs_resubmit. What they hide: single_turn reads less KV per
token (its contexts end at 640, ours at 832 tokens) and prefills no observations; the tool sleeps
are parallel in every mode but turn_by_turn's, where a group's 8 tools sleep together.

Writes JSON (default bench/results/multiturn.json, or multiturn_<card>.json with --card-suffix).
Run: python -m bench.multiturn [--shapes 0.5b,4b] [--tool-ms 50,500] [--cpu-smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, machine, result_path, sync, write_result
from bench.e2e import SHAPES as E2E_SHAPES
from bench.rollout_throughput import TAIL_SHAPES, make_prompts
from colocate.models import ArchConfig, from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import Continue, Request, SamplingParams

RESULTS = RESULTS_DIR / "multiturn.json"
SHAPES = {"0.5b": E2E_SHAPES["0.5b"], "4b": TAIL_SHAPES["4b"], "tiny": E2E_SHAPES["tiny"]}
WORKLOAD = dict(prompts=32, samples=8, prompt_tokens=128, turns=4, turn_tokens=128, observation_tokens=64)
SMOKE = dict(prompts=4, samples=2, prompt_tokens=16, turns=3, turn_tokens=8, observation_tokens=4)


def build_engine(shape: str, device: torch.device, w: dict) -> NativeEngine:
    cfg = SHAPES[shape]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = from_config(ArchConfig(**cfg, eos_token_id=cfg["vocab_size"] - 1), dtype, device, init=True)
    episodes = w["prompts"] * w["samples"]
    per_episode = w["prompt_tokens"] + w["turns"] * w["turn_tokens"] + (w["turns"] - 1) * w["observation_tokens"]
    return NativeEngine(
        model, device=device, max_num_seqs=episodes, max_kv_tokens=episodes * (per_episode + 64), cuda_graph_max_bs=episodes
    )


def observation(episode: int, turn: int, w: dict, vocab: int) -> list[int]:
    rng = random.Random(episode * 1000 + turn)
    return [rng.randrange(vocab - 1) for _ in range(w["observation_tokens"])]


def _sampling(w: dict, n: int, seed: int, tokens: int | None = None) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=tokens or w["turn_tokens"], ignore_eos=True, seed=seed)


def run_ours(engine: NativeEngine, prompts: list[list[int]], w: dict, tool_s: float) -> dict:
    vocab = engine.model.config.vocab_size
    pool = ThreadPoolExecutor(max_workers=len(prompts) * w["samples"])  # every episode's tool at once
    turns: dict[tuple[int, int], int] = {}

    def tool(key, turn):
        if turn + 1 >= w["turns"]:
            return None
        time.sleep(tool_s)
        return Continue(observation(key[0] * w["samples"] + key[1], turn, w, vocab), w["turn_tokens"])

    def next_turn(end):
        key = (end.prompt_index, end.sample_index)
        turn = turns.get(key, 0)
        turns[key] = turn + 1
        return pool.submit(tool, key, turn)

    requests = [Request(p, _sampling(w, w["samples"], seed=i)) for i, p in enumerate(prompts)]
    before = dict(engine.stats)
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate_turns(requests, next_turn)
    seconds = time.perf_counter() - start
    pool.shutdown()
    sampled = sum(sum(c.extra["loss_mask"]) for c in outs)
    assert sampled == len(outs) * w["turns"] * w["turn_tokens"]
    d = {k: engine.stats[k] - before[k] for k in before}
    return {
        "seconds": seconds,
        "sampled_tokens": sampled,
        "tokens_per_s": sampled / seconds,
        "env_wait_seconds": d["env_wait_seconds"],
        **_engine_work(d),
        "kv_reuse": d["reused_history_tokens"] / max(d["history_tokens"], 1),
        "evictions": d["evictions"],
    }


def _engine_work(d: dict) -> dict:
    """The engine's steps and seconds (synchronised) per phase, from a difference of its stats."""
    return {k: d[k] for k in ("prefill_tokens", "prefill_steps", "prefill_seconds", "decode_steps", "decode_seconds")}


def run_turn_by_turn(engine: NativeEngine, prompts: list[list[int]], w: dict, tool_s: float) -> dict:
    vocab = engine.model.config.vocab_size
    sampled = 0
    before = dict(engine.stats)
    sync(engine.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        contexts = [list(prompt) for _ in range(w["samples"])]
        for turn in range(w["turns"]):
            outs = engine.generate(contexts, [_sampling(w, 1, seed=i * 1000 + j) for j in range(w["samples"])])
            sampled += sum(len(c.output_ids) for c in outs)
            if turn + 1 < w["turns"]:
                time.sleep(tool_s)  # the group's tools run together
                for j, c in enumerate(outs):
                    contexts[j] += c.output_ids + observation(i * w["samples"] + j, turn, w, vocab)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "sampled_tokens": sampled,
        "tokens_per_s": sampled / seconds,
        "groups": len(prompts),
        **_engine_work({k: engine.stats[k] - before[k] for k in before}),
    }


def run_resubmit(engine: NativeEngine, prompts: list[list[int]], w: dict, tool_s: float) -> dict:
    """Each episode's next turn enters the running batch as a new request once its tool returns."""
    vocab = engine.model.config.vocab_size
    episodes = {}
    for i, prompt in enumerate(prompts):
        for j in range(w["samples"]):
            episodes[i * w["samples"] + j] = {"context": list(prompt), "turn": 0}
    ready: list[int] = list(episodes)
    lock = threading.Lock()
    timers = []

    def tool_done(e):
        with lock:
            ready.append(e)

    sampled, index_of = 0, {}
    before = dict(engine.stats)
    sync(engine.device)
    start = time.perf_counter()
    while True:
        with lock:
            batch, ready[:] = list(ready), []
        for e in batch:
            index_of[engine.add_request(episodes[e]["context"], _sampling(w, 1, seed=e))] = e
        if not engine.has_unfinished_requests():
            if all(ep["turn"] >= w["turns"] for ep in episodes.values()):
                break
            time.sleep(0.0005)
            continue
        for c in engine.step():
            e = index_of.pop(c.prompt_index)
            ep = episodes[e]
            sampled += len(c.output_ids)
            ep["turn"] += 1
            if ep["turn"] < w["turns"]:
                ep["context"] += c.output_ids + observation(e, ep["turn"] - 1, w, vocab)
                timer = threading.Timer(tool_s, tool_done, (e,))
                timer.start()
                timers.append(timer)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "sampled_tokens": sampled,
        "tokens_per_s": sampled / seconds,
        **_engine_work({k: engine.stats[k] - before[k] for k in before}),
    }


def run_single_turn(engine: NativeEngine, prompts: list[list[int]], w: dict) -> dict:
    tokens = w["turns"] * w["turn_tokens"]
    before = dict(engine.stats)
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, [_sampling(w, w["samples"], seed=i, tokens=tokens) for i in range(len(prompts))])
    seconds = time.perf_counter() - start
    sampled = sum(len(c.output_ids) for c in outs)
    return {
        "seconds": seconds,
        "sampled_tokens": sampled,
        "tokens_per_s": sampled / seconds,
        **_engine_work({k: engine.stats[k] - before[k] for k in before}),
    }


def run_shape(shape: str, device: torch.device, w: dict, tool_ms: list[int], sequential_groups: int) -> dict:
    start = time.perf_counter()
    engine = build_engine(shape, device, w)
    vocab = engine.model.config.vocab_size
    prompts = make_prompts(w["prompts"], w["prompt_tokens"], seed=2, vocab_size=vocab - 1)
    warm = make_prompts(4, 16, seed=1, vocab_size=vocab - 1)
    for batch in (len(prompts) * w["samples"], 8, 1):  # capture, compile and touch every path first
        engine.generate(warm[:1] * batch, SamplingParams(max_new_tokens=16, ignore_eos=True))
    run_ours(engine, prompts, {**w, "turns": 2, "turn_tokens": 8}, 0.0)  # prefills after a cached history
    run_resubmit(engine, prompts[:1], {**w, "turns": 2, "turn_tokens": 8}, 0.0)
    result = {
        "shape": {"name": shape, **SHAPES[shape]},
        "workload": w,
        "engine_init_seconds": time.perf_counter() - start,
        "single_turn": run_single_turn(engine, prompts, w),
        "by_tool_ms": {},
    }
    for ms in tool_ms:
        tool_s = ms / 1e3
        ours = run_ours(engine, prompts, w, tool_s)
        tbt = run_turn_by_turn(engine, prompts[:sequential_groups], w, tool_s)
        resubmit = run_resubmit(engine, prompts, w, tool_s)
        result["by_tool_ms"][str(ms)] = {
            "ours": ours,
            "turn_by_turn": tbt,
            "resubmit": resubmit,
            "ratio_vs_single_turn": ours["tokens_per_s"] / result["single_turn"]["tokens_per_s"],
            "ratio_vs_turn_by_turn": ours["tokens_per_s"] / tbt["tokens_per_s"],
            "ratio_vs_resubmit": ours["tokens_per_s"] / resubmit["tokens_per_s"],
        }
    engine.shutdown()
    return result


def summary(r: dict) -> str:
    parts = []
    for ms, m in r["by_tool_ms"].items():
        parts.append(
            f"{ms} ms tools: ours {m['ours']['tokens_per_s'] / 1e3:.1f}k tok/s, "
            f"{m['ratio_vs_single_turn']:.2f}x single-turn, {m['ratio_vs_turn_by_turn']:.1f}x turn-by-turn, "
            f"{m['ratio_vs_resubmit']:.2f}x resubmit, kv_reuse {m['ours']['kv_reuse']:.3f}"
        )
    return f"multiturn {r['shape']['name']}: " + "; ".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.multiturn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="0.5b,4b")
    parser.add_argument("--tool-ms", default="50,500")
    parser.add_argument("--sequential-groups", type=int, default=4)
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape and workload on the CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes = ["tiny"] if args.cpu_smoke else args.shapes.split(",")
    w = SMOKE if args.cpu_smoke else WORKLOAD
    tool_ms = [int(x) for x in args.tool_ms.split(",")]
    result = {**machine(device), "shapes": {}}
    for shape in shapes:
        result["shapes"][shape] = run_shape(shape, device, w, tool_ms, min(args.sequential_groups, w["prompts"]))
        print(summary(result["shapes"][shape]), flush=True)
    medians = [m["ratio_vs_single_turn"] for r in result["shapes"].values() for m in r["by_tool_ms"].values()]
    result["ratio_vs_single_turn_median"] = statistics.median(medians)
    out = result_path(args.out, RESULTS, args.cpu_smoke)
    write_result(result, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
