"""The host buffers that the pinned offload copies into (colocate/trainer/offload.py).

Pinning host memory is slow (a few GB/s), and while the NVIDIA driver pins it holds a lock that
every CUDA call of the process (and of the machine's other processes) waits for: the 4B shape's
warm start-up spent about 24 s behind 64 GB of it on helper threads (one H200: 19.8 s in the
offload, 3.0 s in a resume phase with nothing to load, 1.0 s laying out the buffers). So:

- torch pins by registering pages that were faulted in beforehand, on threads of its own and
  outside the lock (`use_registered_pinning`), instead of with cudaHostAlloc, which allocates and
  zeroes the pages inside it;
- each layout's pieces (`HostPieces`) pin on helper threads (`Pinner`) as soon as their sizes are
  known, and whoever needs a piece first waits for just that piece (or pins it, when no helper
  has begun it);
- an offload that cannot wait copies into a `pageable` buffer in a piece's place.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from typing import Callable

import torch

_PIN_THREADS = 4
"""Helper threads that pin reservations' pieces. Each piece is one allocation of its own, so
pieces pin side by side where the driver and the kernel allow it; where they do not, the threads
take turns and the total is that of one."""
_FAULT_THREADS = 2
"""Threads that fault in one piece's pages before torch registers them with CUDA (a power of two,
as torch requires; each helper thread pins a piece of its own meanwhile)."""
_REGISTER_KEYS = {"pinned_use_cuda_host_register": "True", "pinned_num_register_threads": str(_FAULT_THREADS)}

_pinning_chosen = False
_registering = False
"""This process pins by page registration (`use_registered_pinning` turned it on)."""
_switch = threading.Lock()


def _allocator_settings(keys: dict[str, str]) -> None:
    """Set these options of torch's allocators. Setting them at run time resets those not named
    to their defaults: the environment's are named again, before these."""
    given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    named = [f"{key}:{value}" for key, value in keys.items()]
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(",".join([given, *named] if given else named))


def use_registered_pinning() -> None:
    """From now on torch pins host memory by allocating it pageable, faulting its pages in on
    _FAULT_THREADS threads, and only then registering it with CUDA, instead of with cudaHostAlloc,
    which allocates and zeroes the pages inside the driver's lock (CUDA calls of this process and
    of the machine's others wait meanwhile). Once per process; not where the environment's allocator
    settings (PYTORCH_CUDA_ALLOC_CONF, PYTORCH_ALLOC_CONF) choose: `pinned_use_cuda_host_register:False`
    there keeps cudaHostAlloc. torch frees each buffer the way it was allocated."""
    global _pinning_chosen, _registering
    with _switch:
        if _pinning_chosen:
            return
        _pinning_chosen = True
        given = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
        if "pinned_use_cuda_host_register" in given:
            return
        _allocator_settings({key: value for key, value in _REGISTER_KEYS.items() if key not in given})
        _registering = True


def pin(num_bytes: int) -> torch.Tensor:
    """A pinned host buffer of this many bytes (uint8). Where registering pages fails (a driver or
    a limit that refuses it), this process goes back to cudaHostAlloc, with a warning."""
    global _registering
    registering = _registering
    try:
        return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as e:
        if not registering:
            raise
        with _switch:
            if _registering:  # the first helper to fail switches
                _registering = False
                _allocator_settings({"pinned_use_cuda_host_register": "False"})
                warnings.warn(f"pinning host memory by page registration failed ({e}); pinning with cudaHostAlloc instead")
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


def pageable(num_bytes: int) -> torch.Tensor:
    """A pageable host buffer of this many bytes (uint8), its pages faulted in (zeroed on torch's
    intra-op threads) before a device copy into it: the driver's copy into pageable memory would
    fault them in one by one."""
    return torch.zeros(num_bytes, dtype=torch.uint8)


