"""Kernel micro-benchmark on one GPU: each kernel side by side with its plain-torch counterpart.

- token_logprobs forward+backward (with entropy) for T=16384, V=151936, H=1536 in bf16, against the
  naive path that materialises fp32 logits (`reference_token_logprobs`): median time and peak
  extra memory of each.
- paged_decode_attention for B=256 sequences of 384 cached tokens, Hq=14, Hk=2, D=64, bf16, against
  SDPA over K/V gathered from the paged cache into dense tensors (gather included, and alone).
- joint_linear (one GEMM over weights joined for the call, as training runs q/k/v) forward+backward
  on T=32768 tokens of the Qwen2.5-1.5B shape, against the parts as separate GEMMs: for q/k/v
  (1536 + 256 + 256 wide, with bias) and for gate/up (2 x 8960), eager, bf16.
- a matmul plus a residual, as compiled blocks run it: inductor rewrites `x @ w.T + r` into
  `addmm(r, x, w.T)` when the sum has a non-pointwise user (a block's output, the next norm), which
  cuBLAS runs as a GEMM with beta=1; against the plain GEMM and against the GEMM then the add, on
  T=32768 tokens of the 1.5B shape (o_proj 1536 -> 1536, down_proj 8960 -> 1536), with each
  variant's kernel names.
- the LoRA merge W + scale * B A (colocate/kernels/lora_merge.py) of every adapted projection of the
  1.5B shape at rank 64, as a forward or a weight push runs them, against the same merge in torch
  ops, and the roofline of its 4 bytes a weight (bf16 read and written); and the host time of one
  forward's merges from compiled blocks (one compiled function of a block's 7 merges, called for
  each of the 28 blocks), the kernel's against the torch ops' under inductor, and of the direct
  launches a weight push makes.

Prints one summary line and writes bench/results/kernels.json. Run: python -m bench.kernel_bench

`--decode-sweep` instead times every decode-kernel launch shape (tile, splits, warps, stages) on
engine-like decode batches (it and `--decode-mixed` run bench/decode_sweeps.py): the kernel runs
over 24 layers' caches in one CUDA graph, as in a decode step, so no layer's K/V is still in L2.
Writes bench/results/paged_decode_sweep.json.

`--fp8-decode-sweep` times the decode kernel over a bf16 cache and over the same cache in e4m3
(rollout.kv_cache_dtype fp8_e4m3), each with the launch shape `decode_config` picks, and the fp8
kernel at every tile size and pipeline depth, on 4B/8B- and 0.5B-shaped heads; the fp8 store beside
the bf16 one. Writes bench/results/fp8_decode_sweep.json.

`--invariant-sweep` times the batch-invariant matmul of `algorithm.true_on_policy`
(colocate/kernels/batch_invariant_cuda.py) on every projection of the 0.5B and 1.5B shapes at a
decode batch (M=256) and a training micro-batch (M=16384): the config the product's shape picks
(and, with several K chunks, split over programs or walked by one), each candidate tile config, and
cuBLAS. The mode picks BLOCK_M, BLOCK_N, warps and stages by shape and keeps BLOCK_K, on the ground
that only BLOCK_K (and the chunks) decide a row's bits: each candidate's bits are compared with the
pick's, and a candidate of the same BLOCK_K that differs is a failure of that ground;
and the same for the mode's attention (the trainer's packed path and the engine's decode, whose
tiles hold a kv head's query heads), with tiles of other sizes, beside the default kernels.
Writes bench/results/invariant_matmul_sweep.json.

`--decode-mixed` times the decode kernel on a decode batch of long-tailed contexts (the 4B shape
of `bench/rollout_throughput.py --cases tail`: 192 rows, the mean decode batch of the partial-rollout tail run,
each a sample drawn by its length, as seats hold long samples longer, at a uniform point of its
response), its rows longest context first (as the scheduler hands them) and in drawn order, beside
the same tokens spread evenly over the rows, over 12 layers' caches in one CUDA graph; against the
roofline of the K/V read at the device's peak HBM bandwidth (bench/common.py's). Writes
bench/results/decode_mixed.json.

`--sample-sweep` times every launch shape of the Gumbel-max sampler (programs per SM, block,
warps) on (B, 151936) fp32 logits, beside the plain-torch reference, and writes
bench/results/sampling_sweep.json.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F

from bench.common import RESULTS_DIR, peak_hbm_bytes_per_s, write_result
from bench.decode_sweeps import decode_mixed, decode_sweep
from bench.lora_merge_bench import bench_lora_merge
from colocate.kernels import (
    paged_attention,
    paged_decode_attention,
    reference_token_logprobs,
    token_logprobs,
)
from colocate.models.transformer import joint_linear

RESULTS = RESULTS_DIR / "kernels.json"
SAMPLE_SWEEP_RESULTS = RESULTS_DIR / "sampling_sweep.json"
INVARIANT_SWEEP_RESULTS = RESULTS_DIR / "invariant_matmul_sweep.json"


def _peak_extra_bytes(fn) -> int:
    """Peak allocated bytes of one call beyond what was allocated before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_logprobs(do_bench, num_tokens=16384, vocab_size=151936, hidden_size=1536) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(num_tokens, hidden_size, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (torch.randn(vocab_size, hidden_size, device="cuda", generator=gen) * hidden_size**-0.5).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab_size, (num_tokens,), device="cuda", generator=gen)

    def step(fn):
        def run():
            lp, ent = fn(hidden, weight, targets, 1.0, with_entropy=True)
            (lp.sum() + 0.01 * ent.sum()).backward()
            return lp

        return run

    with torch.no_grad():
        fused_lp, _ = token_logprobs(hidden, weight, targets)
        naive_lp, _ = reference_token_logprobs(hidden, weight, targets)
    max_abs_diff = (fused_lp - naive_lp).abs().max().item()
    result = {
        "shape": dict(tokens=num_tokens, vocab=vocab_size, hidden=hidden_size, dtype="bfloat16"),
        "logprob_max_abs_diff": max_abs_diff,
    }
    for name, fn in (("fused", token_logprobs), ("naive_fp32", reference_token_logprobs)):
        result[f"{name}_ms"] = do_bench(step(fn), grad_to_none=[hidden, weight], return_mode="median")
        hidden.grad = weight.grad = None
        result[f"{name}_peak_extra_gib"] = _peak_extra_bytes(step(fn)) / 2**30
        hidden.grad = weight.grad = None
    result["speedup"] = result["naive_fp32_ms"] / result["fused_ms"]
    result["memory_ratio"] = result["naive_fp32_peak_extra_gib"] / result["fused_peak_extra_gib"]
    return result


