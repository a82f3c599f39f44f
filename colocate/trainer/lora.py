"""LoRA's trained modules: low-rank adapters on a frozen base model (`model.lora_rank` > 0).

`add_adapters` turns the chosen linear projections of every transformer block into `LoRALinear`s
before the model is sharded: the base keeps its HF-named `weight` (and `bias`) parameters, frozen,
in the compute dtype; each adapted module gains `lora_A.weight` (rank, in) and `lora_B.weight`
(out, rank), fp32, the only trained parameters. Their names are peft's, less peft's adapter name.
The adapters live in their block's FSDP unit, so a block's all-gather brings its adapters along.
What is adapted (`LoRASpec`), which base the adapters belong to, the merge and peft's format live
in colocate/lora/.

Forward: y = x M^T + b with M = W + (alpha / rank) B A, the merged weight, built for each call by
`merged_weight` (colocate/lora/merge.py, the function that makes the engine's copy, so the trainer
multiplies the weights the engine samples with; in the true on-policy mode the products are then the
engine's bit for bit).
Backward: dx = dy W + (alpha / rank) (dy B) A, and A's and B's gradients from their low-rank
products; never the (out, in) weight gradient, and M is neither kept nor merged again. Merging
costs the weight's size in memory traffic per call, where the low-rank path beside the base GEMM
(x W^T + (x A^T) B^T) costs the activations' size (tokens x (in + out)) in every forward. With
dropout (`model.lora_dropout` > 0) the training forward takes that low-rank path, since the
adapter sees dropout(x) where the base sees x. The joint q/k/v GEMM of the attention takes part
through the `joint_forward` hook of colocate.models.transformer.joint_linear. A LoRALinear computes
with the table of operations of the projection it replaces (colocate/kernels/ops.py; `set_ops` on
the model reaches it too).
A starts as peft initialises it (Kaiming-uniform) and B at zero, so step 0 is exactly the base
model. `adapters_disabled` switches every adapter off: the base, which is the reference policy of
the KL terms, with no second copy of the model.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from colocate.kernels.ops import Ops
from colocate.lora.identity import LoRASpec
from colocate.lora.merge import merged_weight
from colocate.models.layers import STANDARD
from colocate.trainer.parallelize import copy_full_


class LoRALinear(nn.Linear):
    """A frozen nn.Linear (the same `weight`/`bias` parameters: HF names unchanged) plus a trained
    low-rank update: y = x W^T + b + scale * (dropout(x) A^T) B^T."""

    ops: Ops = STANDARD

    def __init__(self, base: nn.Linear, spec: LoRASpec):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        self.scale, self.dropout = spec.scale, spec.dropout
        self.ops = getattr(base, "ops", STANDARD)
        self.enabled = True
        """False: the module is its base (see adapters_disabled)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.joint_forward(x, (self,))

    def joint_forward(self, x: torch.Tensor, parts: tuple[nn.Linear, ...]) -> torch.Tensor:
        """`x` through `parts` (this module among them, the others LoRALinear or plain projections of
        the same input) as one GEMM, their outputs side by side; each enabled adapter's weight
        merged. With dropout the training forward adds the low-rank terms beside the base GEMM."""
        bias = torch.cat([m.bias for m in parts]) if parts[0].bias is not None else None
        live = tuple(isinstance(m, LoRALinear) and m.enabled for m in parts)
        if not any(live):
            return self.ops.linear(x, _joined([m.weight for m in parts]), bias)
        if self.dropout and self.training and torch.is_grad_enabled() and not self.ops.invariant:
            out = self.ops.linear(x, _joined([m.weight for m in parts]), bias)
            terms = [
                m.low_rank(F.dropout(x, m.dropout)) if on else x.new_zeros(*x.shape[:-1], m.out_features)
                for m, on in zip(parts, live)
            ]
            return out + torch.cat(terms, dim=-1)
        tensors = [t for m, on in zip(parts, live) for t in ((m.weight, m.lora_A.weight, m.lora_B.weight) if on else (m.weight,))]
        return _MergedLinear.apply(x, bias, self.scale, live, self.ops, *tensors)

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """scale * (x A^T) B^T, the adapter's term beside the base GEMM (..., out)."""
        return F.linear(F.linear(x, self.lora_A.weight) * self.scale, self.lora_B.weight)


