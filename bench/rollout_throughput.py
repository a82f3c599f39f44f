"""Rollout throughput on one GPU: the native engine side by side with transformers' `generate`.

Model: a Qwen2.5-0.5B-shaped Qwen2 (hidden 896, 24 layers, 14 heads, 2 kv heads, head_dim 64,
intermediate 4864, vocab 151936, tied embeddings) with random bf16 weights; the same weights serve
both engines. Every request samples (temperature 1) with ignore_eos, so every run produces exactly
batch x output tokens. Cases:

- b256: 256 prompts x 128 tokens in, 256 out (ours, HF plain, HF static cache + compile)
- b64: the same with 64 prompts
- long: 64 prompts x 1024 in, 2048 out (ours; HF plain with --long-hf)
- shared: 32 prompts x n=8 samples sharing each prompt's prefill, 128 in, 256 out (ours)

Reported per run: output tokens/s (wall time of the whole generate, prefill included); for ours also
ms per decode step and the fraction of the memory-bandwidth roofline of a decode step, i.e.
(weight bytes + KV bytes read per step) / 90% of the device's peak HBM bandwidth (4.3 TB/s on an
H200, 3.0 on an H100) over the measured step time.

Writes JSON (default bench/results/rollout.json) and prints one summary line. `--profile PATH`
also writes the device time per kernel of a b256 generate (64 output tokens), with the decode
graphs replayed and again run eagerly (compiled), to PATH.

`--cases tail` runs alone, on a Qwen3-4B shape (random bf16 weights), and writes
bench/results/rollout_tail.json: the long-tailed response lengths of reasoning RL. 256 prompts of
256 tokens, each with its own max_new_tokens drawn from a fixed lognormal (median 1536, sigma 0.75,
capped at 8192: a few samples reach the cap) and ignore_eos. Reported: the phase's wall time and
output tok/s; utilization, its tok/s over that of a full batch of the same engine (256 samples of
the tail's mean length, so the batch stays full to the end); the decode-step time against the
HBM roofline, (weight bytes + KV bytes read per step) / the device's peak (4.8 TB/s on an H200), at
batch 256 with 2k context and at batch 8 with 8k context; and the phase's HBM floors (`tail_floors`). Long
samples read more KV per token than the same tokens in equal lengths, so even a batch kept full
to the end cannot reach the full batch's tok/s: the floors' ratio is the ceiling of utilization.
`--cpu-smoke` runs it on a tiny shape on CPU.
Run: python -m bench.rollout_throughput [--cases b256,b64,long,shared] [--peers plain,static] [--long-hf]
     python -m bench.rollout_throughput --cases tail [--cpu-smoke] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import statistics
import time

import torch

from bench.common import RESULTS_DIR, machine, peak_hbm_bytes_per_s, result_path, sync, write_result
from colocate.models import ArchConfig, from_config, load_weights
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams

RESULTS = RESULTS_DIR / "rollout.json"
TAIL_RESULTS = RESULTS_DIR / "rollout_tail.json"
ACHIEVABLE_HBM = 0.9
"""The share of the peak a streaming copy reaches (4.3 of the H200's 4.8 TB/s): the cases' roofline."""

CASES = {
    # name: (prompts, samples per prompt, prompt tokens, output tokens)
    "b256": (256, 1, 128, 256),
    "b64": (64, 1, 128, 256),
    "long": (64, 1, 1024, 2048),
    "shared": (32, 8, 128, 256),
}
HF_CONFIG = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=32768,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    bos_token_id=151643,
    eos_token_id=151643,
)


TAIL_SHAPES = {
    "4b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=40960,
    ),
    "tiny": dict(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=1e6,
        max_position_embeddings=4096,
    ),
}
TAIL_RUNS = {
    # points: (batch, context) of the decode-step roofline probes, each decoding probe_tokens
    "4b": dict(
        samples=256,
        prompt_tokens=256,
        median_tokens=1536,
        sigma=0.75,
        max_tokens=8192,
        points=((256, 2048), (8, 8192)),
        probe_tokens=32,
    ),
    "tiny": dict(
        samples=16, prompt_tokens=16, median_tokens=16, sigma=0.75, max_tokens=64, points=((16, 64), (2, 256)), probe_tokens=8
    ),
}


def tail_length(key: int, median_tokens: int, sigma: float, max_tokens: int) -> int:
    """The response length of sample `key` in the long tail: a lognormal draw fixed by the key."""
    draw = random.Random(key).lognormvariate(math.log(median_tokens), sigma)
    return max(1, min(max_tokens, round(draw)))


def build_models():
    """(transformers model, our CausalLM) with the same random bf16 weights on the GPU."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**HF_CONFIG)
    with torch.device("cuda"):
        hf = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    ours = from_config(ArchConfig.from_hf_dict(config.to_dict()), torch.bfloat16, "cuda")
    load_weights(ours, hf.state_dict().items(), source="transformers model")
    return hf, ours


def make_prompts(num: int, length: int, seed: int = 0, vocab_size: int = HF_CONFIG["vocab_size"]) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (num, length), generator=g).tolist()


