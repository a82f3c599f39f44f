"""The inductor pass that keeps a matmul and the residual added to it apart (see
colocate.trainer.inductor_passes): what it splits, what it leaves fused, and that the compiled
numbers stay those of eager mode."""

import torch
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from colocate.trainer.inductor_passes import SplitResidualAddmm, install


def _compiled(fn, *args, split: bool):
    """fn compiled by inductor with dynamic shapes (with or without the pass), its result and
    the generated code's addmm calls."""
    torch._dynamo.reset()
    passes = SplitResidualAddmm() if split else None
    with config.patch(post_grad_custom_post_pass=passes):
        out, code = run_and_get_code(torch.compile(fn, dynamic=True), *args)
    return out, sum(c.count("extern_kernels.addmm(") for c in code)


def _residual_then_norm(x, w, r):
    """A residual add whose sum feeds a norm (a reduction), as in a block: inductor fuses it."""
    s = x @ w + r
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)


def _bias_then_norm(x, w, b):
    s = x @ w + b
    return s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_residual_addmm_is_split_and_bias_addmm_kept():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 24, generator=gen), torch.randn(24, 16, generator=gen)
    r, b = torch.randn(37, 16, generator=gen), torch.randn(16, generator=gen)
    expected = _residual_then_norm(x, w, r)
    fused, fused_calls = _compiled(_residual_then_norm, x, w, r, split=False)
    split, split_calls = _compiled(_residual_then_norm, x, w, r, split=True)
    assert (fused_calls, split_calls) == (1, 0)
    torch.testing.assert_close(split, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, expected, rtol=1e-5, atol=1e-5)
    _, bias_calls = _compiled(_bias_then_norm, x, w, b, split=True)
    assert bias_calls == 1  # a 1-D bias stays in the GEMM's epilogue


class _OtherPass(CustomGraphPass):
    def __call__(self, graph):
        pass

    def uuid(self):
        return b"other"


def test_install_adds_the_pass_once_beside_existing_ones():
    other = _OtherPass()
    with config.patch(post_grad_custom_post_pass=None):
        install()
        install()
        assert [type(p) for p in config.post_grad_custom_post_pass] == [SplitResidualAddmm]
    with config.patch(post_grad_custom_post_pass=other):
        install()
        assert [type(p) for p in config.post_grad_custom_post_pass] == [_OtherPass, SplitResidualAddmm]
