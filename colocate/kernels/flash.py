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
"""

from __future__ import annotations

import functools
import os

import torch


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
    return (q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256 and _device_ok(q.device.index or 0))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
              scale: float) -> torch.Tensor:
    """Causal attention within each packed sequence: q (N, Hq, D), k/v (N, Hk, D), cu_seqlens int32."""
    return torch.ops.colocate.flash_attention(q, k, v, cu_seqlens, max_seqlen, scale)[0]


@torch.library.custom_op("colocate::flash_attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (N, Hq, D), log-sum-exp (Hq, N) fp32)."""
    out, lse, *_ = _interface()._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens, max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen, softmax_scale=scale, causal=True, return_lse=True)
    return out, lse


@_forward.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("colocate::flash_attention_backward", mutates_args=())
def _backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dq, dk, dv = _interface()._flash_attn_bwd(
        q, k, v, out, grad.contiguous(), lse, scale, True, cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen, deterministic=torch.are_deterministic_algorithms_enabled())
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
    dq, dk, dv = torch.ops.colocate.flash_attention_backward(
        grad_out, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_forward.register_autograd(_grad, setup_context=_setup_context)