def bench_paged_decode(do_bench, batch=256, context=384, num_q_heads=14, num_kv_heads=2, head_dim=64, block_size=16) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, device="cuda", generator=gen).bfloat16()
    v_cache = torch.randn(cache_shape, device="cuda", generator=gen).bfloat16()
    tables = torch.randperm(num_blocks, device="cuda", generator=gen).int().view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, num_q_heads, head_dim, device="cuda", generator=gen).bfloat16()
    scale = head_dim**-0.5

    def gather():
        k = k_cache[tables.long()].view(batch, -1, num_kv_heads, head_dim)[:, :context]  # (B, L, Hk, D)
        v = v_cache[tables.long()].view(batch, -1, num_kv_heads, head_dim)[:, :context]
        return k.transpose(1, 2), v.transpose(1, 2)  # (B, Hk, L, D)

    def sdpa(k, v):
        return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)[:, :, 0]

    dense_k, dense_v = (t.contiguous() for t in gather())
    paged = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)
    max_abs_diff = (paged.float() - sdpa(dense_k, dense_v).float()).abs().max().item()
    result = {
        "shape": dict(
            batch=batch,
            context=context,
            q_heads=num_q_heads,
            kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype="bfloat16",
        ),
        "max_abs_diff": max_abs_diff,
        "paged_ms": do_bench(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale), return_mode="median"),
        "gather_sdpa_ms": do_bench(lambda: sdpa(*gather()), return_mode="median"),
        "sdpa_only_ms": do_bench(lambda: sdpa(dense_k, dense_v), return_mode="median"),
    }
    result["speedup_vs_gather_sdpa"] = result["gather_sdpa_ms"] / result["paged_ms"]
    return result