def kv_bytes_per_token(engine: NativeEngine) -> int:
    """K and V of one token in every layer, in the engine's dtype."""
    cfg = engine.model.config
    itemsize = next(engine.model.parameters()).dtype.itemsize
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * itemsize


def ideal_decode_step_s(engine: NativeEngine, batch: int, mean_context: float, bytes_per_s: float) -> float:
    """A decode step that reads every weight and the batch's KV cache once at `bytes_per_s`."""
    weight_bytes = engine.memory_stats()["weights_bytes"]
    return (weight_bytes + batch * mean_context * kv_bytes_per_token(engine)) / bytes_per_s


def decode_floor_s(engine: NativeEngine, prompt_len: int, lengths: list[int], steps: int) -> float:
    """The HBM floor of decoding `lengths` after `prompt_len`-token prompts in `steps` decode
    steps: every step reads the weights once, every token reads its sequence's KV once."""
    kv_reads = sum(prompt_len * n + n * (n - 1) // 2 for n in lengths)
    weight_bytes = engine.memory_stats()["weights_bytes"]
    return (steps * weight_bytes + kv_reads * kv_bytes_per_token(engine)) / peak_hbm_bytes_per_s()


def tail_floors(engine: NativeEngine, prompt_len: int, lengths: list[int], seats: int) -> dict:
    """Seconds at the HBM roofline: the tail under continuous batching (a step per token of the
    longest sample), the tail with every seat always busy (what partial rollout strives for),
    and the same number of tokens in equal lengths; their ratio bounds the tail's utilization."""
    equal = [round(statistics.mean(lengths))] * len(lengths)
    floors = {
        "continuous_batching_s": decode_floor_s(engine, prompt_len, lengths, max(lengths)),
        "full_seats_s": decode_floor_s(engine, prompt_len, lengths, -(-sum(lengths) // seats)),
        "equal_lengths_s": decode_floor_s(engine, prompt_len, equal, equal[0]),
    }
    floors["utilization_ceiling"] = floors["equal_lengths_s"] / floors["full_seats_s"]
    return floors


def roofline_fraction(engine: NativeEngine, batch: int, prompt_len: int, output_len: int, step_s: float) -> float:
    """Ideal decode-step time (weights + mean KV read at HBM bandwidth) over the measured one."""
    bandwidth = ACHIEVABLE_HBM * peak_hbm_bytes_per_s()
    return ideal_decode_step_s(engine, batch, prompt_len + output_len / 2, bandwidth) / step_s


def timed_generate(engine: NativeEngine, prompts: list[list[int]], sampling: list[SamplingParams]) -> dict:
    """Wall time, output tokens and the engine's decode counters of one generate call."""
    before = dict(engine.stats)
    sync(engine.device)
    start = time.perf_counter()
    outs = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.output_ids) for c in outs)
    assert tokens == sum(sp.n * sp.max_new_tokens for sp in sampling), "ignore_eos: every sample runs to its length"
    delta = {k: engine.stats[k] - before[k] for k in before}
    steps = delta["decode_steps"]
    return {
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds,
        "decode_steps": steps,
        "ms_per_decode_step": 1e3 * delta["decode_seconds"] / steps,
        "mean_decode_batch": delta["decode_tokens"] / steps,
        "prefill_seconds": delta["prefill_seconds"],
    }


def run_ours(engine: NativeEngine, case: str) -> dict:
    num, n, prompt_len, output_len = CASES[case]
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=output_len, ignore_eos=True, seed=0)
    result = timed_generate(engine, make_prompts(num, prompt_len), [sp] * num)
    step_s = result["ms_per_decode_step"] / 1e3
    return {
        **result,
        "preemptions": engine.scheduler.num_preemptions,
        "roofline_fraction": roofline_fraction(engine, num * n, prompt_len, output_len, step_s),
    }


