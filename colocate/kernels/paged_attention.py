"""Decode attention over a paged KV cache (one new query token per sequence), GQA aware.

Cache layout: k_cache and v_cache are (num_blocks, block_size, Hk, D); sequence b's token j lives
in block block_tables[b, j // block_size] at offset j % block_size, and attention covers tokens
0..context_lens[b]-1 (the new token's K/V is stored first, by `store_kv`). Query head h reads kv
head h // (Hq // Hk). Rows of block_tables may be padded with -1 past the used blocks, and a
context length of 0 (a padded CUDA-graph row) gives a zero output. The CUDA kernel takes block
sizes that are powers of two >= 16; the plain-torch path takes any.

The Triton kernel runs one program per (kv head, sequence, context split) that serves all query
heads of the group, so each K/V tile is read once per group, with an online softmax in fp32. The
grid starts a sequence's programs together, sequence after sequence: a batch ordered longest context
first (the engine's scheduler hands it so) starts its longest programs first, and a step of
long-tailed contexts does not end on a few long programs started last. A tile of at most one cache
block needs one block-table lookup; a larger tile looks up one block id per token. The context of a
sequence is split across programs (flash-decoding) and a second kernel merges the partial softmaxes:
a decode step is bound by memory latency, and more, shorter programs keep more loads in flight. Tile
size, splits, warps and pipeline stages come from `DecodeConfig` (`decode_config` picks them from
the shapes; bench/kernel_bench.py --decode-sweep measures the alternatives). Everything is shaped by
(B, max_blocks_per_seq) alone and the launch never reads device values back, so both kernels can be
captured in a CUDA graph.

FP8 cache: k_cache and v_cache may be float8_e4m3fn, each with a float32 scale tensor (num_blocks,
block_size, Hk) beside it. A (token, kv head) row x of D values is stored as x / s in e4m3 with
s = amax(|x|) / 448, so the row's largest value maps to e4m3's largest and every value keeps e4m3's
rounding (relative 2^-4). `store_kv` quantizes as it writes; the decode kernel reads the fp8 tiles,
half the bytes of bf16, converts them to q's dtype for its products and folds the scales in as
vectors: key n's into its scores after q.k, value n's into its probabilities before p.v. `gather_kv`
returns dequantized rows, and `kv_bytes_per_token` counts the scales in a token's bytes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from colocate.kernels.fp8 import AMAX_FLOOR, E4M3, E4M3_MAX, quantize_per_token
from colocate.kernels.paged_attention_triton import triton_kernels

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Dtypes of q, of the K/V that `store_kv` writes, and of a cache that is not fp8."""
_MIN_SPLIT_TOKENS = 256
"""Fewest context tokens worth a program of their own in the split kernel."""
_MAX_SPLITS = 16
_PROGRAMS_PER_SM = 4
"""Programs per SM the split count aims for: enough loads in flight to cover memory latency."""


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape of the decode kernel."""

    block_n: int = 64
    """Context tokens per loop iteration (a power of two >= 16)."""
    num_splits: int = 1
    """Programs per (sequence, kv head), each over an equal share of the context (a power of two)."""
    num_warps: int = 4
    num_stages: int = 3


def reference_paged_decode_attention(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    block_tables: torch.Tensor,  # (B, max_blocks_per_seq) int32
    context_lens: torch.Tensor,  # (B,) int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
    v_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
) -> torch.Tensor:
    """Gather every sequence's K/V into a dense, masked tensor (dequantized, for an fp8 cache) and
    attend in fp32 (the CPU path)."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_used_blocks = -(-int(context_lens.max()) // block_size) if batch else 0
    blocks = block_tables[:, :num_used_blocks].long().clamp(min=0)  # (B, nb)
    length = num_used_blocks * block_size
    k = k_cache[blocks].float()  # (B, nb, block_size, Hk, D)
    v = v_cache[blocks].float()
    if k_scale is not None:
        k = k * k_scale[blocks][..., None]
        v = v * v_scale[blocks][..., None]
    k = k.reshape(batch, length, num_kv_heads, head_dim)  # (B, L, Hk, D)
    v = v.reshape(batch, length, num_kv_heads, head_dim)  # (B, L, Hk, D)
    qg = q.float().reshape(batch, num_kv_heads, group, head_dim)  # (B, Hk, G, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale  # (B, Hk, G, L)
    visible = torch.arange(length, device=q.device) < context_lens[:, None]  # (B, L)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with no context are all zero
    out = torch.einsum("bhgl,blhd->bhgd", probs, v)  # (B, Hk, G, D)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def paged_decode_attention(
    q: torch.Tensor,  # (B, Hq, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    block_tables: torch.Tensor,  # (B, max_blocks_per_seq) int32
    context_lens: torch.Tensor,  # (B,) int32
    scale: float,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
    v_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
) -> torch.Tensor:
    """softmax(q K^T * scale) V over each sequence's cached tokens; (B, Hq, D) in q's dtype. An fp8
    cache takes its scales (K ~ k_cache * k_scale[..., None], V likewise)."""
    _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens)
    _check_scales(k_cache, k_scale, v_scale)
    if not q.is_cuda:
        return reference_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale)
    if not _kernel_block_size_ok(k_cache.shape[1]):
        raise ValueError(f"the CUDA kernel needs a power-of-two block_size >= 16, got {k_cache.shape[1]}")
    config = decode_config(
        q.shape[0], k_cache.shape[2], q.shape[2], block_tables.shape[1] * k_cache.shape[1], q.device, k_cache.dtype == E4M3
    )
    return _paged_decode_triton(q, k_cache, v_cache, block_tables, context_lens, scale, config, k_scale, v_scale)


