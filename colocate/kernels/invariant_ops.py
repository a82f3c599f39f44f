"""The true on-policy mode's operations as custom ops, so that a compiled trainer keeps their bits.

torch.compile lowers aten ops to inductor's own kernels: matrix products picked by shape (cuBLAS or
Triton templates), fused reductions and fused element-wise code, each with its own order of
floating-point operations, none of them batch-invariant. Each op here wraps the mode's eager
computation (colocate/kernels/batch_invariant.py) as one opaque op, so a token's result is the same
kernel's whether the caller is compiled or not:

- `linear`: x W^T (+ b) through the mode's matrix product (its aten::mm / addmm overrides);
- `rms_norm`: the Triton row kernel on CUDA, the plain formula on the CPU (a fixed-length row
  reduction there, which inductor would reorder); `add_rms_norm` adds the residual first, in the
  same kernel;
- `attention`: the packed sequences' fixed-block causal attention;
- `silu_mul`: the MLP's SiLU(gate) * up as the mode computes it (the CPU's SiLU from exp), one
  kernel on CUDA.

Their backwards are plain formulas (the gradient needs no invariance), which inductor traces and
fuses. Inductor then fuses only the element-wise work between the ops (the residual add after the
MLP); `batch_invariant.enable` turns on inductor's `emulate_precision_casts`, which rounds each
op's result where eager does and keeps Triton from contracting a multiply and an add into one FMA.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from colocate.kernels import flash


@torch.library.custom_op("colocate::invariant_linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ weight (N, K)^T (+ bias (N,)) -> (..., N), by the mode's matrix product. x is made
    contiguous first: compiled callers may hand over another layout of the same values than eager
    ones, and a CPU BLAS picks its kernel by layout."""
    out = F.linear(x.contiguous(), weight, bias)
    return out.clone() if out._is_view() else out  # the CPU product's rows are a view of a padded one


@linear.register_fake
def _(x, weight, bias=None):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    need = ctx.needs_input_grad  # (x, weight) or (x, weight, bias): an omitted bias may not be listed
    flat = grad.reshape(-1, grad.shape[-1])
    grad_x = grad @ weight if need[0] else None
    grad_w = flat.T @ x.reshape(-1, x.shape[-1]) if need[1] else None
    grad_b = flat.sum(0) if ctx.has_bias and need[2] else None
    return grad_x, grad_w, grad_b


linear.register_autograd(_linear_backward, setup_context=_linear_setup)


