"""Continuous batching: which sequences run next, prefill or decode, and when they finish.

Pure bookkeeping (no tensors). The unit of admission is a group: the samples of one prompt that
share its prefill. The group's first sequence (the head) computes the prompt; the others hold
references to the same KV blocks and sample their first token from the head's last logits.
Each step is either a prefill step (admitted groups, under a token budget, long prompts chunked)
or a decode step of every running sequence for `num_steps` tokens at once (several decode steps
per host round trip; the few tokens sampled past a stop are discarded). When blocks run out the
most recently admitted sequence is preempted: its blocks are freed and it is recomputed later from
its prompt and generated tokens. Sampling noise depends only on (seed, position), so preemption
and batching never change what is sampled.

Admission backs off after a preemption: it then keeps free the blocks that the admitted sequences'
remaining token budgets would fill, a reservation that fades to nothing over
`RESERVE_FADE_TOKENS` decode tokens without another preemption. Without it, blocks freed by a
finished sequence readmit a preempted one at once, whose context is computed again only to be
preempted again as the others grow (long-tailed lengths on a cache they outgrow: hundreds of
preemptions a step). Until the first preemption nothing is reserved.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from colocate.rollout.native.block_manager import BlockManager
from colocate.rollout.protocol import SamplingParams


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    """Prompt followed by the tokens generated so far (a continued sample starts with the tokens
    it kept when it was aborted: its prefill computes them, as after a preemption)."""
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    """This sample's seed (the prompt's seed + sample index)."""
    stop_ids: frozenset[int]
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens whose K/V is in the cache."""
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_remaining(self) -> int:
        return self.params.max_new_tokens - self.num_output_tokens


@dataclass
class PrefillChunk:
    """Tokens [start, end) of `seq` to compute; when they reach its end, `samplers` (the sequence
    and the group members sharing its blocks) each sample a token from the last logits."""

    seq: Sequence
    start: int
    end: int
    samplers: list[Sequence]


@dataclass
class Batch:
    chunks: list[PrefillChunk] = field(default_factory=list)
    """Prefill work; empty for a decode step."""
    seqs: list[Sequence] = field(default_factory=list)
    """Decode work: each sequence feeds its last token and samples `num_steps` tokens. Longest
    context first: the decode kernel starts its programs in row order
    (colocate/kernels/paged_attention.py)."""
    num_steps: int = 1
    copies: list[tuple[int, int]] = field(default_factory=list)
    """(src, dst) block copies to perform before the forward (copy on write)."""

    @property
    def is_prefill(self) -> bool:
        return bool(self.chunks)


