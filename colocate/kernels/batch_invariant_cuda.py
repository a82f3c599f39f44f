"""Batch-invariant matrix products and row reductions on CUDA (colocate/kernels/batch_invariant.py).

A row's result must not depend on how many other rows share the call, nor on where the row sits.
cuBLAS and torch's reduction kernels choose their tiling, split-K and reduction tree from the
shape, so a token computed beside 1 or 255 others comes out with different last bits. The kernels
here fix every choice that decides the order of floating-point operations:

- `matmul` (aten::mm and aten::addmm on CUDA, and the fp32 logits of the lm_head): K is cut into
  chunks of K_CHUNK columns from k = 0; a chunk's partial product is accumulated in fp32 in
  BLOCK_K steps from 0 by the tensor cores' MMA, and an output element is the in-order sum of its
  chunks' partials: a function of K alone. BLOCK_K is one per input dtype; the tile's M and N
  sizes, warps and pipeline stages (TILES) are picked per call from the product's shape, since an
  element's bits come from its row of A, its column of B and the order of the k steps, not from how
  many other rows and columns its tile computes beside it (tests/unit/test_kernel_batch_invariant.py
  checks every tile config bit for bit on the GPU). A product of too few tiles to fill the device
  (a decode step's) whose K spans SPLIT_GAIN chunks or more computes each chunk in a program of its
  own and sums the partials in a second kernel, in that same order; any other walks all chunks in
  one program. Both give the same bits.
  Bias and alpha/beta are applied in fp32 before the one cast to the output dtype;
- `rms_norm`: one program per row (a token, or a token's head for qk-norm), the whole row in one
  block, its sum of squares by one fixed reduction tree; `add_rms_norm` adds the residual in the
  same program first;
- `silu_mul`: the MLP's SiLU(gate) * up, element-wise, in one kernel.

The mode's row log-sum-exp is the sampler's kernel (`invariant_logsumexp` of
colocate/kernels/sampling.py) in the launch the mode's sampler takes too: each row cut into a fixed
number of slices whatever the batch, each slice walked in blocks with an online maximum, the slices
merged in one fixed order.

RMSNorm's gradient is kernels.invariant_ops.rms_norm's plain formula and the log-sum-exp's that of
its autograd function in sampling.py (the gradient needs no invariance); matrix products get theirs
from aten, whose derivatives are matrix products again, which run on cuBLAS: inside a backward pass
`mm` and `addmm` leave the mode's kernel.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

BLOCK_K = {torch.bfloat16: 64, torch.float16: 64, torch.float32: 32}
"""Columns of K per MMA step of the mode's matmul, one per input dtype: with K_CHUNK, all that
decides a product's order of floating-point operations. fp32 inputs are multiplied in full
precision (no TF32)."""
TILES = {  # dtype: (BLOCK_M, BLOCK_N, num_warps, num_stages, wide products only), largest tile first
    torch.bfloat16: ((128, 256, 8, 3, True), (128, 128, 8, 3, False), (64, 64, 4, 4, False)),
    torch.float16: ((128, 256, 8, 3, True), (128, 128, 8, 3, False), (64, 64, 4, 4, False)),
    torch.float32: ((32, 64, 4, 2, False),),
}
"""The matmul's tile configs: a product takes the first whose tiles fill every SM WAVES times (the
last otherwise), among those whose pipeline fits the device's shared memory (the 128 x 256 tile's
144 KiB fit an H100's, not the 99 KiB of an RTX 4090's). The largest holds its accumulator in all
255 registers a thread has, so it takes products of one K chunk only (walking several needs a
second accumulator), and of WIDE_N columns or more: on an H100 (bench/kernel_bench.py
--invariant-sweep) it was 5-40% slower than 128 x 128 on the projections of a 16k-token micro-batch
(N 896 to 17,920) and 1-7% faster on the lm_head. The 128-row tiles run on two warpgroups (Hopper's
wgmma), the 64-row one on one."""
WAVES = 2
"""Tiles per SM a product needs before it takes a larger tile config."""
WIDE_N = 32768
"""Columns a product needs before it may take a wide-only tile (the vocabulary's, not a projection's)."""
K_CHUNK = 4096
"""Columns of K per chunk of the matmul's sum (a multiple of every BLOCK_K). A product whose K fits
in one chunk (every projection from the hidden state, up to 4096 wide) sums exactly as one walk over
K from 0; only the MLP's down projection has several."""
SPLIT_GAIN = 1.5
"""How many times shorter the split launch must make a program's walk over K (K / K_CHUNK) before
it pays for its partials and their merge. On an H200 (bench/kernel_bench.py --invariant-sweep, from
CUDA graphs, 256 rows): the 0.5B shape's down projection (K 4,864: 1.19 times) took 23.9 us split
against 15.0 us walked by one program; the 1.5B shape's (K 8,960: 2.19 times) 30.3 against 31.6 us."""
GROUP_M = 8
"""Row tiles per group of the matmul's launch order (for L2 reuse; no effect on values)."""
RMS_WARPS = 4
SILU_BLOCK = 1024
"""Columns per program of the fused SiLU-and-product kernel."""


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """aten::mm on CUDA in the mode; cuBLAS (through aten::bmm) inside a backward pass."""
    if in_backward():
        return torch.bmm(a[None], b[None])[0]
    return matmul(a, b)


def addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    """aten::addmm on CUDA in the mode: beta * bias + alpha * (a @ b); cuBLAS inside a backward pass."""
    if in_backward():
        return torch.baddbmm(bias.expand(a.shape[0], b.shape[1])[None], a[None], b[None], beta=beta, alpha=alpha)[0]
    return matmul(a, b, bias if beta != 0 else None, alpha=alpha, beta=beta)


def in_backward() -> bool:
    """Whether autograd is running a backward node: gradients (and the forward that activation
    checkpointing recomputes for them) need no invariance, only log-probs do, and cuBLAS is faster
    than the mode's own kernel."""
    return torch._C._current_autograd_node() is not None


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    alpha=1.0,
    beta=1.0,
    out_dtype: torch.dtype | None = None,
    config: tuple[int, int, int, int, int] | None = None,
    split: bool | None = None,
) -> torch.Tensor:
    """a (M, K) @ b (K, N) [+ bias broadcast to (M, N)] -> (M, N) in out_dtype (default a's dtype).
    Any strides (linear's transposed weight is a (K, N) view with strides (1, K)). `config`
    (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) overrides `tile_config`'s pick
    (bench/kernel_bench.py --invariant-sweep times the candidates), `split` its choice of one
    program per K chunk. Neither they nor M change a value, as long as BLOCK_K is BLOCK_K[dtype]."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"matmul: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not multiply")
    if a.dtype != b.dtype or a.dtype not in TILES:
        raise ValueError(f"batch-invariant matmul takes one dtype of {list(TILES)}, got {a.dtype} and {b.dtype}")
    (m, k), n = a.shape, b.shape[1]
    out = torch.empty((m, n), dtype=out_dtype or a.dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if bias is not None:
        bias = bias.expand(m, n)
    chunks = max(_cdiv(k, K_CHUNK), 1)
    picked, picked_split = tile_config(m, n, k, a.dtype, a.device)
    block_m, block_n, block_k, warps, stages = config or picked
    split = picked_split if split is None else split
    if K_CHUNK % block_k:
        raise ValueError(f"matmul: BLOCK_K {block_k} does not divide K_CHUNK {K_CHUNK}")
    tiles = _cdiv(m, block_m) * _cdiv(n, block_n)
    partials = torch.empty((chunks, m, n), dtype=torch.float32, device=a.device) if split else out
    kernels = _kernels()
    bias_args = (
        bias if bias is not None else out,
        bias.stride(0) if bias is not None else 0,
        bias.stride(1) if bias is not None else 0,
    )
    common = dict(HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=GROUP_M)
    kernels.matmul[(tiles, chunks if split else 1)](
        a,
        b,
        *bias_args,
        out,
        partials,
        m,
        n,
        k,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        out.stride(1),
        float(alpha),
        float(beta),
        **common,
        BLOCK_K=block_k,
        K_CHUNK=K_CHUNK,
        SPLIT=split,
        ONE_CHUNK=chunks == 1,
        EVEN_K=k % block_k == 0,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=warps,
        num_stages=stages,
    )
    if split:
        kernels.chunk_sum[(tiles,)](
            partials,
            *bias_args,
            out,
            m,
            n,
            chunks,
            out.stride(0),
            out.stride(1),
            float(alpha),
            float(beta),
            **common,
            num_warps=warps,
        )
    return out


def tile_config(m: int, n: int, k: int, dtype: torch.dtype, device: torch.device) -> tuple[tuple[int, int, int, int, int], bool]:
    """The (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of an (m, k) @ (k, n) product, and
    whether to split its K chunks over programs: the first of TILES[dtype] that the product may take
    and that gives every SM WAVES tiles, else the last; split when it has fewer tiles than SMs and
    K is at least SPLIT_GAIN chunks long.
    The interpreter (CPU tensors) takes the first config it may and splits only when asked."""
    chunks = max(_cdiv(k, K_CHUNK), 1)
    candidates = [tile for tile in TILES[dtype] if not tile[4] or (chunks == 1 and n >= WIDE_N)]
    sms = 0
    if device.type == "cuda":
        from colocate.kernels.paged_attention import _sm_count

        sms, room = _sm_count(device), _shared_memory(device)
        candidates = [
            tile
            for tile in candidates
            if tile is TILES[dtype][-1] or tile[3] * (tile[0] + tile[1]) * BLOCK_K[dtype] * dtype.itemsize <= room
        ]
    block_m, block_n, warps, stages, _ = next(
        (tile for tile in candidates if _cdiv(m, tile[0]) * _cdiv(n, tile[1]) >= WAVES * sms), candidates[-1]
    )
    split = k >= SPLIT_GAIN * K_CHUNK and _cdiv(m, block_m) * _cdiv(n, block_n) < sms
    return (block_m, block_n, BLOCK_K[dtype], warps, stages), split


@functools.cache
def _shared_memory(device: torch.device) -> int:
    """Shared memory a block may take on this device (bytes)."""
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", props.shared_memory_per_block)


def _cdiv(x: int, y: int) -> int:
    return -(-x // y)


class _Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight):
        ctx.save_for_backward(hidden, weight)
        return matmul(hidden, weight.T, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight = ctx.saved_tensors
        grad = grad.to(hidden.dtype)
        grad_hidden = grad @ weight if ctx.needs_input_grad[0] else None
        grad_weight = grad.T @ hidden if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden (T, H) @ weight (V, H).T -> (T, V) fp32, accumulated in fp32 (the lm_head's logits)."""
    return _Logits.apply(hidden, weight)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (N, D) or (N, H, D) over its last dimension, one row per program (forward only:
    the model calls it through kernels.invariant_ops.rms_norm, which has the backward)."""
    if x.ndim not in (2, 3) or x.stride(-1) != 1 or weight.shape != (x.shape[-1],):
        raise ValueError(
            f"rms_norm: x must be (N, D) or (N, H, D) contiguous in D with weight (D,), "
            f"got {tuple(x.shape)} strides {x.stride()} and weight {tuple(weight.shape)}"
        )
    x3 = x if x.ndim == 3 else x[:, None]  # (N, H, D)
    out = torch.empty(x3.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_launch(x3, None, out, out, weight, eps)
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)) of rows (N, D) in one kernel: the sum rounded to x's dtype, as
    torch's addition rounds it, then normalised as `rms_norm` does (forward only, like it)."""
    if (
        x.ndim != 2
        or delta.shape != x.shape
        or delta.dtype != x.dtype
        or x.stride(-1) != 1
        or delta.stride(-1) != 1
        or weight.shape != (x.shape[-1],)
    ):
        raise ValueError(
            f"add_rms_norm: x and delta must be (N, D) of one dtype, contiguous in D, with weight "
            f"(D,), got {tuple(x.shape)} {x.dtype}, {tuple(delta.shape)} {delta.dtype} and "
            f"{tuple(weight.shape)}"
        )
    total = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    _rms_launch(x[:, None], delta, total, out, weight, eps)
    return total, out


def _rms_launch(x3, delta, total, out, weight, eps) -> None:
    """One program per row of x3 (N, H, D); with `delta` (N, D), for H = 1, a row is x + delta, stored
    into `total` before it is normalised."""
    import triton

    n, heads, dim = x3.shape
    if n and heads:
        _kernels().rms[(n * heads,)](
            x3,
            delta if delta is not None else x3,
            total,
            weight.contiguous(),
            out,
            heads,
            dim,
            x3.stride(0),
            x3.stride(1),
            delta.stride(0) if delta is not None else 0,
            eps,
            BLOCK_D=triton.next_power_of_2(dim),
            ADD=delta is not None,
            num_warps=RMS_WARPS,
        )


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of rows (N, F), each contiguous in F (the halves of the packed gate/up
    product): SiLU in fp32 rounded to the inputs' dtype, as an unfused F.silu rounds it, then the
    product, in one kernel (forward only: kernels.invariant_ops.silu_mul has the backward)."""
    if gate.ndim != 2 or up.shape != gate.shape or up.dtype != gate.dtype or gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError(
            f"silu_mul: gate and up must be (N, F) of one dtype, contiguous in F, got "
            f"{tuple(gate.shape)} {gate.dtype} and {tuple(up.shape)} {up.dtype}"
        )
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    rows, cols = gate.shape
    if rows and cols:
        _kernels().silu_mul[(rows, _cdiv(cols, SILU_BLOCK))](
            gate, up, out, cols, gate.stride(0), up.stride(0), BLOCK=SILU_BLOCK, num_warps=4
        )
    return out


@functools.cache
def _kernels():
    """Define the Triton kernels on first CUDA use, so CPU installs never import triton."""
    global triton, tl, tile_of, chunk_product, finish  # module globals, as Triton resolves them
    import triton
    import triton.language as tl

    @triton.jit
    def tile_of(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """The rows and columns of program `pid`'s tile. Tiles go in groups of GROUP_M row tiles,
        column tile by column tile, so that the programs running at once share their A rows and B
        columns in L2; the order of tiles changes no value."""
        tiles_n = tl.cdiv(n, BLOCK_N)
        first_m = pid // (GROUP_M * tiles_n) * GROUP_M
        group_m = tl.minimum(tl.cdiv(m, BLOCK_M) - first_m, GROUP_M)
        tile_m = first_m + pid % (GROUP_M * tiles_n) % group_m
        tile_n = pid % (GROUP_M * tiles_n) // group_m
        return tile_m * BLOCK_M + tl.arange(0, BLOCK_M), tile_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def chunk_product(
        a_tile,
        b_tile,
        k0,
        k,
        s_ak,
        s_bk,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """The fp32 product of the chunk of K from k0, in BLOCK_K steps from 0; the tiles' addresses
        point at column k0 and are advanced by BLOCK_K per step."""
        ks = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k1 in range(k0, tl.minimum(k0 + K_CHUNK, k), BLOCK_K):
            if EVEN_K:
                a = tl.load(a_tile)
                b = tl.load(b_tile)
            else:
                a = tl.load(a_tile, mask=(k1 + ks < k)[None, :], other=0.0)
                b = tl.load(b_tile, mask=(k1 + ks < k)[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_tile += BLOCK_K * s_ak
            b_tile += BLOCK_K * s_bk
        return acc

    @triton.jit
    def finish(total, rows, cols, m, n, bias_ptr, s_biasm, s_biasn, c_ptr, s_cm, s_cn, alpha, beta, HAS_BIAS: tl.constexpr):
        """alpha * total (+ beta * bias) in fp32, cast once into C; one code for both launches."""
        acc = total * alpha
        mask = (rows < m)[:, None] & (cols < n)[None, :]
        if HAS_BIAS:
            bias = tl.load(bias_ptr + rows.to(tl.int64)[:, None] * s_biasm + cols[None, :] * s_biasn, mask=mask, other=0.0)
            acc = acc + beta * bias.to(tl.float32)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * s_cm + cols[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty), mask=mask)

    # M (and the row counts below) are not specialised on: a batch of 1 compiles the same kernel.
    @triton.jit(do_not_specialize=["m"])
    def matmul_kernel(
        a_ptr,
        b_ptr,
        bias_ptr,
        s_biasm,
        s_biasn,
        c_ptr,
        partial_ptr,
        m,
        n,
        k,
        s_am,
        s_ak,
        s_bk,
        s_bn,
        s_cm,
        s_cn,
        alpha,
        beta,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        K_CHUNK: tl.constexpr,
        SPLIT: tl.constexpr,
        ONE_CHUNK: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Unsplit (grid: tiles): a tile's chunk partials summed in order, into C. Split (grid:
        tiles x chunks): one chunk's fp32 partial into `partial_ptr` (chunks, M, N)."""
        rows, cols = tile_of(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
        ks = tl.arange(0, BLOCK_K)
        # Rows and columns past the edge read row/column 0 instead of being masked: their results are
        # never stored, and the loads stay unmasked (and vectorised) wherever K is a multiple of BLOCK_K.
        a_tile = a_ptr + tl.where(rows < m, rows, 0).to(tl.int64)[:, None] * s_am + ks.to(tl.int64)[None, :] * s_ak  # (BM, BK)
        b_tile = b_ptr + tl.where(cols < n, cols, 0).to(tl.int64)[None, :] * s_bn + ks.to(tl.int64)[:, None] * s_bk  # (BK, BN)
        if SPLIT:
            k0 = tl.program_id(1) * K_CHUNK
            part = chunk_product(
                a_tile + k0 * s_ak, b_tile + k0 * s_bk, k0, k, s_ak, s_bk, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, EVEN_K, PRECISION
            )
            mask = (rows < m)[:, None] & (cols < n)[None, :]
            tl.store(
                partial_ptr + (tl.program_id(1).to(tl.int64) * m + rows.to(tl.int64)[:, None]) * n + cols[None, :],
                part,
                mask=mask,
            )
        else:
            # The sum starts as the first chunk's partial. A second accumulator, which the later chunks
            # need, doubles the registers (occupancy); a product of one chunk is compiled without it.
            total = chunk_product(a_tile, b_tile, 0, k, s_ak, s_bk, BLOCK_M, BLOCK_N, BLOCK_K, K_CHUNK, EVEN_K, PRECISION)
            if not ONE_CHUNK:
                for k0 in range(K_CHUNK, k, K_CHUNK):
                    total += chunk_product(
                        a_tile + k0 * s_ak,
                        b_tile + k0 * s_bk,
                        k0,
                        k,
                        s_ak,
                        s_bk,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        K_CHUNK,
                        EVEN_K,
                        PRECISION,
                    )
            finish(total, rows, cols, m, n, bias_ptr, s_biasm, s_biasn, c_ptr, s_cm, s_cn, alpha, beta, HAS_BIAS)

    @triton.jit(do_not_specialize=["m"])
    def chunk_sum_kernel(
        partial_ptr,
        bias_ptr,
        s_biasm,
        s_biasn,
        c_ptr,
        m,
        n,
        chunks,
        s_cm,
        s_cn,
        alpha,
        beta,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """A split product's tile: its chunks' partials summed in order, into C."""
        rows, cols = tile_of(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
        mask = (rows < m)[:, None] & (cols < n)[None, :]
        partial = partial_ptr + rows.to(tl.int64)[:, None] * n + cols[None, :]
        total = tl.load(partial, mask=mask, other=0.0)
        for _ in range(1, chunks):
            partial += tl.cast(m, tl.int64) * n
            total += tl.load(partial, mask=mask, other=0.0)
        finish(total, rows, cols, m, n, bias_ptr, s_biasm, s_biasn, c_ptr, s_cm, s_cn, alpha, beta, HAS_BIAS)

    @triton.jit
    def rms_kernel(
        x_ptr, delta_ptr, total_ptr, w_ptr, out_ptr, heads, dim, s_xn, s_xh, s_dn, eps, BLOCK_D: tl.constexpr, ADD: tl.constexpr
    ):
        row = tl.program_id(0)
        d = tl.arange(0, BLOCK_D)
        ok = d < dim
        x_row = x_ptr + (row // heads).to(tl.int64) * s_xn + (row % heads) * s_xh
        x = tl.load(x_row + d, mask=ok, other=0.0)
        if ADD:  # rows of one head: the residual sum, rounded to x's dtype and stored, is what is normalised
            delta = tl.load(delta_ptr + row.to(tl.int64) * s_dn + d, mask=ok, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(total_ptr + row.to(tl.int64) * dim + d, x, mask=ok)
        x = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / dim + eps)
        normed = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row.to(tl.int64) * dim + d, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def silu_mul_kernel(gate_ptr, up_ptr, out_ptr, cols, s_gate, s_up, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < cols
        g = tl.load(gate_ptr + row * s_gate + c, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(up_ptr + row * s_up + c, mask=ok, other=0.0)
        act = (g / (1.0 + tl.exp(-g))).to(up.dtype).to(tl.float32)
        tl.store(out_ptr + row * cols + c, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=ok)

    return SimpleNamespace(matmul=matmul_kernel, chunk_sum=chunk_sum_kernel, rms=rms_kernel, silu_mul=silu_mul_kernel)
