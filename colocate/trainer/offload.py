"""Move trainer state (parameters, gradients, optimizer state) off the GPU and back, in place.

Colocation needs the trainer's memory back for the rollout engine between training phases, and
the trainer needs its tensors back unchanged afterwards: the same Python objects (FSDP holds its
sharded parameters, the optimizer holds its state by identity), with the same values. Two methods:

- "pinned" (default, faster): every distinct device storage behind the registered tensors is copied
  into a slot of the group's pinned host buffers (allocated once, then reused), on a side stream,
  then the storage is resized to zero. Onload resizes it back and copies the bytes home. The buffers
  are pieces of one power of two (`pinned_layout`): torch's pinned allocator rounds every allocation
  up to a power of two, so one buffer a group pinned up to twice its bytes (a 1.5B model's 18.5 GB
  of gradients and AdamW moments took 32 GiB). Views into a storage (FSDP's padded shard, the
  parameter view) keep working because they reference the storage, not its address.
  A group may name tensors that never change (`constant`: the frozen base under LoRA adapters):
  their bytes are copied out once, and later offloads only free their storages.
- "tms": the tensors are allocated inside a torch_memory_saver region with a CPU backup, and
  offload/onload pause and resume that region. Slower (the library copies through freshly
  allocated pinned memory each time), kept selectable for setups that already use the library.

Pinning is slow, and it stalls every CUDA call of the process while it runs
(colocate/trainer/host_buffers.py), so no start-up waits for it: the first offload of a layout
copies nothing for storages that hold only zeros (a fresh optimizer's state; they come back as
zeros), and copies those whose pieces are not pinned yet into pageable stand-ins, which serve their
return. Helper threads pin the pieces meanwhile (queued by `reserve`, or by that first offload).
Every later offload copies into the pinned pieces, waiting for any still pinning.

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
from colocate.trainer.host_buffers import HostPieces, Pinner, pageable, use_registered_pinning

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
TensorSource = Callable[[], Iterable[torch.Tensor]]
ConstantTest = Callable[[torch.Tensor], bool]


@dataclass
class OffloadStats:
    num_bytes: int = 0
    """Bytes that changed sides: an offload's to the host, an onload's home."""
    seconds: float = 0.0
    pageable_bytes: int = 0
    """Of an offload's bytes, those copied to pageable stand-ins (pieces not pinned yet)."""
    zero_bytes: int = 0
    """Of an offload's bytes, those left behind as zeros (nothing copied; zeros come home)."""
    pinned_wait_s: float = 0.0
    """Seconds spent on pinned pieces not there yet: waiting for a helper, or pinning one."""

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def __add__(self, other: "OffloadStats") -> "OffloadStats":
        return OffloadStats(
            self.num_bytes + other.num_bytes,
            self.seconds + other.seconds,
            self.pageable_bytes + other.pageable_bytes,
            self.zero_bytes + other.zero_bytes,
            self.pinned_wait_s + other.pinned_wait_s,
        )


def _storages(
    tensors: Iterable[torch.Tensor], index: dict[int, int] | None = None, device_type: str = "cuda"
) -> list[torch.UntypedStorage]:
    """Distinct non-empty storages on `device_type` behind these tensors, in first-seen order.
    With `index`, also record there each tensor's (by id) position in that list."""
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
        if storage.device.type != device_type or storage.nbytes() == 0:
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


