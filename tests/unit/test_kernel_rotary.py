"""The rotary op against the plain-torch rotation: values, gradients, registration and compiled
use on CPU (where the op computes the reference) and with the Triton kernel on CUDA."""

import pytest
import torch

from colocate.kernels.rotary import reference_rotate, rotate
from colocate.models.layers import Rotary


def _inputs(n: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: str):
    """q and k as the attention layer makes them: strided views of one packed projection output."""
    g = torch.Generator(device=device).manual_seed(0)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, device=device, dtype=dtype, generator=g)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    positions = torch.randint(0, 4096, (n,), device=device, generator=g)
    cos, sin = Rotary(head_dim, 1e6, None).to(device)(positions, dtype)
    return q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), cos, sin


def _check_against_reference(q, k, cos, sin, atol: float):
    """Values and gradients of `rotate` against autograd through the fp32 reference."""
    leaves = [x.detach().clone().requires_grad_() for x in (q, k)]
    outs = rotate(*leaves, cos, sin)
    grads_out = [torch.randn_like(o) for o in outs]
    grads = torch.autograd.grad(outs, leaves, grads_out)
    for x, out, grad_out, grad in zip((q, k), outs, grads_out, grads):
        assert out.dtype == x.dtype and out.shape == x.shape and out.is_contiguous()
        ref_leaf = x.detach().float().requires_grad_()
        expected = reference_rotate(ref_leaf, cos.float(), sin.float())
        (expected_grad,) = torch.autograd.grad(expected, ref_leaf, grad_out.float())
        torch.testing.assert_close(out.float(), expected, rtol=0, atol=atol)
        torch.testing.assert_close(grad.float(), expected_grad, rtol=0, atol=atol)


def _check_op(device: str):
    q, k, cos, sin = _inputs(64, 4, 1, 16, torch.float32, device)
    torch.library.opcheck(torch.ops.colocate.rotary.default, (q.detach().clone().requires_grad_(), k.detach().clone(), cos, sin))
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(
        lambda a, b: [t.sum(-1) for t in rotate(a, b, cos, sin)], dynamic=True, fullgraph=True, backend=backend
    )
    for got, x in zip(compiled(q, k), (q, k)):
        torch.testing.assert_close(got, reference_rotate(x, cos, sin).sum(-1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no gradient to cos/sin"):
        rotate(q, k, cos.clone().requires_grad_(), sin)
    with pytest.raises(ValueError, match=r"q/k must be \(N, H, D\)"):
        rotate(q, k[:-1], cos, sin)


def test_cpu_op_matches_the_reference_and_keeps_pair_norms():
    q, k, cos, sin = _inputs(37, 3, 1, 8, torch.float32, "cpu")
    _check_against_reference(q, k, cos, sin, atol=1e-6)
    pairs = lambda t: t[..., :4].square() + t[..., 4:].square()  # noqa: E731 (rotation keeps them)
    torch.testing.assert_close(pairs(rotate(q, k, cos, sin)[0]), pairs(q), rtol=1e-5, atol=1e-5)


def test_cpu_op_gives_contiguous_outputs_for_permuted_inputs():
    """As its fake kernel says, which a compiled graph checks: a gradient arriving as a dense but
    permuted (heads-major) tensor once came back permuted and failed that check."""
    q, k, cos, sin = _inputs(37, 3, 1, 8, torch.float32, "cpu")
    permuted = [x.transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k)]
    outs = rotate(*permuted, cos, sin)
    for out, x in zip(outs, (q, k)):
        assert out.is_contiguous()
        torch.testing.assert_close(out, reference_rotate(x, cos, sin), rtol=0, atol=1e-6)


def test_cpu_op_registration_and_compiled_use():
    _check_op("cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, heads, kv_heads, head_dim", [(1, 1, 1, 2), (1000, 14, 2, 64), (333, 7, 1, 12), (4099, 12, 2, 128)])
def test_kernel_matches_reference_values_and_gradients(n, heads, kv_heads, head_dim, dtype):
    q, k, cos, sin = _inputs(n, heads, kv_heads, head_dim, dtype, "cuda")
    _check_against_reference(q, k, cos, sin, atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.gpu
def test_kernel_op_registration_and_compiled_use():
    _check_op("cuda")
