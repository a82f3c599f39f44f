"""The LoRA merge W + scale * B A in one pass over W: one kernel where plain torch takes five.

`colocate.lora.merge.merged_weight` defines the merge: A and B rounded to W's dtype, their
product and the sum in fp32, rounded once to the output dtype. Written with torch ops on a 16-bit
W that is a tensor-core product into an fp32 (out, in) tensor, a scale and an add over it in place,
and the rounding: about 28 bytes of memory traffic per weight element. The trainer merges every
adapted module in every forward of every micro-batch, and the weight sync once a step, so at 1.5B
(1.3 billion adapted weights) that is about 12 ms of the device's time per pass. Here each
program computes one (BLOCK_M x BLOCK_N) tile of B A on the tensor cores (A and B read in fp32 and
rounded in registers), scales it, adds the tile of W and stores the rounded result: W read once
and the result written once, 4 bytes per element in bf16.

The products' fp32 sums run in the tile's order rather than cuBLAS's, so a result can differ from
the torch merge's in the last fp32 bit, which rarely flips a rounded bf16 value; the multiply and
the add stay two roundings (a multiply that the compiler may not fuse into the add), as in the
torch merge. Compiled blocks call it through `torch.library.triton_op`, which puts the kernel
itself in their graph: a 1.5B training forward's 196 merges took 5.3 ms of host time this way
against 14.8 ms through an opaque custom op (H100).
"""

from __future__ import annotations

import functools
import os

import torch

BLOCK_M = 128
BLOCK_N = 128
MAX_BLOCK_R = 64
"""The rank's chunk of one tile product (tl.dot needs at least 16)."""


def lora_merge(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    """W + scale * B A in `out_dtype`: weight (out, in) 16-bit, lora_a (rank, in), lora_b (out, rank),
    A and B in any float dtype (rounded to W's dtype first). Outside a compiled region the kernel
    is launched directly, without an op's dispatch: a weight push makes one call per adapted module."""
    if torch.compiler.is_compiling():
        return _lora_merge_op(weight, lora_a, lora_b, scale, out_dtype)
    return _launch(weight, lora_a, lora_b, scale, out_dtype)


@torch.library.triton_op("colocate::lora_merge", mutates_args=())
def _lora_merge_op(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    return _launch(weight, lora_a, lora_b, scale, out_dtype, wrap=torch.library.wrap_triton)


def _launch(
    weight: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    out_dtype: torch.dtype,
    wrap=lambda kernel: kernel,
) -> torch.Tensor:
    rows, cols = weight.shape
    rank = lora_a.shape[0]
    assert lora_a.shape == (rank, cols) and lora_b.shape == (rows, rank), (weight.shape, lora_a.shape, lora_b.shape)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:  # Triton's interpreter truncates where the GPU rounds: round them here
        lora_a, lora_b = lora_a.to(weight.dtype), lora_b.to(weight.dtype)
    weight, lora_a, lora_b = weight.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    out = torch.empty(rows, cols, dtype=out_dtype, device=weight.device)
    block_r = min(MAX_BLOCK_R, max(16, 1 << (rank - 1).bit_length()))
    grid = (-(-rows // BLOCK_M), -(-cols // BLOCK_N))
    wrap(_kernel())[grid](
        weight,
        lora_a,
        lora_b,
        out,
        rows,
        cols,
        rank,
        scale,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_R=block_r,
        INTERPRETED=interpreted,
        num_warps=8,
        num_stages=2,
    )
    return out


@functools.cache
def _kernel():
    """Define the kernel on first use, so CPU installs never import triton."""
    global triton, tl  # the kernel resolves `tl` as a module global, as Triton expects
    import triton
    import triton.language as tl

    @triton.jit
    def lora_merge_kernel(
        w_ptr,
        a_ptr,
        b_ptr,
        out_ptr,
        rows,
        cols,
        rank,
        scale,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_R: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        in_m, in_n = offs_m < rows, offs_n < cols
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            in_r = offs_r < rank
            b = tl.load(
                b_ptr + offs_m[:, None].to(tl.int64) * rank + offs_r[None, :], mask=in_m[:, None] & in_r[None, :], other=0.0
            )
            a = tl.load(
                a_ptr + offs_r[:, None].to(tl.int64) * cols + offs_n[None, :], mask=in_r[:, None] & in_n[None, :], other=0.0
            )
            b = b.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            a = a.to(w_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            if INTERPRETED:  # its dot takes 16-bit floats for integers: exact fp32 products
                acc = tl.dot(b.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(b, a, acc)
        tile = offs_m[:, None].to(tl.int64) * cols + offs_n[None, :]
        inside = in_m[:, None] & in_n[None, :]
        w = tl.load(w_ptr + tile, mask=inside, other=0.0)
        if INTERPRETED:  # numpy rounds each operation on its own; the interpreter runs no PTX
            scaled = acc * scale
        else:  # a rounded multiply the add cannot contract into an FMA, denormals kept (libdevice's flushes
            # them); a compiled graph passes scale as fp64, and torch 2.11's check of what the kernel
            # writes passes it as a constant (with `scale.to` that check failed: W, A and B were copied)
            scaled = tl.inline_asm_elementwise(
                "mul.rn.f32 $0, $1, $2;", "=r,r,r", [acc, tl.cast(scale, tl.float32)], dtype=tl.float32, is_pure=True, pack=1
            )
        merged = scaled + w.to(tl.float32)
        tl.store(out_ptr + tile, merged.to(out_ptr.dtype.element_ty), mask=inside)

    return lora_merge_kernel
