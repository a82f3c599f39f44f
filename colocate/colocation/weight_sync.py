"""Trainer -> engine weight sync, one FSDP unit at a time.

Each FSDP2 unit (a transformer block, then the root's embeddings/norm/head) is all-gathered with
`unshard()` — under mixed precision that gathers straight into the engine's bf16 — handed to the
engine as HF-named full tensors in buckets of at most `bucket_bytes`, and resharded before the next
unit, so at most one unit's full tensors exist at a time and no second copy of the model stays alive.

A unit whose shards already are the full tensors (one rank) is not gathered: its fp32 master
tensors go to the engine as they are when the engine casts while it copies
(`casts_on_update`), so each weight is read once and written once, as in a plain device copy; such
units fill buckets together, so a bucket is one large multi-tensor copy rather than one per block.

LoRA (colocate/trainer/lora.py): the engine holds merged weights. An adapted module's weight goes
out as W + (alpha / rank) B A in the engine dtype (colocate/lora/merge.py, with the module's table of
operations: the trainer's forward multiplies the same bits), its adapters never. Frozen
parameters cannot change between pushes: when the engine still holds the previous push
(`since_last`), only what can have changed goes out (with LoRA: the adapted modules' merged
weights), a unit with nothing to send is not even gathered, and the engine's session is partial.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from colocate.kernels.ops import Ops
from colocate.lora.merge import merged_weight
from colocate.rollout.protocol import RolloutEngine
from colocate.trainer.lora import LoRALinear


@dataclass
class SyncStats:
    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float
    partial: bool = False
    """Only what can have changed since the previous push was sent."""

    def metrics(self) -> dict[str, float]:
        return {
            "perf/sync_gib": self.num_bytes / (1 << 30),
            "perf/sync_buckets": self.num_buckets,
            "perf/sync_tensors": self.num_tensors,
            "perf/sync_gb_per_s": self.num_bytes / max(self.seconds, 1e-9) / 1e9,
        }


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def fsdp_units(model: nn.Module) -> list[tuple[nn.Module, list[tuple[str, str]]]]:
    """[(unit, [(full name, name within unit)])] with every parameter in exactly one unit.

    Child units come first (blocks in order); the root unit — or the model itself when it is not
    sharded — owns what is left. Shared (tied) parameters appear once, under their first name.
    """
    units: dict[str, tuple[nn.Module, list]] = {}
    prefixes = [p for p, m in model.named_modules() if p and _is_fsdp(m)]
    for prefix in prefixes:
        units[prefix] = (model.get_submodule(prefix), [])
    root: list = []
    for name, _ in model.named_parameters():
        owner = max((p for p in prefixes if name.startswith(p + ".")), key=len, default=None)
        if owner is None:
            root.append((name, name))
        else:
            units[owner][1].append((name, name[len(owner) + 1 :]))
    return [u for u in units.values() if u[1]] + ([(model, root)] if root else [])


def _is_whole(param: torch.Tensor) -> bool:
    """A parameter whose rank-local data is the full tensor (one rank, or replicated)."""
    return not hasattr(param, "to_local") or tuple(param.to_local().shape) == tuple(param.shape)


@dataclass
class _Unit:
    module: nn.Module
    names: list[tuple[str, str]]  # (full name, name within the unit)
    params: list[nn.Parameter]  # the unit's own parameters, as registered between forwards (sharded)
    whole: bool  # every one of them holds the full tensor on this rank: nothing to gather
    merges: dict[str, tuple[str, str, float, Ops]]  # weight -> (its lora_A, its lora_B, scale, table), names within
    adapters: frozenset[str]  # names within the unit of adapter parameters (never sent)
    changing: frozenset[str]  # names within the unit of what a push since the last one sends

    def sends(self, local: str, since_last: bool) -> bool:
        return local not in self.adapters and (not since_last or local in self.changing)


def _merges(unit: nn.Module, own: set[str]) -> dict[str, tuple[str, str, float, Ops]]:
    """The unit's LoRA modules whose weight the unit owns, by weight name within the unit, with
    what merges it: the adapters' names, the scale and the module's table of operations."""
    out = {}
    for prefix, m in unit.named_modules():
        if isinstance(m, LoRALinear) and f"{prefix}.weight" in own:
            out[f"{prefix}.weight"] = (f"{prefix}.lora_A.weight", f"{prefix}.lora_B.weight", m.scale, m.ops)
    return out


_PLANS: "weakref.WeakKeyDictionary[nn.Module, list[_Unit]]" = weakref.WeakKeyDictionary()


def _plan(model: nn.Module) -> list[_Unit]:
    """The units of `model`, worked out once per model: walking the module tree and inspecting
    hundreds of DTensors costs milliseconds of host time, more than the copies themselves."""
    plan = _PLANS.get(model)
    if plan is None:
        plan = []
        for unit, names in fsdp_units(model):
            params = dict(unit.named_parameters())
            own = [params[local] for _, local in names]
            merges = _merges(unit, {local for _, local in names})
            adapters = frozenset(n for a, b, _, _ in merges.values() for n in (a, b))
            changing = frozenset(local for _, local in names if params[local].requires_grad or local in merges)
            plan.append(_Unit(unit, names, own, all(_is_whole(p) for p in own), merges, adapters, changing))
        _PLANS[model] = plan
    return plan


def _gathered(unit: _Unit) -> dict[str, torch.Tensor]:
    """Full tensors of an unsharded unit's parameters, by name within the unit."""
    params = dict(unit.module.named_parameters())
    out = {}
    for _, local in unit.names:
        t = params[local].detach()
        # A DTensor left sharded (not an FSDP unit param): gather it.
        out[local] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return out


