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
(weight bytes + KV bytes read per step) / 4.3 TB/s over the measured step time.

Writes JSON (default bench/results/rollout.json) and prints one summary line. `--profile PATH`
also writes the device time per kernel of a b256 generate (64 output tokens), with the decode
graphs replayed and again run eagerly (compiled), to PATH.
Run: python bench/rollout.py [--cases b256,b64,long,shared] [--peers plain,static] [--long-hf]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import torch

from colocate.models import ModelConfig, from_config, load_weights
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams

RESULTS = pathlib.Path(__file__).parent / "results" / "rollout.json"
HBM_BYTES_PER_S = 4.3e12
CASES = {
    # name: (prompts, samples per prompt, prompt tokens, output tokens)
    "b256": (256, 1, 128, 256),
    "b64": (64, 1, 128, 256),
    "long": (64, 1, 1024, 2048),
    "shared": (32, 8, 128, 256),
}
HF_CONFIG = dict(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, max_position_embeddings=32768,
    rope_theta=1e6, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643,
)


def build_models():
    """(transformers model, our CausalLM) with the same random bf16 weights on the GPU."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**HF_CONFIG)
    with torch.device("cuda"):
        hf = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    ours = from_config(ModelConfig.from_hf_dict(config.to_dict()), torch.bfloat16, "cuda")
    load_weights(ours, hf.state_dict().items(), source="transformers model")
    return hf, ours


def make_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, HF_CONFIG["vocab_size"], (num, length), generator=g).tolist()


def roofline_fraction(engine: NativeEngine, batch: int, prompt_len: int, output_len: int, step_s: float) -> float:
    """Ideal decode-step time (weights + mean KV read at HBM bandwidth) over the measured one."""
    cfg = engine.model.config
    weight_bytes = engine.memory_stats()["weights_bytes"]
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    mean_context = prompt_len + output_len / 2
    ideal_s = (weight_bytes + batch * mean_context * kv_bytes_per_token) / HBM_BYTES_PER_S
    return ideal_s / step_s


def run_ours(engine: NativeEngine, case: str) -> dict:
    num, n, prompt_len, output_len = CASES[case]
    prompts = make_prompts(num, prompt_len)
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=output_len, ignore_eos=True, seed=0)
    before = dict(engine.stats)
    torch.cuda.synchronize()
    start = time.perf_counter()
    outs = engine.generate(prompts, sp)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.output_ids) for c in outs)
    assert tokens == num * n * output_len
    delta = {k: engine.stats[k] - before[k] for k in before}
    step_s = delta["decode_seconds"] / delta["decode_steps"]
    return {
        "seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
        "ms_per_decode_step": 1e3 * step_s, "decode_steps": delta["decode_steps"],
        "prefill_seconds": delta["prefill_seconds"], "preemptions": engine.scheduler.num_preemptions,
        "roofline_fraction": roofline_fraction(engine, num * n, prompt_len, output_len, step_s),
    }


def run_hf(hf, case: str, static: bool) -> dict:
    num, n, prompt_len, output_len = CASES[case]
    ids = torch.tensor(make_prompts(num, prompt_len), device="cuda")
    kwargs = dict(do_sample=True, temperature=1.0, max_new_tokens=output_len, min_new_tokens=output_len,
                  pad_token_id=0, attention_mask=torch.ones_like(ids))
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="b256,b64,long,shared", help="comma-separated subset of " + ",".join(CASES))
    parser.add_argument("--peers", default="plain,static", help="transformers runs for b256/b64: plain,static or none")
    parser.add_argument("--long-hf", action="store_true", help="also run HF plain on the long case (minutes)")
    parser.add_argument("--max-decode-steps", type=int, default=16, help="decode steps per host round trip")
    parser.add_argument("--no-compile-decode", action="store_true", help="run our decode forward uncompiled")
    parser.add_argument("--out", type=pathlib.Path, default=RESULTS, help="JSON output path")
    parser.add_argument("--profile", type=pathlib.Path, default=None, help="write a decode kernel profile here")
    args = parser.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"--cases: unknown {unknown}; choose from {list(CASES)}")
    peers = [] if args.peers == "none" else [p for p in args.peers.split(",") if p]
    if any(p not in ("plain", "static") for p in peers):
        raise ValueError(f"--peers={args.peers!r}: expected a subset of plain,static, or none")

    hf, ours = build_models()
    start = time.perf_counter()
    engine = NativeEngine(ours, max_kv_tokens=1 << 20, max_num_seqs=256, max_decode_steps=args.max_decode_steps,
                          compile_decode=not args.no_compile_decode)
    del ours
    init_s = time.perf_counter() - start
    start = time.perf_counter()
    for batch in (256, 64, 8, 1):  # compile the sampler and touch every path before timing
        engine.generate(make_prompts(batch, 16, seed=1), SamplingParams(max_new_tokens=16, ignore_eos=True))
    warmup_s = time.perf_counter() - start
    print(f"engine ready: init {init_s:.1f} s, warm-up {warmup_s:.1f} s", flush=True)
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": HF_CONFIG,
        "engine": {"init_seconds": init_s, "warmup_seconds": warmup_s, "memory": engine.memory_stats(),
                   "max_decode_steps": args.max_decode_steps, "compile_decode": not args.no_compile_decode},
        "cases": {},
    }
    for case in cases:
        results["cases"][case] = {"shape": dict(zip(("prompts", "n", "prompt_tokens", "output_tokens"), CASES[case])),
                                  "ours": run_ours(engine, case)}
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
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")

    parts = []
    for case, r in results["cases"].items():
        o = r["ours"]
        line = f"{case} {o['tokens_per_s'] / 1e3:.1f}k tok/s {o['ms_per_decode_step']:.2f} ms/step " \
               f"{100 * o['roofline_fraction']:.0f}% roofline"
        for peer in ("hf_static", "hf_plain"):
            if peer in r:
                line += f", {o['tokens_per_s'] / r[peer]['tokens_per_s']:.1f}x {peer}"
        parts.append(line)
    print("rollout (native engine, 0.5B shape, H200): " + "; ".join(parts))


if __name__ == "__main__":
    main()