def run_hf(hf, case: str, static: bool) -> dict:
    num, n, prompt_len, output_len = CASES[case]
    ids = torch.tensor(make_prompts(num, prompt_len), device="cuda")
    kwargs = dict(
        do_sample=True,
        temperature=1.0,
        max_new_tokens=output_len,
        min_new_tokens=output_len,
        pad_token_id=0,
        attention_mask=torch.ones_like(ids),
    )
    if static:
        kwargs["cache_implementation"] = "static"  # transformers compiles the forward for it
        compile_start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, **kwargs)  # warm-up: compilation at these shapes
        compile_s = time.perf_counter() - compile_start
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.no_grad():
        out = hf.generate(ids, **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = (out.shape[1] - prompt_len) * num
    result = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}
    if static:
        result["warmup_seconds"] = compile_s
    return result


def profile_decode(engine: NativeEngine, path: pathlib.Path) -> None:
    """Kernel table (device time, sorted) of one b256 generate, with and without the decode graphs."""
    from torch.profiler import ProfilerActivity, profile

    prompts = make_prompts(256, 128)
    sp = SamplingParams(temperature=1.0, max_new_tokens=64, ignore_eos=True, seed=0)
    graphs = engine.runner.graphs
    sections = []
    for name in ("cuda graphs", "eager (compiled)"):
        engine.runner.graphs = graphs if name == "cuda graphs" else None
        engine.generate(prompts, sp)  # warm this path
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, sp)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=40, max_name_column_width=90)
        sections.append(f"== b256 x 64 tokens, {name}\n{table}")
    engine.runner.graphs = graphs
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(sections) + "\n")
    print(f"decode profile -> {path}", flush=True)


