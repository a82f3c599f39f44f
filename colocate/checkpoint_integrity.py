"""A checkpoint's integrity as DCP writes and reads it: each file's CRC-32 taken from the bytes as
they stream out (no second read), the first tensor holding NaN or inf on save and on load, and the
verdict on a checkpoint that does not load, agreed by every rank (colocate/checkpoint.py uses them;
colocate/checkpoint_manifest.py keeps the manifest)."""

from __future__ import annotations

import contextlib
import pickle
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.tensor import DTensor

from colocate import dist as cdist
from colocate.checkpoint_manifest import ChecksummingStream, DamagedCheckpoint


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, keeping the size and CRC-32 of each file written (`records`, by
    name) from the bytes as they go out."""

    def __init__(self):
        super().__init__()
        self.records: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = ChecksummingStream(raw)
            yield stream
        self.records[Path(path).name] = stream.record()

    def rename(self, path, new_path) -> None:
        # DCP writes .metadata under a temporary name, then renames it.
        super().rename(path, new_path)
        self.records[Path(new_path).name] = self.records.pop(Path(path).name)


class ChecksummingWriter(FileSystemWriter):
    """DCP's file writer, writing through ChecksummingFileSystem."""

    def __init__(self, path: Path):
        super().__init__(path)
        self.fs = ChecksummingFileSystem()


def first_non_finite(named: Iterable[tuple[str, Any]]) -> str | None:
    """The first key (sorted) whose floating tensor holds NaN or inf on this rank (its shard, for a
    DTensor), or None. The flags are reduced on each tensor's device: one host sync per device."""
    flags = defaultdict(list)
    for key, value in named:
        local = value.to_local() if isinstance(value, DTensor) else value
        if isinstance(local, torch.Tensor) and local.is_floating_point() and local.numel():
            flags[local.device].append((key, torch.isfinite(local).all()))
    bad = []
    for pairs in flags.values():
        finite = torch.stack([flag for _, flag in pairs]).tolist()
        bad += [key for (key, _), ok in zip(pairs, finite) if not ok]
    return min(bad, default=None)


class FiniteSavePlanner(DefaultSavePlanner):
    """DCP's save planner, noting the first tensor to be saved that holds NaN or inf (`non_finite`)."""

    non_finite: str | None = None

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.non_finite = first_non_finite(self.state_dict.items())


class FiniteLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, keeping every tensor read with its key (`read`) to check it is finite."""

    def __init__(self):
        super().__init__()
        self.read: list[tuple[str, torch.Tensor]] = []

    def commit_tensor(self, read_item, tensor) -> None:
        super().commit_tensor(read_item, tensor)
        self.read.append((read_item.dest_index.fqn, tensor))


# What bytes that do not deserialise raise: DCP wraps each rank's error in a CheckpointException
# (a BaseException), torch.load and pickle raise their own.
_UNREADABLE = (CheckpointException, pickle.UnpicklingError, EOFError, RuntimeError)
# Errors that are the device's or the process group's, not the files': raised, not fallen back from.
_NOT_DAMAGE = (torch.OutOfMemoryError, dist.DistBackendError)


def _unreadable(error: BaseException) -> str:
    """One line saying why stored bytes did not load (the first failing rank's error, for DCP)."""
    cause = error
    if isinstance(error, CheckpointException):
        failure = next(iter(error.failures.values()))
        cause = failure[0] if isinstance(failure, tuple) else failure
    if isinstance(cause, _NOT_DAMAGE):
        raise cause
    first_line = next(iter(str(cause).splitlines()), "")
    return f"unreadable ({type(cause).__name__}: {first_line})"


def raise_damaged(path: Path, step: Callable[[], str | None]) -> None:
    """Run one check or read of a checkpoint on this rank; DamagedCheckpoint on every rank when
    any rank found a problem (the first rank's), so all ranks fall back together. Every rank
    reaches the gather, whatever it raised: any other error (a mismatch of the states, or one of
    _NOT_DAMAGE) then ends the load on every rank."""
    problem, fatal = None, None
    try:
        problem = step()
    except _UNREADABLE as e:
        try:
            problem = _unreadable(e)
        except _NOT_DAMAGE as error:
            fatal = error
    except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
        fatal = e
    found = cdist.all_gather_object((problem, fatal is not None))
    if fatal is not None:
        raise fatal
    if any(failed for _, failed in found):
        raise RuntimeError(f"checkpoint {path}: another rank failed while loading it")
    problem = next((p for p, _ in found if p is not None), None)
    if problem is not None:
        raise DamagedCheckpoint(path, problem)
