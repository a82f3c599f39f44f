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

Multi-turn episodes (`NativeEngine.generate_turns`): a sequence that `holds` keeps its blocks when
its turn ends and waits, parked, for its environment's answer. `resume` appends the observation's
tokens and queues the sequence again; its prefill computes only the new tokens, after the history
already in the cache. Sequences that hold blocks without running, parked ones and resumed ones
waiting for admission, are the first to give them up when a running sequence or an admission needs
room (they are recomputed from the start when they run again, as a preempted sequence is).
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
    """One per output token (0.0 for the observation tokens of a multi-turn episode)."""
    finish_reason: str | None = None
    hold: bool = False
    """Multi-turn: keep the blocks when the turn ends (parked until `Scheduler.resume`)."""
    max_output_tokens: int | None = None
    """Output tokens at which the current turn ends by length (None: params.max_new_tokens)."""
    turn_start: int = 0
    """Output index of the current turn's first sampled token."""
    observation_spans: list[tuple[int, int]] = field(default_factory=list)
    """Output index ranges [start, end) of the appended observation tokens."""
    cached_history: int = 0
    """Tokens in the cache when the turn ended: counted against the reuse at the next admission."""
    resumed: bool = False
    """Queued by `resume` and not admitted since."""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_remaining(self) -> int:
        limit = self.params.max_new_tokens if self.max_output_tokens is None else self.max_output_tokens
        return limit - self.num_output_tokens

    @property
    def turn_ids(self) -> list[int]:
        """The tokens sampled in the current (or just ended) turn."""
        return self.token_ids[self.num_prompt_tokens + self.turn_start :]

    @property
    def loss_mask(self) -> list[int]:
        """Per output token: 1 if sampled, 0 if appended as an observation."""
        mask = [1] * self.num_output_tokens
        for start, end in self.observation_spans:
            mask[start:end] = [0] * (end - start)
        return mask


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
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_decode_steps: int):
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_decode_steps = max_decode_steps
        self.waiting: deque[list[Sequence]] = deque()
        self.prefilling: deque[list[Sequence]] = deque()
        """Admitted groups whose head's prompt is partly computed (they hold their blocks)."""
        self.running: list[Sequence] = []
        """Decoding sequences, in admission order (the last one is preempted first)."""
        self.parked: list[Sequence] = []
        """Held sequences whose turn ended, keeping their blocks until resumed or released."""
        self.num_preemptions = 0
        self.num_evictions = 0
        """Parked sequences whose blocks were taken for others (they are recomputed on resume)."""
        self.history_tokens = 0
        self.reused_tokens = 0
        """Multi-turn: cached history tokens at the ends of turns, and those still cached when the
        sequence was admitted again (the rest was computed again)."""
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
            # Keep a block of headroom per admitted sequence for its first decode write, unless the
            # cache is idle (then anything that fits at all must be admitted, or nothing ever runs).
            idle = not self.running and not self.prefilling
            headroom = 0 if idle else min(len(group), seats) + self._reserved_blocks(group[:seats])
            if not self._make_room(head, headroom, idle):
                break
            self.waiting.popleft()
            if len(group) > seats:  # the rest of the group is admitted later, with its own prefill
                self.waiting.appendleft(group[seats:])
                group = group[:seats]
            if head.resumed:
                head.resumed = False
                self.history_tokens += head.cached_history
                self.reused_tokens += head.num_computed
            if head.block_table:  # a resumed turn: the history stays, the observation is written
                batch.copies += self.blocks.write(head.block_table, head.num_computed, head.num_tokens)
            else:
                head.block_table = self.blocks.allocate(self.blocks.blocks_for(head.num_tokens))
            for seq in group[1:]:
                seq.block_table = self.blocks.share(head.block_table)
            self.prefilling.append(group)
            budget -= self._add_chunk(batch, group, budget)
        return batch

    def _blocks_to_admit(self, head: Sequence) -> int:
        if head.block_table:
            return self.blocks.blocks_to_write(head.block_table, head.num_computed, head.num_tokens)
        return self.blocks.blocks_for(head.num_tokens)

    def _make_room(self, head: Sequence, headroom: int, idle: bool) -> bool:
        """Whether `head` can be admitted with `headroom` blocks to spare. Parked sequences give
        their blocks up first; on an idle cache, resumed ones queued behind `head` too, then a
        resumed head its own history (an empty cache holds any one sequence, so something runs)."""
        while self._blocks_to_admit(head) + headroom > self.blocks.num_free_blocks:
            if self._evict_idle(exclude=head, queued=idle):
                continue
            if not idle or not head.block_table:
                return False
            self._drop_cache(head)
        return True

    def _evict_idle(self, exclude: Sequence | None = None, queued: bool = True) -> bool:
        """Free the blocks of one sequence that holds them without running: the most recently parked
        one, else (with `queued`) the last resumed one waiting for admission other than `exclude`.
        It is recomputed from the start when it runs again. False if there is none."""
        candidates = list(reversed(self.parked))
        if queued:
            candidates += [g[0] for g in reversed(self.waiting) if g[0] is not exclude]
        for seq in candidates:
            if seq.block_table:
                self._drop_cache(seq)
                self.num_evictions += 1
                return True
        return False

    def _drop_cache(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.num_computed = 0

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
        while sum(needs) > self.blocks.num_free_blocks and self._evict_idle():  # idle blocks go first
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
        """Remove every unfinished sequence, parked ones included (finish reason 'abort'), and free
        its blocks."""
        seqs = [s for g in (*self.waiting, *self.prefilling) for s in g] + self.running + self.parked
        for seq in seqs:
            self.blocks.free(seq.block_table)
            seq.finish_reason = "abort"
        self.waiting.clear()
        self.prefilling.clear()
        self.running, self.parked = [], []
        return seqs

    def resume(self, seq: Sequence, observation_ids: list[int], max_new_tokens: int) -> None:
        """Continue a parked sequence: append the observation and sample up to `max_new_tokens`
        more tokens; it is admitted again ahead of new work, its cached history kept."""
        self.parked.remove(seq)
        start = seq.num_output_tokens
        seq.token_ids += observation_ids
        seq.logprobs += [0.0] * len(observation_ids)
        if observation_ids:
            seq.observation_spans.append((start, seq.num_output_tokens))
        seq.turn_start = seq.num_output_tokens
        seq.max_output_tokens = seq.num_output_tokens + max_new_tokens
        seq.finish_reason = None
        seq.resumed = True
        self.waiting.appendleft([seq])

    def release(self, seq: Sequence) -> None:
        """End a parked sequence: its blocks go back to the free list."""
        self.parked.remove(seq)
        self.blocks.free(seq.block_table)

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
            if seq.hold:
                seq.cached_history = seq.num_computed
                self.parked.append(seq)
            else:
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
