"""A layout's first offload waits for no pinning: storages that hold only zeros stay behind (and
come back as zeros), the rest of what is not pinned yet goes to pageable stand-ins, which a mover
copies into their pieces once pinned. Later offloads copy into the pinned pieces. Helpers pin
reservations in order and pause at a gate; torch pins by page registration, keeping the
environment's allocator settings, and goes back to cudaHostAlloc where registration is refused.
On CPU the group moves CPU storages between plain host buffers, with the pinning faked (held back
until released)."""

from __future__ import annotations

import threading

import pytest
import torch

from colocate.colocation.handoff import Colocation
from colocate.config import OffloadConfig
from colocate.trainer import host_buffers, offload
from colocate.trainer.host_buffers import HostPieces, Pinner
from colocate.trainer.offload import OffloadStats, _PinnedGroup


class HeldPinning:
    """Stands in for `pin`: plain host buffers, each allocation held until `release` is set."""

    def __init__(self):
        self.release, self.calls, self.lock = threading.Event(), [], threading.Lock()

    def __call__(self, num_bytes: int) -> torch.Tensor:
        assert self.release.wait(10)
        with self.lock:
            self.calls.append(num_bytes)
        return torch.full((num_bytes,), 7, dtype=torch.uint8)


@pytest.fixture
def pinning(monkeypatch):
    monkeypatch.setattr(offload, "_PIECE", 4096)  # a piece per 4 KiB: several pieces from small tensors
    held = HeldPinning()
    monkeypatch.setattr(host_buffers, "pin", held)
    return held


def state():
    """A parameter, two moments of zeros as a fresh optimizer has them (one a view of a larger
    storage), a -0.0 (bytes not all zero) and a step count of 0."""
    moments = torch.zeros(2048)
    return [torch.randn(1024), moments[:1024], moments[1024:], torch.zeros(1000), torch.tensor([-0.0]), torch.zeros(())]


def storage_bytes(tensors) -> list[bytes]:
    return [bytes(t.untyped_storage()) for t in tensors]


def test_zeros_stay_behind_and_the_rest_goes_to_stand_ins_without_waiting(pinning):
    tensors = state()
    saved = [t.clone() for t in tensors]
    group = _PinnedGroup(lambda: tensors, device_type="cpu")
    stats = group.offload(None)
    zero_bytes = (2048 + 1000) * 4 + 4  # the moments' storage, the zeros and the step count
    assert stats.num_bytes == 1024 * 4 + 2048 * 4 + 1000 * 4 + 4 + 4  # every storage left the device
    assert stats.zero_bytes == zero_bytes and stats.pageable_bytes == stats.num_bytes - zero_bytes
    assert not pinning.calls and group.pieces.wait_seconds == 0.0  # nothing pinned, nothing waited for
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    assert group.onload(None) == stats.num_bytes  # while the pinning is still held back
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))
    assert torch.equal(tensors[4], saved[4]) and torch.signbit(tensors[4]).item()  # -0.0 was copied
    pinning.release.set()
    group._join_mover()
    # The mover pinned the two pieces with stand-ins (the moments' piece holds zeros only: the
    # offloader's helpers pin that one) and let the stand-ins go.
    assert group.pieces.sizes == [8192, 8192, 1024] and sorted(pinning.calls) == [1024, 8192]
    assert not group.standins


def test_the_next_offload_copies_every_storage_into_the_pinned_pieces(pinning):
    tensors = state()
    group = _PinnedGroup(lambda: tensors, device_type="cpu")
    group.offload(None)
    group.onload(None)
    with torch.no_grad():
        tensors[0].add_(1.0)
        tensors[1].fill_(0.5)  # the first step wrote the moments
    expected = storage_bytes(tensors)
    pinning.release.set()
    stats = group.offload(None)
    assert stats.zero_bytes == stats.pageable_bytes == 0 and stats.num_bytes == sum(group.sizes)
    assert not group.standins and len(pinning.calls) == len(group.pieces.sizes)
    group.onload(None)
    assert storage_bytes(tensors) == expected


def test_a_later_offload_waits_for_a_piece_still_pinning(pinning):
    tensors = [torch.randn(1024) for _ in range(3)]  # 4 KiB each: 3 pieces
    group = _PinnedGroup(lambda: tensors, device_type="cpu")
    group.offload(None)
    group.onload(None)
    waiting = threading.Timer(0.3, pinning.release.set)
    waiting.start()
    group.offload(None)  # joins the mover, which waits for the pieces
    waiting.join()
    assert group.earlier_wait_seconds >= 0.2
    group.onload(None)


def test_constant_storages_are_kept_once_their_stand_in_is_in_its_piece(pinning):
    """The frozen base under LoRA: copied out once, to a stand-in; once the mover has put it in its
    pinned piece, later offloads copy only what changes, and every return brings its bytes back."""
    frozen, trained = torch.randn(1024), torch.randn(1024)
    frozen.requires_grad_(False)
    trained.requires_grad_(True)
    tensors = [frozen, trained]
    expected = frozen.clone()
    group = _PinnedGroup(lambda: tensors, constant=lambda t: not t.requires_grad, device_type="cpu")
    assert group.offload(None).pageable_bytes == 2 * 4096
    pinning.release.set()
    group.onload(None)
    group._join_mover()
    assert group.kept == {0} and not group.standins
    for step in range(2):
        with torch.no_grad():
            trained.fill_(step)
        assert group.offload(None).num_bytes == 4096, step  # the frozen bytes stayed on the host
        group.onload(None)
        assert torch.equal(frozen, expected) and torch.equal(trained, torch.full((1024,), float(step))), step


