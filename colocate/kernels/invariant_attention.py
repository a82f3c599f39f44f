"""Batch-invariant causal attention on CUDA: one kernel for the trainer's packed sequences, the
engine's prefill chunks and its decode steps (colocate/kernels/batch_invariant.py).

A query at sequence position p attends over keys 0..p walked in blocks of BLOCK_N keys from
position 0, with an online softmax in fp32: per block, scores = (q . k) * scale by one tl.dot of a
(rows x D) query tile with a (D x BLOCK_N) key tile, the running max, the rescale factor, and two
sums accumulated by tl.dot from the probabilities rounded to v's dtype: acc = acc * alpha + p @ v
and l = l * alpha + p @ 1 (the softmax's denominator); at the end acc / l, cast to q's dtype.
Every path runs this same code with the same BLOCK_N; only the address of a key differs:

- packed (`packed_attention`, the trainer): keys of sequence s at rows cu_seqlens[s] + j of k/v;
- paged (`paged_prefill_attention`, `paged_decode_attention`, the engine): key j of sequence s in
  cache block block_tables[s, j // block_size] at offset j % block_size.

A program takes one head and a tile of up to BLOCK_M consecutive queries of one sequence; a decode
step (one query per sequence) takes the query heads of one kv head as its rows instead, in tiles of
DECODE_BLOCK_M, so each key and value block is read once per kv head, not once per query head. The
tile walks the blocks up to its last query's position;
for an earlier query of the tile the blocks past its position are fully masked, and their update
is an exact no-op (alpha = 1, a sum of zeros), so a query's result does not depend on its tile's
other queries nor on where the tile starts. Nor on how many rows the tile has: a row's max is exact
in any order, and its sums come from the MMA, element by element, not from a reduction across the
threads that hold the row (whose tree follows the tile's layout). So the paths may take tiles of
their own sizes; tests/unit/test_kernel_batch_invariant.py checks them against each other bit for
bit on the GPU, and `bench/kernel_bench.py --invariant-sweep` times other sizes and compares their
bits. Keys past the tile's last position are never loaded (an unwritten cache slot may hold
anything).

The decode launch reads its sizes from tensor shapes and its context lengths on the device alone,
so it can be captured in a CUDA graph. The trainer's gradient (kernels.invariant_ops.attention) is
the default packed attention's (FlashAttention-4 or torch's varlen flash kernel, in one call for all
sequences; the gradient needs no invariance).
"""

from __future__ import annotations

import functools

import torch

BLOCK_M = 64
"""Queries per program of the packed and prefill paths: one warpgroup's MMA rows."""
DECODE_BLOCK_M = 64
"""Query heads per program of a decode step (a kv head's group, padded). A tile of 64 rows runs on the
warpgroup MMA (wgmma on Hopper), as the packed path's does; one of 16 would take the older mma.sync
instead, a quarter of the work, but the same bits only if the two instructions round alike."""
BLOCK_N = 64
"""Keys per step, counted from position 0: the one constant every path must share."""
SUM_COLUMNS = 16
"""Columns of the ones that the probabilities multiply for the denominator (tl.dot's smallest N)."""
NUM_WARPS = 4


