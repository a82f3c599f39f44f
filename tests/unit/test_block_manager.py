import pytest

from colocate.rollout.native.block_manager import BlockManager


def test_allocate_and_free_account_for_every_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    a = bm.allocate(2)
    b = bm.allocate(3)
    assert bm.num_free_blocks == 1
    assert len(set(a + b)) == 5 and all(bm.ref_counts[x] == 1 for x in a + b)
    bm.free(a)
    assert a == [] and bm.num_free_blocks == 3
    c = bm.allocate(3)
    assert bm.num_free_blocks == 0 and not set(c) & set(b)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and bm.ref_counts == [0] * 6


def test_blocks_for_rounds_up():
    bm = BlockManager(num_blocks=4, block_size=16)
    assert [bm.blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_shared_blocks_are_freed_only_by_the_last_owner():
    bm = BlockManager(num_blocks=4, block_size=4)
    owner = bm.allocate(2)
    sharers = [bm.share(owner) for _ in range(3)]
    assert [bm.ref_counts[b] for b in owner] == [4, 4]
    assert bm.num_free_blocks == 2
    for table in sharers:
        bm.free(table)
    assert bm.num_free_blocks == 2 and [bm.ref_counts[b] for b in owner] == [1, 1]
    bm.free(owner)
    assert bm.num_free_blocks == 4


def test_write_copies_a_shared_partial_block_once_per_writer():
    # A 6-token prompt in blocks of 4: one full block, one partly filled, shared by 3 samples.
    bm = BlockManager(num_blocks=8, block_size=4)
    s0 = bm.allocate(2)
    full, partial = s0
    s1, s2 = bm.share(s0), bm.share(s0)
    # Each sample writes its first generated token at position 6 (in the partial block).
    assert bm.blocks_to_write(s1, 6, 7) == 1
    copies1 = bm.write(s1, 6, 7)
    copies2 = bm.write(s2, 6, 7)
    assert bm.blocks_to_write(s0, 6, 7) == 0  # the last holder writes in place
    copies0 = bm.write(s0, 6, 7)
    assert copies0 == [] and s0 == [full, partial]
    assert [src for src, _ in copies1 + copies2] == [partial, partial]
    dsts = [dst for _, dst in copies1 + copies2]
    assert s1 == [full, dsts[0]] and s2 == [full, dsts[1]] and len(set(dsts + [partial])) == 3
    assert bm.ref_counts[full] == 3 and bm.ref_counts[partial] == 1
    assert bm.num_free_blocks == 8 - 4


def test_write_grows_the_table_across_block_boundaries():
    bm = BlockManager(num_blocks=8, block_size=4)
    table = bm.allocate(1)
    # Positions 3..9 touch blocks 0, 1 and 2: two new blocks.
    assert bm.blocks_to_write(table, 3, 10) == 2
    assert bm.write(table, 3, 10) == []
    assert len(table) == 3 and bm.num_free_blocks == 5
    assert bm.blocks_to_write(table, 10, 12) == 0  # still inside block 2


def test_write_of_a_shared_block_at_a_boundary_takes_a_new_block_and_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    s0 = bm.allocate(1)  # a 4-token prompt: exactly one full block
    s1 = bm.share(s0)
    assert bm.blocks_to_write(s1, 4, 5) == 1
    assert bm.write(s1, 4, 5) == []
    assert s1[0] == s0[0] and len(s1) == 2 and bm.ref_counts[s0[0]] == 2


def test_invalid_sizes_are_rejected():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