def _bytes_view(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class _PinnedGroup:
    """One group's storages and their slots in reusable pinned host buffers. `stream` arguments are
    the side stream the copies run on; None runs them on the caller's (a group of CPU storages,
    `device_type` "cpu", moves between plain host buffers: the tests').

    A stand-in (a layout's first offload) lives until a thread of the group's, the mover, has
    copied it into its piece once that is pinned; returns read the stand-in until then, the piece
    after. A constant storage's bytes are kept from then on. The next offload waits for the mover
    (it may copy into the same pieces)."""

    def __init__(self, source: TensorSource, constant: ConstantTest | None = None, device_type: str = "cuda"):
        self.source, self.constant, self.device_type = source, constant, device_type
        self.storages: list[torch.UntypedStorage] = []
        self.sizes: list[int] = []
        self.pieces: HostPieces | None = None  # pinned (see pinned_layout)
        self.slots: list[tuple[int, int]] = []  # (piece, offset) of each storage
        self.fresh = True  # no offload has used this layout yet
        self.away: set[int] = set()  # storages on the host, not yet queued home
        self.zeros: set[int] = set()  # storages left behind as zeros: nothing copied, zeros come home
        self.standins: dict[int, torch.Tensor] = {}  # piece -> pageable buffer in its place
        self.tensors: list[torch.Tensor] = []  # held while offloaded, so that `index`'s ids stay theirs
        self.index: dict[int, int] = {}  # id(tensor) -> its storage's position
        self.arrived: torch.cuda.Event | None = None  # end of an onload not yet waited for
        self.kept: set[int] = set()  # constant storages whose bytes the host holds already
        self.earlier_wait_seconds = 0.0  # the wait_seconds of layouts replaced since, and the mover's
        self._lock = threading.Lock()  # `standins` and `kept`, which the mover changes
        self._mover: threading.Thread | None = None

    @property
    def offloaded(self) -> bool:
        return bool(self.away)

    def _host(self, piece: int, standin: bool = False) -> torch.Tensor:
        """Where a piece's bytes live: its pageable stand-in if it has one, else its pinned buffer.
        With `standin` (an offload, no mover running), a piece not pinned yet gets a stand-in now
        instead of being waited for."""
        if standin and piece not in self.standins and not self.pieces.ready(piece):
            self.standins[piece] = pageable(self.pieces.sizes[piece])
        with self._lock:
            buffer = self.standins.get(piece)
        return self.pieces.get(piece) if buffer is None else buffer

    def _slot(self, i: int, standin: bool = False) -> torch.Tensor:
        piece, offset = self.slots[i]
        return self._host(piece, standin)[offset : offset + self.sizes[i]]

    def prepare(self) -> tuple[list[torch.Tensor], dict[int, int]]:
        """Find the group's storages as they are now; lay out new pinned buffers if their sizes
        differ from the last layout (allocated when first used, unless a `Pinner` pins them before).
        Returns the tensors and their storage positions."""
        tensors, index = [t for t in self.source() if t is not None], {}
        self.storages = _storages(tensors, index, self.device_type)
        sizes = [s.nbytes() for s in self.storages]
        if sizes != self.sizes or self.pieces is None:
            self.sizes = sizes
            self.slots, pieces = pinned_layout(sizes)
            if self.pieces is not None:
                self.pieces.cancel()
                self.earlier_wait_seconds += self.pieces.wait_seconds
            self.pieces = None  # the old pieces go back to torch's pinned cache before the new ones come
            self.pieces = HostPieces(pieces)
            self.fresh, self.kept, self.zeros = True, set(), set()
        return tensors, index

    def _zero_storages(self, positions: list[int]) -> set[int]:
        """Those of these storages whose bytes are all zero (one read of them on the device, one
        wait for its answer)."""
        if not positions:
            return set()
        nonzero = torch.stack([_bytes_view(self.storages[i]).any() for i in positions]).tolist()
        return {i for i, any_set in zip(positions, nonzero) if not any_set}

    def offload(self, stream: torch.cuda.Stream | None) -> OffloadStats:
        """Copy the group out and free its storages. The first offload of a layout copies nothing
        for storages that hold only zeros, and copies those of pieces not pinned yet into pageable
        stand-ins; later ones copy into the pinned pieces, waiting for any still pinning."""
        if self.offloaded:
            return OffloadStats()
        self._join_mover()
        self.standins = {}  # what a mover stopped by a failed pinning left
        self.tensors, self.index = self.prepare()
        todo = [i for i in range(len(self.storages)) if i not in self.kept]
        zeros = self._zero_storages(todo) if self.fresh else set()
        # In slot order: the copies into a piece queue as soon as it is pinned, while helper
        # threads may still pin the next.
        copies = sorted((i for i in todo if i not in zeros), key=self.slots.__getitem__)
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in copies:
                self._slot(i, standin=self.fresh).copy_(_bytes_view(self.storages[i]), non_blocking=True)
        if stream is not None:
            stream.synchronize()
        for storage in self.storages:
            storage.resize_(0)
        self.away, self.arrived = set(range(len(self.storages))), None
        standing_in = {i for i in copies if self.slots[i][0] in self.standins}
        self.zeros = zeros | (self.zeros & self.kept)  # a constant storage of zeros stays one
        constant = self._constant_storages()
        self.kept = constant - standing_in
        self.fresh = False
        if self.standins:
            kept_later = {piece: {i for i in constant & standing_in if self.slots[i][0] == piece} for piece in self.standins}
            self._mover = threading.Thread(
                target=self._move_standins, args=(self.pieces, kept_later), name="colocate-move", daemon=True
            )
            self._mover.start()
        return OffloadStats(
            num_bytes=sum(self.sizes[i] for i in todo),
            pageable_bytes=sum(self.sizes[i] for i in standing_in),
            zero_bytes=sum(self.sizes[i] for i in zeros),
        )

    def _constant_storages(self) -> set[int]:
        """Positions of the storages behind constant tensors only (one changing tensor on a
        storage makes it change)."""
        if self.constant is None:
            return set()
        changing = {self.index[id(t)] for t in self.tensors if not self.constant(t)}
        return set(range(len(self.storages))) - changing

    def onload(self, stream: torch.cuda.Stream | None, tensors: Iterable[torch.Tensor] | None = None) -> int:
        """Allocate the storages again (only those behind `tensors`, when given) on the current
        stream and queue their copies home on `stream`; `wait` orders the current stream after them.
        The group is back once every storage is. (A copy from a stand-in, pageable memory, has read
        it when it returns: the mover may let it go at any time.)"""
        chosen = self.away if tensors is None else {self.index[id(t)] for t in tensors if id(t) in self.index}
        todo = sorted(chosen & self.away)
        if not todo:
            return 0
        for i in todo:
            self.storages[i].resize_(self.sizes[i])
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for i in todo:
                if i in self.zeros:
                    _bytes_view(self.storages[i]).zero_()
                else:
                    _bytes_view(self.storages[i]).copy_(self._slot(i), non_blocking=True)
        self.arrived = stream.record_event() if stream is not None else None
        self.away.difference_update(todo)
        if not self.away:
            self.tensors, self.index = [], {}
        return sum(self.sizes[i] for i in todo)

    def _move_standins(self, pieces: HostPieces, kept_later: dict[int, set[int]]) -> None:
        """The mover: each stand-in, in piece order, into its piece once that is pinned, then let
        go, its constant storages (`kept_later`) kept. Stops at a piece whose pinning failed (the
        next offload raises the error)."""
        for piece in sorted(kept_later):
            try:
                pinned = pieces.get(piece, timed=False)
            except Exception:
                return
            pinned.copy_(self.standins[piece])
            with self._lock:
                del self.standins[piece]
                self.kept |= kept_later[piece]

    def _join_mover(self) -> None:
        if self._mover is not None:
            start = time.perf_counter()
            self._mover.join()
            self._mover = None
            self.earlier_wait_seconds += time.perf_counter() - start

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
    a tensor's bytes never change once built ("pinned": copied to the host once).
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
        self._pinner = Pinner(device)
        if self._stream is not None:
            use_registered_pinning()

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
        """Lay out the pinned buffers of these groups (not yet offloaded) for their storages' sizes
        as they are now, and queue them for the helper threads, which pin reservations in the order
        they come; returns the seconds this took (the layout, not the pinning). An offload waits
        for just the pieces it copies into, each when it first needs it (`wait_seconds` adds up
        those waits; a layout's first offload waits for none), and raises any error pinning it
        raised. A group not reserved has its pieces queued by its first offload."""
        start = time.perf_counter()
        if self._stream is not None:
            groups = [self.groups[tag] for tag in tags if not self.groups[tag].offloaded]
            for group in groups:
                group.prepare()
            self._pinner.add([group.pieces for group in groups if not group.pieces.helped])
        return time.perf_counter() - start

    @property
    def wait_seconds(self) -> float:
        """Seconds offloads and onloads have spent on pinned buffers not yet there (waiting for the
        helper threads, or allocating)."""
        return sum(
            g.earlier_wait_seconds + (g.pieces.wait_seconds if g.pieces is not None else 0.0) for g in self.groups.values()
        )

    def pinned_bytes(self) -> tuple[int, int]:
        """(bytes pinned so far, bytes laid out) of the groups' current layouts ("pinned")."""
        layouts = [g.pieces for g in self.groups.values() if g.pieces is not None]
        return sum(p.ready_bytes() for p in layouts), sum(sum(p.sizes) for p in layouts)

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
        start, waited = time.perf_counter(), self.wait_seconds
        if self._tms is None:
            stats = self._pinned_move([self.groups[tag] for tag in tags], to_host)
        else:
            stats = OffloadStats()
            for tag in tags:
                if to_host != (tag in self.paused):
                    stats.num_bytes += sum(s.nbytes() for s in _storages(self.groups[tag].source()))
                    (self._tms.pause if to_host else self._tms.resume)(tag)
                    (self.paused.add if to_host else self.paused.discard)(tag)
        stats.pinned_wait_s = self.wait_seconds - waited
        if not wait:
            return stats
        self.wait(tags)
        torch.cuda.synchronize()
        stats.seconds = time.perf_counter() - start
        return stats

    def _pinned_move(self, groups: list[_PinnedGroup], to_host: bool) -> OffloadStats:
        stats = OffloadStats()
        if not to_host:
            for group in groups:
                group.reserve_device()
                stats.num_bytes += group.onload(self._stream)
            return stats
        # A layout's first offload copies into stand-ins what is not pinned yet; meanwhile the
        # helpers begin no piece, whose pinning would hold up every copy.
        if any(group.fresh and not group.offloaded for group in groups):
            self._pinner.gate.clear()
        try:
            for group in groups:
                stats += group.offload(self._stream)
        finally:
            self._pinner.gate.set()
        self._pinner.add([g.pieces for g in groups if g.pieces is not None and not g.pieces.helped])  # layouts new here
        return stats
