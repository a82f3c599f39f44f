"""One plain-torch decoder definition for Llama, Qwen2 and Qwen3, with HF parameter names.

The model never knows about parallelism or paging. `forward` works on flat packed tokens; callers
that own a KV cache (the rollout engine) pass an `attn(module, q, k, v)` callable that stores
k/v and attends over the cache (the calling `Attention` module tells it the layer by its
`layer_idx`), and the model stays the same.

q/k/v run as one GEMM whose output is split, since one wide GEMM beats a wide one and two narrow
GQA ones, in training too, where their weights are joined for each call (a copy of a few MB;
autograd splits the gradient back). An inference owner may call `CausalLM.pack_projections()`:
q/k/v and gate/up then live in one packed tensor each (their parameters become views of it, so
names and loading are unchanged), no copy is made, and gate/up run as one GEMM too, which at decode
batch sizes costs little more than one of the parts. Training keeps gate and up apart: their GEMMs
are already wide, and a joint one slows the compiled SiLU backward (measured by bench/kernel_bench.py;
figures in docs/benchmarks/2026-12-kernels.md).

The operations the true on-policy mode swaps come from a table (colocate/kernels/ops.py) that the
model is given at construction (`CausalLM(cfg, ops)`) or later (`set_ops`), which every layer reads;
by default `Ops.standard()`.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from colocate.kernels.fp8 import fp8_linear, quantize_rowwise
from colocate.kernels.ops import Ops
from colocate.kernels.rotary import rotate
from colocate.models.config import ArchConfig
from colocate.models.layers import STANDARD, Linear, RMSNorm, Rotary, packed_causal_attention, set_ops

AttnFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Attention(nn.Module):
    ops: Ops = STANDARD

    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.qkv_sizes = [self.num_heads * self.head_dim] + [self.num_kv_heads * self.head_dim] * 2
        self.qkv_weight: torch.Tensor | None = None  # packed q/k/v (see pack_projections)
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_scale: torch.Tensor | None = None  # packed FP8 row scales (see quantize_projections)

    def pack(self, keep_values: bool) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        self.qkv_weight = pack_parameters([m.weight for m in parts], keep_values)
        if parts[0].bias is not None:
            self.qkv_bias = pack_parameters([m.bias for m in parts], keep_values)
        if parts[0].weight_scale is not None:
            self.qkv_scale = pack_parameters([m.weight_scale for m in parts], keep_values)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, attn: AttnFn | None):
        n = x.shape[0]
        parts = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = joint_linear(x, parts, self.qkv_weight, self.qkv_bias, self.ops, self.qkv_scale).split(self.qkv_sizes, dim=-1)
        q = q.view(n, self.num_heads, self.head_dim)  # (N, Hq, D)
        k = k.view(n, self.num_kv_heads, self.head_dim)  # (N, Hk, D)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if attn is None:  # packed training and scoring tokens: the rotary op, then varlen attention
            q, k = rotate(q, k, cos, sin)
            out = packed_causal_attention(q, k, v, cu_seqlens, max_seqlen, self.ops)
        else:  # the engine: plain ops, which its compiled decode step fuses with the cos/sin math
            q, k = self.ops.engine_rotate(q, k, cos, sin)  # in the mode, the trainer's rotary op
            # The module, not its index: a compile of one layer shared by all then never reads a
            # number that differs between layers (which some torch versions guard on).
            out = attn(self, q, k, v)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    ops: Ops = STANDARD

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gate_up_weight: torch.Tensor | None = None  # packed gate/up (see pack_projections)
        self.gate_up_scale: torch.Tensor | None = None  # packed FP8 row scales (see quantize_projections)

    def pack(self, keep_values: bool) -> None:
        parts = [self.gate_proj, self.up_proj]
        self.gate_up_weight = pack_parameters([m.weight for m in parts], keep_values)
        if parts[0].weight_scale is not None:
            self.gate_up_scale = pack_parameters([m.weight_scale for m in parts], keep_values)

    def forward(self, x):
        if self.gate_up_weight is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            parts = (self.gate_proj, self.up_proj)
            gate, up = joint_linear(x, parts, self.gate_up_weight, None, self.ops, self.gate_up_scale).chunk(2, dim=-1)
        return self.down_proj(self.ops.silu_mul(gate, up))


def joint_linear(
    x: torch.Tensor,
    parts: tuple[nn.Linear, ...],
    weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    ops: Ops = STANDARD,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """All `parts` applied to `x` as one GEMM (`ops.linear`), their outputs side by side.
    `weight`/`bias`/`scale` are the packed tensors when the parts were packed; otherwise the parts'
    weights are joined here, or, when a part has a `joint_forward(x, parts)` method (a trainer's LoRA
    projection, which computes with its own table), that part computes the joint product. With FP8
    weights (`scale`, or the parts' `weight_scale`) the GEMM is kernels.fp8.fp8_linear."""
    if weight is None:
        owner = next((m for m in parts if hasattr(m, "joint_forward")), None)
        if owner is not None:
            return owner.joint_forward(x, parts)
        weight = torch.cat([m.weight for m in parts])
        bias = torch.cat([m.bias for m in parts]) if parts[0].bias is not None else None
        if parts[0].weight_scale is not None:
            scale = torch.cat([m.weight_scale for m in parts])
    if scale is not None:
        return fp8_linear(x, weight, scale, bias)
    return ops.linear(x, weight, bias)


def pack_parameters(params: list[nn.Parameter], keep_values: bool) -> torch.Tensor:
    """One new tensor holding `params` stacked along dim 0; each parameter becomes a view of its
    slice (the same Parameter object, so copies into it land in the packed tensor)."""
    first = params[0]
    packed = torch.empty((sum(p.shape[0] for p in params), *first.shape[1:]), dtype=first.dtype, device=first.device)
    offset = 0
    for p in params:
        view = packed[offset : offset + p.shape[0]]
        if keep_values:
            view.copy_(p.detach())
        p.data = view
        offset += p.shape[0]
    return packed


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer_idx)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cu_seqlens, max_seqlen, attn=None):
        attended = self.self_attn(self.input_layernorm(x), cos, sin, cu_seqlens, max_seqlen, attn)
        x, normed = self.post_attention_layernorm.add_forward(x, attended)
        return x + self.mlp(normed)


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, cfg: ArchConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)