def store_kv(
    k: torch.Tensor,  # (N, Hk, D)
    v: torch.Tensor,  # (N, Hk, D)
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    slot_mapping: torch.Tensor,  # (N,) int64
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
    v_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
) -> None:
    """Write token i's K/V to flat slot slot_mapping[i] = block * block_size + offset; -1 skips it.
    Into an fp8 cache each (token, head) row goes quantized, its scale into k_scale/v_scale.

    On CUDA a Triton kernel does the scatter (and the quantization) so that skipped rows need no
    host-side filtering (which would sync and break CUDA-graph capture).
    """
    _check_store_inputs(k, v, k_cache, v_cache, slot_mapping)
    _check_scales(k_cache, k_scale, v_scale)
    if k.shape[0] == 0:
        return
    if k.is_cuda:
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    for x, cache, x_scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if x_scale is None:
            cache[blocks, offsets] = x
        else:
            x8, s = quantize_per_token(x.reshape(-1, x.shape[-1]))  # (n * Hk, D), (n * Hk, 1)
            cache[blocks, offsets] = x8.view(x.shape)
            x_scale[blocks, offsets] = s.view(x.shape[:-1])


def gather_kv(
    k_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    v_cache: torch.Tensor,  # (num_blocks, block_size, Hk, D)
    slots: torch.Tensor,  # (M,) int64, each >= 0
    dtype: torch.dtype,
    k_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
    v_scale: torch.Tensor | None = None,  # (num_blocks, block_size, Hk) fp32, with an fp8 cache
) -> tuple[torch.Tensor, torch.Tensor]:
    """The cached K and V at flat slots (block * block_size + offset), each (M, Hk, D) in `dtype`,
    dequantized from an fp8 cache. Slots are not bounds-checked (that would sync with the device)."""
    _check_cache(k_cache, v_cache)
    _check_scales(k_cache, k_scale, v_scale)
    if slots.ndim != 1 or slots.dtype != torch.int64:
        raise ValueError(f"slots must be (M,) int64, got {tuple(slots.shape)} {slots.dtype}")
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k, v = k_cache[blocks, offsets], v_cache[blocks, offsets]  # (M, Hk, D)
    if k_scale is not None:
        k = k.float() * k_scale[blocks, offsets][..., None]
        v = v.float() * v_scale[blocks, offsets][..., None]
    return k.to(dtype), v.to(dtype)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token's K and V take in one layer's cache of `dtype`, an fp8 cache's scales included."""
    if dtype == E4M3:
        return 2 * num_kv_heads * (head_dim + 4)  # one byte a value, an fp32 scale a row
    if dtype not in _DTYPES:
        raise ValueError(f"a KV cache dtype is one of {(*_DTYPES, E4M3)}, got {dtype}")
    return 2 * num_kv_heads * head_dim * dtype.itemsize