def unit_stride(t: torch.Tensor) -> torch.Tensor:
    """t, copied only if its last dimension is strided: the row kernels take any row stride, so the
    halves of the packed gate/up product go in as views (a compiled caller may hand over another
    layout of the same values)."""
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("colocate::invariant_rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x (..., D) over D: normalised in fp32, cast back to x's dtype, times weight (D,)."""
    if x.is_cuda:
        from colocate.kernels import batch_invariant_cuda

        return batch_invariant_cuda.rms_norm(unit_stride(x), weight, eps)
    return reference_rms_norm(x.contiguous(), weight, eps)


@rms_norm.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in plain torch, normalised in fp32 and cast back before the weight as the HF
    implementations do: colocate.models.layers.RMSNorm outside the mode, and the mode's reference."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rms_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rms_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x, grad_w = _rms_grads(x, weight, ctx.eps, grad)
    return grad_x.to(x.dtype), grad_w, None


def _rms_grads(x, weight, eps, grad):
    """y = w n, n = round(x r), r = (mean(x^2) + eps)^-1/2: the rounding passes the gradient through.
    Returns the fp32 gradient of x and that of w in w's dtype."""
    xf = x.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    gf = grad.float()
    grad_w = (gf * (xf * r).to(x.dtype).float()).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    grad_n = gf * weight.float()
    return r * grad_n - xf * r.pow(3) * (grad_n * xf).mean(-1, keepdim=True), grad_w


rms_norm.register_autograd(_rms_backward, setup_context=_rms_setup)


@torch.library.custom_op("colocate::invariant_add_rms_norm", mutates_args=())
def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, RMSNorm(x + delta)): the residual stream and its normalised form, one Triton
    kernel on CUDA for rows (N, D), the sum and `rms_norm` elsewhere; the same values either way."""
    if x.is_cuda and x.ndim == 2 and delta.dtype == x.dtype:
        from colocate.kernels import batch_invariant_cuda

        return batch_invariant_cuda.add_rms_norm(unit_stride(x), unit_stride(delta), weight, eps)
    total = x + delta
    return total, rms_norm(total, weight, eps)


@add_rms_norm.register_fake
def _(x, delta, weight, eps):
    total = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, delta.dtype))
    return total, total.new_empty(x.shape, dtype=torch.promote_types(total.dtype, weight.dtype))


def _add_rms_setup(ctx, inputs, output):
    _, _, weight, eps = inputs
    ctx.save_for_backward(output[0], weight)
    ctx.eps = eps


def _add_rms_backward(ctx, grad_total, grad_normed):
    total, weight = ctx.saved_tensors
    grad_x, grad_w = _rms_grads(total, weight, ctx.eps, grad_normed)
    if grad_total is not None:
        grad_x = grad_x + grad_total.float()
    return grad_x.to(total.dtype), grad_x.to(total.dtype), grad_w, None


add_rms_norm.register_autograd(_add_rms_backward, setup_context=_add_rms_setup)


@torch.library.custom_op("colocate::invariant_attention", mutates_args=())
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> torch.Tensor:
    """Causal attention within each packed sequence, q (N, Hq, D), k/v (N, Hk, D) -> (N, Hq, D), in
    the mode's fixed key order; inside a backward pass (activation checkpointing's recompute, which
    feeds only gradients) by the default packed attention, as the products go to cuBLAS there."""
    if q.is_cuda:  # the kernel reads head_dim contiguously; a compiled caller may pass another layout
        from colocate.kernels import batch_invariant_cuda, invariant_attention

        if batch_invariant_cuda.in_backward():
            return flash.fast_packed_attention(q, k, v, cu_seqlens, max_seqlen, scale)
        q, k, v = (unit_stride(t) for t in (q, k, v))
        return invariant_attention.packed_attention(q, k, v, cu_seqlens, scale)
    from colocate.kernels import batch_invariant

    return flash.per_sequence(
        q,
        k,
        v,
        cu_seqlens,
        lambda qs, ks, vs: batch_invariant.attention(qs, ks, vs, torch.arange(qs.shape[0], device=qs.device), scale),
    )


@attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q)


def _attention_setup(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    ctx.save_for_backward(q, k, v, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale


def _attention_backward(ctx, grad):
    q, k, v, cu_seqlens = ctx.saved_tensors
    return *attention_backward(grad, q, k, v, cu_seqlens, ctx.max_seqlen, ctx.scale), None, None, None


@torch.library.custom_op("colocate::invariant_attention_backward", mutates_args=())
def attention_backward(
    grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradient of the default packed attention (FlashAttention or SDPA) by autograd, as one
    opaque op: traced into a compiled backward, the CPU's per-sequence split would read the lengths
    on the host, which a trace cannot."""
    with _autograd_inside_op(), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash.fast_packed_attention(q, k, v, cu_seqlens, max_seqlen, scale)
        return tuple(g.detach() for g in torch.autograd.grad(out, (q, k, v), grad))


@contextlib.contextmanager
def _autograd_inside_op():
    """Let autograd record inside a custom op's kernel, where the dispatcher has turned it off (the
    op's own gradient is registered beside it; this one's inputs are fresh leaves)."""
    keys = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView)
    before = [torch._C._dispatch_tls_is_dispatch_key_excluded(k) for k in keys]
    for key in keys:
        torch._C._dispatch_tls_set_dispatch_key_excluded(key, False)
    try:
        yield
    finally:
        for key, excluded in zip(keys, before):
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, excluded)


@attention_backward.register_fake
def _(grad, q, k, v, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


attention.register_autograd(_attention_backward, setup_context=_attention_setup)


@torch.library.custom_op("colocate::invariant_silu_mul", mutates_args=())
def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up, as the mode computes it: one Triton kernel on CUDA, F.silu (the mode's CPU
    SiLU) and the product elsewhere; the SiLU is rounded to the inputs' dtype before the product."""
    if gate.is_cuda and gate.ndim == 2 and up.dtype == gate.dtype:
        from colocate.kernels import batch_invariant_cuda

        return batch_invariant_cuda.silu_mul(unit_stride(gate), unit_stride(up))
    return F.silu(gate) * up


@silu_mul.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_backward(ctx, grad):
    gate, up = ctx.saved_tensors
    gf, gradf = gate.float(), grad.float()
    s = torch.sigmoid(gf)
    grad_gate = gradf * up.float() * s * (1 + gf * (1 - s))
    return grad_gate.to(gate.dtype), (gradf * gf * s).to(up.dtype)


silu_mul.register_autograd(_silu_mul_backward, setup_context=_silu_mul_setup)
