"""The inductor pass that keeps a matmul and the residual added to it apart (see
colocate.trainer.inductor_passes): what it splits, what it leaves fused, and that the compiled
numbers stay those of eager mode; on CUDA (gpu), a whole compiled block."""

import pytest
import torch
from torch._inductor import config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code

from colocate.models import ModelConfig
from colocate.models.layers import Rotary
from colocate.models.transformer import DecoderLayer
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
        assert type(config.post_grad_custom_post_pass) is SplitResidualAddmm  # one pass: any torch takes it
    with config.patch(post_grad_custom_post_pass=other):
        install()
        assert [type(p) for p in config.post_grad_custom_post_pass] == [_OtherPass, SplitResidualAddmm]
    with config.patch(post_grad_custom_post_pass=(other, SplitResidualAddmm())):
        install()
        assert len(config.post_grad_custom_post_pass) == 2


@pytest.mark.gpu
def test_compiled_cuda_block_keeps_only_the_bias_addmm():
    """A Qwen2 block compiled by inductor on CUDA (bf16, dynamic shapes) with the pass: the only
    addmm left is the q/k/v projection's bias, and output and gradients stay those of eager mode
    up to bf16 rounding."""
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=256, intermediate_size=512,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                      attention_bias=True)
    torch.manual_seed(0)
    block = DecoderLayer(cfg, 0).cuda().bfloat16()
    lengths = [37, 91]
    positions = torch.cat([torch.arange(n) for n in lengths]).cuda()
    cos, sin = Rotary(cfg.head_dim, cfg.rope_theta, None).cuda()(positions, torch.bfloat16)
    cu = torch.tensor([0, lengths[0], sum(lengths)], device="cuda", dtype=torch.int32)
    x0 = torch.randn(sum(lengths), cfg.hidden_size, device="cuda", dtype=torch.bfloat16)

    def run(forward):
        x = x0.clone().requires_grad_()
        block.zero_grad(set_to_none=True)
        out = forward(x, cos, sin, cu, max(lengths))
        out.float().square().sum().backward()
        return [out.detach(), x.grad] + [p.grad for p in block.parameters()]

    expected = run(block.forward)
    torch._dynamo.reset()
    with config.patch(post_grad_custom_post_pass=SplitResidualAddmm()):
        got, code = run_and_get_code(run, torch.compile(block.forward, dynamic=True))
    assert sum(c.count("extern_kernels.addmm(") for c in code) == 1
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2 * e.float().abs().max().item())
