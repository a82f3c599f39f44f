"""Activation checkpointing plans: where the recomputed blocks go, that every block mode gives the
gradients of a plain block, which forward matmuls each mode runs again in backward, compiled
or not, and (GPU) that the "attention" mode's recompute skips attention."""

import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from colocate.kernels.ops import Ops
from colocate.models import ArchConfig
from colocate.models.layers import Rotary, set_ops
from colocate.models.transformer import DecoderLayer
from colocate.trainer.parallelize import ActivationCheckpointing, _attention_ops, _checkpointed, _compiled_blocks

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


def test_recomputed_blocks_with_dropout_run_uncompiled_where_torch_cannot_compile_them(monkeypatch):
    """torch 2.11 and 2.12 fail compiling a recomputed block that draws random numbers: those
    blocks run eagerly there, with a warning; the others, and every block on a newer torch, compile."""
    modes = ["full", "none", "ops"]
    monkeypatch.setattr("colocate.trainer.parallelize.compiles_random_recompute", lambda: True)
    assert _compiled_blocks(modes, compile=True, random=True) == [True] * 3
    monkeypatch.setattr("colocate.trainer.parallelize.compiles_random_recompute", lambda: False)
    with pytest.warns(UserWarning, match="cannot compile a recomputed block with LoRA dropout"):
        assert _compiled_blocks(modes, compile=True, random=True) == [False, True, False]
    assert _compiled_blocks(modes, compile=True, random=False) == [True] * 3
    assert _compiled_blocks(["none"], compile=True, random=True) == [True]
    assert _compiled_blocks(modes, compile=False, random=True) == [False] * 3


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


CFG = ArchConfig(
    model_type="qwen2",
    vocab_size=64,
    hidden_size=256,
    intermediate_size=320,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=128,
    attention_bias=True,
)
LENGTHS = [5, 11]


def _block_grads(mode: str | None, dtype: torch.dtype, device: str, table: Ops | None = None) -> tuple[list[torch.Tensor], _Ops]:
    """Gradients of one decoder block on two packed sequences (computing with `table`, default the
    standard one), and the ops its backward ran (recomputation included)."""
    cfg, lengths = CFG, LENGTHS
    torch.manual_seed(0)
    block = DecoderLayer(cfg, 0).to(device=device, dtype=dtype)
    if table is not None:
        set_ops(block, table)
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


def _mixing_stand_in(q, k, v, cu_seqlens, max_seqlen, table=None):
    """A stand-in for attention with no data-dependent op (the CPU path loops over cu_seqlens),
    so that a compiled block has no graph break of its own."""
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return q * k + v


def _matmul_counts(ops: _Ops, cfg: ArchConfig, n: int) -> tuple[int, int]:
    """Matmuls run in a backward with a (tokens, intermediate) and a (tokens, q+k+v) output."""
    matmuls = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.colocate.invariant_linear.default}
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    return ops.count(matmuls, (n, cfg.intermediate_size)), ops.count(matmuls, (n, qkv))


RECOMPUTED = {None: (1, 0), "ops": (1, 0), "mlp": (3, 0), "attention": (3, 1), "full": (3, 1)}
"""Per mode, the backward's matmul counts: a (tokens, intermediate) output is the down projection's
input gradient (always) or a recomputed gate/up projection; a (tokens, q+k+v) one only a
recomputed q/k/v projection."""


def test_modes_recompute_the_forward_matmuls_they_do_not_keep():
    seen = {}
    for mode in (None, *MODES):
        _, ops = _block_grads(mode, torch.float32, "cpu")
        seen[mode] = _matmul_counts(ops, CFG, sum(LENGTHS))
    assert seen == RECOMPUTED, seen


def test_modes_keep_the_true_on_policy_mode_s_products_and_attention():
    """In the mode the projections and attention are the mode's custom ops: each block mode keeps
    and recomputes them as it does aten's products and the default attention."""
    from colocate.kernels import batch_invariant

    table = Ops.true_on_policy(torch.device("cpu"))
    try:
        seen = {
            mode: _matmul_counts(_block_grads(mode, torch.float32, "cpu", table)[1], CFG, sum(LENGTHS)) for mode in (None, *MODES)
        }
        _, ops = _block_grads("attention", torch.float32, "cpu", table)
        attention_recomputed = ops.count(_attention_ops())
    finally:
        batch_invariant.disable()
    assert seen == RECOMPUTED, seen
    assert attention_recomputed == 0


