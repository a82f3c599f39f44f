"""The rotary kernel against the plain-torch rotation: values, gradients and the op registration."""

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


def test_cpu_rotate_is_the_reference():
    q, _, cos, sin = _inputs(7, 3, 1, 8, torch.float32, "cpu")
    assert torch.equal(rotate(q, cos, sin), reference_rotate(q, cos, sin))
    # the rotation keeps each (x1, x2) pair's norm
    pairs = lambda t: t[..., :4].square() + t[..., 4:].square()  # noqa: E731
    torch.testing.assert_close(pairs(rotate(q, cos, sin)), pairs(q), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n, heads, kv_heads, head_dim", [(1, 1, 1, 2), (1000, 14, 2, 64), (333, 7, 1, 12),
                                                          (4099, 12, 2, 128)])
def test_kernel_matches_reference_values_and_gradients(n, heads, kv_heads, head_dim, dtype):
    q, k, cos, sin = _inputs(n, heads, kv_heads, head_dim, dtype, "cuda")
    tol = dict(rtol=0, atol=1e-5) if dtype == torch.float32 else dict(rtol=0, atol=2e-2)
    for x in (q, k):
        leaf = x.detach().clone().requires_grad_()
        out = rotate(leaf, cos, sin)
        assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
        expected = reference_rotate(x.float(), cos.float(), sin.float())
        torch.testing.assert_close(out.float(), expected, **tol)
        grad_out = torch.randn_like(out)
        (grad,) = torch.autograd.grad(out, leaf, grad_out)
        ref_leaf = x.detach().float().requires_grad_()
        (expected_grad,) = torch.autograd.grad(reference_rotate(ref_leaf, cos.float(), sin.float()), ref_leaf,
                                               grad_out.float())
        torch.testing.assert_close(grad.float(), expected_grad, **tol)


@pytest.mark.gpu
def test_op_registration_and_compiled_use():
    q, _, cos, sin = _inputs(64, 4, 1, 16, torch.float32, "cuda")
    torch.library.opcheck(torch.ops.colocate.rotary.default, (q.detach().clone().requires_grad_(), cos, sin))
    compiled = torch.compile(lambda x: rotate(x, cos, sin).sum(-1), dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q), reference_rotate(q, cos, sin).sum(-1), rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="no gradient to cos/sin"):
        rotate(q, cos.clone().requires_grad_(), sin)
