"""Building blocks shared by the model families: linear projections, RMSNorm (with the residual
add before it), rotary embedding, SiLU and its product, packed attention.

Each module that computes one of them calls the table of operations it was handed
(colocate/kernels/ops.py, its `ops` attribute; `Ops.standard()` unless `set_ops` gave another): in the
true on-policy mode the projections, RMSNorm, SiLU and attention are the mode's custom ops
(colocate/kernels/invariant_ops.py), compiled or not."""

from __future__ import annotations

import math

import torch
from torch import nn

from colocate.kernels.fp8 import fp8_linear
from colocate.kernels.ops import Ops

STANDARD = Ops.standard()


def set_ops(module: nn.Module, ops: Ops) -> None:
    """Hand `ops` to `module` and every submodule that computes with a table (those with an `ops`
    attribute: these layers, the models, LoRA's projections). One object for all, so a compiled
    layer shared by every layer guards on one table."""
    for m in module.modules():
        if isinstance(getattr(m, "ops", None), Ops):
            m.ops = ops


class Linear(nn.Linear):
    """nn.Linear through the table's `linear`; with a `weight_scale` (an FP8 engine's projection,
    `CausalLM.quantize_projections`), the weight is e4m3 and the product an FP8 GEMM."""

    ops: Ops = STANDARD

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.weight_scale: nn.Parameter | None = None
        """Per-output-row fp32 scales of an e4m3 weight (kernels/fp8.py), else None."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, self.bias)
        return self.ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    ops: Ops = STANDARD

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual stream and its normalised form, one op in the mode."""
        return self.ops.add_rms_norm(x, delta, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Rotary inverse frequencies (head_dim/2,), with llama3 frequency-dependent scaling if given."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not scaling:
        return inv
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos/sin tables computed on the fly from positions (no cache to invalidate or offload)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.float()[..., None] * self.inv_freq.float()  # (..., D/2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (..., D)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    ops: Ops = STANDARD,
) -> torch.Tensor:
    """Causal attention within each packed sequence. q (N, Hq, D), k/v (N, Hk, D) -> (N, Hq, D).

    By default (kernels.flash) CUDA uses FlashAttention-4 where `flash.usable` (Hopper, Blackwell),
    else torch's varlen flash attention (GQA native; head_dim zero-padded to a multiple of 8);
    elsewhere one causal SDPA per sequence; with the batch-invariant table, the engine's
    fixed-block attention (one Triton kernel for all sequences on CUDA, the fixed-chunk one per
    sequence elsewhere).
    """
    return ops.packed_attention(q, k, v, cu_seqlens, max_seqlen, q.shape[-1] ** -0.5)
