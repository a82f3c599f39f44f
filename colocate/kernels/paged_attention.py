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

from colocate.kernels.fp8 import _TINY, E4M3, E4M3_MAX, quantize_per_token

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
    head_dim 128, they beat 64-token ones by 1.26-1.32x (bench/kernel_bench.py --fp8-decode-sweep).
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
    decode_kernel, merge_kernel, _ = _triton_kernels()
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
    _, _, store_kernel = _triton_kernels()
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
        TINY=_TINY,
    )


@functools.cache
def _triton_kernels():
    """Define the Triton kernels on first CUDA use, so CPU installs never import triton."""
    global triton, tl  # the kernels resolve `tl` as a module global, as Triton expects
    import triton
    import triton.language as tl

    @triton.jit
    def decode(
        q_ptr,
        k_ptr,
        v_ptr,
        k_scale_ptr,
        v_scale_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        stats_ptr,
        scale,
        stride_qb,
        stride_qh,
        stride_cb,
        stride_ct,
        stride_ch,
        stride_sb,
        stride_st,
        stride_sh,
        stride_tb,
        stride_tn,
        max_blocks,
        stride_ob,
        stride_oh,
        stride_os,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        NUM_SPLITS: tl.constexpr,
        FP8: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
        split = tl.program_id(2)
        context = tl.load(lens_ptr + seq)
        num_tiles = tl.cdiv(context, BLOCK_N)
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first = split * tiles_per_split
        last = tl.minimum(first + tiles_per_split, num_tiles)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, D_PAD)
        t = tl.arange(0, BLOCK_N)
        heads = kv_head * GROUP + g  # (GP,)
        head_ok = g < GROUP
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + seq.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=head_ok[:, None] & d_ok[None, :],
            other=0.0,
        )  # (GP, D)
        m_i = tl.full([GROUP_PAD], -1e30, tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
        table = tables_ptr + seq.to(tl.int64) * stride_tb
        head_off = kv_head * stride_ch
        for tile in range(first, last):
            pos = tile * BLOCK_N
            if BLOCK_N <= BLOCK_SIZE:
                # The tile lies inside one cache block: one lookup, then fixed offsets.
                block = tl.load(table + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1) * stride_tn).to(tl.int64)
                offset = (pos % BLOCK_SIZE) + t  # (N,)
            else:
                tok = pos + t
                block = tl.load(table + tl.minimum(tok // BLOCK_SIZE, max_blocks - 1) * stride_tn).to(tl.int64)  # (N,)
                offset = tok % BLOCK_SIZE  # (N,)
            rows = block * stride_cb + offset * stride_ct + head_off  # (N,)
            valid = pos + t < context  # (N,)
            kv_mask = valid[:, None] & d_ok[None, :]
            offs = rows[:, None] + d[None, :]  # (N, D)
            k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)  # (N, D)
            v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)  # (N, D)
            if FP8:
                scale_rows = block * stride_sb + offset * stride_st + kv_head * stride_sh  # (N,)
                k_scale = tl.load(k_scale_ptr + scale_rows, mask=valid, other=0.0)  # (N,)
                v_scale = tl.load(v_scale_ptr + scale_rows, mask=valid, other=0.0)  # (N,)
                s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * (k_scale * scale)[None, :]
            else:
                s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # (GP, N) fp32
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])  # (GP, N)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if FP8:
                # p weighted by v_scale / its tile max stays in [0, 1]: p * v_scale itself (about
                # |v| / 448) would fall to fp16's subnormals. The max comes back on the fp32 product.
                v_max = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
                pv = (p * (v_scale / v_max)[None, :]).to(q.dtype)
                acc = acc * alpha[:, None] + tl.dot(pv, v.to(q.dtype), input_precision=PRECISION) * v_max
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out_offs = seq.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os + d[None, :]
        out_mask = head_ok[:, None] & d_ok[None, :]
        if NUM_SPLITS == 1:
            out = acc / tl.maximum(l_i, 1e-30)[:, None]
            tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
        else:
            tl.store(out_ptr + out_offs, acc, mask=out_mask)
            num_rows = tl.num_programs(0) * tl.num_programs(1) * GROUP * NUM_SPLITS
            stat_offs = ((seq * tl.num_programs(0) * GROUP + heads) * NUM_SPLITS + split).to(tl.int64)
            tl.store(stats_ptr + stat_offs, m_i, mask=head_ok)
            tl.store(stats_ptr + num_rows + stat_offs, l_i, mask=head_ok)

    @triton.jit
    def merge(part_ptr, stats_ptr, out_ptr, num_q_heads, head_dim, NUM_SPLITS: tl.constexpr, D_PAD: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        row = seq.to(tl.int64) * num_q_heads + head
        num_rows = tl.num_programs(0) * num_q_heads * NUM_SPLITS
        s = tl.arange(0, NUM_SPLITS)
        d = tl.arange(0, D_PAD)
        m = tl.load(stats_ptr + row * NUM_SPLITS + s)  # (S,)
        l = tl.load(stats_ptr + num_rows + row * NUM_SPLITS + s)  # (S,)
        weight = tl.exp(m - tl.max(m, axis=0))  # (S,); empty splits have l = 0 and acc = 0
        total = tl.sum(weight * l, axis=0)
        d_ok = d < head_dim
        part = tl.load(
            part_ptr + (row * NUM_SPLITS + s[:, None]) * head_dim + d[None, :], mask=d_ok[None, :], other=0.0
        )  # (S, D)
        out = tl.sum(part * weight[:, None], axis=0) / tl.maximum(total, 1e-30)
        tl.store(out_ptr + row * head_dim + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)

    @triton.jit
    def store(
        k_ptr,
        v_ptr,
        k_cache_ptr,
        v_cache_ptr,
        k_scale_ptr,
        v_scale_ptr,
        slots_ptr,
        stride_kn,
        stride_kh,
        stride_vn,
        stride_vh,
        stride_kcb,
        stride_kct,
        stride_kch,
        stride_vcb,
        stride_vct,
        stride_vch,
        stride_sb,
        stride_st,
        stride_sh,
        block_size,
        head_dim,
        D_PAD: tl.constexpr,
        FP8: tl.constexpr,
        FP8_MAX: tl.constexpr,
        TINY: tl.constexpr,
    ):
        token = tl.program_id(0)
        head = tl.program_id(1)
        slot = tl.load(slots_ptr + token)
        if slot >= 0:
            block = slot // block_size
            offset = slot % block_size
            d = tl.arange(0, D_PAD)
            d_ok = d < head_dim
            k = tl.load(k_ptr + token.to(tl.int64) * stride_kn + head * stride_kh + d, mask=d_ok, other=0.0)
            v = tl.load(v_ptr + token.to(tl.int64) * stride_vn + head * stride_vh + d, mask=d_ok, other=0.0)
            if FP8:
                # fp8.quantize_per_token's arithmetic, with IEEE divisions (Triton's `/` is approximate),
                # so the cache holds the bytes the CPU path writes.
                scale_off = block * stride_sb + offset * stride_st + head * stride_sh
                k_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(k.to(tl.float32)), axis=0), TINY), FP8_MAX)
                v_scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v.to(tl.float32)), axis=0), TINY), FP8_MAX)
                k = tl.clamp(tl.math.div_rn(k.to(tl.float32), k_scale), -FP8_MAX, FP8_MAX)
                v = tl.clamp(tl.math.div_rn(v.to(tl.float32), v_scale), -FP8_MAX, FP8_MAX)
                tl.store(k_scale_ptr + scale_off, k_scale)
                tl.store(v_scale_ptr + scale_off, v_scale)
            k = k.to(k_cache_ptr.dtype.element_ty)
            v = v.to(v_cache_ptr.dtype.element_ty)
            tl.store(k_cache_ptr + block * stride_kcb + offset * stride_kct + head * stride_kch + d, k, mask=d_ok)
            tl.store(v_cache_ptr + block * stride_vcb + offset * stride_vct + head * stride_vch + d, v, mask=d_ok)

    return decode, merge, store