def _joined(weights: list[torch.Tensor]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def _merged(live: tuple[bool, ...], tensors: tuple[torch.Tensor, ...], scale: float, ops: Ops) -> torch.Tensor:
    """The joined weight that `_MergedLinear` multiplies: per part W, or W + scale * B A when `live`;
    `tensors` holds W, or W, A and B, per part."""
    weights, i = [], 0
    for on in live:
        w = tensors[i]
        weights.append(merged_weight(w, tensors[i + 1], tensors[i + 2], scale, w.dtype, ops) if on else w)
        i += 3 if on else 1
    return _joined(weights)


class _MergedLinear(torch.autograd.Function):
    """y = x M^T + bias (`_merged`), and the gradients of x and of the adapters, the base being
    frozen. The backward never needs M (as large as the weight, so neither kept nor merged again):
    dx = dy W + scale (dy B) A per part, the low-rank terms added into one GEMM's output. The live
    parts' A are stacked (R = rank x live parts rows), so x is read once for their low-rank input
    x A^T and once for their A gradients, not once per part."""

    @staticmethod
    def forward(ctx, x, bias, scale, live, ops, *tensors):
        ctx.scale, ctx.live = scale, live
        ctx.save_for_backward(x, *tensors)
        return ops.linear(x, _merged(live, tensors, scale, ops), bias)

    @staticmethod
    def backward(ctx, grad):
        x, *tensors = ctx.saved_tensors
        flat_x, flat_grad = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        weights, parts, i, start = [], [], 0, 0
        for on in ctx.live:
            weights.append(tensors[i])
            if on:  # this part's output-gradient columns, its A and its B
                parts.append((slice(start, start + tensors[i].shape[0]), tensors[i + 1], tensors[i + 2]))
            start += tensors[i].shape[0]
            i += 3 if on else 1
        downs = torch.cat([a.to(x.dtype) for _, a, _ in parts])  # (R, in)
        low = flat_x @ downs.T  # (tokens, R)
        grad_low = torch.cat([flat_grad[:, cols] @ b.to(x.dtype) for cols, _, b in parts], dim=1) * ctx.scale
        rank = parts[0][1].shape[0]
        grad_downs = (grad_low.T @ flat_x).split(rank)  # each part's A gradient (rank, in)
        lows = low.split(rank, dim=1)
        adapter_grads = iter(
            [
                (grad_a.to(a.dtype), ((flat_grad[:, cols].T @ part_low) * ctx.scale).to(b.dtype))
                for (cols, a, b), grad_a, part_low in zip(parts, grad_downs, lows)
            ]
        )
        grads = []  # None for each frozen base weight, then the part's A and B gradients when live
        for on in ctx.live:
            grads += [None, *next(adapter_grads)] if on else [None]
        if not ctx.needs_input_grad[0]:  # the first block's input under a frozen embedding
            return None, None, None, None, None, *grads
        grad_x = torch.addmm(flat_grad @ _joined(weights), grad_low, downs)
        return grad_x.view(x.shape), None, None, None, None, *grads


def add_adapters(model: nn.Module, spec: LoRASpec) -> None:
    """In place, before sharding: freeze every parameter, then replace the `spec.target_modules`
    projections of every transformer block by LoRALinear (adapters in fp32, on the model's device:
    meta before materialising)."""
    model.requires_grad_(False)
    count = 0
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name in spec.target_modules:
                module = getattr(parent, name, None)
                if isinstance(module, nn.Linear):
                    setattr(parent, name, LoRALinear(module, spec))
                    count += 1
    assert count == len(model.model.layers) * len(spec.target_modules), (count, spec.target_modules)


def adapted_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(module name, module) of every LoRALinear, in model order."""
    return ((n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear))


@torch.no_grad()
def init_adapters_(model: nn.Module, seed: int) -> None:
    """A as peft initialises it (Kaiming-uniform, a = sqrt(5): U(-1/sqrt(in), 1/sqrt(in))), B zero.
    Each A is drawn whole from one generator in model order and each rank keeps its rows, so
    the values do not depend on the world size."""
    gen = torch.Generator().manual_seed(seed)
    for _, module in adapted_modules(model):
        a = torch.empty(module.lora_A.weight.shape)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)
        copy_full_(module.lora_A.weight, a)
        copy_full_(module.lora_B.weight, torch.zeros(module.lora_B.weight.shape))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Run `model` as its base: every adapter off inside the context."""
    modules = [m for _, m in adapted_modules(model)]
    for m in modules:
        m.enabled = False
    try:
        yield
    finally:
        for m in modules:
            m.enabled = True
