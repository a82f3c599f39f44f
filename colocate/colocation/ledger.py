"""The memory ledger: bytes at every phase transition, logged each step, checked for growth.

On CUDA a row holds torch's allocated and reserved bytes and the device's used bytes (total - free,
which also sees memory held outside torch, e.g. torch_memory_saver regions and other processes). On
CPU the process's resident set size stands in for the device.

On CUDA each step also counts the caching allocator's retries (`memory/alloc_retries`): an
allocation that found no free cached block and no free device memory, so the allocator freed its
whole cache and asked again. Each retry synchronises the device; a step with retries ran at the
edge of memory and was slower for it, with no error to say so.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

GIB = 1 << 30


@dataclass
class MemoryRow:
    step: int
    phase: str
    allocated: int
    reserved: int
    device_used: int


def read_memory(device: torch.device) -> tuple[int, int, int]:
    """(allocated, reserved, device_used) bytes right now, after the current stream's queued work
    (side-stream copies still in flight hold memory allocated already)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
        free, total = torch.cuda.mem_get_info(device)
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device), total - free
    rss = _rss_bytes()
    return rss, rss, rss


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def alloc_retries(device: torch.device) -> int | None:
    """The caching allocator's retries since the process began (None off CUDA)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


class MemoryGrowthError(RuntimeError):
    pass


class DeviceMemoryError(ValueError):
    """A phase of the loop ran out of GPU memory: the settings ask for more than the device has
    (a user error: the message names the settings that give the phase room)."""


def out_of_memory(cfg, phase: str, step: int, device: torch.device, error: BaseException) -> DeviceMemoryError:
    """The error for `error`, a torch.OutOfMemoryError raised in the loop's `phase` of `step`: what
    the device had in use, and which settings of the run's `cfg` would leave that phase more room."""
    m, r, t, o = cfg.model, cfg.rollout, cfg.train, cfg.offload
    kv = f"a lower rollout.gpu_memory_fraction (now {r.gpu_memory_fraction}: the KV cache's share)"
    if phase in ("generate", "eval"):
        advice = [f"{kv} or rollout.max_running_requests (now {r.max_running_requests})"]
        if not o.offload_train:
            advice.append("offload.offload_train (the trainer's state now stays on the GPU while generating)")
    elif phase == "train":
        advice = [f"a lower train.max_tokens_per_gpu (now {t.max_tokens_per_gpu}: one micro-batch's tokens)"]
        full = m.full_recompute_fraction
        if full < 1:
            advice.append(
                "model.gradient_checkpointing (each block recomputes its forward in the backward)"
                if full == 0
                else f"a higher model.recompute_fraction (now {full})"
            )
        if not o.offload_rollout:
            advice.append("offload.offload_rollout (the engine now keeps its KV cache through training)")
    else:  # the switches between the two, and checkpoint writing
        advice = [kv] + [f"offload.{name}" for name in ("offload_train", "offload_rollout") if not getattr(o, name)]
    used = ""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = f" ({(total - free) / GIB:.1f} of {total / GIB:.1f} GiB in use)"
    lines = str(error).strip().splitlines()
    return DeviceMemoryError(
        f"step {step}: the {phase} phase ran out of GPU memory{used}. For more room: "
        f"{'; or '.join(advice)}. ({lines[0] if lines else type(error).__name__})"
    )


class MemoryLedger:
    """Records memory at named phases; flags growth of a phase across steps after warm-up.

    `tolerance` is relative (0.01 = 1%) with a floor of `min_bytes`, so that allocator noise of a few
    MiB on a tiny CPU run is not reported as a leak.
    """

    def __init__(
        self,
        device: torch.device,
        *,
        warmup_steps: int = 2,
        tolerance: float = 0.01,
        min_bytes: int = 64 << 20,
        strict: bool = False,
    ):
        self.device = device
        self.warmup_steps, self.tolerance, self.min_bytes, self.strict = warmup_steps, tolerance, min_bytes, strict
        self.rows: list[MemoryRow] = []
        self._baseline: dict[str, MemoryRow] = {}
        self.reports: list[str] = []
        self._retries = 0  # the allocator's retries at the last step_metrics (warned of once, at the first)

    def record(self, step: int, phase: str) -> MemoryRow:
        row = MemoryRow(step, phase, *read_memory(self.device))
        self.rows.append(row)
        if step == self.warmup_steps:
            self._baseline.setdefault(phase, row)
        elif step > self.warmup_steps and phase in self._baseline:
            self._check(self._baseline[phase], row)
        return row

    def _check(self, base: MemoryRow, row: MemoryRow):
        limit = max(base.device_used * self.tolerance, self.min_bytes)
        growth = row.device_used - base.device_used
        if growth <= limit:
            return
        msg = (
            f"memory at phase '{row.phase}' grew by {growth / GIB:.3f} GiB since step {base.step} "
            f"({base.device_used / GIB:.3f} -> {row.device_used / GIB:.3f} GiB device used)"
        )
        self.reports.append(msg)
        if self.strict:
            raise MemoryGrowthError(msg)
        warnings.warn(msg, stacklevel=2)

    def step_metrics(self, step: int) -> dict[str, float]:
        """memory/<phase>/{allocated,reserved,device_used}_gib for this step's rows and, on CUDA,
        memory/alloc_retries since the last call (called once per step; the first: since start-up)."""
        out = {}
        for r in self.rows:
            if r.step == step:
                for key in ("allocated", "reserved", "device_used"):
                    out[f"memory/{r.phase}/{key}_gib"] = getattr(r, key) / GIB
        retries = alloc_retries(self.device)
        if retries is not None:
            new, first = retries - self._retries, self._retries == 0
            out["memory/alloc_retries"] = new
            self._retries = retries
            if new and first:
                warnings.warn(
                    f"step {step}: the CUDA caching allocator freed its cache and retried {new} "
                    f"allocation(s), each a device-wide synchronisation: memory is nearly full. Lower "
                    f"rollout.gpu_memory_fraction or train.max_tokens_per_gpu, or offload "
                    f"(memory/alloc_retries counts them every step; this is said once)",
                    stacklevel=2,
                )
        return out

    def append_to(self, path: Path, step: int) -> None:
        """Append this step's rows to a JSONL file (one per rank: only rank 0 logs metrics, and a
        leak or a missed release on another rank must be visible too)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            for r in self.rows:
                if r.step == step:
                    f.write(json.dumps(dataclasses.asdict(r)) + "\n")

    def phase(self, step: int, phase: str) -> MemoryRow | None:
        """The last row recorded for (step, phase)."""
        for r in reversed(self.rows):
            if r.step == step and r.phase == phase:
                return r
        return None
