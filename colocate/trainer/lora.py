"""LoRA: trained low-rank adapters on a frozen base model (`model.lora_rank` > 0).

`add_adapters` turns the chosen linear projections of every transformer block into `LoRALinear`s
before the model is sharded: the base keeps its HF-named `weight` (and `bias`) parameters, frozen,
in the compute dtype; each adapted module gains `lora_A.weight` (rank, in) and `lora_B.weight`
(out, rank), fp32, the only trained parameters. Their names are peft's, less peft's adapter name.
The adapters live in their block's FSDP unit, so a block's all-gather brings its adapters along.

Forward: y = x M^T + b with M = W + (alpha / rank) B A, the merged weight, built for each call by
`merged_weight` (the function that makes the engine's copy, so the trainer multiplies the weights
the engine samples with; in the true on-policy mode the products are then the engine's bit for bit).
Backward: dx = dy W + (alpha / rank) (dy B) A, and A's and B's gradients from their low-rank
products; never the (out, in) weight gradient, and M is neither kept nor merged again. Merging
costs the weight's size in memory traffic per call, where the low-rank path beside the base GEMM
(x W^T + (x A^T) B^T) costs the activations' size (tokens x (in + out)) in every forward. With
dropout (`model.lora_dropout` > 0) the training forward takes that low-rank path, since the
adapter sees dropout(x) where the base sees x. The joint q/k/v GEMM of the attention takes part
through the `joint_forward` hook of colocate.models.transformer.joint_linear.
A starts as peft initialises it (Kaiming-uniform) and B at zero, so step 0 is exactly the base
model. `adapters_disabled` switches every adapter off: the base, which is the reference policy of
the KL terms, with no second copy of the model.

The rollout engine holds merged weights: `merged_weight` is W + (alpha / rank) B A, computed in
fp32 from A and B in the base's dtype (what the forward multiplies) and rounded once to the
engine's dtype; the weight sync (colocate/colocation/weight_sync.py) and `colocate.export` both
use it.

Adapters fit only the base they were trained on. `describe` names it by its path, the SHA-256 of
its config.json and `weights_fingerprint`, a hash of each safetensors file's name, size, header
and a few fixed byte ranges of its tensor data, cheap for any model size; resuming
(`check_same_adapters`) and colocate.export compare them.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from colocate.kernels import batch_invariant
from colocate.kernels.lora_merge import lora_merge
from colocate.models.layers import linear
from colocate.models.loading import safetensors_files
from colocate.trainer.parallelize import copy_full_

ADAPTER_PARTS = ("lora_A", "lora_B")
NUM_SAMPLES = 8
"""Byte ranges of each safetensors file's tensor data that `weights_fingerprint` reads."""
SAMPLE_BYTES = 4096
"""Length of each of them."""


