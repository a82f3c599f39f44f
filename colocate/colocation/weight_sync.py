"""Trainer -> engine weight sync, one FSDP unit at a time.

Each FSDP2 unit (a transformer block, then the root's embeddings/norm/head) is all-gathered with
`unshard()` — under mixed precision that gathers straight into the engine's bf16 — handed to the
engine as HF-named full tensors in buckets of at most `bucket_bytes`, and resharded before the next
unit, so at most one unit's full tensors exist at a time and no second copy of the model stays alive.

A unit whose shards already are the full tensors (one rank) is not gathered: its fp32 master
tensors go to the engine as they are when the engine casts while it copies
(`casts_on_update`), so each weight is read once and written once, as in a plain device copy; such
units fill buckets together, so a bucket is one large multi-tensor copy rather than one per block.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from colocate.rollout.protocol import RolloutEngine


@dataclass
class SyncStats:
    version: int
    num_tensors: int
    num_bytes: int
    num_buckets: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {"perf/sync_gib": self.num_bytes / (1 << 30), "perf/sync_buckets": self.num_buckets,
                "perf/sync_gb_per_s": self.num_bytes / max(self.seconds, 1e-9) / 1e9}


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
            units[owner][1].append((name, name[len(owner) + 1:]))
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
            plan.append(_Unit(unit, names, own, all(_is_whole(p) for p in own)))
        _PLANS[model] = plan
    return plan


def _gathered_tensors(unit: nn.Module, names, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Full tensors of an unsharded unit's parameters, in `dtype`."""
    params = dict(unit.named_parameters())
    for full, local in names:
        t = params[local].detach()
        if hasattr(t, "full_tensor"):  # a DTensor left sharded (not an FSDP unit param): gather it
            t = t.full_tensor()
        yield full, (t if t.dtype == dtype else t.to(dtype))


def _whole_tensors(unit: _Unit, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """A whole unit's rank-local tensors, in `dtype` (None: as stored)."""
    for (full, _), p in zip(unit.names, unit.params):
        t = p.to_local() if hasattr(p, "to_local") else p.detach()
        yield full, (t if dtype is None or t.dtype == dtype else t.to(dtype))


def _buckets(model: nn.Module, dtype: torch.dtype, bucket_bytes: int, engine_casts: bool
             ) -> Iterator[tuple[list[tuple[str, torch.Tensor]], int]]:
    """(named tensors, bytes in the engine dtype) per bucket. A gathered unit's last bucket is taken
    before the unit is resharded; whole units fill buckets together."""
    bucket, size = [], 0
    for unit in _plan(model):
        gather = _is_fsdp(unit.module) and not unit.whole
        if gather:
            unit.module.unshard()
            tensors = _gathered_tensors(unit.module, unit.names, dtype)
        else:
            tensors = _whole_tensors(unit, None if engine_casts else dtype)
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
def sync_weights(model: nn.Module, engine: RolloutEngine, *, version: int, dtype: torch.dtype,
                 bucket_bytes: int = 512 << 20) -> SyncStats:
    """Push every parameter of `model` (HF names) into `engine`, then record `version` there."""
    start = time.perf_counter()
    engine.begin_weight_update()
    num_tensors = num_bytes = num_buckets = 0
    for bucket, size in _buckets(model, dtype, bucket_bytes, engine.casts_on_update):
        engine.update_weights(bucket)
        num_tensors, num_bytes, num_buckets = num_tensors + len(bucket), num_bytes + size, num_buckets + 1
        del bucket  # before the generator resumes and reshards: no full tensor outlives its unit
    engine.end_weight_update(version)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return SyncStats(version, num_tensors, num_bytes, num_buckets, time.perf_counter() - start)