def run_tail(shape: str, device: torch.device) -> dict:
    """The long-tail case (module docstring) on a fresh engine of the given shape."""
    run = TAIL_RUNS[shape]
    n, prompt_len = run["samples"], run["prompt_tokens"]
    lengths = [tail_length(i, run["median_tokens"], run["sigma"], run["max_tokens"]) for i in range(n)]
    mean_len = round(statistics.mean(lengths))
    # KV room for the tail's last moment (every sample at full length) and for the largest probe.
    kv_tokens = max(
        sum(lengths) + n * prompt_len, *(b * (c + run["probe_tokens"]) for b, c in run["points"]), n * (prompt_len + mean_len)
    )
    cfg = TAIL_SHAPES[shape]
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = from_config(ArchConfig(**cfg, eos_token_id=cfg["vocab_size"] - 1), dtype, device, init=True)
    start = time.perf_counter()
    engine = NativeEngine(model, device=device, max_num_seqs=n, max_kv_tokens=kv_tokens + 64 * 16, cuda_graph_max_bs=n)
    del model
    init_s = time.perf_counter() - start
    vocab = cfg["vocab_size"]
    for batch in (n, 8, 1):  # compile the sampler and touch every path before timing
        engine.generate(make_prompts(batch, 16, seed=1, vocab_size=vocab), SamplingParams(max_new_tokens=16, ignore_eos=True))
    prompts = make_prompts(n, prompt_len, seed=2, vocab_size=vocab)
    tail = timed_generate(
        engine, prompts, [SamplingParams(max_new_tokens=length, ignore_eos=True, seed=i) for i, length in enumerate(lengths)]
    )
    full = timed_generate(engine, prompts, [SamplingParams(max_new_tokens=mean_len, ignore_eos=True, seed=i) for i in range(n)])
    points = {}
    for batch, context in run["points"]:
        probe = run["probe_tokens"]
        r = timed_generate(
            engine,
            make_prompts(batch, context, seed=3, vocab_size=vocab),
            [SamplingParams(max_new_tokens=probe, ignore_eos=True, seed=i) for i in range(batch)],
        )
        ideal_ms = 1e3 * ideal_decode_step_s(engine, batch, context + probe / 2, peak_hbm_bytes_per_s())
        points[f"b{batch}_ctx{context}"] = {
            "ms_per_decode_step": r["ms_per_decode_step"],
            "roofline_ms": ideal_ms,
            "roofline_fraction": ideal_ms / r["ms_per_decode_step"],
        }
    result = {
        "shape": {"name": shape, **cfg},
        "run": {k: v for k, v in run.items() if k != "points"},
        "lengths": {
            "mean": statistics.mean(lengths),
            "median": statistics.median(lengths),
            "max": max(lengths),
            "at_cap": sum(x == run["max_tokens"] for x in lengths),
            "total": sum(lengths),
        },
        "engine": {
            "init_seconds": init_s,
            "init_parts_seconds": engine.startup_seconds,
            "memory": engine.memory_stats(),
            "preemptions": engine.scheduler.num_preemptions,
        },
        "tail": tail,
        "full_batch": {"output_tokens_each": mean_len, **full},
        "utilization": tail["tokens_per_s"] / full["tokens_per_s"],
        "decode_batch_occupancy": tail["mean_decode_batch"] / n,
        "hbm_floor": tail_floors(engine, prompt_len, lengths, n),
        "roofline": points,
    }
    engine.shutdown()
    return result


def tail_summary(r: dict) -> str:
    lengths, tail = r["lengths"], r["tail"]
    probes = ", ".join(
        f"{name} {p['ms_per_decode_step']:.3g} ms/step ({100 * p['roofline_fraction']:.0f}% of {p['roofline_ms']:.3g} ms)"
        for name, p in r["roofline"].items()
    )
    return (
        f"rollout tail ({r['shape']['name']} shape, {r['run']['samples']} samples, lengths median "
        f"{lengths['median']:.0f} mean {lengths['mean']:.0f}, {lengths['at_cap']} at {r['run']['max_tokens']}): "
        f"{tail['seconds']:.1f} s, {tail['tokens_per_s'] / 1e3:.1f}k tok/s, utilization "
        f"{100 * r['utilization']:.0f}% of a full batch's {r['full_batch']['tokens_per_s'] / 1e3:.1f}k tok/s "
        f"(at most {100 * r['hbm_floor']['utilization_ceiling']:.0f}% at the HBM roofline); "
        f"decode {probes}"
    )


