"""Kernel micro-benchmark on one GPU: each kernel side by side with its plain-torch counterpart.

- token_logprobs forward+backward (with entropy) for T=16384, V=151936, H=1536 in bf16, against the
  naive path that materialises fp32 logits (`reference_token_logprobs`): median time and peak
  extra memory of each.
- paged_decode_attention for B=256 sequences of 384 cached tokens, Hq=14, Hk=2, D=64, bf16, against
  SDPA over K/V gathered from the paged cache into dense tensors (gather included, and alone).

Prints one summary line and writes bench/results/kernels.json. Run: python bench/kernels.py
"""

from __future__ import annotations

import json
import pathlib

import torch
import torch.nn.functional as F

from colocate.kernels import (
    paged_decode_attention,
    reference_token_logprobs,
    token_logprobs,
)

RESULTS = pathlib.Path(__file__).parent / "results" / "kernels.json"


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
    weight = (torch.randn(vocab_size, hidden_size, device="cuda", generator=gen) * hidden_size**-0.5
              ).bfloat16().requires_grad_()
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
    result = {"shape": dict(tokens=num_tokens, vocab=vocab_size, hidden=hidden_size, dtype="bfloat16"),
              "logprob_max_abs_diff": max_abs_diff}
    for name, fn in (("fused", token_logprobs), ("naive_fp32", reference_token_logprobs)):
        result[f"{name}_ms"] = do_bench(step(fn), grad_to_none=[hidden, weight], return_mode="median")
        hidden.grad = weight.grad = None
        result[f"{name}_peak_extra_gib"] = _peak_extra_bytes(step(fn)) / 2**30
        hidden.grad = weight.grad = None
    result["speedup"] = result["naive_fp32_ms"] / result["fused_ms"]
    result["memory_ratio"] = result["naive_fp32_peak_extra_gib"] / result["fused_peak_extra_gib"]
    return result


def bench_paged_decode(do_bench, batch=256, context=384, num_q_heads=14, num_kv_heads=2, head_dim=64,
                       block_size=16) -> dict:
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
        "shape": dict(batch=batch, context=context, q_heads=num_q_heads, kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, dtype="bfloat16"),
        "max_abs_diff": max_abs_diff,
        "paged_ms": do_bench(lambda: paged_decode_attention(q, k_cache, v_cache, tables, lens, scale),
                             return_mode="median"),
        "gather_sdpa_ms": do_bench(lambda: sdpa(*gather()), return_mode="median"),
        "sdpa_only_ms": do_bench(lambda: sdpa(dense_k, dense_v), return_mode="median"),
    }
    result["speedup_vs_gather_sdpa"] = result["gather_sdpa_ms"] / result["paged_ms"]
    return result


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/kernels.py needs a CUDA device")
    from triton.testing import do_bench

    results = {
        "device": torch.cuda.get_device_name(),
        "token_logprobs": bench_logprobs(do_bench),
        "paged_decode": bench_paged_decode(do_bench),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    lp, pd = results["token_logprobs"], results["paged_decode"]
    print(
        f"token_logprobs fwd+bwd {lp['fused_ms']:.1f} ms ({lp['fused_peak_extra_gib']:.2f} GiB) vs naive "
        f"{lp['naive_fp32_ms']:.1f} ms ({lp['naive_fp32_peak_extra_gib']:.1f} GiB) | paged decode "
        f"{pd['paged_ms'] * 1e3:.0f} us vs gather+SDPA {pd['gather_sdpa_ms'] * 1e3:.0f} us "
        f"(SDPA alone {pd['sdpa_only_ms'] * 1e3:.0f} us) -> {RESULTS}"
    )


if __name__ == "__main__":
    main()
