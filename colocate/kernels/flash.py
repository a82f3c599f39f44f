"""Packed causal attention through FlashAttention-4's CuTe kernels, on Hopper and Blackwell GPUs.

Why: for the 1.5B shape (12 query and 2 key/value heads of 128) on 16,384 packed tokens of
160..4160-token sequences, torch's varlen flash kernel (FlashAttention-2) took 0.81 ms forward and
1.80 ms backward a layer on an H200; FlashAttention-4 took 0.57 and 1.01 ms, with the same outputs
and gradients to bf16 rounding.

The kernels come from the optional `flash-attn-4` package (the `flash` extra). `usable(q)` says
whether a call takes this path: CUDA, half precision, compute capability 9 or 10, head_dim a
multiple of 8 up to 256, the package importable, and COLOCATE_ATTENTION not set to `torch` (which
keeps torch's kernel, for comparisons). Forward and backward are torch custom ops, so a compiled
block calls them without a graph break and selective recomputation can keep the forward's output.
The backward accumulates key/value gradients across the query heads of a group in any order, so two
runs differ by rounding unless `torch.use_deterministic_algorithms(True)` is on, which selects the
kernel's ordered (deterministic) mode.

`fast_packed_attention` is the models' packed attention outside the batch-invariant mode: this
kernel where `usable`, else torch's varlen flash kernel, else one causal SDPA per sequence.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


@functools.cache
def _interface():
    try:
        from flash_attn.cute import interface
    except ImportError:
        return None
    return interface


@torch.compiler.assume_constant_result
def _device_ok(device_index: int) -> bool:
    if os.environ.get("COLOCATE_ATTENTION", "auto") == "torch":
        return False
    return torch.cuda.get_device_capability(device_index)[0] in (9, 10) and _interface() is not None


def usable(q: torch.Tensor) -> bool:
    """Whether `attention(q, ...)` runs here (see the module docstring)."""
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
        and _device_ok(q.device.index or 0)
    )


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Causal attention within each packed sequence: q (N, Hq, D), k/v (N, Hk, D), cu_seqlens int32."""
    return torch.ops.colocate.flash_attention(q, k, v, cu_seqlens, max_seqlen, scale)[0]


@torch.library.custom_op("colocate::flash_attention", mutates_args=())
def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (N, Hq, D), log-sum-exp (Hq, N) fp32)."""
    out, lse, *_ = _interface()._flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=True,
        return_lse=True,
    )
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("colocate::flash_attention_backward", mutates_args=())
def _backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(
        q,
        k,
        v,
        out,
        grad.contiguous(),
        lse,
        scale,
        True,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        deterministic=torch.are_deterministic_algorithms_enabled(),
    )
    return dq, dk, dv


@_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, *output, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _grad(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = torch.ops.colocate.flash_attention_backward(grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)


def fast_packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """packed_causal_attention's default path: FlashAttention-4, torch's varlen flash kernel, or on
    CPU one SDPA per sequence. Also the backward of the batch-invariant kernel (gradients need no
    invariance)."""
    if usable(q):
        return attention(q, k, v, cu_seqlens.to(torch.int32), max_seqlen, scale)
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn

        cu = cu_seqlens.to(torch.int32)
        head_dim = q.shape[-1]
        pad = -head_dim % 8  # the flash kernel needs a multiple of 8; zero lanes change no score
        if pad:
            q, k, v = (F.pad(t, (0, pad)) for t in (q, k, v))
        out = varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, scale=scale, window_size=(-1, 0))
        return out[..., :head_dim] if pad else out
    return _per_sequence_sdpa(q, k, v, cu_seqlens, scale)


@torch.compiler.disable
def _per_sequence_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """One causal SDPA per sequence (a packed block-diagonal mask would be quadratic in N): CPU, and
    fp32 on CUDA. Left out of compiled blocks: traced with dynamic shapes, the sequences' bounds
    became sizes that inductor (torch 2.13, CPU) failed to simplify."""
    return per_sequence(
        q,
        k,
        v,
        cu_seqlens,
        lambda qs, ks, vs: F.scaled_dot_product_attention(
            qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
        ).transpose(0, 1),
    )


def per_sequence(q, k, v, cu_seqlens: torch.Tensor, attend) -> torch.Tensor:
    """`attend(q, k, v)` on each packed sequence's rows, the outputs concatenated."""
    bounds = cu_seqlens.tolist()
    outs = [attend(q[a:b], k[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs) if outs else q.new_empty(q.shape)