def sweep_sampling(batch: int, vocab_size: int = 151936) -> dict:
    """Microseconds per call of every sampler launch shape, and of the plain-torch reference."""
    from triton.testing import do_bench

    from colocate.kernels import sampling

    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch, vocab_size, device="cuda", generator=gen) * 4
    temperature = torch.ones(batch, device="cuda")
    seed = torch.arange(batch, device="cuda") * 7919
    counter = torch.arange(batch, device="cuda") + 100
    args = (logits, temperature, seed, counter, None, None)
    want = sampling.reference_gumbel_sample(*args)[1]

    def median_us(fn) -> float:
        return do_bench(fn, rep=50, return_mode="median") * 1e3

    rows = []
    for per_sm, block, warps in itertools.product((1, 2, 4, 8, 16), (512, 1024, 2048, 4096), (4, 8, 16)):
        config = sampling.SampleConfig(sampling.sample_config(batch, vocab_size, logits.device, per_sm).num_splits, block, warps)
        try:
            torch.testing.assert_close(sampling._gumbel_sample_triton(*args, config)[1], want, atol=1e-4, rtol=0)
            us = median_us(lambda: sampling._gumbel_sample_triton(*args, config))
            rows.append(dict(vars(config), programs_per_sm=per_sm, us=us))
        except Exception as exc:  # a shape Triton cannot build is skipped
            rows.append(dict(vars(config), programs_per_sm=per_sm, error=f"{type(exc).__name__}: {str(exc)[:200]}"))
    timed = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
    auto = sampling.sample_config(batch, vocab_size, logits.device)
    return {
        "shape": dict(batch=batch, vocab=vocab_size),
        "roofline_us": batch * vocab_size * 4 / peak_hbm_bytes_per_s() * 1e6,
        "reference_us": median_us(lambda: sampling.reference_gumbel_sample(*args)),
        "auto": dict(vars(auto), us=median_us(lambda: sampling._gumbel_sample_triton(*args, auto))),
        "best": timed[:5],
        "all": rows,
    }


def sample_sweep() -> None:
    results = {"shapes": []}
    for batch in (256, 64, 16):
        r = sweep_sampling(batch)
        results["shapes"].append(r)
        best = r["best"][0]
        print(
            f"sampler B={batch}: roofline {r['roofline_us']:.1f} us | reference {r['reference_us']:.1f} us | "
            f"auto {r['auto']['us']:.1f} us | best {best['us']:.1f} us "
            f"{ {k: best[k] for k in ('programs_per_sm', 'num_splits', 'block', 'num_warps')} }",
            flush=True,
        )
    write_result(results, SAMPLE_SWEEP_RESULTS)


INVARIANT_SHAPES = {  # (hidden, intermediate, q/k/v width): each projection's (N, K); lm_head apart
    "0.5b": (896, 4864, 896 + 2 * 128),
    "1.5b": (1536, 8960, 1536 + 2 * 256),
}
INVARIANT_CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)
    (64, 128, 64, 4, 3),
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 64, 64, 4, 3),
    (64, 64, 64, 4, 4),
    (64, 32, 64, 4, 4),
    (32, 64, 64, 4, 4),
    (64, 32, 128, 4, 4),
    (32, 32, 128, 4, 4),
    (16, 64, 128, 4, 4),
]


