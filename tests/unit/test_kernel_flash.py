"""FlashAttention-4 packed causal attention against an fp32 per-sequence reference, beside torch's
varlen kernel on the same bf16 inputs: values, gradients, the ops' registration and compiled use.
GPU only, and only where the `flash` extra is installed on a Hopper or Blackwell GPU."""

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

from colocate.kernels import flash
from colocate.models.layers import packed_causal_attention

LENGTHS = [1, 7, 129, 300, 1000, 2100]


def test_cpu_tensors_never_take_the_flash_path():
    assert not flash.usable(torch.zeros(4, 2, 128, dtype=torch.bfloat16))


def _inputs(heads: int = 12, kv_heads: int = 2, head_dim: int = 128):
    if not flash.usable(torch.empty(1, 1, head_dim, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("flash-attn-4 is not installed or this GPU is not Hopper/Blackwell")
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(LENGTHS)
    q, k, v = (torch.randn(n, h, head_dim, device="cuda", generator=g).bfloat16() for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, cu, max(LENGTHS)


def _run(fn, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    return [out.detach().float(), *(t.float() for t in torch.autograd.grad(out, leaves, grad_out))]


@pytest.mark.gpu
def test_values_and_gradients_match_the_reference_as_closely_as_torchs_kernel(monkeypatch):
    q, k, v, cu, max_len = _inputs()
    scale = q.shape[-1] ** -0.5
    grad_out = torch.randn(q.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(1)).bfloat16()
    ref = _run(lambda a, b, c: packed_causal_attention(a, b, c, cu, max_len), q.float(), k.float(), v.float(), grad_out.float())
    ours = _run(lambda a, b, c: flash.attention(a, b, c, cu, max_len, scale), q, k, v, grad_out)
    torchs = _run(
        lambda a, b, c: varlen_attn(a, b, c, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0)), q, k, v, grad_out
    )
    for name, r, a, b in zip(["out", "dq", "dk", "dv"], ref, ours, torchs):
        err, torch_err = (a - r).abs().max().item(), (b - r).abs().max().item()
        assert err <= 2 * torch_err + 1e-3, f"{name}: flash error {err:.2e}, torch's kernel {torch_err:.2e}"
        assert err <= 0.02 * r.abs().max().item(), f"{name}: flash error {err:.2e} of {r.abs().max().item():.2e}"
    monkeypatch.setenv("COLOCATE_ATTENTION", "torch")
    assert not flash.usable(q)


@pytest.mark.gpu
def test_op_registration_and_compiled_blocks_without_graph_breaks():
    q, k, v, cu, max_len = _inputs(heads=4, kv_heads=1)
    scale = q.shape[-1] ** -0.5
    torch.library.opcheck(
        torch.ops.colocate.flash_attention.default,
        (q.clone().requires_grad_(), k.clone().requires_grad_(), v.clone().requires_grad_(), cu, max_len, scale),
    )
    grad_out = torch.randn_like(q)
    eager = _run(lambda a, b, c: packed_causal_attention(a, b, c, cu, max_len), q, k, v, grad_out)
    compiled_fn = torch.compile(lambda a, b, c: packed_causal_attention(a, b, c, cu, max_len), dynamic=True, fullgraph=True)
    compiled = _run(compiled_fn, q, k, v, grad_out)
    for a, b in zip(eager, compiled):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2)
