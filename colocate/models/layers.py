"""Building blocks shared by the model families: linear projections, RMSNorm (with the residual
add before it), rotary embedding, SiLU and its product, packed attention. In the true on-policy mode
the projections, RMSNorm, SiLU and attention go through the mode's custom ops
(colocate/kernels/invariant_ops.py), compiled or not."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from colocate.kernels import batch_invariant, flash, invariant_ops


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the mode's op in the true on-policy mode."""
    if batch_invariant.enabled():
        return invariant_ops.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up, or the mode's one op in the true on-policy mode."""
    return invariant_ops.silu_mul(gate, up) if batch_invariant.enabled() else F.silu(gate) * up


class Linear(nn.Linear):
    """nn.Linear through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if batch_invariant.enabled():  # torch's CUDA mean picks its reduction order by shape
            return invariant_ops.rms_norm(x, self.weight, self.eps)
        return invariant_ops.reference_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, self(x + delta)): a residual stream and its normalised form, one op in the mode."""
        if batch_invariant.enabled():
            return invariant_ops.add_rms_norm(x, delta, self.weight, self.eps)
        total = x + delta
        return total, self(total)


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
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """Causal attention within each packed sequence. q (N, Hq, D), k/v (N, Hk, D) -> (N, Hq, D).

    CUDA uses FlashAttention-4 where `flash.usable` (Hopper, Blackwell), else torch's varlen flash
    attention (GQA native; head_dim zero-padded to a multiple of 8); elsewhere one causal SDPA per
    sequence; in batch-invariant mode, the engine's fixed-block attention (one Triton kernel for
    all sequences on CUDA, the fixed-chunk one per sequence elsewhere).
    """
    scale = q.shape[-1] ** -0.5
    if batch_invariant.enabled():
        return invariant_ops.attention(q, k, v, cu_seqlens, max_seqlen, scale)
    return flash.fast_packed_attention(q, k, v, cu_seqlens, max_seqlen, scale)