def main_tail(args) -> None:
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    result = {**machine(device), **run_tail("tiny" if args.cpu_smoke else "4b", device)}
    out = result_path(args.out, TAIL_RESULTS, args.cpu_smoke)
    write_result(result, out)
    print(tail_summary(result))
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.rollout_throughput", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases", default="b256,b64,long,shared", help="comma-separated subset of " + ",".join(CASES) + "; or tail, alone"
    )
    parser.add_argument("--peers", default="plain,static", help="transformers runs for b256/b64: plain,static or none")
    parser.add_argument("--long-hf", action="store_true", help="also run HF plain on the long case (minutes)")
    parser.add_argument("--max-decode-steps", type=int, default=16, help="decode steps per host round trip")
    parser.add_argument("--no-compile-decode", action="store_true", help="run our decode forward uncompiled")
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="JSON output path (default bench/results/rollout.json, or rollout_tail.json)",
    )
    parser.add_argument("--profile", type=pathlib.Path, default=None, help="write a decode kernel profile here")
    parser.add_argument("--cpu-smoke", action="store_true", help="--cases tail on a tiny shape on CPU")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in (*CASES, "tail")]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {[*CASES, 'tail']}")
    if "tail" in cases:
        if len(cases) > 1:
            raise ValueError(f"--cases={args.cases}: run tail alone (its own model shape and JSON file)")
        return main_tail(args)
    if args.cpu_smoke:
        raise ValueError("--cpu-smoke runs --cases tail only")
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    if any(p not in ("plain", "static") for p in peers):
        raise ValueError(f"--peers={args.peers!r}: expected a subset of plain,static, or none")

    hf, ours = build_models()
    start = time.perf_counter()
    engine = NativeEngine(
        ours,
        max_kv_tokens=1 << 20,
        max_num_seqs=256,
        max_decode_steps=args.max_decode_steps,
        compile_decode=not args.no_compile_decode,
    )
    del ours
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    for batch in (256, 64, 8, 1):  # compile the sampler and touch every path before timing
        engine.generate(make_prompts(batch, 16, seed=1), SamplingParams(max_new_tokens=16, ignore_eos=True))
    warmup_s = time.perf_counter() - start
    parts = ", ".join(f"{k.replace('_', ' ')} {v:.1f}" for k, v in engine.startup_seconds.items())
    print(f"engine ready: init {init_s:.1f} s ({parts}), warm-up {warmup_s:.1f} s", flush=True)
    results = {
        **machine(),
        "model": HF_CONFIG,
        "engine": {
            "init_seconds": init_s,
            "init_parts_seconds": engine.startup_seconds,
            "warmup_seconds": warmup_s,
            "memory": engine.memory_stats(),
            "max_decode_steps": args.max_decode_steps,
            "compile_decode": not args.no_compile_decode,
        },
        "cases": {},
    }
    for case in cases:
        results["cases"][case] = {
            "shape": dict(zip(("prompts", "n", "prompt_tokens", "output_tokens"), CASES[case])),
            "ours": run_ours(engine, case),
        }
        print(f"{case} ours: {results['cases'][case]['ours']}", flush=True)
    if args.profile:
        profile_decode(engine, args.profile)
    engine.shutdown()
    torch.cuda.empty_cache()
    for case in cases:
        runs = []
        if case in ("b256", "b64"):
            runs = [(f"hf_{p}", p == "static") for p in peers]
        elif case == "long" and args.long_hf:
            runs = [("hf_plain", False)]
        for name, static in runs:
            results["cases"][case][name] = run_hf(hf, case, static)
            print(f"{case} {name}: {results['cases'][case][name]}", flush=True)
    write_result(results, args.out or RESULTS)

    parts = []
    for case, r in results["cases"].items():
        o = r["ours"]
        line = (
            f"{case} {o['tokens_per_s'] / 1e3:.1f}k tok/s {o['ms_per_decode_step']:.2f} ms/step "
            f"{100 * o['roofline_fraction']:.0f}% roofline"
        )
        for peer in ("hf_static", "hf_plain"):
            if peer in r:
                line += f", {o['tokens_per_s'] / r[peer]['tokens_per_s']:.1f}x {peer}"
        parts.append(line)
    print(f"rollout (native engine, 0.5B shape, {results['device']}): " + "; ".join(parts))


if __name__ == "__main__":
    main()
