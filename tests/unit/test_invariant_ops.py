"""The true on-policy mode's custom ops (colocate/kernels/invariant_ops.py) on CPU: registered as
torch.library expects (fake tensors, autograd), forward bits equal to the mode's eager computation,
compiled or not, and gradients equal to autograd of the plain formulas."""

import pytest
import torch
import torch.nn.functional as F

from colocate.kernels import batch_invariant, invariant_ops
from colocate.kernels.ops import Ops


@pytest.fixture
def invariant():
    """The mode's table; building it switches aten's products and SiLU to the mode's."""
    yield Ops.true_on_policy(torch.device("cpu"))
    batch_invariant.disable()


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lens = [5, 19, 1, 33]
    n = sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(
        x=r(n, 24),
        y=r(n, 24),
        w=r(40, 24),
        b=r(40),
        norm_w=r(24) + 1,
        q=r(n, 6, 8),
        k=r(n, 2, 8),
        v=r(n, 2, 8),
        cu=cu,
        max_len=max(lens),
    )


def _calls(t):
    """(op, args) of every op on `t`'s tensors."""
    return [
        (invariant_ops.linear, (t["x"], t["w"], t["b"])),
        (invariant_ops.linear, (t["x"], t["w"], None)),
        (invariant_ops.rms_norm, (t["x"], t["norm_w"], 1e-6)),
        (invariant_ops.add_rms_norm, (t["x"], t["y"], t["norm_w"], 1e-6)),
        (invariant_ops.silu_mul, (t["x"], t["y"])),
        (invariant_ops.attention, (t["q"], t["k"], t["v"], t["cu"], t["max_len"], 8**-0.5)),
    ]


def test_ops_pass_torch_library_checks(invariant):
    t = _inputs()
    for key in ("x", "y", "w", "b", "norm_w", "q", "k", "v"):
        t[key].requires_grad_()
    for op, args in _calls(t):
        torch.library.opcheck(op, args)


def _plain(op, args):
    """The plain-torch formula of each op (gradient reference; attention by dense SDPA)."""
    if op is invariant_ops.linear:
        return F.linear(*args)
    if op is invariant_ops.rms_norm:
        return invariant_ops.reference_rms_norm(*args)
    if op is invariant_ops.add_rms_norm:
        total = args[0] + args[1]
        return total, invariant_ops.reference_rms_norm(total, *args[2:])
    if op is invariant_ops.silu_mul:
        return args[0] * torch.sigmoid(args[0]) * args[1]
    q, k, v, cu, _, scale = args
    bounds = cu.tolist()
    return torch.cat(
        [
            F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1),
                k[a:b].transpose(0, 1),
                v[a:b].transpose(0, 1),
                is_causal=True,
                scale=scale,
                enable_gqa=True,
            ).transpose(0, 1)
            for a, b in zip(bounds[:-1], bounds[1:])
        ]
    )


def test_gradients_equal_autograd_of_the_plain_formulas(invariant):
    t = _inputs()
    for op, args in _calls(t):
        leaves = [
            a.detach().double().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args
        ]
        ours = [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
        outs, plain = _tuple(op(*ours)), _tuple(_plain(op, leaves))
        grads = [torch.randn(o.shape, generator=torch.Generator().manual_seed(1 + i)) for i, o in enumerate(outs)]
        torch.autograd.backward(outs, grads)
        torch.autograd.backward(plain, [g.double() for g in grads])
        for out, want in zip(outs, plain):
            torch.testing.assert_close(out.double(), want.detach(), rtol=1e-5, atol=1e-5)
        for got, want in zip(ours, leaves):
            if isinstance(got, torch.Tensor) and got.requires_grad:
                torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5, msg=str(op))


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def test_compiled_callers_get_the_eager_bits(invariant):
    """A compiled function of the ops and the element-wise work between them (residual add, gate
    product, scaling) gives the eager function's bits, forward and backward."""
    t = _inputs()

    def block(x, y, w, b, norm_w, q, k, v):
        h = invariant_ops.rms_norm(x, norm_w, 1e-6)
        a = invariant_ops.attention(q, k, v, t["cu"], t["max_len"], 8**-0.5).reshape(x.shape[0], -1)
        stream, h = invariant_ops.add_rms_norm(h, y * 0.5, norm_w, 1e-6)
        gate = invariant_ops.linear(h, w, b)
        return stream[:, :1] * 0.5 + invariant_ops.silu_mul(gate, invariant_ops.linear(h, w)) + a[:, :1]

    names = ("x", "y", "w", "b", "norm_w", "q", "k", "v")
    eager = block(*(t[n] for n in names))
    compiled = torch.compile(block, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(*(t[n] for n in names)), eager)
    ours = [t[n].detach().requires_grad_() for n in names]
    compiled(*ours).sum().backward()
    plain = [t[n].detach().requires_grad_() for n in names]
    block(*plain).sum().backward()
    for name, got, want in zip(names, ours, plain):  # fp32 sums in another order: relative to the norm
        assert ((got.grad - want.grad).norm() / want.grad.norm()).item() < 1e-5, name
