"""Activation checkpointing plans: where the recomputed blocks go, that every block mode gives the
gradients of a plain block, which forward matmuls each mode runs again in backward, that each
mode compiles to one graph, and (GPU) that the "attention" mode's recompute skips attention."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colocate.models import ModelConfig
from colocate.models.layers import Rotary
from colocate.models.transformer import DecoderLayer
from colocate.trainer.parallelize import ActivationCheckpointing, _attention_ops, _checkpointed

MODES = ("full", "attention", "ops", "mlp")


def test_activation_checkpointing_places_full_blocks_evenly():
    assert ActivationCheckpointing(1 / 3).block_modes(9) == ["full", "none", "none"] * 3
    assert ActivationCheckpointing(0.5, "ops").block_modes(4) == ["full", "ops", "full", "ops"]
    assert ActivationCheckpointing(0.5, "ops", full_keeps_attention=True).block_modes(4) == ["attention", "ops"] * 2
    assert ActivationCheckpointing(0.5, "mlp", full_keeps_attention=True).block_modes(2) == ["attention", "mlp"]
    assert ActivationCheckpointing(1.0).block_modes(3) == ["full"] * 3
    assert ActivationCheckpointing().block_modes(2) == ["none", "none"]
    with pytest.raises(ValueError, match="full_fraction"):
        ActivationCheckpointing(1.5)
    with pytest.raises(ValueError, match="rest"):
        ActivationCheckpointing(0.5, "selective")


class _Ops(TorchDispatchMode):
    """The ops run under it, with their outputs' shapes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.ops.append((func, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
        return out

    def count(self, funcs, shape=None) -> int:
        return sum(f in funcs and (shape is None or s == shape) for f, s in self.ops)


CFG = ModelConfig(model_type="qwen2", vocab_size=64, hidden_size=256, intermediate_size=320, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=128, attention_bias=True)
LENGTHS = [5, 11]


def _block_grads(mode: str | None, dtype: torch.dtype, device: str) -> tuple[list[torch.Tensor], _Ops]:
    """Gradients of one decoder block on two packed sequences, and the ops its backward ran
    (recomputation included)."""
    cfg, lengths = CFG, LENGTHS
    torch.manual_seed(0)
    block = DecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    forward = _checkpointed(block.forward, mode, cfg.intermediate_size) if mode else block.forward
    x = torch.randn(sum(lengths), cfg.hidden_size, device=device, dtype=dtype, requires_grad=True)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cos, sin = Rotary(cfg.head_dim, cfg.rope_theta, None).to(device)(positions, dtype)
    cu = torch.tensor([0, 5, 16], device=device, dtype=torch.int32)
    out = forward(x, cos, sin, cu, max(lengths))
    ops = _Ops()
    with ops:
        out.square().sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())], ops


def test_every_block_mode_gives_the_plain_gradients():
    expected, _ = _block_grads(None, torch.float32, "cpu")
    for mode in MODES:
        grads, _ = _block_grads(mode, torch.float32, "cpu")
        for g, e in zip(grads, expected):
            torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=mode)


def test_modes_recompute_the_forward_matmuls_they_do_not_keep():
    """In backward, a (tokens, intermediate) matmul output is the down projection's input gradient
    (always) or a recomputed gate/up projection; a (tokens, q+k+v) one only a recomputed q/k/v."""
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}
    n = sum(LENGTHS)
    qkv = (CFG.num_attention_heads + 2 * CFG.num_key_value_heads) * CFG.head_dim
    seen = {}
    for mode in (None, *MODES):
        _, ops = _block_grads(mode, torch.float32, "cpu")
        seen[mode] = (ops.count(matmuls, (n, CFG.intermediate_size)), ops.count(matmuls, (n, qkv)))
    assert seen == {None: (1, 0), "ops": (1, 0), "mlp": (3, 0), "attention": (3, 1), "full": (3, 1)}, seen


def _mixing_stand_in(q, k, v, cu_seqlens, max_seqlen):
    """A stand-in for attention with no data-dependent op (the CPU path loops over cu_seqlens),
    so that a compiled block has no graph break of its own."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return q * k + v


def test_every_block_mode_compiles_to_one_graph(monkeypatch):
    """torch.compile with dynamic shapes (as parallelize compiles blocks) captures each mode's block,
    recomputation policy included, as one graph for every micro-batch size: a graph break makes
    the block run eagerly, slower but with the same gradients, which no other CPU test would see."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("colocate.models.transformer.packed_causal_attention", _mixing_stand_in)
    block = DecoderLayer(CFG, 0)
    rotary = Rotary(CFG.head_dim, CFG.rope_theta, None)
    for mode in (None, *MODES):
        torch._dynamo.reset()
        counters.clear()
        forward = _checkpointed(block.forward, mode, CFG.intermediate_size) if mode else block.forward
        compiled = torch.compile(forward, backend="aot_eager", dynamic=True)
        for n in (13, 21):
            cos, sin = rotary(torch.arange(n), torch.float32)
            x = torch.randn(n, CFG.hidden_size, requires_grad=True)
            compiled(x, cos, sin, torch.tensor([0, n], dtype=torch.int32), n).sum().backward()
        assert not counters["graph_break"], (mode, dict(counters["graph_break"]))
        assert counters["stats"]["unique_graphs"] == 1, (mode, dict(counters["stats"]))


@pytest.mark.gpu
def test_attention_mode_recomputes_everything_but_attention(deterministic):
    plain, plain_ops = _block_grads(None, torch.bfloat16, "cuda")
    plain_calls = plain_ops.count(_attention_ops())
    calls = {}
    for mode in MODES:
        grads, ops = _block_grads(mode, torch.bfloat16, "cuda")
        calls[mode] = ops.count(_attention_ops())
        for g, e in zip(grads, plain):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=mode)
    assert plain_calls == 0 and calls == {"full": 1, "attention": 0, "ops": 0, "mlp": 0}, calls