def _check_attention_inputs(q, k_cache, v_cache, block_tables, context_lens) -> None:
    if q.ndim != 3:
        raise ValueError(f"q must be (batch, num_q_heads, head_dim), got shape {tuple(q.shape)}")
    _check_cache(k_cache, v_cache)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if head_dim != k_cache.shape[3]:
        raise ValueError(f"q head_dim {head_dim} differs from the cache's {k_cache.shape[3]}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads are not a multiple of the cache's {num_kv_heads} kv heads")
    if k_cache.dtype == E4M3 and q.dtype not in _DTYPES:
        raise ValueError(f"q dtype must be one of {_DTYPES} with an fp8 cache, got {q.dtype}")
    if k_cache.dtype != E4M3 and q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the cache dtype {k_cache.dtype}")
    if q.stride(-1) != 1:
        raise ValueError("q must be contiguous in head_dim")
    if block_tables.ndim != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(
            f"block_tables must be ({batch}, max_blocks_per_seq) int32, got {tuple(block_tables.shape)} {block_tables.dtype}"
        )
    if context_lens.shape != (batch,) or context_lens.dtype != torch.int32:
        raise ValueError(f"context_lens must be ({batch},) int32, got {tuple(context_lens.shape)} {context_lens.dtype}")
    devices = {t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}
    if len(devices) != 1:
        raise ValueError(f"q, caches, block_tables and context_lens must share one device, got {devices}")


def _check_store_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_cache(k_cache, v_cache)
    expected = (k.shape[0], *k_cache.shape[2:])
    if k.shape != expected or v.shape != expected:
        raise ValueError(f"k and v must be (N, Hk, D) = {expected}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.dtype == E4M3 and (k.dtype not in _DTYPES or v.dtype != k.dtype):
        raise ValueError(f"k and v must share one dtype of {_DTYPES} with an fp8 cache, got {k.dtype} and {v.dtype}")
    if k_cache.dtype != E4M3 and (k.dtype != k_cache.dtype or v.dtype != k_cache.dtype):
        raise ValueError(f"k and v must have the cache dtype {k_cache.dtype}, got {k.dtype} and {v.dtype}")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v must be contiguous in head_dim")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be ({k.shape[0]},) int64, got {tuple(slot_mapping.shape)} {slot_mapping.dtype}")
    devices = {t.device for t in (k, v, k_cache, v_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"k, v, caches and slot_mapping must share one device, got {devices}")


def _check_cache(k_cache, v_cache) -> None:
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be (num_blocks, block_size, num_kv_heads, head_dim), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.dtype not in (*_DTYPES, E4M3) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"caches must share one dtype of {(*_DTYPES, E4M3)}, got {k_cache.dtype} and {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError(
            f"k_cache and v_cache must share strides and be contiguous in head_dim, got {k_cache.stride()} and {v_cache.stride()}"
        )


def _check_scales(k_cache, k_scale, v_scale) -> None:
    """An fp8 cache needs both scale tensors, (num_blocks, block_size, Hk) fp32 with one set of
    strides on the cache's device; any other cache takes none."""
    if k_cache.dtype != E4M3:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale and v_scale belong with a {E4M3} cache, not a {k_cache.dtype} one")
        return
    if k_scale is None or v_scale is None:
        raise ValueError(f"a {E4M3} cache needs k_scale and v_scale")
    expected = tuple(k_cache.shape[:3])
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tuple(s.shape) != expected or s.dtype != torch.float32 or s.device != k_cache.device:
            raise ValueError(
                f"{name} must be (num_blocks, block_size, Hk) = {expected} float32 on {k_cache.device}, "
                f"got {tuple(s.shape)} {s.dtype} on {s.device}"
            )
    if k_scale.stride() != v_scale.stride():
        raise ValueError(f"k_scale and v_scale must share strides, got {k_scale.stride()} and {v_scale.stride()}")


def _kernel_block_size_ok(block_size: int) -> bool:
    """A power of two >= 16, so that tiles and cache blocks nest."""
    return block_size >= 16 and block_size & (block_size - 1) == 0