@dataclass(frozen=True)
class LoRASpec:
    """What `add_adapters` builds: `model.lora_*` of the config."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, model_cfg) -> "LoRASpec | None":
        """The spec of a colocate.config.ModelConfig, or None when LoRA is off (rank 0)."""
        if not model_cfg.lora_rank:
            return None
        return cls(model_cfg.lora_rank, float(model_cfg.lora_alpha), float(model_cfg.lora_dropout),
                   tuple(model_cfg.lora_target_modules))

    def describe(self, base_path: str | Path) -> dict:
        """JSON-able identity of the adapters and of the base they belong to (saved in checkpoints)."""
        return {**asdict(self), "target_modules": list(self.target_modules), "base_path": str(base_path),
                "base_config_sha256": config_sha256(base_path),
                "base_weights_fingerprint": weights_fingerprint(base_path)}


def config_sha256(model_dir: str | Path) -> str:
    """SHA-256 of a model directory's config.json: which base a checkpoint's adapters belong to."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def sampled_ranges(data_start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of a safetensors file's tensor data (from `data_start` to
    `size`) that `weights_fingerprint` reads: all of it when short, else NUM_SAMPLES ranges of
    SAMPLE_BYTES spread evenly from its first byte to its last."""
    span = size - data_start
    if span <= NUM_SAMPLES * SAMPLE_BYTES:
        return [(data_start, max(span, 0))]
    step = (span - SAMPLE_BYTES) // (NUM_SAMPLES - 1)
    return [(data_start + i * step, SAMPLE_BYTES) for i in range(NUM_SAMPLES)]


def weights_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 over each safetensors file of a model directory (as loading finds them): its name,
    size, JSON header (every tensor's name, dtype, shape and place) and `sampled_ranges` of its
    data. A copy of the same files elsewhere gives the same fingerprint; other weights of the same
    shapes almost surely do not (an edit between the sampled ranges is not seen). It reads each
    file's header and NUM_SAMPLES * SAMPLE_BYTES (32 KiB) of its data, however large the file."""
    digest = hashlib.sha256()
    for file in safetensors_files(model_dir):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            digest.update(f"{file.name}\0{size}\0".encode())
            digest.update(f.read(min(header_size, size)))
            for offset, length in sampled_ranges(8 + header_size, size):
                f.seek(offset)
                digest.update(f.read(length))
    return digest.hexdigest()


