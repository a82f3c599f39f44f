"""The merged weight W + (alpha / rank) B A of an adapted projection.

The rollout engine holds merged weights: `merged_weight` computes them in fp32 from A and B in the
base's dtype (what the trainer's forward multiplies) and rounds once to the engine's dtype. The
trainer's forward (colocate/trainer/lora.py), the weight sync (colocate/colocation/weight_sync.py)
and colocate.export all use it, so the trainer multiplies the weights the engine samples with.
"""

from __future__ import annotations

import torch

from colocate.kernels.lora_merge import lora_merge
from colocate.kernels.ops import Ops


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float, dtype: torch.dtype, ops: Ops | None = None
) -> torch.Tensor:
    """W + scale * B A as a new tensor in `dtype`: A and B in W's dtype, product and sum in fp32,
    rounded once at the end. weight (out, in), lora_a (rank, in), lora_b (out, rank). On CUDA with
    a 16-bit W the product runs on tensor cores with fp32 sums (a product of two 16-bit values is
    exact in fp32), in one kernel that reads W once and writes the result once
    (colocate/kernels/lora_merge.py), not as an fp32 GEMM; the true on-policy mode's table (`ops`,
    colocate/kernels/ops.py; default `Ops.standard()`) keeps its own product."""
    ops = Ops.standard() if ops is None else ops
    if weight.is_cuda and weight.element_size() == 2 and not ops.invariant:
        return lora_merge(weight, lora_a, lora_b, scale, dtype)
    a, b = lora_a.to(weight.dtype), lora_b.to(weight.dtype)
    merged = ops.linear(b.float(), a.float().T)  # b @ a (out, in) fp32, by the mode's product in the mode
    merged.mul_(scale).add_(weight)
    return merged.to(dtype)