def _whole(unit: _Unit) -> dict[str, torch.Tensor]:
    """A whole unit's rank-local tensors, by name within the unit."""
    return {local: p.to_local() if hasattr(p, "to_local") else p.detach() for (_, local), p in zip(unit.names, unit.params)}


def _unit_tensors(
    unit: _Unit, tensors: dict[str, torch.Tensor], dtype: torch.dtype, cast: bool, since_last: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """What the engine gets of one unit: merged LoRA weights in `dtype`, other tensors cast to
    `dtype` when `cast` (else as stored); with `since_last`, only what can have changed."""
    for full, local in unit.names:
        if not unit.sends(local, since_last):
            continue
        if local in unit.merges:
            a, b, scale, ops = unit.merges[local]
            yield full, merged_weight(tensors[local], tensors[a], tensors[b], scale, dtype, ops)
        else:
            t = tensors[local]
            yield full, (t if not cast or t.dtype == dtype else t.to(dtype))


def _buckets(
    model: nn.Module, dtype: torch.dtype, bucket_bytes: int, engine_casts: bool, since_last: bool
) -> Iterator[tuple[list[tuple[str, torch.Tensor]], int]]:
    """(named tensors, bytes in the engine dtype) per bucket. A gathered unit's last bucket is taken
    before the unit is resharded; whole units fill buckets together."""
    bucket, size = [], 0
    for unit in _plan(model):
        if not any(unit.sends(local, since_last) for _, local in unit.names):
            continue
        gather = _is_fsdp(unit.module) and not unit.whole
        if gather:
            unit.module.unshard()
            tensors = _unit_tensors(unit, _gathered(unit), dtype, True, since_last)
        else:
            tensors = _unit_tensors(unit, _whole(unit), dtype, not engine_casts, since_last)
        for name, tensor in tensors:
            bucket.append((name, tensor))
            size += tensor.numel() * dtype.itemsize
            if size >= bucket_bytes:
                yield bucket, size
                bucket, size = [], 0
        if gather:
            if bucket:
                yield bucket, size
                bucket, size = [], 0
            del tensors
            unit.module.reshard()
    if bucket:
        yield bucket, size


@torch.no_grad()
def sync_weights(
    model: nn.Module,
    engine: RolloutEngine,
    *,
    version: int,
    dtype: torch.dtype,
    bucket_bytes: int = 512 << 20,
    since_last: bool = False,
) -> SyncStats:
    """Push the weights of `model` (HF names; LoRA modules merged) into `engine`, then record
    `version` there: every one, or with `since_last` (the engine holds the previous push) those
    that can have changed since, in a partial session when some are left out."""
    start = time.perf_counter()
    # Partial when some parameter is left out: neither one that can change nor an adapter.
    partial = since_last and any(local not in u.changing | u.adapters for u in _plan(model) for _, local in u.names)
    engine.begin_weight_update(partial=partial)
    num_tensors = num_bytes = num_buckets = 0
    for bucket, size in _buckets(model, dtype, bucket_bytes, engine.casts_on_update, partial):
        engine.update_weights(bucket)
        num_tensors, num_bytes, num_buckets = num_tensors + len(bucket), num_bytes + size, num_buckets + 1
        del bucket  # before the generator resumes and reshards: no full tensor outlives its unit
    engine.end_weight_update(version)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncStats(version, num_tensors, num_bytes, num_buckets, time.perf_counter() - start, partial)