def decode_config(
    batch: int, num_kv_heads: int, head_dim: int, max_context: int, device: torch.device, fp8: bool = False
) -> DecodeConfig:
    """The launch shape for these sizes, from the H200 sweep (bench/kernel_bench.py --decode-sweep): big
    tiles with a 3-stage pipeline, and the context split only as far as it takes to give each SM
    about four programs. An fp8 cache (`fp8`) takes 128-token tiles at every head_dim: on an H100,
    head_dim 128, they beat 64-token ones by 1.27-1.33x (bench/kernel_bench.py --fp8-decode-sweep).
    Depends on shapes alone, so one captured graph keeps one choice for every replay (the kernel
    sizes each split from the real context length)."""
    num_programs = batch * num_kv_heads
    splits = _PROGRAMS_PER_SM * _sm_count(device) // max(num_programs, 1)
    splits = max(1, min(splits, max_context // _MIN_SPLIT_TOKENS, _MAX_SPLITS))
    splits = 1 << (splits.bit_length() - 1)  # a power of two: fewer compiles
    # 128 x 64 and 64 x 128 tiles are the same bytes; larger ones spill registers.
    return DecodeConfig(block_n=128 if head_dim <= 64 or fp8 else 64, num_splits=splits, num_warps=4, num_stages=3)


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _tile(n: int) -> int:
    """Smallest power of two >= n, and >= 16 so that tl.dot accepts the tile (CUDA launchers only)."""
    import triton

    return max(16, triton.next_power_of_2(n))


def _paged_decode_triton(
    q, k_cache, v_cache, block_tables, context_lens, scale, config: DecodeConfig, k_scale=None, v_scale=None
):
    """Launch the decode kernel (and the merge kernel when the context is split)."""
    decode_kernel, merge_kernel, _ = triton_kernels()
    fp8 = k_cache.dtype == E4M3
    assert fp8 == (k_scale is not None) == (v_scale is not None)
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    num_splits = config.num_splits
    out = torch.empty((batch, num_q_heads, head_dim), dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    assert _kernel_block_size_ok(block_size)
    assert config.block_n >= 16 and config.block_n & (config.block_n - 1) == 0
    assert num_splits >= 1 and num_splits & (num_splits - 1) == 0
    if num_splits == 1:
        part_out, part_stats = out, out  # the stats pointers are unused without splits
    else:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_out = torch.empty((batch, num_q_heads, num_splits, head_dim), **f32)  # (B, Hq, S, D)
        part_stats = torch.empty((2, batch, num_q_heads, num_splits), **f32)  # max, sum-exp
    if not fp8:
        k_scale, v_scale = k_cache, v_cache  # the scale pointers are unused without fp8
    decode_kernel[(num_kv_heads, batch, num_splits)](
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        part_out,
        part_stats,
        scale,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        *(k_scale.stride() if fp8 else (0, 0, 0)),
        block_tables.stride(0),
        block_tables.stride(1),
        block_tables.shape[1],
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2) if num_splits > 1 else 0,
        GROUP=group,
        GROUP_PAD=_tile(group),
        HEAD_DIM=head_dim,
        D_PAD=_tile(head_dim),
        BLOCK_N=config.block_n,
        BLOCK_SIZE=block_size,
        NUM_SPLITS=num_splits,
        FP8=fp8,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if num_splits > 1:
        merge_kernel[(batch, num_q_heads)](
            part_out,
            part_stats,
            out,
            num_q_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            D_PAD=_tile(head_dim),
            num_warps=4,
        )
    return out


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """Launch the store kernel: one program per (token, kv head)."""
    _, _, store_kernel = triton_kernels()
    fp8 = k_cache.dtype == E4M3
    assert fp8 == (k_scale is not None) == (v_scale is not None)
    if not fp8:
        k_scale, v_scale = k_cache, v_cache  # the scale pointers are unused without fp8
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    store_kernel[(k.shape[0], num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        *(k_scale.stride() if fp8 else (0, 0, 0)),
        k_cache.shape[1],
        head_dim,
        D_PAD=_tile(head_dim),
        FP8=fp8,
        FP8_MAX=E4M3_MAX,
        TINY=AMAX_FLOOR,
    )
