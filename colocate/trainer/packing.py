"""Which samples go into which micro-batch and which optimizer step: pure integer bookkeeping.

A micro-batch is a list of sample indices whose tokens are concatenated (packed, no padding) and
run through the model as one varlen forward. The token budget `max_tokens` bounds its size, which
bounds activation memory; a sample longer than the budget gets a micro-batch of its own.

Within the budget, the samples are spread over the micro-batches so that their token counts are
as even as the longest-first greedy rule makes them (each sample, longest first, goes to the
currently lightest micro-batch): even micro-batches mean no one of them sets the memory peak
alone and every forward does a similar amount of work.

Every rank must run the same number of micro-batches, because each forward and backward of an
FSDP model is a collective. The caller takes the largest count over ranks (all_reduce_max) and
asks for exactly that many; a rank with fewer samples than that gets empty micro-batches, which
it still runs (on a dummy sequence, contributing zero).
"""

from __future__ import annotations

import heapq
from typing import Sequence


def balanced_partition(lengths: Sequence[int], num_parts: int) -> list[list[int]]:
    """Split sample indices into exactly `num_parts` lists with near-equal length sums.

    Longest first, each index goes to the part with the smallest sum so far (ties: lowest part).
    Indices within a part are in increasing order; parts may be empty when there are fewer
    samples than parts.
    """
    if num_parts < 1:
        raise ValueError(f"num_parts must be >= 1, got {num_parts}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    heap = [(0, part) for part in range(num_parts)]
    parts: list[list[int]] = [[] for _ in range(num_parts)]
    for i in order:
        load, part = heapq.heappop(heap)
        parts[part].append(i)
        heapq.heappush(heap, (load + lengths[i], part))
    return [sorted(p) for p in parts]


def _fits(parts: list[list[int]], lengths: Sequence[int], max_tokens: int) -> bool:
    return all(len(p) <= 1 or sum(lengths[i] for i in p) <= max_tokens for p in parts)


def pack_micro_batches(lengths: Sequence[int], max_tokens: int, num_micro_batches: int | None = None) -> list[list[int]]:
    """Micro-batches (lists of sample indices) under a token budget.

    Without `num_micro_batches`: the fewest balanced micro-batches in which every micro-batch with
    more than one sample holds at most `max_tokens` tokens. With it (at least that fewest count,
    as agreed over ranks): exactly that many, balanced over all of them, padded with empty ones
    when the samples run out. Samples over the budget each get their own micro-batch.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sample must have at least one token")
    big = [i for i, n in enumerate(lengths) if n > max_tokens]
    small = [i for i, n in enumerate(lengths) if n <= max_tokens]
    small_lengths = [lengths[i] for i in small]

    def split(num_parts: int) -> list[list[int]] | None:
        if num_parts < 1:
            return [] if not small else None
        parts = balanced_partition(small_lengths, num_parts)
        if not _fits(parts, small_lengths, max_tokens):
            return None
        return [[small[i] for i in p] for p in parts]

    fewest = -(-sum(small_lengths) // max_tokens)
    parts = split(fewest)
    while parts is None:
        fewest += 1
        parts = split(fewest)
    packed = [[i] for i in big] + [p for p in parts if p]
    if num_micro_batches is None:
        return packed
    if num_micro_batches < len(packed):
        raise ValueError(f"num_micro_batches={num_micro_batches} is fewer than the {len(packed)} the budget needs")
    # More micro-batches than needed: rebalance the small samples over all the extra room.
    wider = split(num_micro_batches - len(big))
    if wider is not None:
        packed = [[i] for i in big] + wider
    return packed + [[] for _ in range(num_micro_batches - len(packed))]


def step_slices(num_samples: int, samples_per_step: int | None, num_steps: int | None = None) -> list[range]:
    """Consecutive sample ranges, one per optimizer step (the last may be short, some empty).

    `samples_per_step` None means one step over everything; `num_steps` (the count agreed over
    ranks) pads with empty ranges so every rank runs the same number of steps.
    """
    if samples_per_step is None:
        slices = [range(num_samples)]
    else:
        if samples_per_step < 1:
            raise ValueError(f"samples_per_step must be >= 1, got {samples_per_step}")
        slices = [range(s, min(s + samples_per_step, num_samples)) for s in range(0, num_samples, samples_per_step)] or [range(0)]
    if num_steps is not None:
        if num_steps < len(slices):
            raise ValueError(f"num_steps={num_steps} is fewer than the {len(slices)} steps needed")
        slices += [range(num_samples, num_samples)] * (num_steps - len(slices))
    return slices