class LoRALinear(nn.Linear):
    """A frozen nn.Linear (the same `weight`/`bias` parameters: HF names unchanged) plus a trained
    low-rank update: y = x W^T + b + scale * (dropout(x) A^T) B^T."""

    def __init__(self, base: nn.Linear, spec: LoRASpec):
        super().__init__(base.in_features, base.out_features, bias=False, device="meta")
        self.weight, self.bias = base.weight, base.bias
        device = base.weight.device
        self.lora_A = nn.Linear(base.in_features, spec.rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(spec.rank, base.out_features, bias=False, device=device, dtype=torch.float32)
        self.scale, self.dropout = spec.scale, spec.dropout
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
            return linear(x, _joined([m.weight for m in parts]), bias)
        if self.dropout and self.training and torch.is_grad_enabled() and not batch_invariant.enabled():
            out = linear(x, _joined([m.weight for m in parts]), bias)
            terms = [m.low_rank(F.dropout(x, m.dropout)) if on else x.new_zeros(*x.shape[:-1], m.out_features)
                     for m, on in zip(parts, live)]
            return out + torch.cat(terms, dim=-1)
        tensors = [t for m, on in zip(parts, live)
                   for t in ((m.weight, m.lora_A.weight, m.lora_B.weight) if on else (m.weight,))]
        return _MergedLinear.apply(x, bias, self.scale, live, *tensors)

    def low_rank(self, x: torch.Tensor) -> torch.Tensor:
        """scale * (x A^T) B^T, the adapter's term beside the base GEMM (..., out)."""
        return F.linear(F.linear(x, self.lora_A.weight) * self.scale, self.lora_B.weight)


def _joined(weights: list[torch.Tensor]) -> torch.Tensor:
    return weights[0] if len(weights) == 1 else torch.cat(weights)


def _merged(live: tuple[bool, ...], tensors: tuple[torch.Tensor, ...], scale: float) -> torch.Tensor:
    """The joined weight that `_MergedLinear` multiplies: per part W, or W + scale * B A when `live`;
    `tensors` holds W, or W, A and B, per part."""
    weights, i = [], 0
    for on in live:
        w = tensors[i]
        weights.append(merged_weight(w, tensors[i + 1], tensors[i + 2], scale, w.dtype) if on else w)
        i += 3 if on else 1
    return _joined(weights)


class _MergedLinear(torch.autograd.Function):
    """y = x M^T + bias (`_merged`), and the gradients of x and of the adapters, the base being
    frozen. The backward never needs M (as large as the weight, so neither kept nor merged again):
    dx = dy W + scale (dy B) A per part, the low-rank terms added into one GEMM's output. The live
    parts' A are stacked (R = rank x live parts rows), so x is read once for their low-rank input
    x A^T and once for their A gradients, not once per part."""

    @staticmethod
    def forward(ctx, x, bias, scale, live, *tensors):
        ctx.scale, ctx.live = scale, live
        ctx.save_for_backward(x, *tensors)
        return linear(x, _merged(live, tensors, scale), bias)

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
        adapter_grads = iter([(grad_a.to(a.dtype), ((flat_grad[:, cols].T @ part_low) * ctx.scale).to(b.dtype))
                              for (cols, a, b), grad_a, part_low in zip(parts, grad_downs, lows)])
        grads = []  # None for each frozen base weight, then the part's A and B gradients when live
        for on in ctx.live:
            grads += [None, *next(adapter_grads)] if on else [None]
        if not ctx.needs_input_grad[0]:  # the first block's input under a frozen embedding
            return None, None, None, None, *grads
        grad_x = torch.addmm(flat_grad @ _joined(weights), grad_low, downs)
        return grad_x.view(x.shape), None, None, None, *grads


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


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to an adapter (`...proj.lora_A.weight`)."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


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


def merged_weight(weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """W + scale * B A as a new tensor in `dtype`: A and B in W's dtype, product and sum in fp32,
    rounded once at the end. weight (out, in), lora_a (rank, in), lora_b (out, rank). On CUDA with
    a 16-bit W the product runs on tensor cores with fp32 sums (a product of two 16-bit values is
    exact in fp32), in one kernel that reads W once and writes the result once
    (colocate/kernels/lora_merge.py), not as an fp32 GEMM; the true on-policy mode keeps its own
    product."""
    if weight.is_cuda and weight.element_size() == 2 and not batch_invariant.enabled():
        return lora_merge(weight, lora_a, lora_b, scale, dtype)
    a, b = lora_a.to(weight.dtype), lora_b.to(weight.dtype)
    merged = linear(b.float(), a.float().T)  # b @ a (out, in) fp32, by the mode's product in the mode
    merged.mul_(scale).add_(weight)
    return merged.to(dtype)


def same_base_weights(saved: dict, fingerprint: str) -> bool:
    """Whether saved adapters' base had the weights of `fingerprint` (weights_fingerprint). Adapters
    saved without a fingerprint pass, with a warning that their base was checked by config.json only."""
    if "base_weights_fingerprint" not in saved:
        warnings.warn(f"the LoRA adapters of the base {saved['base_path']} were saved without a fingerprint of "
                      "its weights: that base is checked by its config.json only", stacklevel=3)
        return True
    return saved["base_weights_fingerprint"] == fingerprint


def check_same_adapters(saved: dict, current: dict) -> None:
    """ValueError naming both bases when saved adapters belong to another base model (its
    config.json or its weights differ), or naming the setting when rank, alpha or target modules
    differ."""
    if saved["base_config_sha256"] != current["base_config_sha256"]:
        raise ValueError(f"the checkpoint's LoRA adapters were trained on the base {saved['base_path']} "
                         f"(config.json SHA-256 {saved['base_config_sha256'][:12]}), not on this run's base "
                         f"{current['base_path']} (config.json SHA-256 {current['base_config_sha256'][:12]})")
    if not same_base_weights(saved, current["base_weights_fingerprint"]):
        raise ValueError(f"the checkpoint's LoRA adapters were trained on the base {saved['base_path']} "
                         f"(weights fingerprint {saved['base_weights_fingerprint'][:12]}), not on this run's "
                         f"base {current['base_path']} (weights fingerprint "
                         f"{current['base_weights_fingerprint'][:12]}): same config.json, other weights")
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != current[key]:
            raise ValueError(f"the checkpoint's LoRA adapters have {key} {saved[key]!r}, this run's "
                             f"model.lora_{key} is {current[key]!r}")
