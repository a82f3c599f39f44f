"""Move trainer state (parameters, gradients, optimizer state) off the GPU and back, in place.

Colocation needs the trainer's memory back for the rollout engine between training phases, and
the trainer needs its tensors back unchanged afterwards: the same Python objects (FSDP holds its
sharded parameters, the optimizer holds its state by identity), with the same values. Two methods:

- "pinned" (default, faster): every distinct device storage behind the registered tensors is copied
  into a slot of the group's pinned host buffers (allocated once, then reused, since pinning many
  GiB takes seconds: by helper threads that `reserve` starts, while the start-up goes on, or at
  the first offload), on a side stream, then the storage is resized to zero. Onload resizes it back
  and copies the bytes home. The buffers are pieces of one power of two (`pinned_layout`): torch's
  pinned allocator rounds every allocation up to a power of two, so one buffer a group pinned up
  to twice its bytes (a 1.5B model's 18.5 GB of gradients and AdamW moments took 32 GiB). Views
  into a storage (FSDP's padded shard, the parameter view) keep working because they reference the
  storage, not its address.
  A group may name tensors that never change (`constant`: the frozen base under LoRA adapters):
  their bytes are copied out once, and later offloads only free their storages.
- "tms": the tensors are allocated inside a torch_memory_saver region with a CPU backup, and
  offload/onload pause and resume that region. Slower (the library copies through freshly
  allocated pinned memory each time), kept selectable for setups that already use the library.

On CPU nothing moves; calls still return statistics (0 bytes) so callers need no special case.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor

from colocate.memory_saver import handle as memory_saver_handle

OFFLOAD_METHODS = ("pinned", "tms")
_ALIGN = 512
"""Byte alignment of each storage's slot in the pinned buffers (keeps copies on fast paths)."""
_PIECE = 1 << 30
"""The smallest size of a full pinned piece (bytes); a larger storage raises it to the power of two
that holds it."""
_SMALL = 1 << 20
"""torch's caching allocator serves requests up to this size (bytes) from its small pool's 2 MiB
segments, larger ones from the large pool, rounded up to _BLOCK bytes."""
_BLOCK = 512
_PIN_THREADS = 4
"""Helper threads that pin a reservation's pieces. Each piece is one allocation of its own, so
pieces pin side by side where the driver and the kernel allow it; where they do not, the threads
take turns and the total is that of one."""

TensorSource = Callable[[], Iterable[torch.Tensor]]
ConstantTest = Callable[[torch.Tensor], bool]


@dataclass
class OffloadStats:
    num_bytes: int = 0
    seconds: float = 0.0

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: "OffloadStats") -> "OffloadStats":
        return OffloadStats(self.num_bytes + other.num_bytes, self.seconds + other.seconds)


def _storages(tensors: Iterable[torch.Tensor], index: dict[int, int] | None = None) -> list[torch.UntypedStorage]:
    """Distinct non-empty device storages behind these tensors, in first-seen order. With `index`,
    also record there each tensor's (by id) position in that list."""
    seen: dict[int, int] = {}
    out = []
    for t in tensors:
        if t is None:
            continue
        # A DTensor's local shard read directly: `to_local()` is an autograd call (~20 us a tensor
        # on the host) and an offload visits every parameter and optimizer state.
        local = t._local_tensor if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        ptr = storage.data_ptr()
        if storage.device.type == "cpu" or storage.nbytes() == 0:
            continue
        if ptr not in seen:
            seen[ptr] = len(out)
            out.append(storage)
        if index is not None:
            index[id(t)] = seen[ptr]
    return out