def packing_from_lengths(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cu_seqlens (S+1,) int32 and per-token positions (N,) for sequences of these lengths."""
    lengths = lengths.long()
    cu = F.pad(lengths.cumsum(0), (1, 0))
    starts = torch.repeat_interleave(cu[:-1], lengths)
    positions = torch.arange(int(cu[-1]), device=lengths.device) - starts
    return cu.to(torch.int32), positions


class CausalLM(nn.Module):
    ops: Ops = STANDARD
    """The table of operations every layer computes with (colocate/kernels/ops.py)."""

    def __init__(self, cfg: ArchConfig, ops: Ops | None = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        if ops is not None:
            self.set_ops(ops)

    def set_ops(self, ops: Ops) -> None:
        """Compute with `ops` from now on: this model, every layer, and the adapters added to it."""
        set_ops(self, ops)

    def pack_projections(self, keep_values: bool = True) -> None:
        """Pack q/k/v and gate/up of every layer (inference only: a training step would still see
        separate parameters but views of shared storage). keep_values=False packs uninitialised
        storage, for an owner that reallocated its parameters and writes them next."""
        for layer in self.model.layers:
            layer.self_attn.pack(keep_values)
            layer.mlp.pack(keep_values)

    def unpack_projections(self) -> None:
        """Forget the packed tensors (their parameters must have been given new storage first)."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_weight = attn.qkv_bias = attn.qkv_scale = mlp.gate_up_weight = mlp.gate_up_scale = None

    def quantize_projections(self) -> None:
        """Turn every decoder layer's projection weight (q/k/v/o, gate/up/down) into e4m3 with a
        per-row fp32 scale, its `weight_scale` parameter (kernels/fp8.py): an inference owner's FP8
        weights, half the bytes of bf16. Embeddings, norms and the lm_head stay as they are. Call
        before `pack_projections` (packed tensors are built from the quantized parts); a module at a
        time, so at most one projection's extra copy is alive."""
        if any(layer.self_attn.qkv_weight is not None for layer in self.model.layers):
            raise RuntimeError("quantize_projections must run before pack_projections")
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                w8, scale = quantize_rowwise(m.weight.detach())
                m.weight = nn.Parameter(w8, requires_grad=False)
                m.weight_scale = nn.Parameter(scale, requires_grad=False)

    def tie_weights(self):
        """Share lm_head with the embeddings when the config says so (again after to_empty/moves)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        attn: AttnFn | None = None,
    ) -> torch.Tensor:
        """Final-norm hidden states. input_ids (B, T) -> (B, T, H); flat (N,) -> (N, H).

        Flat input is packed: `cu_seqlens` (S+1,) marks sequence starts (one sequence if omitted),
        positions default to 0.. within each sequence. With `attn` given, positions are required and
        attention is the caller's (cu_seqlens unused).
        """
        batched = input_ids.dim() == 2
        if batched:
            b, t = input_ids.shape
            cu_seqlens = torch.arange(0, (b + 1) * t, t, device=input_ids.device, dtype=torch.int32)
            max_seqlen = t
            input_ids = input_ids.reshape(-1)
            if positions is None:
                positions = torch.arange(t, device=input_ids.device).repeat(b)
            else:
                positions = positions.reshape(-1)
        elif attn is None:
            if cu_seqlens is None:
                cu_seqlens = torch.tensor([0, input_ids.numel()], device=input_ids.device, dtype=torch.int32)
            if positions is None:
                _, positions = packing_from_lengths(cu_seqlens.diff())
            if max_seqlen is None:
                max_seqlen = int(cu_seqlens.diff().max())
        elif positions is None:
            raise ValueError("positions are required when a custom attention is given")
        x = self.model.embed_tokens(input_ids)  # (N, H)
        cos, sin = self.model.rotary(positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin, cu_seqlens, max_seqlen, attn)
        x = self.model.norm(x)
        return x.view(b, t, -1) if batched else x

    def forward(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        """Logits: (B, T) -> (B, T, V); flat packed (N,) -> (N, V). kwargs as `hidden_states`."""
        return self.lm_head(self.hidden_states(input_ids, **kwargs))
