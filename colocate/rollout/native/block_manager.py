"""Paged KV-cache bookkeeping in plain integers: which physical blocks a sequence owns.

A sequence's block table lists physical block ids; token j of the sequence lives in block
table[j // block_size] at offset j % block_size. Blocks are reference counted so that the n
completions of one prompt can point at the same prompt blocks: the prompt is prefilled once, and
a shared block is copied (copy on write) only when a sequence is about to write into it. No tensor
is touched here; copies are returned as (src, dst) pairs for the model runner to perform.
"""

from __future__ import annotations


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        # Popped from the end: a freed block is reused first, while its pages are still warm.
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` fresh blocks (reference count 1 each)."""
        assert num_blocks <= len(self._free), f"allocating {num_blocks} blocks with {len(self._free)} free"
        blocks = [self._free.pop() for _ in range(num_blocks)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def share(self, table: list[int]) -> list[int]:
        """A new table pointing at the same blocks (each gains one reference)."""
        for b in table:
            assert self.ref_counts[b] > 0, f"sharing free block {b}"
            self.ref_counts[b] += 1
        return list(table)

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block; blocks nobody references go back to the free list."""
        for b in reversed(table):
            assert self.ref_counts[b] > 0, f"freeing free block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)
        table.clear()

    def blocks_to_write(self, table: list[int], start: int, end: int) -> int:
        """Fresh blocks that `write(table, start, end)` will take: copies of shared blocks plus
        new blocks past the end of the table."""
        assert 0 <= start <= end
        if start == end:
            return 0
        first, last = start // self.block_size, (end - 1) // self.block_size
        count = max(0, last + 1 - len(table))
        ref_counts = self.ref_counts
        for i in range(first, min(last + 1, len(table))):
            if ref_counts[table[i]] > 1:
                count += 1
        return count

    def write(self, table: list[int], start: int, end: int) -> list[tuple[int, int]]:
        """Make token positions [start, end) of this sequence writable: grow the table to cover
        them, and replace each shared block among them by a private copy. Returns the (src, dst)
        block copies the runner must perform before the write."""
        if start == end:
            return []
        copies = []
        first, last = start // self.block_size, (end - 1) // self.block_size
        for i in range(first, min(last + 1, len(table))):
            src = table[i]
            if self.ref_counts[src] > 1:
                (dst,) = self.allocate(1)
                self.ref_counts[src] -= 1
                table[i] = dst
                copies.append((src, dst))
        table.extend(self.allocate(max(0, last + 1 - len(table))))
        return copies
