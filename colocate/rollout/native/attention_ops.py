"""The attention ops of the engine's default path, opaque to torch.compile: each stores one layer's
new K/V into its paged cache and attends over it (decode: one query per sequence, through
kernels.paged_attention; prefill: packed new tokens, varlen flash attention on CUDA, one SDPA per
sequence elsewhere). The compiled decode and prefill fuse everything around them
(colocate/rollout/native/model_runner.py, which calls them)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from colocate.kernels.fp8 import E4M3
from colocate.kernels.paged_attention import gather_kv, paged_decode_attention, store_kv


def _kv_scales(kv: torch.Tensor, kv_scale: torch.Tensor) -> dict:
    """The scale arguments of the cache ops: an FP8 cache's (2, num_blocks, block_size, Hk) scales
    (`kv_scale`; an empty placeholder for a cache in the compute dtype)."""
    return dict(k_scale=kv_scale[0], v_scale=kv_scale[1]) if kv.dtype == E4M3 else {}


@torch.library.custom_op("colocate_native::decode_attention", mutates_args=("kv", "kv_scale"))
def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Store one layer's new K/V into its paged cache `kv` (2, num_blocks, block_size, Hk, D) and
    attend over it (the default table's `decode_attention`); an FP8 cache's scales are `kv_scale`.
    An opaque op to torch.compile, which fuses everything around it."""
    scales = _kv_scales(kv, kv_scale)
    store_kv(k, v, kv[0], kv[1], slot_mapping, **scales)
    return paged_decode_attention(q, kv[0], kv[1], block_tables, context_lens, scale, **scales)


@decode_attention.register_fake
def _(q, k, v, kv, kv_scale, slot_mapping, block_tables, context_lens, scale):
    return torch.empty_like(q)


@torch.library.custom_op("colocate_native::prefill_attention", mutates_args=("kv", "kv_scale"))
def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_lens: torch.Tensor,
    gather_slots: Optional[torch.Tensor],
    scale: float,
) -> torch.Tensor:
    """Store one layer's new K/V of a packed prefill into its paged cache `kv` (2, num_blocks,
    block_size, Hk, D), then attend: each sequence's queries, its last tokens, over its keys
    (causal, the last query aligned with the last key). `gather_slots` holds the cache slots of every
    key when some sequence continues a cached prefix (else the keys are the new ones); `max_lens`,
    on the host, the longest query and key runs; an FP8 cache's scales are `kv_scale` (every
    sequence's new keys attend as computed, whatever it is batched with; a cached prefix is read
    dequantized). An opaque op to torch.compile (the default path's: the true on-policy mode's
    prefill is `ModelRunner._invariant_prefill_attention`)."""
    scales = _kv_scales(kv, kv_scale)
    store_kv(k, v, kv[0], kv[1], slot_mapping, **scales)
    if gather_slots is not None:  # (M, Hk, D): cached prefix + new keys
        new_k, new_v = k, v
        k, v = gather_kv(kv[0], kv[1], gather_slots, q.dtype, **scales)
        if scales:  # the new keys as computed, not as the e4m3 cache rounded them
            rows = _new_key_rows(cu_seq_q, cu_seq_k, q.shape[0])
            k[rows], v[rows] = new_k, new_v
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        max_q, max_k = max_lens.tolist()
        return varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=(-1, 0))
    return attention_per_sequence(q, k, v, cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist(), scale)


def _new_key_rows(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Where each new token's key sits among the gathered keys: sequence i's new tokens are its last
    keys, so token j of it (packed index j) is key j + cu_seq_k[i + 1] - cu_seq_q[i + 1]. No host sync."""
    shift = (cu_seq_k[1:] - cu_seq_q[1:]).long()
    per_token = torch.repeat_interleave(shift, cu_seq_q.diff(), output_size=num_tokens)
    return torch.arange(num_tokens, device=cu_seq_q.device) + per_token


@prefill_attention.register_fake
def _(q, k, v, kv, kv_scale, slot_mapping, cu_seq_q, cu_seq_k, max_lens, gather_slots, scale):
    return torch.empty_like(q)


def attention_per_sequence(q, k, v, q_lens: list[int], k_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its keys, one
    SDPA call per sequence: cost sum(q_len * k_len), where one packed mask would cost N * M."""
    out = torch.empty_like(q)  # (N, Hq, D)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        qs, ks, vs = (t.transpose(0, 1) for t in (q[q0 : q0 + nq], k[k0 : k0 + nk], v[k0 : k0 + nk]))
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
        out[q0 : q0 + nq] = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True).transpose(
            0, 1
        )
        q0, k0 = q0 + nq, k0 + nk
    return out