def test_a_piece_pinned_already_takes_the_first_offload_copy(pinning):
    tensors = [torch.randn(1024) for _ in range(2)]
    group = _PinnedGroup(lambda: tensors, device_type="cpu")
    group.prepare()
    pinning.release.set()
    group.pieces.get(0)  # pinned before the offload comes
    stats = group.offload(None)
    assert stats.pageable_bytes == 4096 and set(group.standins) <= {1}
    group.onload(None)
    group._join_mover()
    assert not group.standins


def test_a_failed_pinning_leaves_the_stand_in_and_is_raised_by_the_next_offload(monkeypatch):
    monkeypatch.setattr(offload, "_PIECE", 4096)

    def fails(num_bytes):
        raise MemoryError(f"no host memory for {num_bytes} bytes")

    monkeypatch.setattr(host_buffers, "pin", fails)
    tensors = [torch.randn(1024)]
    saved = tensors[0].clone()
    group = _PinnedGroup(lambda: tensors, device_type="cpu")
    group.offload(None)
    group._join_mover()  # it stopped at the failure
    assert list(group.standins) == [0]
    group.onload(None)
    assert torch.equal(tensors[0], saved)  # from the stand-in
    with pytest.raises(MemoryError, match="no host memory for 4096 bytes"):
        group.offload(None)


def test_helpers_pin_reservations_in_the_order_they_come_and_pause_at_the_gate():
    order, lock = [], threading.Lock()

    def alloc(num_bytes):
        with lock:
            order.append(num_bytes)
        return torch.empty(num_bytes, dtype=torch.uint8)

    pinner = Pinner(num_threads=1)
    pinner.gate.clear()
    first, second = HostPieces([1, 2], alloc), HostPieces([3], alloc)
    threads = pinner.add([first])
    threads += pinner.add([second])  # queued behind the first: no second helper beyond num_threads
    assert len(threads) == 1 and first.helped and second.helped
    threading.Event().wait(0.1)
    assert order == []  # the gate holds the helper before its first piece
    pinner.gate.set()
    for thread in threads:
        thread.join(10)
    assert order == [1, 2, 3]
    assert pinner.add([HostPieces([4], alloc)])  # the helper ended: a new one starts


def test_registered_pinning_keeps_the_environments_allocator_settings(monkeypatch):
    calls, ours = [], "pinned_use_cuda_host_register:True,pinned_num_register_threads:2"
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    for given, expected in [
        (None, ours),
        ("expandable_segments:False", f"expandable_segments:False,{ours}"),  # named again: setting resets the rest
        ("pinned_use_cuda_host_register:False", None),  # the user's choice stands
    ]:
        monkeypatch.setattr(host_buffers, "_pinning_chosen", False)
        monkeypatch.setattr(host_buffers, "_registering", False)
        monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
        if given is None:
            monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
        else:
            monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", given)
        calls.clear()
        host_buffers.use_registered_pinning()
        host_buffers.use_registered_pinning()  # once per process
        assert calls == ([] if expected is None else [expected]), given
        assert host_buffers._registering == (expected is not None), given


def test_a_refused_registration_goes_back_to_cuda_host_alloc(monkeypatch):
    """The first failed pinning by registration switches the process to cudaHostAlloc, with a
    warning, and pins again (here, on CPU, that fails too, and its error is raised)."""
    switched = []
    monkeypatch.setattr(host_buffers, "_registering", True)
    monkeypatch.setattr(host_buffers, "_allocator_settings", switched.append)
    with pytest.warns(UserWarning, match="page registration failed"), pytest.raises(RuntimeError):
        host_buffers.pin(16)
    assert switched == [{"pinned_use_cuda_host_register": "False"}] and not host_buffers._registering
    with pytest.raises(RuntimeError):  # not registering: an error is the error
        host_buffers.pin(16)
    assert len(switched) == 1


class FakeMemory:
    def offload(self, *tags):
        return OffloadStats(3 << 30, 0.5, pageable_bytes=1 << 30, zero_bytes=2 << 30, pinned_wait_s=0.0)


def test_the_start_up_offload_reports_what_went_to_pageable_memory_and_what_stayed_behind():
    trainer = type("Trainer", (), {"memory": FakeMemory(), "device": torch.device("cpu"), "lora": None})()
    room = Colocation(trainer, OffloadConfig(offload_train=True), dtype=torch.float32, bucket_bytes=1 << 20).make_room()
    assert room.transfer_metrics() == {
        "handoff/trainer_offload_gib": 3.0,
        "handoff/trainer_offload_s": 0.5,
        "handoff/trainer_offload_pageable_gib": 1.0,
        "handoff/trainer_offload_zeros_gib": 2.0,
    }
    assert room.transfer_metrics("handoff/first_sync/")["handoff/first_sync/trainer_offload_gib"] == 3.0
