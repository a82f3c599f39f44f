"""The decode kernel's launch shapes timed on engine-like decode batches (run through
bench/kernel_bench.py --decode-sweep and --decode-mixed, whose docstring says what each measures):
every shape on batches of equal contexts, and the picked shape on long-tailed contexts."""

from __future__ import annotations

import itertools
import random

import torch

from bench.common import RESULTS_DIR, peak_hbm_bytes_per_s, write_result
from bench.rollout_throughput import TAIL_RUNS, tail_length
from colocate.kernels import paged_attention

SWEEP_RESULTS = RESULTS_DIR / "paged_decode_sweep.json"
MIXED_RESULTS = RESULTS_DIR / "decode_mixed.json"
SWEEP_SHAPES = [(256, 256), (256, 384), (256, 1024), (64, 384), (64, 2048), (16, 3072)]
"""(batch, context) pairs: the rollout benchmark's b256, b64 and long cases at mid-generation."""


def sweep_paged_decode(
    batch, context, num_layers=24, num_q_heads=14, num_kv_heads=2, head_dim=64, block_size=16, max_model_len=32768
) -> dict:
    """Microseconds per layer of every launch shape, for one decode batch of Qwen2.5-0.5B shape."""
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    kv = torch.randn((2, num_layers, num_blocks, block_size, num_kv_heads, head_dim), device="cuda", generator=gen).bfloat16()
    tables = torch.full((batch, max_model_len // block_size), -1, dtype=torch.int32, device="cuda")
    tables[:, :blocks_per_seq] = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, -1)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", generator=gen).bfloat16()
    scale = head_dim**-0.5
    want = paged_attention.reference_paged_decode_attention(q, kv[0, 0], kv[1, 0], tables, lens, scale).float()

    def time_us(config) -> float:
        def step():
            for layer in range(num_layers):
                paged_attention._paged_decode_triton(q, kv[0, layer], kv[1, layer], tables, lens, scale, config)

        got = paged_attention._paged_decode_triton(q, kv[0, 0], kv[1, 0], tables, lens, scale, config)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        return do_bench_cudagraph(step, rep=20, return_mode="median") * 1e3 / num_layers

    auto = paged_attention.decode_config(batch, num_kv_heads, head_dim, tables.shape[1] * block_size, q.device)
    rows = []
    for block_n, splits, warps, stages in itertools.product((16, 32, 64, 128), (1, 2, 4, 8), (2, 4, 8), (1, 3)):
        config = paged_attention.DecodeConfig(block_n=block_n, num_splits=splits, num_warps=warps, num_stages=stages)
        try:
            rows.append(dict(vars(config), us=time_us(config)))
        except Exception as exc:  # a shape Triton cannot build (registers, shared memory) is skipped
            rows.append(dict(vars(config), error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * 2
    auto_us = time_us(auto)
    return {
        "shape": dict(
            batch=batch, context=context, q_heads=num_q_heads, kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size
        ),
        "roofline_us": kv_bytes / peak_hbm_bytes_per_s() * 1e6,
        "auto": dict(vars(auto), us=auto_us),
        "best": timed[:5],
        "all": rows,
    }


def decode_sweep() -> None:
    results = {"shapes": []}
    for batch, context in SWEEP_SHAPES:
        r = sweep_paged_decode(batch, context)
        results["shapes"].append(r)
        best = r["best"][0]
        print(
            f"B={batch} ctx={context}: roofline {r['roofline_us']:.1f} us | auto {r['auto']['us']:.1f} us "
            f"{ {k: r['auto'][k] for k in ('block_n', 'num_splits', 'num_warps', 'num_stages')} } | best "
            f"{best['us']:.1f} us { {k: best[k] for k in ('block_n', 'num_splits', 'num_warps', 'num_stages')} }",
            flush=True,
        )
    write_result(results, SWEEP_RESULTS)


def tail_contexts(batch: int, seed: int = 0) -> list[int]:
    """Contexts of a decode batch mid-step in the tail run: samples drawn with weight = response
    length (a seat holds a long sample longer), each at a uniform point of its response."""
    run, rng = TAIL_RUNS["4b"], random.Random(seed)
    lengths = [tail_length(key, run["median_tokens"], run["sigma"], run["max_tokens"]) for key in range(8192)]
    drawn = rng.choices(lengths, weights=lengths, k=batch)
    return [run["prompt_tokens"] + rng.randrange(n) + 1 for n in drawn]


def decode_mixed(
    batch: int = 192,
    num_layers: int = 12,
    num_q_heads: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    block_size: int = 16,
) -> None:
    from triton.testing import do_bench_cudagraph

    contexts = tail_contexts(batch)
    even = [sum(contexts) // batch] * batch
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_blocks = sum(-(-c // block_size) for c in contexts) + batch
    kv = torch.randn((2, num_layers, num_blocks, block_size, num_kv_heads, head_dim), device="cuda", generator=gen).bfloat16()
    width = -(-max(contexts) // block_size)
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", generator=gen).bfloat16()
    scale = head_dim**-0.5

    def rows(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables over a random permutation of the cache's blocks, and the context lengths."""
        tables = torch.full((batch, width), -1, dtype=torch.int32)
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).int()
        used = 0
        for i, c in enumerate(lens):
            n = -(-c // block_size)
            tables[i, :n] = perm[used : used + n]
            used += n
        return tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")

    picked = paged_attention.decode_config(batch, num_kv_heads, head_dim, width * block_size, q.device)

    def time_us(lens: list[int], config: paged_attention.DecodeConfig) -> float:
        tables, lens_t = rows(lens)
        got = paged_attention._paged_decode_triton(q, kv[0, 0], kv[1, 0], tables, lens_t, scale, config)
        some = slice(0, 16)  # the dense reference of every row would take tens of GiB
        want = paged_attention.reference_paged_decode_attention(q[some], kv[0, 0], kv[1, 0], tables[some], lens_t[some], scale)
        torch.testing.assert_close(got[some].float(), want.float(), atol=2e-2, rtol=2e-2)

        def step():
            for layer in range(num_layers):
                paged_attention._paged_decode_triton(q, kv[0, layer], kv[1, layer], tables, lens_t, scale, config)

        return do_bench_cudagraph(step, rep=50, return_mode="median") * 1e3 / num_layers

    peak = peak_hbm_bytes_per_s()
    roofline_us = 2 * sum(contexts) * num_kv_heads * head_dim * 2 / peak * 1e6
    longest_first = sorted(contexts, reverse=True)
    cases = {"longest_first": (longest_first, picked), "drawn_order": (contexts, picked), "even": (even, picked)}
    result = {
        "shape": dict(
            batch=batch, q_heads=num_q_heads, kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, layers=num_layers
        ),
        "contexts": dict(mean=sum(contexts) / batch, max=max(contexts), min=min(contexts)),
        "roofline_us": roofline_us,
        "hbm_bytes_per_s": peak,
    }
    for name, (lens, config) in cases.items():
        us = time_us(lens, config)
        result[name] = dict(us=us, roofline_share=roofline_us / us, config=vars(config))
    write_result(result, MIXED_RESULTS)
    print(
        " | ".join(f"{name} {result[name]['us']:.1f} us ({result[name]['roofline_share']:.0%} of the roofline)" for name in cases)
        + f" | contexts mean {result['contexts']['mean']:.0f}, max "
        f"{result['contexts']['max']} -> {MIXED_RESULTS}"
    )


FP8_SWEEP_RESULTS = RESULTS_DIR / "fp8_decode_sweep.json"
FP8_SWEEP_SHAPES = [(64, 32, 8, 128, 4096), (8, 32, 8, 128, 16384), (128, 14, 2, 64, 4096)]
"""(batch, q heads, kv heads, head_dim, context): 4B/8B-shaped heads at a long context, few and many
sequences, and the 0.5B shape's."""


def fp8_decode_sweep() -> dict:
    """The decode kernel over a bf16 cache and over the same cache in e4m3 (with its scales), each
    with the picked launch shape, and the fp8 kernel at every tile size and pipeline depth; the fp8
    store beside the bf16 one. Microseconds (triton's do_bench)."""
    from triton.testing import do_bench

    from colocate.kernels.fp8 import E4M3

    result = {"shapes": []}
    for batch, hq, hk, d, ctx in FP8_SWEEP_SHAPES:
        torch.manual_seed(0)
        bs = 16
        nb = batch * ctx // bs
        tables = torch.randperm(nb, device="cuda", dtype=torch.int32).view(batch, ctx // bs)
        lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, hq, d, device="cuda", dtype=torch.bfloat16)
        kc, vc = (torch.randn(nb, bs, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        k8, v8 = torch.empty_like(kc, dtype=E4M3), torch.empty_like(vc, dtype=E4M3)
        ks, vs = (torch.empty(nb, bs, hk, device="cuda") for _ in range(2))
        paged_attention.store_kv(kc.flatten(0, 1), vc.flatten(0, 1), k8, v8, torch.arange(nb * bs, device="cuda"), ks, vs)
        picked = paged_attention.decode_config(batch, hk, d, ctx, q.device)
        picked8 = paged_attention.decode_config(batch, hk, d, ctx, q.device, fp8=True)
        bf16_us = 1e3 * do_bench(lambda: paged_attention._paged_decode_triton(q, kc, vc, tables, lens, 0.1, picked), rep=200)
        fp8_us = 1e3 * do_bench(
            lambda: paged_attention._paged_decode_triton(q, k8, v8, tables, lens, 0.1, picked8, ks, vs), rep=200
        )
        tiles = {}
        for block_n, stages in itertools.product((32, 64, 128), (1, 2, 3, 4)):
            config = paged_attention.DecodeConfig(block_n=block_n, num_splits=picked8.num_splits, num_warps=4, num_stages=stages)
            try:
                tiles[f"bn{block_n}_s{stages}"] = 1e3 * do_bench(
                    lambda: paged_attention._paged_decode_triton(q, k8, v8, tables, lens, 0.1, config, ks, vs), rep=100
                )
            except Exception as e:  # noqa: BLE001 - out of shared memory, say: recorded, the sweep goes on
                tiles[f"bn{block_n}_s{stages}"] = f"{type(e).__name__}"
        slots = torch.arange(batch, device="cuda")
        store8 = do_bench(
            lambda: paged_attention.store_kv(kc[:1].flatten(0, 1)[:batch], vc[:1].flatten(0, 1)[:batch], k8, v8, slots, ks, vs)
        )
        store16 = do_bench(
            lambda: paged_attention.store_kv(kc[:1].flatten(0, 1)[:batch], vc[:1].flatten(0, 1)[:batch], kc, vc, slots)
        )
        kv_bytes = 2 * batch * ctx * hk * d
        result["shapes"].append(
            {
                "batch": batch, "q_heads": hq, "kv_heads": hk, "head_dim": d, "context": ctx,
                "bf16_config": str(picked), "fp8_config": str(picked8),
                "bf16_us": bf16_us, "fp8_us": fp8_us, "fp8_speedup": bf16_us / fp8_us,
                "bf16_tb_per_s": kv_bytes * 2 / bf16_us / 1e6, "fp8_tb_per_s": kv_bytes * (d + 4) / d / fp8_us / 1e6,
                "fp8_tiles_us": tiles, "store_fp8_us": 1e3 * store8, "store_bf16_us": 1e3 * store16,
                "hbm_peak_tb_per_s": peak_hbm_bytes_per_s() / 1e12,
            }
        )  # fmt: skip
        print(result["shapes"][-1], flush=True)
    write_result(result, FP8_SWEEP_RESULTS)
    return result
