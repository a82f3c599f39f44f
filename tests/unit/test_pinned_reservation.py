"""The offload's host buffers pinned behind the start-up: helper threads allocate each piece once,
the first use waits for just its piece, and a helper's error is raised there. On CPU the pieces are
plain host buffers (pinning needs CUDA); a GPU test runs the real pinned path."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from colocate.trainer.host_buffers import HostPieces, pin_in_background


class Allocator:
    """Plain host buffers; counts every allocation and can hold one size back until released."""

    def __init__(self, held: int | None = None, fails: int | None = None):
        self.calls: list[tuple[int, str]] = []
        self.held, self.fails = held, fails
        self.release, self.started = threading.Event(), threading.Event()
        self.lock = threading.Lock()

    def __call__(self, num_bytes: int) -> torch.Tensor:
        with self.lock:
            self.calls.append((num_bytes, threading.current_thread().name))
        if num_bytes == self.fails:
            raise MemoryError(f"no host memory for {num_bytes} bytes")
        if num_bytes == self.held:
            self.started.set()
            assert self.release.wait(10)
        return torch.full((num_bytes,), 7, dtype=torch.uint8)


def join(threads):
    for t in threads:
        t.join(10)
        assert not t.is_alive()


def test_helpers_allocate_every_piece_once_off_the_calling_thread():
    alloc = Allocator()
    groups = [HostPieces([100, 200, 300], alloc), HostPieces([], alloc), HostPieces([400], alloc)]
    join(pin_in_background(groups, num_threads=3))
    assert sorted(n for n, _ in alloc.calls) == [100, 200, 300, 400]
    assert all(name.startswith("colocate-pin") for _, name in alloc.calls)
    assert [groups[0].get(i).numel() for i in range(3)] == [100, 200, 300] and groups[2].get(0).numel() == 400
    assert groups[0].get(1) is groups[0].get(1)  # a second use allocates nothing
    assert len(alloc.calls) == 4 and groups[0].wait_seconds == 0.0


def test_the_first_use_waits_for_just_its_piece():
    """Piece 1 is held back in its helper: piece 0 is there at once, piece 1's use waits until the
    helper is done (and is counted), and nobody allocates it a second time meanwhile."""
    alloc = Allocator(held=200)
    pieces = HostPieces([100, 200, 300], alloc)
    threads = pin_in_background([pieces], num_threads=2)
    assert alloc.started.wait(10)
    assert pieces.get(0).numel() == 100
    got = []
    user = threading.Thread(target=lambda: got.append(pieces.get(1)))
    user.start()
    time.sleep(0.2)
    assert not got  # still waiting for the helper
    alloc.release.set()
    user.join(10)
    join(threads)
    assert got[0].numel() == 200 and torch.all(got[0] == 7)
    assert sorted(n for n, _ in alloc.calls) == [100, 200, 300]  # nothing twice
    assert pieces.wait_seconds >= 0.2


def test_a_piece_no_helper_has_begun_is_allocated_by_its_first_user():
    alloc = Allocator()
    pieces = HostPieces([100, 200], alloc)
    assert pieces.get(1).numel() == 200 and alloc.calls == [(200, threading.current_thread().name)]
    join(pin_in_background([pieces], num_threads=2))  # the helpers find only piece 0 left
    assert sorted(n for n, _ in alloc.calls) == [100, 200]


def test_an_error_in_a_helper_is_raised_by_the_first_use_of_its_piece():
    alloc = Allocator(fails=200)
    pieces = HostPieces([100, 200, 300, 400], alloc)
    join(pin_in_background([pieces], num_threads=1))
    # The helper stopped at its failure: the pieces after it are left to their first use.
    assert [n for n, _ in alloc.calls] == [100, 200]
    assert pieces.get(0).numel() == 100
    with pytest.raises(MemoryError, match="no host memory for 200 bytes") as first:
        pieces.get(1)
    with pytest.raises(MemoryError) as again:
        pieces.get(1)
    assert again.value is first.value  # the helper's own exception, every time
    assert pieces.get(3).numel() == 400 and [n for n, _ in alloc.calls] == [100, 200, 400]


def test_a_replaced_layout_begins_no_more_pieces_and_lets_go_of_its_buffers():
    alloc = Allocator()
    pieces = HostPieces([100, 200], alloc)
    first = pieces.get(0)
    pieces.cancel()
    join(pin_in_background([pieces], num_threads=2))
    assert alloc.calls == [(100, threading.current_thread().name)]
    assert pieces._pieces == [None, None] and first.numel() == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_first_offload_waits_for_no_pinning_and_the_next_copies_into_the_pinned_pieces(monkeypatch):
    """A reservation pins on helper threads (the calling thread returns at once). With the pinning
    held back, the first offload copies into pageable stand-ins without waiting; once the pieces
    are pinned, the second copies into them. The bytes come back exactly both times."""
    from colocate.trainer import host_buffers, offload
    from colocate.trainer.offload import StateOffloader

    monkeypatch.setattr(offload, "_PIECE", 1 << 20)
    tensors = [torch.randn(1 << 18, device="cuda") for _ in range(6)]  # 1 MiB each: 6 pieces
    saved = [t.clone() for t in tensors]
    release, made, pin = threading.Event(), [], host_buffers.pin

    def held_pin(num_bytes):
        assert release.wait(10)
        made.append(threading.current_thread().name)
        return pin(num_bytes)

    monkeypatch.setattr(host_buffers, "pin", held_pin)
    offloader = StateOffloader("pinned", torch.device("cuda"))
    offloader.register("g", lambda: tensors)
    assert offloader.reserve(["g"]) < 1.0
    stats = offloader.offload(["g"])
    assert stats.num_bytes == stats.pageable_bytes == 6 << 20 and stats.pinned_wait_s == 0.0 and not made
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    release.set()
    offloader.onload(["g"])
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))
    stats = offloader.offload(["g"])
    assert stats.num_bytes == 6 << 20 and stats.pageable_bytes == 0
    pieces = offloader.groups["g"].pieces
    assert len(made) == 6 and all(pieces.get(i).is_pinned() for i in range(6))  # each pinned once
    offloader.onload(["g"])
    assert all(torch.equal(t, s) for t, s in zip(tensors, saved))
