"""Activation checkpointing plans: where the recomputed blocks go, that every block mode gives the
gradients of a plain block, and (GPU) that the "attention" mode's recompute skips attention."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colocate.models import ModelConfig
from colocate.models.layers import Rotary
from colocate.models.transformer import DecoderLayer
from colocate.trainer.parallelize import ActivationCheckpointing, _attention_ops, _checkpointed

MODES = ("full", "attention", "ops")


def test_activation_checkpointing_places_full_blocks_evenly():
    assert ActivationCheckpointing(1 / 3).block_modes(9) == ["full", "none", "none"] * 3
    assert ActivationCheckpointing(0.5, "ops").block_modes(4) == ["full", "ops", "full", "ops"]
    assert ActivationCheckpointing(0.5, "ops", full_keeps_attention=True).block_modes(4) == ["attention", "ops"] * 2
    assert ActivationCheckpointing(1.0).block_modes(3) == ["full"] * 3
    assert ActivationCheckpointing().block_modes(2) == ["none", "none"]
    with pytest.raises(ValueError, match="full_fraction"):
        ActivationCheckpointing(1.5)
    with pytest.raises(ValueError, match="rest"):
        ActivationCheckpointing(0.5, "selective")


class _CountAttention(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in _attention_ops()
        return func(*args, **(kwargs or {}))


def _block_grads(mode: str | None, dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], int]:
    """Gradients of one decoder block on two packed sequences, and the attention calls its
    backward made (recomputation included)."""
    cfg = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=256, intermediate_size=320, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=128, attention_bias=True)
    torch.manual_seed(0)
    block = DecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    forward = _checkpointed(block.forward, mode) if mode else block.forward
    lengths = [5, 11]
    x = torch.randn(sum(lengths), cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cos, sin = Rotary(cfg.head_dim, cfg.rope_theta, None).to(device)(positions, dtype)
    cu = torch.tensor([0, 5, 16], device=device, dtype=torch.int32)
    out = forward(x, cos, sin, cu, max(lengths))
    counter = _CountAttention()
    with counter:
        out.square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], counter.calls


def test_every_block_mode_gives_the_plain_gradients():
    expected, _ = _block_grads(None, torch.float32, "cpu")
    for mode in MODES:
        grads, _ = _block_grads(mode, torch.float32, "cpu")
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=mode)


@pytest.mark.gpu
def test_attention_mode_recomputes_everything_but_attention(deterministic):
    plain, plain_calls = _block_grads(None, torch.bfloat16, "cuda")
    calls = {}
    for mode in MODES:
        grads, calls[mode] = _block_grads(mode, torch.bfloat16, "cuda")
        for g, e in zip(grads, plain):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=mode)
    assert plain_calls == 0 and calls["full"] == 1 and calls["attention"] == 0 and calls["ops"] == 0, calls
