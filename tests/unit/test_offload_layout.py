"""The pinned offloader's layout: slots in pieces that torch's pinned allocator, which rounds every
allocation up to a power of two, pins with little waste."""

from colocate.trainer import offload
from colocate.trainer.offload import pinned_layout


def pinned_bytes(pieces):
    """What torch's pinned allocator takes for these allocations (each rounded up to a power of two)."""
    return sum(1 << (n - 1).bit_length() for n in pieces)


def check_slots(sizes, slots, pieces):
    ends = {}
    for size, (piece, offset) in zip(sizes, slots, strict=True):
        assert offset % 512 == 0 and offset >= ends.get(piece, 0)  # aligned, placed in turn, no overlap
        ends[piece] = offset + size
        assert ends[piece] <= pieces[piece]
    assert sorted(ends) == list(range(len(pieces)))


def test_small_pieces_hold_each_storage_whole(monkeypatch):
    monkeypatch.setattr(offload, "_PIECE", 4096)
    sizes = [8192, 4000, 56, 1]
    slots, pieces = pinned_layout(sizes)
    assert slots == [(0, 0), (1, 0), (1, 4096), (1, 4608)] and pieces == [8192, 5120]
    check_slots(sizes, slots, pieces)
    slots, pieces = pinned_layout([6000, 4000, 1000])  # the last fills the first piece's gap
    assert slots == [(0, 0), (1, 0), (0, 6144)] and pieces == [7168, 4096]
    assert pinned_layout([]) == ([], [])


def test_an_optimizer_group_pins_close_to_its_bytes():
    """A 1.5B model's fp32 gradients and AdamW moments (Qwen2.5-1.5B shapes, 18.5 GB): one buffer
    pinned 32 GiB; the pieces pin within 3% of the bytes. A storage above a piece's size (here a
    1.5 GiB embedding) raises every piece to the power of two that holds it."""
    hidden, inter, vocab, kv = 1536, 8960, 151936, 256
    layer = [
        hidden * hidden,
        hidden,
        kv * hidden,
        kv,
        kv * hidden,
        kv,
        hidden * hidden,
        inter * hidden,
        inter * hidden,
        hidden * inter,
        hidden,
        hidden,
    ]
    params = [vocab * hidden] + layer * 28 + [hidden]
    sizes = [4 * n for n in params for _ in range(3)]
    slots, pieces = pinned_layout(sizes)
    check_slots(sizes, slots, pieces)
    assert pinned_bytes([sum(sizes)]) == 32 << 30
    assert pinned_bytes(pieces) <= 1.02 * sum(sizes), (pinned_bytes(pieces), sum(sizes))
    big = [3 << 29] + sizes  # 1.5 GiB first
    slots, pieces = pinned_layout(big)
    check_slots(big, slots, pieces)
    assert max(pieces) <= 2 << 30 and pinned_bytes(pieces) <= 1.02 * sum(big), (pinned_bytes(pieces), sum(big))