class HostPieces:
    """The host buffers (uint8) of one layout, each allocated exactly once: by whichever comes to it
    first of the helper threads of a `Pinner` (`claim`, then `fill`) and the caller of `get`, which
    waits for a piece a helper has begun. An error in a helper is kept with its piece and raised by
    that piece's `get`, as the same exception the allocation raised."""

    def __init__(self, sizes: list[int], allocate: Callable[[int], torch.Tensor] | None = None):
        self.sizes = sizes
        self._allocate = allocate or pin
        self._lock = threading.Lock()
        self._begun = [False] * len(sizes)
        self._done = [threading.Event() for _ in sizes]
        self._pieces: list[torch.Tensor | None] = [None] * len(sizes)
        self._errors: list[BaseException | None] = [None] * len(sizes)
        self._cancelled = False
        self.helped = False
        """A `Pinner` has taken these pieces on."""
        self.wait_seconds = 0.0
        """Seconds `get` spent on pieces not yet there: waiting for a helper, or allocating one
        that no helper had begun."""

    def __len__(self) -> int:
        return len(self.sizes)

    def claim(self) -> int | None:
        """The first piece nobody has begun, now begun by the caller; None when none is left."""
        with self._lock:
            i = next((i for i, begun in enumerate(self._begun) if not begun), None)
            if i is not None:
                self._begun[i] = True
            return i

    def fill(self, i: int) -> bool:
        """Allocate claimed piece i; False if that raised (the error is kept for its `get`) or the
        layout was cancelled meanwhile (the piece is let go at once)."""
        try:
            piece = self._allocate(self.sizes[i])
            with self._lock:
                if self._cancelled:
                    return False
                self._pieces[i] = piece
        except Exception as e:
            self._errors[i] = e
        finally:
            self._done[i].set()
        return self._errors[i] is None

    def cancel(self) -> None:
        """A new layout replaced this one: no more pieces begin, and those done are let go."""
        with self._lock:
            self._cancelled = True
            for i, begun in enumerate(self._begun):
                if not begun:
                    self._begun[i] = True
                    self._errors[i] = RuntimeError("host piece of a replaced layout")
                    self._done[i].set()
            self._pieces = [None] * len(self.sizes)

    def unclaimed(self) -> int:
        """Pieces nobody has begun."""
        with self._lock:
            return self._begun.count(False)

    def ready(self, i: int) -> bool:
        """Piece i's allocation has ended (`get` returns it, or raises its error, at once)."""
        return self._done[i].is_set()

    def ready_bytes(self) -> int:
        """Bytes of the pieces allocated so far."""
        with self._lock:
            return sum(size for size, piece in zip(self.sizes, self._pieces) if piece is not None)

    def get(self, i: int, timed: bool = True) -> torch.Tensor:
        """Piece i, allocated now if nobody has begun it, else once its helper is done. `timed`:
        count the time it was not there in `wait_seconds`."""
        if not self._done[i].is_set():
            start = time.perf_counter()
            with self._lock:
                mine = not self._begun[i]
                self._begun[i] = True
            if mine:
                self.fill(i)
            self._done[i].wait()
            if timed:
                self.wait_seconds += time.perf_counter() - start
        if self._errors[i] is not None:
            raise self._errors[i]
        return self._pieces[i]


class Pinner:
    """Helper threads that allocate the pieces of reservations (`HostPieces`), reservation after
    reservation in the order they were added; a helper stops at its first failed allocation (its
    error waits in that piece), leaving the rest to the other helpers and to whoever needs them.
    While `gate` is clear, helpers begin no new piece. `device` is made current in each thread:
    pinned allocations go through its context."""

    def __init__(self, device: torch.device | None = None, num_threads: int = _PIN_THREADS):
        self.index = None  # a bare "cuda" device is the caller's current one
        if device is not None and device.type == "cuda":
            self.index = torch.cuda.current_device() if device.index is None else device.index
        self.num_threads = num_threads
        self.gate = threading.Event()
        self.gate.set()
        self._lock = threading.Lock()
        self._queue: list[HostPieces] = []
        self._num_alive = 0

    def add(self, reservations: list[HostPieces]) -> list[threading.Thread]:
        """Queue these reservations' pieces; returns the helper threads this started (up to
        `num_threads` run at a time)."""
        with self._lock:
            for pieces in reservations:
                pieces.helped = True
            self._queue.extend(reservations)
            left = sum(pieces.unclaimed() for pieces in self._queue)
            count = max(0, min(self.num_threads - self._num_alive, left))
            self._num_alive += count
        threads = [threading.Thread(target=self._work, name=f"colocate-pin-{n}", daemon=True) for n in range(count)]
        for thread in threads:
            thread.start()
        return threads

    def _next(self) -> tuple[HostPieces, int] | None:
        """The next piece to allocate, claimed; None (and this helper ends) when none is left."""
        with self._lock:
            for pieces in self._queue:
                i = pieces.claim()
                if i is not None:
                    return pieces, i
            self._queue.clear()
            self._num_alive -= 1
            return None

    def _work(self) -> None:
        if self.index is not None:
            torch.cuda.set_device(self.index)
        while True:
            self.gate.wait()
            job = self._next()
            if job is None:
                return
            pieces, i = job
            if not pieces.fill(i):
                with self._lock:
                    self._num_alive -= 1
                return


def pin_in_background(
    reservations: list[HostPieces], device: torch.device | None = None, num_threads: int = _PIN_THREADS
) -> list[threading.Thread]:
    """Start helper threads (a `Pinner` of their own) that allocate these pieces, in this order."""
    return Pinner(device, num_threads).add(reservations)
