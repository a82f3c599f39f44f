"""Decode throughput of the native engine in bf16 and in FP8, side by side in one run.

Shapes: Qwen3-4B (hidden 2560, 36 layers, 32 heads, 8 kv heads, head_dim 128, intermediate 9728,
tied embeddings) and Qwen3-8B (hidden 4096, 36 layers, 32 heads, 8 kv heads, intermediate 12288,
untied), random bf16 weights built once per shape (on the GPU, then held on the host so that the
engine's copy, not the source, sits beside the KV cache). For each shape three engines run the
same 256 prompts x 256 tokens in, 1024 out (temperature 1, ignore_eos, so every run makes exactly
262,144 tokens): bf16 (`rollout.weight_dtype bf16`), FP8 weights (`fp8`), FP8 weights and an FP8 KV
cache (`fp8` + `rollout.kv_cache_dtype fp8_e4m3`). Each engine generates once to compile and
capture, then is timed once.

Reported per run: output tokens/s over the whole generate (prefill included), ms per decode step,
the engine's weight and KV-cache bytes, and the HBM roofline fraction of a decode step: (weight
bytes + the batch's KV bytes at the mean context) / the device's peak bandwidth, over the measured
step. Ratios: each FP8 run's tok/s over bf16's of the same shape (keys `decode_<shape>_fp8_ratio`,
`decode_<shape>_fp8_kv_ratio`). `--cpu-smoke` runs a tiny shape on CPU to check the script.

Run: python -m bench.fp8_decode [--shapes 4b,8b] [--out PATH] [--cpu-smoke]
Writes bench/results/fp8_decode.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import RESULTS_DIR, free_memory, guarded, peak_hbm_bytes_per_s, result_path, sync, write_result
from colocate.kernels.fp8 import E4M3
from colocate.kernels.paged_attention import kv_bytes_per_token
from colocate.models import ArchConfig, from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams

RESULTS = RESULTS_DIR / "fp8_decode.json"
QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_attention_heads=32, num_key_value_heads=8, head_dim=128, qk_norm=True)
SHAPES = {
    "4b": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, tie_word_embeddings=True),
    "8b": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, tie_word_embeddings=False),
    "tiny": dict(QWEN3, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, tie_word_embeddings=True),
}  # fmt: skip
RUN = dict(prompts=256, prompt_tokens=256, output_tokens=1024)
SMOKE_RUN = dict(prompts=8, prompt_tokens=16, output_tokens=16)
VARIANTS = {"bf16": dict(), "fp8": dict(weight_dtype="fp8"), "fp8_kv": dict(weight_dtype="fp8", kv_cache_dtype="fp8_e4m3")}


def source_model(shape: str, device: torch.device):
    """Random weights of `shape` (initialised on `device`), held on the host."""
    cfg = ArchConfig(**SHAPES[shape], rope_theta=1e6, max_position_embeddings=40960, eos_token_id=SHAPES[shape]["vocab_size"] - 1)
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = from_config(cfg, dtype, device, init=True).to("cpu")
    free_memory() if device.type == "cuda" else None
    return model


def run_variant(model, variant: str, run: dict, device: torch.device) -> dict:
    n, prompt_len, out_len = run["prompts"], run["prompt_tokens"], run["output_tokens"]
    start = time.perf_counter()
    engine = NativeEngine(
        model, device=device, max_num_seqs=n, cuda_graph_max_bs=n, max_kv_tokens=n * (prompt_len + out_len) + 64 * 16,
        **VARIANTS[variant],
    )  # fmt: skip
    init_s = time.perf_counter() - start
    g = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    prompts = torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()
    sp = SamplingParams(temperature=1.0, max_new_tokens=out_len, ignore_eos=True, seed=0)
    engine.generate(prompts[: max(1, n // 8)], SamplingParams(temperature=1.0, max_new_tokens=32, ignore_eos=True))
    engine.generate(prompts, sp)  # every decode batch size compiled and captured
    before = dict(engine.stats)
    sync(device)
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    sync(device)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.output_ids) for c in outs)
    assert tokens == n * out_len
    steps = engine.stats["decode_steps"] - before["decode_steps"]
    step_s = (engine.stats["decode_seconds"] - before["decode_seconds"]) / steps
    stats = engine.memory_stats()
    cfg = model.config
    kv_dtype = engine.runner.kv_dtype
    per_token = cfg.num_hidden_layers * kv_bytes_per_token(cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
    step_bytes = stats["weights_bytes"] + n * (prompt_len + out_len / 2) * per_token
    result = {
        "tokens_per_s": tokens / seconds,
        "seconds": seconds,
        "ms_per_decode_step": 1e3 * step_s,
        "prefill_seconds": engine.stats["prefill_seconds"] - before["prefill_seconds"],
        "weights_gib": stats["weights_bytes"] / 2**30,
        "kv_cache_gib": stats["kv_cache_bytes"] / 2**30,
        "kv_bytes_per_token": per_token,
        "kv_dtype": "fp8_e4m3" if kv_dtype == E4M3 else str(kv_dtype).removeprefix("torch."),
        "hbm_roofline_fraction": step_bytes / peak_hbm_bytes_per_s() / step_s if device.type == "cuda" else None,
        "engine_init_s": init_s,
    }
    engine.shutdown()
    del engine
    free_memory() if device.type == "cuda" else None
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="4b,8b")
    parser.add_argument("--cpu-smoke", action="store_true", help="a tiny shape on CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    shapes = ["tiny"] if args.cpu_smoke else args.shapes.split(",")
    run = SMOKE_RUN if args.cpu_smoke else RUN
    result: dict = {"run": run, "shapes": {}}
    out = result_path(args.out, RESULTS, smoke=args.cpu_smoke)
    for shape in shapes:
        model = source_model(shape, device)
        runs = result["shapes"][shape] = {}
        for variant in VARIANTS:
            runs[variant] = guarded(run_variant, model, variant, run, device)
            print(f"{shape} {variant}: {runs[variant]}", flush=True)
        base = runs["bf16"].get("tokens_per_s")
        for variant in ("fp8", "fp8_kv"):
            if base and "tokens_per_s" in runs[variant]:
                result[f"decode_{shape}_{variant}_ratio"] = runs[variant]["tokens_per_s"] / base
        write_result(result, out)
        del model
    ratios = {k: round(v, 3) for k, v in result.items() if k.endswith("_ratio")}
    print(f"fp8 decode: {ratios} -> {out}")


if __name__ == "__main__":
    main()