def reference_attention(q, k, v, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's queries q (Nq, Hq, D) at `positions` over its keys k, v
    (Nk, Hk, D) at positions 0..Nk-1, in fp32 with dense softmax -> (Nq, Hq, D) fp32 (test oracle)."""
    group = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(group, dim=1) for t in (k, v))  # (Nk, Hq, D)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale  # (Hq, Nq, Nk)
    future = torch.arange(k.shape[0], device=q.device)[None, :] > positions[:, None]  # (Nq, Nk)
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, vf)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: q (N, Hq, D), k/v (N, Hk, D) -> (N, Hq, D)
    (forward only: the model calls it through kernels.invariant_ops.attention, which has the backward)."""
    lengths = cu_seqlens.diff().tolist()
    starts = cu_seqlens[:-1].to(torch.int32).contiguous()
    return _launch(q, k, v, _tiles(lengths, lengths, q.device), starts, scale, block_size=0)


def paged_prefill_attention(
    q, k_cache, v_cache, block_tables: torch.Tensor, q_lens: list[int], k_lens: list[int], scale: float
) -> torch.Tensor:
    """Sequence s's q_lens[s] new queries (packed in q (N, Hq, D)) at positions
    k_lens[s] - q_lens[s] .. k_lens[s] - 1, over its k_lens[s] cached keys (the new ones stored
    already); caches (num_blocks, block_size, Hk, D), block_tables (S, max_blocks) int32."""
    tiles = _tiles(q_lens, k_lens, q.device)
    return _launch(q, k_cache.flatten(0, 1), v_cache.flatten(0, 1), tiles, block_tables, scale, block_size=k_cache.shape[1])


def paged_decode_attention(
    q, k_cache, v_cache, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    """One query per sequence, q (B, Hq, D), at position context_lens - 1 over its cached keys;
    rows with no context give zeros. No host sync: CUDA-graph capturable. The kernel reads each
    tile from context_lens (int32) itself: a decode step launches it alone, once per layer."""
    return _launch(
        q,
        k_cache.flatten(0, 1),
        v_cache.flatten(0, 1),
        context_lens,
        block_tables,
        scale,
        block_size=k_cache.shape[1],
        heads_as_rows=True,
    )


def _tiles(q_lens: list[int], k_lens: list[int], device) -> torch.Tensor:
    """(4, T) int32: per tile of up to BLOCK_M queries of one sequence, the sequence, its first
    query's row in q, that query's position, and the tile's query count."""
    seqs, rows, positions, counts = [], [], [], []
    row = 0
    for s, (nq, nk) in enumerate(zip(q_lens, k_lens)):
        for t in range(0, nq, BLOCK_M):
            seqs.append(s)
            rows.append(row + t)
            positions.append(nk - nq + t)
            counts.append(min(BLOCK_M, nq - t))
        row += nq
    return torch.tensor([seqs, rows, positions, counts], dtype=torch.int32).view(4, -1).to(device)


def _launch(
    q, k, v, tiles: torch.Tensor, keys: torch.Tensor, scale: float, block_size: int, heads_as_rows: bool = False
) -> torch.Tensor:
    """k, v (rows, Hk, D): packed keys (block_size 0; `keys` holds each sequence's first row) or the
    cache's flat slots (`keys` is the block table). `tiles`: `_tiles`'s (4, T); with heads_as_rows,
    the context lengths (B,) of one query per sequence, whose query heads of one kv head fill a
    tile's rows (GROUP > DECODE_BLOCK_M takes several)."""
    if q.ndim != 3 or k.ndim != 3 or k.shape != v.shape or q.shape[2] != k.shape[2] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention: q (N, Hq, D), k/v (M, Hk, D) with Hk | Hq, got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.dtype != k.dtype or v.dtype != k.dtype or any(t.stride(-1) != 1 for t in (q, k, v)):
        raise ValueError("attention: q, k, v must share one dtype and be contiguous in head_dim")
    if tiles.dtype != torch.int32 or keys.dtype != torch.int32:
        raise ValueError("attention: tiles and block tables / sequence starts must be int32")
    import triton

    num_heads, head_dim = q.shape[1], q.shape[2]
    out = torch.empty_like(q)  # (N, Hq, D); every row is stored, an empty context's as zeros
    num_tiles = tiles.shape[-1]
    if num_tiles == 0:
        return out
    tiles = tiles.contiguous()
    group = num_heads // k.shape[1]
    block_m = DECODE_BLOCK_M if heads_as_rows else BLOCK_M
    head_chunks = -(-group // block_m)
    _kernel()[(num_tiles, k.shape[1] * head_chunks if heads_as_rows else num_heads)](
        q,
        k,
        v,
        out,
        tiles,
        num_tiles,
        keys,
        scale,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        out.stride(0),
        out.stride(1),
        keys.stride(0),
        GROUP=group,
        HEADS_AS_ROWS=heads_as_rows,
        HEAD_CHUNKS=head_chunks,
        HEAD_DIM=head_dim,
        D_PAD=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        SUM_COLUMNS=SUM_COLUMNS,
        BLOCK_SIZE=max(block_size, 1),
        PAGED=block_size > 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=NUM_WARPS,
        num_stages=2,
    )
    return out


@functools.cache
def _kernel():
    """Define the Triton kernel on first CUDA use, so CPU installs never import triton."""
    global triton, tl  # the kernel resolves `tl` as a module global, as Triton expects
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_tiles"])
    def attend(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        tiles_ptr,
        num_tiles,
        keys_ptr,
        scale,
        s_qn,
        s_qh,
        s_kn,
        s_kh,
        s_vn,
        s_vh,
        s_on,
        s_oh,
        s_keys,
        GROUP: tl.constexpr,
        HEADS_AS_ROWS: tl.constexpr,
        HEAD_CHUNKS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SUM_COLUMNS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        PAGED: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        tile = tl.program_id(0)
        r = tl.arange(0, BLOCK_M)
        if HEADS_AS_ROWS:  # sequence `tile`'s query (none without context); row r: query head first + r
            context = tl.load(tiles_ptr + tile)
            seq, row0, pos0, count = tile, tile, context - 1, (context > 0).to(tl.int32)
            kv_head = tl.program_id(1) // HEAD_CHUNKS
            first = (tl.program_id(1) % HEAD_CHUNKS) * BLOCK_M
            rows_out = first + r < GROUP  # stored, as zeros without a query
            live = rows_out & (0 * r < count)
            pos = tl.where(live, pos0, -1)
            q_rows = (row0 + 0 * r).to(tl.int64)
            heads = kv_head * GROUP + first + r
        else:  # row r is query row0 + r of one head
            seq = tl.load(tiles_ptr + tile)
            row0 = tl.load(tiles_ptr + num_tiles + tile)
            pos0 = tl.load(tiles_ptr + 2 * num_tiles + tile)
            count = tl.load(tiles_ptr + 3 * num_tiles + tile)
            heads = tl.program_id(1) + 0 * r
            kv_head = tl.program_id(1) // GROUP
            live = r < count
            rows_out = live
            pos = tl.where(live, pos0 + r, -1)  # (BM,), inert rows see no key
            q_rows = (row0 + r).to(tl.int64)
        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q = tl.load(
            q_ptr + q_rows[:, None] * s_qn + heads[:, None] * s_qh + d[None, :], mask=live[:, None] & d_ok[None, :], other=0.0
        )  # (BM, D)
        last = pos0 + count - 1
        m_i = tl.full([BLOCK_M], -1e30, tl.float32)
        l_acc = tl.zeros([BLOCK_M, SUM_COLUMNS], tl.float32)  # every column the row's denominator
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        ones = tl.full([BLOCK_N, SUM_COLUMNS], 1.0, v_ptr.dtype.element_ty)
        if not PAGED:
            first_key = tl.load(keys_ptr + seq)
        for start in range(0, last + 1, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            k_ok = j <= last
            if PAGED:
                block = tl.load(keys_ptr + seq.to(tl.int64) * s_keys + j // BLOCK_SIZE, mask=k_ok, other=0)
                kv_rows = block.to(tl.int64) * BLOCK_SIZE + j % BLOCK_SIZE
            else:
                kv_rows = (first_key + j).to(tl.int64)
            kt = tl.load(
                k_ptr + kv_rows[None, :] * s_kn + kv_head * s_kh + d[:, None], mask=k_ok[None, :] & d_ok[:, None], other=0.0
            )  # (D, BN)
            scores = tl.dot(q, kt, input_precision=PRECISION) * scale  # (BM, BN)
            scores = tl.where(j[None, :] <= pos[:, None], scores, -float("inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None]).to(v_ptr.dtype.element_ty)
            l_acc = tl.dot(p, ones, l_acc * alpha[:, None], input_precision=PRECISION)
            vt = tl.load(
                v_ptr + kv_rows[:, None] * s_vn + kv_head * s_vh + d[None, :], mask=k_ok[:, None] & d_ok[None, :], other=0.0
            )  # (BN, D)
            acc = tl.dot(p, vt, acc * alpha[:, None], input_precision=PRECISION)
            m_i = m_new
        l_i = tl.max(l_acc, axis=1)  # its columns are equal: no order of summing involved
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + q_rows[:, None] * s_on + heads[:, None] * s_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=rows_out[:, None] & d_ok[None, :],
        )

    return attend