@pytest.mark.slow
def test_compiled_modes_recompute_what_they_should_without_graph_breaks(monkeypatch):
    """torch.compile with dynamic shapes, as parallelize compiles blocks, with one compile cache for
    every mode and two intermediate sizes: each compiled block recomputes exactly what its mode
    says (a graph shared between modes would not), with no graph break (a break makes the block
    run eagerly: slower, with the same gradients, which the gradient tests cannot see)."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("colocate.models.transformer.packed_causal_attention", _mixing_stand_in)
    torch._dynamo.reset()
    counters.clear()
    for cfg in (CFG, dataclasses.replace(CFG, intermediate_size=384)):
        rotary = Rotary(cfg.head_dim, cfg.rope_theta, None)
        seen = {}
        for mode in (None, *MODES):
            block = DecoderLayer(cfg, 0)
            forward = _checkpointed(block.forward, mode, cfg.intermediate_size) if mode else block.forward
            compiled = torch.compile(forward, backend="aot_eager", dynamic=True)
            for n in (13, 21):  # the second size runs the same graph
                cos, sin = rotary(torch.arange(n), torch.float32)
                x = torch.randn(n, cfg.hidden_size, requires_grad=True)
                out = compiled(x, cos, sin, torch.tensor([0, n], dtype=torch.int32), n)
                ops = _Ops()
                with ops:
                    out.sum().backward()
            seen[mode] = _matmul_counts(ops, cfg, n)
        assert seen == RECOMPUTED, (cfg.intermediate_size, seen)
    assert not counters["graph_break"], dict(counters["graph_break"])


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


def _lora_block_grads(
    mode: str | None, compiled: bool = False, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], int, list, list]:
    """Gradients of one decoder block with rank-4 adapters on every projection (B not zero), how
    many weight merges its backward ran (recomputation included), and the shapes of the tensors
    of at least one element per token that its forward saved for backward outside any
    recomputation's own store, less the parameters and the block's inputs: those of a weight's
    shape, and all of them. Compiled by aot_eager on the CPU, by inductor on a GPU."""
    from colocate.lora.identity import LoRASpec
    from colocate.trainer.lora import LoRALinear

    torch.manual_seed(0)
    block = DecoderLayer(CFG, 0).to(device=device, dtype=dtype)
    block.requires_grad_(False)
    spec = LoRASpec(4, 8.0, 0.0, ())
    for parent in (block.self_attn, block.mlp):
        for name, module in list(parent.named_children()):
            if isinstance(module, torch.nn.Linear):
                setattr(parent, name, LoRALinear(module, spec))
                torch.nn.init.normal_(getattr(parent, name).lora_B.weight, std=0.05)
    forward = _checkpointed(block.forward, mode, CFG.intermediate_size, 4) if mode else block.forward
    if compiled:
        forward = torch.compile(forward, backend="aot_eager" if device == "cpu" else "inductor", dynamic=True)
    weights = {tuple(m.weight.shape) for m in block.modules() if isinstance(m, LoRALinear)}
    n = sum(LENGTHS)
    x = torch.randn(n, CFG.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = Rotary(CFG.head_dim, CFG.rope_theta, None).to(device)(torch.arange(n, device=device), dtype)
    cu = torch.tensor([0, n], device=device, dtype=torch.int32)
    known = {t.untyped_storage().data_ptr() for t in (*block.parameters(), x, cos, sin, cu)}
    saved = []

    def pack(t):
        if t.numel() >= n and t.untyped_storage().data_ptr() not in known:  # not scalars
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward(x, cos, sin, cu, n)
    ops = _Ops()
    with ops:
        out.square().sum().backward()
    merges = sum(f == torch.ops.aten.mm.default and s in weights for f, s in ops.ops)
    kept = [shape for shape in saved if shape in weights]
    return [x.grad, *(p.grad for p in block.parameters() if p.requires_grad)], merges, kept, saved


MERGES = {
    (None, False): 0,
    (None, True): 0,
    **{(mode, False): 7 for mode in MODES},
    ("full", True): 6,
    ("attention", True): 6,
    ("ops", True): 0,
    ("mlp", True): 2,
}
"""Per mode, eager and compiled, the weight merges a LoRA block's backward runs: none of its own;
an eager recomputation runs all 7 (one per adapted projection), a compiled one only those whose
products it recomputes and needs (the down projection's output is not needed; "ops" keeps every
product, "mlp" recomputes gate and up)."""


@pytest.mark.slow
def test_lora_blocks_never_keep_a_merged_weight(monkeypatch):
    """A LoRA block multiplies merged weights: every mode gives the gradients of the plain block,
    no merged weight (each as large as its weight) is kept for backward, a "full" block keeps
    nothing but its input, compiled or not, the modes that keep matmul outputs recompute the merges
    that they need rather than keep them, and a compiled block has no graph break."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr("colocate.models.transformer.packed_causal_attention", _mixing_stand_in)
    expected, _, _, _ = _lora_block_grads(None)
    torch._dynamo.reset()
    counters.clear()
    seen = {}
    for mode in (None, *MODES):
        for compiled in (False, True):
            grads, seen[mode, compiled], kept, saved = _lora_block_grads(mode, compiled)
            assert not kept, (mode, compiled, kept)
            if mode == "full":  # only the block's input: torch 2.11 kept the adapted products
                assert not saved, (compiled, saved)
            for g, e in zip(grads, expected, strict=True):
                torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, msg=mode)
    assert seen == MERGES, seen
    assert not counters["graph_break"], dict(counters["graph_break"])


@pytest.mark.gpu
def test_gpu_lora_blocks_never_keep_a_merged_weight():
    """The same on a GPU, in bf16, where each merge is the Triton kernel (inside inductor's graph
    when compiled): no merged weight is kept for backward, and a "full" block keeps nothing but its
    input."""
    for mode in ("full", "ops", "mlp"):
        for compiled in (False, True):
            _, _, kept, saved = _lora_block_grads(mode, compiled, "cuda", torch.bfloat16)
            assert not kept, (mode, compiled, kept)
            if mode == "full":
                assert not saved, (compiled, saved)
