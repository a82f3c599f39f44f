"""torchrun environment -> process group and device. Plain `python -m ...` is world size 1."""

from __future__ import annotations

import atexit
import datetime
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return default if value is None else int(value)


def init(timeout_minutes: int = 30, backend: str | None = None, store: dist.Store | None = None) -> DistInfo:
    """Initialise the default process group from torchrun's variables (nccl on GPU, gloo on CPU).

    Without torchrun (no WORLD_SIZE, no MASTER_ADDR) a single-process group is created on an
    in-memory store, so that collectives and FSDP2 work the same way in a plain `python -m` run
    with no port to pick (a port found free can be taken by another process before the group
    binds it). `store` is the rendezvous of ranks started some other way (tests use a file store).
    """
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", world)
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        if store is None and world == 1 and "MASTER_ADDR" not in os.environ:
            store = dist.HashStore()
        backend = backend or ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world,
            store=store,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(rank, world, local_rank, local_world, device)


def get_info() -> DistInfo:
    """The current process's DistInfo (after `init`)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local_rank = _env_int("LOCAL_RANK", 0)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return DistInfo(rank, world, local_rank, _env_int("LOCAL_WORLD_SIZE", world), device)


def all_reduce_sum(values: list[float] | torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
    """Sum a small vector of numbers over all ranks (fp64 on the collective's device)."""
    device = device or get_info().device
    t = torch.as_tensor(values, dtype=torch.float64, device=device).clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t


def all_reduce_max(value: int, device: torch.device | None = None) -> int:
    device = device or get_info().device
    return int(all_reduce_max_values(torch.tensor([value], dtype=torch.int64, device=device))[0])


def all_reduce_max_values(values: torch.Tensor) -> torch.Tensor:
    """The elementwise maximum of a small tensor over all ranks (a reduced copy)."""
    t = values.clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t


def broadcast_from_main(obj):
    """Rank 0's `obj` (any picklable value) on every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_object(obj) -> list:
    """Every rank's `obj` (any picklable value), in rank order."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def barrier():
    if dist.is_initialized():
        dist.barrier()


def destroy(synchronize: bool = True):
    """Leave the process group. On a normal exit every rank first meets at a barrier, so that no
    rank tears its group down while a peer's last collective is still in flight; after a failure
    the barrier is skipped (peers may be gone). A process that ran collectives should then end
    with `exit_process`."""
    if dist.is_initialized():
        if synchronize and dist.get_world_size() > 1:
            dist.barrier()
        dist.destroy_process_group()


def exit_process(code: int) -> None:
    """End a process that ran collectives: run the atexit handlers, flush, then leave with `code`
    without finalizing the interpreter.

    A gloo group outlives `destroy` once FSDP2 has used it (its module state keeps the group),
    and so do its worker threads. Such a thread drops its last collective's tensors a moment
    after the collective completes, and dropping a tensor that Python has seen takes the GIL.
    Once the main thread has begun finalizing, CPython ends any thread that asks for the GIL
    with pthread_exit, which unwinds through gloo's C++ frames and aborts the process
    ("terminate called without an active exception": about 1 two-rank run in 20 on 2 cores).
    Leaving with os._exit after the handlers have run skips finalization, and the race with it."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: nothing more can reach it
            pass
    os._exit(code)
