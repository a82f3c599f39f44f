"""The Triton kernels of colocate/kernels/paged_attention.py (which documents what they compute and
launches them): the paged decode, the merge of its context splits, and the store of new K/V rows,
each over a bf16/fp16/fp32 cache or an e4m3 one with per-token, per-head scales."""

from __future__ import annotations

import functools


@functools.cache
def triton_kernels():
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