def pinned_layout(sizes: list[int]) -> tuple[list[tuple[int, int]], list[int]]:
    """Slots for storages of these byte sizes: (piece, byte offset) each, and each piece's size.
    Each storage goes to the first piece with room for it (first fit), a piece holding at most
    `capacity` bytes: a power of two, at least _PIECE and at least the largest aligned storage. A
    nearly full piece then pins its capacity, and only the last is rounded up (by less than half of
    it). Slots are _ALIGN-aligned."""
    aligned = [-(-size // _ALIGN) * _ALIGN for size in sizes]
    capacity = max([_PIECE, *aligned])
    capacity = 1 << (capacity - 1).bit_length()
    slots, pieces = [], []
    for size in aligned:
        piece = next((i for i, used in enumerate(pieces) if used + size <= capacity), len(pieces))
        if piece == len(pieces):
            pieces.append(0)
        slots.append((piece, pieces[piece]))
        pieces[piece] += size
    return slots, pieces


def pin(num_bytes: int) -> torch.Tensor:
    """A pinned host buffer of this many bytes (uint8)."""
    return torch.empty(num_bytes, dtype=torch.uint8, pin_memory=True)


class HostPieces:
    """The host buffers (uint8) of one layout, each allocated exactly once: by whichever comes to it
    first of the helper threads that `pin_in_background` starts (`claim`, then `fill`) and the
    caller of `get`, which waits for a piece a helper has begun. An error in a helper is kept with
    its piece and raised by that piece's `get`, as the same exception the allocation raised."""

    def __init__(self, sizes: list[int], allocate: Callable[[int], torch.Tensor] | None = None):
        self.sizes = sizes
        self._allocate = allocate or pin
        self._lock = threading.Lock()
        self._begun = [False] * len(sizes)
        self._done = [threading.Event() for _ in sizes]
        self._pieces: list[torch.Tensor | None] = [None] * len(sizes)
        self._errors: list[BaseException | None] = [None] * len(sizes)
        self._cancelled = False
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

    def get(self, i: int) -> torch.Tensor:
        """Piece i, allocated now if nobody has begun it, else once its helper is done."""
        if not self._done[i].is_set():
            start = time.perf_counter()
            with self._lock:
                mine = not self._begun[i]
                self._begun[i] = True
            if mine:
                self.fill(i)
            self._done[i].wait()
            self.wait_seconds += time.perf_counter() - start
        if self._errors[i] is not None:
            raise self._errors[i]
        return self._pieces[i]


def pin_in_background(
    reservations: list[HostPieces], device: torch.device | None = None, num_threads: int = _PIN_THREADS
) -> list[threading.Thread]:
    """Start helper threads that allocate these pieces, in this order; a helper stops at its first
    failed allocation (its error waits in that piece), leaving the rest to whoever needs them.
    `device` is made current in each thread first: pinned allocations go through its context."""
    index = None  # a bare "cuda" device is the caller's current one
    if device is not None and device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index

    def work():
        if index is not None:
            torch.cuda.set_device(index)
        for pieces in reservations:
            while (i := pieces.claim()) is not None:
                if not pieces.fill(i):
                    return

    count = min(num_threads, sum(len(pieces) for pieces in reservations))
    threads = [threading.Thread(target=work, name=f"colocate-pin-{n}", daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    return threads


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class _PinnedGroup:
    """One group's storages and their slots in reusable pinned host buffers."""

    def __init__(self, source: TensorSource, constant: ConstantTest | None = None):
        self.source, self.constant = source, constant
        self.storages: list[torch.UntypedStorage] = []
        self.sizes: list[int] = []
        self.pieces: HostPieces | None = None  # pinned (see pinned_layout)
        self.slots: list[tuple[int, int]] = []  # (piece, offset) of each storage
        self.away: set[int] = set()  # storages on the host, not yet queued home
        self.tensors: list[torch.Tensor] = []  # held while offloaded, so that `index`'s ids stay theirs
        self.index: dict[int, int] = {}  # id(tensor) -> its storage's position
        self.arrived: torch.cuda.Event | None = None  # end of an onload not yet waited for
        self.kept: set[int] = set()  # constant storages whose slot holds their bytes already
        self.earlier_wait_seconds = 0.0  # the wait_seconds of layouts replaced since

    @property
    def offloaded(self) -> bool:
        return bool(self.away)

    def _slot(self, i: int) -> torch.Tensor:
        piece, offset = self.slots[i]
        return self.pieces.get(piece)[offset : offset + self.sizes[i]]

    def prepare(self) -> tuple[list[torch.Tensor], dict[int, int]]:
        """Find the group's storages as they are now; lay out new pinned buffers if their sizes
        differ from the last layout (allocated when first used, unless `pin_in_background` pins
        them before). Returns the tensors and their storage positions."""
        tensors, index = [t for t in self.source() if t is not None], {}
        self.storages = _storages(tensors, index)
        sizes = [s.nbytes() for s in self.storages]
        if sizes != self.sizes or self.pieces is None:
            self.sizes = sizes
            self.slots, pieces = pinned_layout(sizes)
            if self.pieces is not None:
                self.pieces.cancel()
                self.earlier_wait_seconds += self.pieces.wait_seconds
            self.pieces = None  # the old pieces go back to torch's pinned cache before the new ones come
            self.pieces = HostPieces(pieces)
            self.kept = set()
        return tensors, index

    def offload(self, stream: torch.cuda.Stream) -> int:
        if self.offloaded:
            return 0
        self.tensors, self.index = self.prepare()
        # In slot order: the copies into a piece queue as soon as it is pinned, while helper
        # threads may still pin the next.
        copies = sorted((i for i in range(len(self.storages)) if i not in self.kept), key=self.slots.__getitem__)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in copies:
                self._slot(i).copy_(_bytes_view(self.storages[i]), non_blocking=True)
        stream.synchronize()
        for storage in self.storages:
            storage.resize_(0)
        self.away, self.arrived = set(range(len(self.storages))), None
        self.kept = self._constant_storages()
        return sum(self.sizes[i] for i in copies)

    def _constant_storages(self) -> set[int]:
        """Positions of the storages behind constant tensors only (one changing tensor on a
        storage makes it change)."""
        if self.constant is None:
            return set()
        changing = {self.index[id(t)] for t in self.tensors if not self.constant(t)}
        return set(range(len(self.storages))) - changing

    def onload(self, stream: torch.cuda.Stream, tensors: Iterable[torch.Tensor] | None = None) -> int:
        """Allocate the storages again (only those behind `tensors`, when given) on the current
        stream and queue their copies home on `stream`; `wait` orders the current stream after them.
        The group is back once every storage is."""
        chosen = self.away if tensors is None else {self.index[id(t)] for t in tensors if id(t) in self.index}
        todo = sorted(chosen & self.away)
        if not todo:
            return 0
        for i in todo:
            self.storages[i].resize_(self.sizes[i])
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in todo:
                _bytes_view(self.storages[i]).copy_(self._slot(i), non_blocking=True)
        self.arrived = stream.record_event()
        self.away.difference_update(todo)
        if not self.away:
            self.tensors, self.index = [], {}
        return sum(self.sizes[i] for i in todo)

    def wait(self) -> None:
        if self.arrived is not None:
            torch.cuda.current_stream().wait_event(self.arrived)
            self.arrived = None

    def reserve_device(self) -> None:
        """Before the storages on the host come back: one device allocation the size of their large
        ones, freed at once. The caching allocator keeps it as one segment and carves them from it,
        so their return costs one cudaMalloc, and their release by torch.cuda.empty_cache one
        cudaFree, instead of one each (a 1.5B model's 340 parameter storages took 70 ms of host
        time a step in cudaMalloc and 40 ms in cudaFree, with the device idle)."""
        large = [self.sizes[i] for i in self.away if self.sizes[i] > _SMALL]
        if not large or self.storages[0].device.type != "cuda":
            return
        try:
            torch.empty(sum(-(-n // _BLOCK) * _BLOCK for n in large), dtype=torch.uint8, device=self.storages[0].device)
        except torch.OutOfMemoryError:  # no free piece that large: they come back one by one
            pass


class StateOffloader:
    """Named groups of device tensors that go to the host and come back together.

    `register(tag, source, constant)` names a group; `source()` returns its tensors at offload time
    (so gradients and lazily created state are found as they are then), `constant(t)` says whether
    a tensor's bytes never change once built ("pinned": copied out at the first offload only).
    Under "tms" the group's tensors must be allocated inside `region(tag)`; under "pinned" that
    context does nothing.
    """

    def __init__(self, method: str, device: torch.device):
        if method not in OFFLOAD_METHODS:
            raise ValueError(f"offload.method={method!r} must be one of {OFFLOAD_METHODS}")
        self.method, self.device = method, device
        self.enabled = device.type == "cuda"
        self.groups: dict[str, _PinnedGroup] = {}
        self.paused: set[str] = set()
        self._stream = torch.cuda.Stream(device) if self.enabled and method == "pinned" else None
        self._tms = memory_saver_handle() if self.enabled and method == "tms" else None

    def register(self, tag: str, source: TensorSource, constant: ConstantTest | None = None) -> None:
        assert tag not in self.groups, f"offload group {tag!r} registered twice"
        self.groups[tag] = _PinnedGroup(source, constant)

    def region(self, tag: str):
        if self._tms is None:
            return contextlib.nullcontext()
        return self._tms.region(tag=tag, enable_cpu_backup=True)

    def is_offloaded(self, tag: str) -> bool:
        return self.groups[tag].offloaded or tag in self.paused

    def away_bytes(self, tag: str) -> int:
        """Bytes of this group still on the host ("pinned"; 0 otherwise)."""
        group = self.groups[tag]
        return sum(group.sizes[i] for i in group.away)

    def reserve(self, tags: Iterable[str]) -> float:
        """Lay out the pinned buffers of these groups (not yet offloaded) for their tensors as they
        are now, and start pinning them on helper threads, in this order; returns the seconds this
        took (the layout, not the pinning). An offload waits for just the pieces it copies into,
        each when it first needs it (`wait_seconds` adds up those waits), and raises any error
        pinning it raised. Without a reservation the first offload allocates them."""
        start = time.perf_counter()
        if self._stream is not None:
            groups = [self.groups[tag] for tag in tags if not self.groups[tag].offloaded]
            for group in groups:
                group.prepare()
            pin_in_background([group.pieces for group in groups], self.device)
        return time.perf_counter() - start

    @property
    def wait_seconds(self) -> float:
        """Seconds offloads and onloads have spent on pinned buffers not yet there (waiting for the
        helper threads of `reserve`, or allocating)."""
        return sum(
            g.earlier_wait_seconds + (g.pieces.wait_seconds if g.pieces is not None else 0.0) for g in self.groups.values()
        )

    def offload(self, tags: Iterable[str]) -> OffloadStats:
        return self._move(list(tags), to_host=True)

    def onload(self, tags: Iterable[str], wait: bool = True) -> OffloadStats:
        """Bring these groups back. With `wait=False` ("pinned" only) the copies are just queued on
        the side stream, to overlap whatever the device does next: call `wait(tags)` before any
        use of those tensors. The statistics then hold the bytes and no time."""
        return self._move(list(tags), to_host=False, wait=wait)

    def onload_part(self, tag: str, tensors: Iterable[torch.Tensor], stream: torch.cuda.Stream | None = None) -> int:
        """Queue home just the storages behind `tensors` of an offloaded group ("pinned" only; under
        "tms" or on CPU nothing moves): the part of the state needed next, into memory the device
        freed just now. They are allocated on `stream` (default: the current one), whose work so
        far the copies wait for. Returns the bytes queued; `wait(tag)` before using them."""
        if self._stream is None or not self.groups[tag].offloaded:
            return 0
        with torch.cuda.stream(stream or torch.cuda.current_stream()):
            return self.groups[tag].onload(self._stream, tensors)

    def onload_parts(self, tag: str, parts: Iterable[Iterable[torch.Tensor]]) -> tuple[list[torch.cuda.Event | None], int]:
        """Queue an offloaded group home part by part, in this order, then whatever no part named
        ("pinned" only): each part's storages not queued with an earlier part, its event marking
        their arrival (None for a part with nothing left). Returns the events and the bytes queued;
        no events where nothing moves this way (CPU, "tms", a group on the device)."""
        if self._stream is None or not self.groups[tag].offloaded:
            return [], 0
        group, events, num_bytes = self.groups[tag], [], 0
        group.reserve_device()
        for tensors in parts:
            moved = group.onload(self._stream, tensors)
            events.append(group.arrived if moved else None)
            num_bytes += moved
        return events, num_bytes + group.onload(self._stream)

    def wait(self, tags: Iterable[str]) -> None:
        """Order the current stream after the pending onloads of these groups (no host wait)."""
        for tag in tags:
            self.groups[tag].wait()

    def _move(self, tags: list[str], to_host: bool, wait: bool = True) -> OffloadStats:
        for tag in tags:
            if tag not in self.groups:
                raise KeyError(f"unknown offload group {tag!r}; registered: {sorted(self.groups)}")
        if not self.enabled:
            return OffloadStats()
        if wait or self._tms is not None:  # a queued pinned onload neither waits nor is timed
            torch.cuda.synchronize()
        start = time.perf_counter()
        num_bytes = 0
        for tag in tags:
            if self._tms is None:
                group = self.groups[tag]
                if not to_host:
                    group.reserve_device()
                num_bytes += group.offload(self._stream) if to_host else group.onload(self._stream)
            elif to_host != (tag in self.paused):
                num_bytes += sum(s.nbytes() for s in _storages(self.groups[tag].source()))
                (self._tms.pause if to_host else self._tms.resume)(tag)
                (self.paused.add if to_host else self.paused.discard)(tag)
        if not wait:
            return OffloadStats(num_bytes)
        self.wait(tags)
        torch.cuda.synchronize()
        return OffloadStats(num_bytes, time.perf_counter() - start)