RESERVE_FADE_TOKENS = 1024
"""Decode tokens over which admission's reservation fades from whole budgets to none."""


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_decode_steps: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_decode_steps = max_decode_steps
        self.waiting: deque[list[Sequence]] = deque()
        self.prefilling: deque[list[Sequence]] = deque()
        """Admitted groups whose head's prompt is partly computed (they hold their blocks)."""
        self.running: list[Sequence] = []
        """Decoding sequences, in admission order (the last one is preempted first)."""
        self.num_preemptions = 0
        self.reserve = 0.0
        """The fraction of admitted sequences' remaining budgets that admission keeps free: 1 after
        a preemption, fading to 0 (see the module docstring)."""

    def add(self, group: list[Sequence]) -> None:
        assert group and all(s.prompt_index == group[0].prompt_index for s in group)
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def schedule(self) -> Batch:
        assert self.has_unfinished()
        batch = self._schedule_prefill()
        if batch.chunks:
            return batch
        batch = self._schedule_decode()
        batch.seqs.sort(key=lambda s: s.num_tokens, reverse=True)
        return batch

    def _num_seats_taken(self) -> int:
        return len(self.running) + sum(len(g) for g in self.prefilling)

    def _schedule_prefill(self) -> Batch:
        batch = Batch()
        budget = self.max_num_batched_tokens
        for group in self.prefilling:
            if budget == 0:
                return batch
            budget -= self._add_chunk(batch, group, budget)
        while self.waiting and budget > 0:
            group = self.waiting[0]
            seats = self.max_num_seqs - self._num_seats_taken()
            if seats == 0:
                break
            head = group[0]
            needed = self.blocks.blocks_for(head.num_tokens)
            # Keep a block of headroom per admitted sequence for its first decode write, unless the
            # cache is idle (then anything that fits at all must be admitted, or nothing ever runs).
            idle = not self.running and not self.prefilling
            headroom = 0 if idle else min(len(group), seats) + self._reserved_blocks(group[:seats])
            if needed + headroom > self.blocks.num_free_blocks:
                break
            self.waiting.popleft()
            if len(group) > seats:  # the rest of the group is admitted later, with its own prefill
                self.waiting.appendleft(group[seats:])
                group = group[:seats]
            head.block_table = self.blocks.allocate(needed)
            for seq in group[1:]:
                seq.block_table = self.blocks.share(head.block_table)
            self.prefilling.append(group)
            budget -= self._add_chunk(batch, group, budget)
        return batch

    def _reserved_blocks(self, group: list[Sequence]) -> int:
        """Blocks kept free for growth when `group` is admitted: `reserve` of the remaining budgets
        of the admitted sequences and the group's."""
        if not self.reserve:
            return 0
        admitted = [*self.running, *(s for g in self.prefilling for s in g), *group]
        return self.blocks.blocks_for(int(self.reserve * sum(s.num_remaining for s in admitted)))

    def _add_chunk(self, batch: Batch, group: list[Sequence], budget: int) -> int:
        head = group[0]
        start = head.num_computed
        end = min(head.num_tokens, start + budget)
        batch.chunks.append(PrefillChunk(head, start, end, group if end == head.num_tokens else []))
        return end - start

    def _schedule_decode(self) -> Batch:
        num_steps = min(self.max_decode_steps, min(s.num_remaining for s in self.running))
        needs = [self._blocks_to_decode(s, num_steps) for s in self.running]
        if sum(needs) > self.blocks.num_free_blocks and num_steps > 1:
            num_steps = 1  # short of blocks: advance one token at a time before preempting anyone
            needs = [self._blocks_to_decode(s, num_steps) for s in self.running]
        batch = Batch(num_steps=num_steps)
        self.reserve = max(0.0, self.reserve - num_steps / RESERVE_FADE_TOKENS)
        if sum(needs) <= self.blocks.num_free_blocks:  # the common case: everyone fits
            for seq, need in zip(self.running, needs):
                if need:
                    batch.copies += self._write(seq, num_steps)
            batch.seqs = list(self.running)
            return batch
        queue = deque(self.running)
        while queue:
            seq = queue.popleft()
            while self._blocks_to_decode(seq, num_steps) > self.blocks.num_free_blocks:
                victim = queue.pop() if queue else seq
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.copies += self._write(seq, num_steps)
                batch.seqs.append(seq)
        assert batch.seqs, "a single sequence does not fit in the KV cache"
        return batch

    def _write(self, seq: Sequence, num_steps: int) -> list[tuple[int, int]]:
        # The step writes the K/V of the last token and of the next num_steps - 1 samples.
        return self.blocks.write(seq.block_table, seq.num_computed, seq.num_tokens - 1 + num_steps)

    def _blocks_to_decode(self, seq: Sequence, num_steps: int) -> int:
        return self.blocks.blocks_to_write(seq.block_table, seq.num_computed, seq.num_tokens - 1 + num_steps)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.num_computed = 0
        self.waiting.appendleft([seq])
        self.num_preemptions += 1
        self.reserve = 1.0

    def abort_all(self) -> list[Sequence]:
        """Remove every unfinished sequence (finish reason 'abort') and free its blocks."""
        seqs = [s for g in (*self.waiting, *self.prefilling) for s in g] + self.running
        for seq in seqs:
            self.blocks.free(seq.block_table)
            seq.finish_reason = "abort"
        self.waiting.clear()
        self.prefilling.clear()
        self.running = []
        return seqs

    def postprocess(self, batch: Batch, token_ids: list[list[int]], logprobs: list[list[float]]) -> list[Sequence]:
        """Apply sampled tokens; return the sequences that finished (their blocks are freed).

        Prefill: one token per sampler, in chunk then sampler order (token_ids[i] = [id]).
        Decode: token_ids[i] holds the `num_steps` tokens of batch.seqs[i].
        """
        finished = []
        if batch.is_prefill:
            row = 0
            for chunk in batch.chunks:
                chunk.seq.num_computed = chunk.end
                if not chunk.samplers:
                    continue
                group = self.prefilling.popleft()
                assert group[0] is chunk.seq
                for seq in chunk.samplers:
                    seq.num_computed = chunk.end
                    self.running.append(seq)
                    if self._append(seq, token_ids[row][0], logprobs[row][0]):
                        finished.append(seq)
                    row += 1
            assert row == len(token_ids)
        else:
            for seq, ids, lps in zip(batch.seqs, token_ids, logprobs, strict=True):
                if len(ids) < seq.num_remaining and seq.stop_ids.isdisjoint(ids):
                    # Nothing can finish in this window: take it whole (the common case, and the
                    # host's time per decode step is what the GPU waits on).
                    seq.token_ids += ids
                    seq.logprobs += lps
                    seq.num_computed += len(ids)
                    continue
                for token, lp in zip(ids, lps):
                    seq.num_computed += 1
                    if self._append(seq, token, lp):
                        finished.append(seq)
                        break
        for seq in finished:
            self.running.remove(seq)
            self.blocks.free(seq.block_table)
        return finished

    @staticmethod
    def _append(seq: Sequence, token: int, logprob: float) -> bool:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if token in seq.stop_ids and seq.num_output_tokens > seq.params.min_new_tokens:
            seq.finish_reason = "stop"
        elif seq.num_remaining == 0:
            seq.finish_reason = "length"
        return seq.finish_reason is not None
