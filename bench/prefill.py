"""Prefill throughput of the native engine: compiled decoder layers against eager, in one run.

Model: the Qwen3-4B shape of `bench/rollout_throughput.py --cases tail` (random bf16 weights), one GPU. Each
case is a generate of one new token per prompt, so its time is almost all prefill, under the
engine's default budget of 16,384 tokens a prefill. Prefills of at least
`COMPILED_PREFILL_MIN_TOKENS` tokens run their layers compiled by default; the eager runs raise
that threshold past every prefill of the same engine. The two alternate, `--repeats` times each,
on fresh prompts every time (no cached prefix), after one warm-up each (the compile's):

- prompts: 512 prompts of 256 tokens, a step's fresh prompts
- carried: 96 contexts of 300-7,000 tokens (lognormal around 2,000), like the contexts that
  partial rollout prefills again after an offload

Reported: median tokens/s of each, their ratio, the warm-ups' seconds and the graphs compiled.
Writes JSON (default bench/results/prefill.json). `--cpu-smoke` runs a tiny shape in fp32 on CPU
(compiled there too).
Run: python -m bench.prefill [--repeats 3] [--out PATH] [--cpu-smoke]
"""

from __future__ import annotations

import argparse
import math
import pathlib
import random
import statistics
import time

import torch

from bench.common import RESULTS_DIR, machine, result_path, sync, write_result
from bench.rollout_throughput import TAIL_SHAPES
from colocate.models import ArchConfig, from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams

RESULTS = RESULTS_DIR / "prefill.json"
EAGER = 1 << 62
"""A compiled-prefill threshold that no prefill reaches."""


def case_lengths(case: str, scale: float, rng: random.Random) -> list[int]:
    """Prompt lengths of a case; `scale` shrinks them for the CPU smoke run."""
    if case == "prompts":
        return [max(1, round(256 * scale))] * 512
    return [max(1, round(scale * min(7000, max(300, rng.lognormvariate(math.log(2000), 0.6))))) for _ in range(96)]


def timed(engine: NativeEngine, lengths: list[int], vocab: int, rng: random.Random) -> float:
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    sync(engine.device)
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=1, ignore_eos=True))
    sync(engine.device)
    return time.perf_counter() - start


def run(device: torch.device, repeats: int, smoke: bool) -> dict:
    shape = TAIL_SHAPES["tiny" if smoke else "4b"]
    torch.manual_seed(0)
    dtype = torch.float32 if smoke else torch.bfloat16
    model = from_config(ArchConfig(**shape, eos_token_id=shape["vocab_size"] - 1), dtype, device, init=True)
    engine = NativeEngine(
        model, device=device, max_num_seqs=256, max_kv_tokens=300_000 if not smoke else 1 << 16, compile_decode=True
    )
    del model
    runner, threshold = engine.runner, engine.runner.compiled_prefill_min_tokens
    scale = 1 / 16 if smoke else 1.0
    if smoke:
        runner.compiled_prefill_min_tokens = threshold = 256  # the tiny prefills reach it
    rng = random.Random(0)
    vocab = shape["vocab_size"] - 1
    out = {
        **machine(device),
        "shape": shape,
        "dtype": str(dtype),
        "compiled_prefill_min_tokens": threshold,
        "repeats": repeats,
        "cases": {},
    }
    for case in ("prompts", "carried"):
        lengths = case_lengths(case, scale, rng)
        seconds = {"compiled": [], "eager": []}
        warmup = {}
        for i in range(repeats + 1):
            for variant in seconds:
                runner.compiled_prefill_min_tokens = threshold if variant == "compiled" else EAGER
                s = timed(engine, lengths, vocab, rng)
                if i:
                    seconds[variant].append(s)
                else:
                    warmup[variant] = s
        tokens = sum(lengths)
        rate = {v: tokens / statistics.median(s) for v, s in seconds.items()}
        out["cases"][case] = {
            "prompts": len(lengths),
            "tokens": tokens,
            "seconds": seconds,
            "warmup_seconds": warmup,
            "tokens_per_s": rate,
            "compiled_over_eager": rate["compiled"] / rate["eager"],
        }
        print(
            f"{case}: {tokens} tokens, compiled {rate['compiled'] / 1e3:.1f}k tok/s, eager "
            f"{rate['eager'] / 1e3:.1f}k tok/s ({rate['compiled'] / rate['eager']:.2f}x); warm-ups "
            f"{warmup['compiled']:.1f} s and {warmup['eager']:.1f} s",
            flush=True,
        )
    from torch._dynamo.utils import counters

    out["compiled_graphs"] = counters["stats"]["unique_graphs"]
    engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefill", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each variant per case")
    parser.add_argument("--out", type=pathlib.Path, default=None, help=f"JSON path (default {RESULTS})")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on CPU")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats={args.repeats} must be >= 1")
    result = run(torch.device("cpu" if args.cpu_smoke else "cuda"), args.repeats, args.cpu_smoke)
    out = result_path(args.out, RESULTS, args.cpu_smoke)
    write_result(result, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