def invariant_sweep() -> None:
    from triton.testing import do_bench, do_bench_cudagraph

    from colocate.kernels import batch_invariant_cuda as bic

    def ms(fn) -> float:  # replayed from a CUDA graph, as the decode step is: no host launch cost
        return do_bench_cudagraph(fn, rep=50, return_mode="median")

    def eager_ms(fn) -> float:  # the trainer's packed attention runs outside graphs
        return do_bench(fn, rep=50, return_mode="median")

    gen = torch.Generator(device="cuda").manual_seed(0)
    block_k = bic.BLOCK_K[torch.bfloat16]
    results = {"k_chunk": bic.K_CHUNK, "block_k": block_k, "shapes": {}}
    broken = []
    for shape, (hidden, inter, qkv) in INVARIANT_SHAPES.items():
        rows = []
        for name, n, k in (
            ("qkv", qkv, hidden),
            ("o", hidden, hidden),
            ("gate_up", 2 * inter, hidden),
            ("down", hidden, inter),
            ("lm_head", 151936, hidden),
        ):
            out_dtype = torch.float32 if name == "lm_head" else None
            w = (torch.randn(n, k, device="cuda", generator=gen) * k**-0.5).bfloat16()
            chunks = -(-k // bic.K_CHUNK)
            row = dict(name=name, n=n, k=k, chunks=chunks, configs=[])
            for m in (256, 16384):
                x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
                picked = bic.matmul(x, w.T, out_dtype=out_dtype)
                torch.testing.assert_close(picked.float(), x.float() @ w.float().T, atol=5e-2, rtol=2e-2)
                config, split = bic.tile_config(m, n, k, torch.bfloat16, x.device)
                row[f"picked_m{m}"] = dict(
                    config=list(config), split=split, ms=ms(lambda: bic.matmul(x, w.T, out_dtype=out_dtype))
                )
                row[f"cublas_ms_m{m}"] = ms(lambda: F.linear(x, w))
                if chunks > 1:  # the picked tile with K's chunks split over programs, or walked by one
                    got = bic.matmul(x, w.T, out_dtype=out_dtype, config=config, split=not split)
                    row[f"picked_m{m}"]["other_split_equal"] = torch.equal(got, picked)
                    row[f"picked_m{m}"]["other_split_ms"] = ms(
                        lambda: bic.matmul(x, w.T, out_dtype=out_dtype, config=config, split=not split)
                    )
                for config in INVARIANT_CONFIGS:
                    entry = next((c for c in row["configs"] if c["config"] == list(config)), None)
                    if entry is None:
                        entry = dict(config=list(config))
                        row["configs"].append(entry)
                    try:
                        got = bic.matmul(x, w.T, out_dtype=out_dtype, config=config, split=False)
                        entry[f"equal_m{m}"] = torch.equal(got, picked)
                        entry[f"ms_m{m}"] = ms(lambda: bic.matmul(x, w.T, out_dtype=out_dtype, config=config, split=False))
                        if config[2] == block_k and not entry[f"equal_m{m}"]:
                            broken.append(f"{shape} {name} M={m} {config}")
                    except Exception as exc:  # a config Triton cannot build (shared memory) is skipped
                        entry["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            # "best": of the configs that keep the mode's bits (BLOCK_K[bf16]); the others are timed for reference
            timed = [c for c in row["configs"] if "error" not in c and c["config"][2] == block_k]
            row["best_decode"] = min(timed, key=lambda c: c["ms_m256"])
            row["best_train"] = min(timed, key=lambda c: c["ms_m16384"])
            rows.append(row)
            decode, train = row["picked_m256"], row["picked_m16384"]
            print(
                f"{shape} {name} N={n} K={k}: M=256 cuBLAS {row['cublas_ms_m256'] * 1e3:.0f} us, picked "
                f"{decode['config']}{' split' if decode['split'] else ''} {decode['ms'] * 1e3:.0f} us, best "
                f"{row['best_decode']['ms_m256'] * 1e3:.0f} us {row['best_decode']['config']} | M=16384 cuBLAS "
                f"{row['cublas_ms_m16384']:.2f} ms, picked {train['config']} {train['ms']:.2f} ms, best "
                f"{row['best_train']['ms_m16384']:.2f} ms {row['best_train']['config']}",
                flush=True,
            )
        results["shapes"][shape] = rows
    results["same_block_k_bits_differ"] = broken
    print(f"configs of BLOCK_K {block_k} whose bits differ from the pick's: {broken or 'none'}", flush=True)
    results["attention"] = invariant_attention_sweep(eager_ms, ms)
    write_result(results, INVARIANT_SWEEP_RESULTS)


def invariant_attention_sweep(
    eager_ms,
    graphed_ms,
    num_seqs=8,
    seq_len=2048,
    num_q_heads=12,
    num_kv_heads=2,
    head_dim=128,
    decode_batch=256,
    decode_context=1024,
    block_size=16,
) -> dict:
    """The mode's packed attention forward (the trainer's) with query tiles of 16 to 128 rows and its
    paged decode (the engine's) with tiles of 16 and 64 query heads, on the 1.5B shape's heads: time,
    and whether each gives the bits of the current tile sizes; beside the default packed attention
    (FlashAttention-4 or varlen) and the default paged decode."""
    from colocate.kernels import invariant_attention as ia
    from colocate.kernels.flash import fast_packed_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    n = num_seqs * seq_len
    q, k, v = (
        torch.randn(n, h, head_dim, device="cuda", generator=gen).bfloat16() for h in (num_q_heads, num_kv_heads, num_kv_heads)
    )
    cu = torch.arange(0, n + 1, seq_len, device="cuda", dtype=torch.int32)
    scale = head_dim**-0.5
    blocks = decode_batch * decode_context // block_size
    k_cache, v_cache = (
        torch.randn(blocks, block_size, num_kv_heads, head_dim, device="cuda", generator=gen).bfloat16() for _ in range(2)
    )
    tables = torch.randperm(blocks, device="cuda", generator=gen).int().view(decode_batch, -1)
    lens = torch.full((decode_batch,), decode_context, dtype=torch.int32, device="cuda")
    dq = torch.randn(decode_batch, num_q_heads, head_dim, device="cuda", generator=gen).bfloat16()

    def packed():
        return ia.packed_attention(q, k, v, cu, scale)

    def decoded():
        return ia.paged_decode_attention(dq, k_cache, v_cache, tables, lens, scale)

    current = {"packed": (ia.BLOCK_M, packed()), "decode": (ia.DECODE_BLOCK_M, decoded())}
    rows = {}
    for path, name, fn, sizes, ms in (
        ("packed", "BLOCK_M", packed, (16, 64, 128), eager_ms),
        ("decode", "DECODE_BLOCK_M", decoded, (16, 64), graphed_ms),
    ):
        default = getattr(ia, name)
        try:
            for size in sizes:
                setattr(ia, name, size)
                rows[f"{path}_{size}"] = dict(ms=ms(fn), equal_to_current=torch.equal(fn(), current[path][1]))
        finally:
            setattr(ia, name, default)
    result = {
        "shape": dict(
            seqs=num_seqs,
            seq_len=seq_len,
            q_heads=num_q_heads,
            kv_heads=num_kv_heads,
            head_dim=head_dim,
            decode_batch=decode_batch,
            decode_context=decode_context,
        ),
        "current": {path: size for path, (size, _) in current.items()},
        "default_packed_ms": eager_ms(lambda: fast_packed_attention(q, k, v, cu, seq_len, scale)),
        "default_decode_ms": graphed_ms(
            lambda: paged_attention.paged_decode_attention(dq, k_cache, v_cache, tables, lens, scale)
        ),
        "tiles": rows,
    }
    print(
        f"invariant attention {num_seqs} x {seq_len} / decode {decode_batch} x {decode_context}: default "
        f"{result['default_packed_ms']:.2f} / {result['default_decode_ms']:.3f} ms | "
        + " | ".join(
            f"{key}: {r['ms']:.3f} ms, bits {'=' if r['equal_to_current'] else '!='} current" for key, r in rows.items()
        ),
        flush=True,
    )
    return result


def bench_joint_linear(do_bench, num_tokens=32768, hidden_size=1536, widths=None, device="cuda") -> dict:
    """Forward + backward of linear layers sharing their input, separate against joint."""
    gen = torch.Generator(device=device).manual_seed(0)
    cases = widths or {"qkv": ([1536, 256, 256], True), "gate_up": ([8960, 8960], False)}
    x = torch.randn(num_tokens, hidden_size, device=device, generator=gen).bfloat16().requires_grad_()
    result = {"shape": dict(tokens=num_tokens, hidden=hidden_size, dtype="bfloat16")}
    for name, (sizes, bias) in cases.items():
        parts = tuple(torch.nn.Linear(hidden_size, n, bias=bias, device=device, dtype=torch.bfloat16) for n in sizes)
        grads = [torch.randn(num_tokens, n, device=device, generator=gen).bfloat16() for n in sizes]
        leaves = [x] + [p for m in parts for p in m.parameters()]
        x.grad = None  # the previous case's timing runs leave it set

        def separate():
            return [m(x) for m in parts]

        def joint():
            return list(joint_linear(x, parts, None).split(sizes, dim=-1))

        def step(fn):
            return lambda: torch.autograd.backward(fn(), grads)

        got = {}
        for fn in (separate, joint):
            step(fn)()
            got[fn] = [t.grad.float() for t in leaves]
            for t in leaves:
                t.grad = None
        with torch.no_grad():
            outputs = (torch.cat(separate(), -1).float() - torch.cat(joint(), -1).float()).abs().max().item()
        result[name] = {
            "widths": sizes,
            "max_abs_diff_out": outputs,
            "max_abs_diff_grads": max((a - b).abs().max().item() for a, b in zip(got[separate], got[joint])),
            "separate_ms": do_bench(step(separate), grad_to_none=leaves, return_mode="median"),
            "joint_ms": do_bench(step(joint), grad_to_none=leaves, return_mode="median"),
        }
        result[name]["speedup"] = result[name]["separate_ms"] / result[name]["joint_ms"]
    return result


def bench_residual_addmm(do_bench, num_tokens=32768, hidden_size=1536, intermediate_size=8960, device="cuda") -> dict:
    """addmm(r, x, w.T) (beta=1, 2-D r) against mm(x, w.T) alone and mm then add, eager, bf16."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator(device=device).manual_seed(0)
    residual = torch.randn(num_tokens, hidden_size, device=device, generator=gen).bfloat16()
    result = {"shape": dict(tokens=num_tokens, dtype="bfloat16")}
    for name, width in (("o_proj", hidden_size), ("down_proj", intermediate_size)):
        x = torch.randn(num_tokens, width, device=device, generator=gen).bfloat16()
        w_t = torch.randn(hidden_size, width, device=device, generator=gen).bfloat16().T
        variants = {
            "addmm": lambda: torch.addmm(residual, x, w_t),
            "mm": lambda: torch.mm(x, w_t),
            "mm_then_add": lambda: torch.mm(x, w_t) + residual,
        }
        case = {f"{k}_ms": do_bench(fn, return_mode="median") for k, fn in variants.items()}
        for k, fn in variants.items():
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
            case[f"{k}_kernels"] = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
        case["addmm_over_mm_then_add"] = case["addmm_ms"] / case["mm_then_add_ms"]
        result[name] = case
    return result


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel_bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--decode-sweep", action="store_true", help="time every paged-decode launch shape")
    parser.add_argument("--sample-sweep", action="store_true", help="time every sampler launch shape")
    parser.add_argument(
        "--fp8-decode-sweep", action="store_true", help="the decode kernel over an fp8 cache beside bf16, every fp8 tile"
    )
    parser.add_argument(
        "--decode-mixed",
        action="store_true",
        help="time the decode kernel on long-tailed contexts, longest first and in drawn order",
    )
    parser.add_argument(
        "--invariant-sweep", action="store_true", help="time the true-on-policy matmul's candidate tile configs by (N, K)"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench.kernel_bench needs a CUDA device")
    if args.invariant_sweep:
        return invariant_sweep()
    if args.decode_sweep:
        return decode_sweep()
    if args.fp8_decode_sweep:
        from bench.decode_sweeps import fp8_decode_sweep

        return fp8_decode_sweep()
    if args.sample_sweep:
        return sample_sweep()
    if args.decode_mixed:
        return decode_mixed()
    from triton.testing import do_bench

    results = {
        "token_logprobs": bench_logprobs(do_bench),
        "paged_decode": bench_paged_decode(do_bench),
        "joint_linear": bench_joint_linear(do_bench),
        "residual_addmm": bench_residual_addmm(do_bench),
        "lora_merge": bench_lora_merge(do_bench),
    }
    write_result(results, RESULTS)
    lp, pd, jl, ra, lm = (results[k] for k in ("token_logprobs", "paged_decode", "joint_linear", "residual_addmm", "lora_merge"))
    print(
        f"token_logprobs fwd+bwd {lp['fused_ms']:.1f} ms ({lp['fused_peak_extra_gib']:.2f} GiB) vs naive "
        f"{lp['naive_fp32_ms']:.1f} ms ({lp['naive_fp32_peak_extra_gib']:.1f} GiB) | paged decode "
        f"{pd['paged_ms'] * 1e3:.0f} us vs gather+SDPA {pd['gather_sdpa_ms'] * 1e3:.0f} us "
        f"(SDPA alone {pd['sdpa_only_ms'] * 1e3:.0f} us) | joint q/k/v {jl['qkv']['joint_ms']:.2f} ms vs "
        f"separate {jl['qkv']['separate_ms']:.2f} ms, joint gate/up {jl['gate_up']['joint_ms']:.2f} ms vs "
        f"separate {jl['gate_up']['separate_ms']:.2f} ms | residual addmm o_proj {ra['o_proj']['addmm_ms']:.2f} ms vs "
        f"mm+add {ra['o_proj']['mm_then_add_ms']:.2f}, down_proj {ra['down_proj']['addmm_ms']:.2f} vs "
        f"{ra['down_proj']['mm_then_add_ms']:.2f} | LoRA merges of a 1.5B pass {lm['kernel_ms']:.2f} ms vs torch ops "
        f"{lm['torch_ops_ms']:.2f} ms (roofline {lm['roofline_ms']:.2f}), host {lm['host_ms']['kernel_compiled']:.1f} ms "
        f"compiled vs {lm['host_ms']['torch_ops_compiled']:.1f} ms for compiled torch ops -> {RESULTS}"
    )


if __name__ == "__main__":
    main()
