"""FP8 weights (colocate/kernels/fp8.py): the row-wise quantization's error bound, the FP8 GEMM
against its dequantized reference, and the models' quantized projections."""

import pytest
import torch

from colocate.kernels.fp8 import (
    E4M3,
    E4M3_MAX,
    dequantize_rowwise,
    fp8_linear,
    quantize_per_token,
    quantize_rowwise,
    quantize_rowwise_into,
)
from colocate.models import ArchConfig, CausalLM
from colocate.models.transformer import joint_linear

REL = 2.0**-4
"""e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of it."""
SUBNORMAL_STEP = 2.0**-9
"""Below e4m3's smallest normal (2^-6) values sit on a grid of 2^-9 (of the scale)."""


def _bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest rounding error of each element of x quantized with its (broadcast) scale."""
    return torch.maximum(x.abs() * REL, scale * SUBNORMAL_STEP / 2) + 1e-7


def test_rowwise_quantization_is_within_e4m3_rounding_and_keeps_each_row_amax():
    torch.manual_seed(0)
    w = torch.randn(64, 96) * torch.logspace(-3, 2, 64)[:, None]  # rows of very different sizes
    w[5] = 0.0
    w8, scale = quantize_rowwise(w)
    assert w8.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == (64,)
    back = dequantize_rowwise(w8, scale, torch.float32)
    assert bool(((back - w).abs() <= _bound(w, scale[:, None])).all())
    amax = w.abs().amax(dim=1)
    torch.testing.assert_close(scale, amax.clamp(min=1e-12) / E4M3_MAX)
    # Each row's largest value maps to 448, which e4m3 holds exactly (up to fp32's division rounding).
    torch.testing.assert_close(back.abs().amax(dim=1), amax, rtol=1e-6, atol=0)
    assert torch.equal(back[5], torch.zeros(96))


def test_quantize_into_writes_the_same_bits_in_place():
    torch.manual_seed(1)
    w = torch.randn(32, 48, dtype=torch.bfloat16)
    out, out_scale = torch.empty(32, 48, dtype=E4M3), torch.empty(32)
    view = out[8:16]  # a packed tensor's slice keeps its storage
    quantize_rowwise_into(w, out, out_scale)
    w8, scale = quantize_rowwise(w)
    assert torch.equal(out.view(torch.uint8), w8.view(torch.uint8)) and torch.equal(out_scale, scale)
    assert view.data_ptr() == out[8:16].data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_equals_the_product_of_its_dequantized_operands(dtype):
    """One scaled GEMM = (per-token dequantized x) @ (row-dequantized W)^T + bias, accumulated in
    fp32; and the whole error against the unquantized product is within both roundings."""
    torch.manual_seed(2)
    x, w, bias = torch.randn(3, 5, 64, dtype=dtype), torch.randn(48, 64), torch.randn(48, dtype=dtype)
    w8, scale = quantize_rowwise(w)
    out = fp8_linear(x, w8, scale, bias)
    assert out.shape == (3, 5, 48) and out.dtype == dtype
    x8, x_scale = quantize_per_token(x.reshape(-1, 64))
    ref = (x8.float() * x_scale) @ dequantize_rowwise(w8, scale, torch.float32).T + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2**-7 * ref.abs().max().item()
    assert (out.reshape(-1, 48).float() - ref).abs().max().item() <= tol
    exact = x.reshape(-1, 64).float() @ w.T + bias.float()
    # Each product term errs by at most (2^-4 + 2^-4 + 2^-8) of |x_k| |w_k| (subnormals: tiny here).
    budget = (2 * REL + REL**2) * (x.reshape(-1, 64).float().abs() @ w.abs().T) + tol + 1e-4
    assert bool(((out.reshape(-1, 48).float() - exact).abs() <= budget).all())


def _tiny(**overrides) -> CausalLM:
    cfg = ArchConfig(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        attention_bias=True,
        eos_token_id=1,
        **overrides,
    )
    torch.manual_seed(3)
    model = CausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


def test_quantized_projections_compute_fp8_gemms_of_the_row_quantized_weights():
    model = _tiny()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, 97, (2, 9))
    model.quantize_projections()
    model.pack_projections()
    params = dict(model.named_parameters())
    for name, w in originals.items():
        proj = name.endswith("proj.weight")
        assert (params[name].dtype == E4M3) == proj, name
        if proj:
            w8, scale = quantize_rowwise(w)
            assert torch.equal(params[name].view(torch.uint8), w8.view(torch.uint8))
            assert torch.equal(params[name + "_scale"], scale)
        else:
            assert torch.equal(params[name], w), name  # embeddings, norms, biases, lm_head untouched
    # The packed q/k/v GEMM equals the parts' own FP8 GEMMs (row scales are independent).
    attn = model.model.layers[0].self_attn
    x = torch.randn(7, 64)
    joint = joint_linear(x, (attn.q_proj, attn.k_proj, attn.v_proj), attn.qkv_weight, attn.qkv_bias, scale=attn.qkv_scale)
    parts = torch.cat([m(x) for m in (attn.q_proj, attn.k_proj, attn.v_proj)], dim=-1)
    torch.testing.assert_close(joint, parts, rtol=0, atol=1e-5)
    assert attn.q_proj.weight.data_ptr() == attn.qkv_weight.data_ptr()
    # The whole model stays close to the unquantized one (a bound on the drift, not on the bits).
    reference = _tiny()
    logits, ref = model(ids), reference(ids)
    assert (logits - ref).abs().max().item() <= 0.1 * ref.abs().max().item()
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


def test_quantize_after_packing_is_refused():
    model = _tiny()
    model.pack_projections()
    with pytest.raises(RuntimeError, match="before pack_projections"):
        model.quantize_projections()
