from colocate.rollout.native.block_manager import BlockManager
from colocate.rollout.native.scheduler import Scheduler, Sequence
from colocate.rollout.protocol import SamplingParams


def make_group(prompt, n=1, prompt_index=0, first_id=0, **params):
    sp = SamplingParams(n=n, **params)
    return [
        Sequence(
            seq_id=first_id + j,
            prompt_index=prompt_index,
            sample_index=j,
            token_ids=list(prompt),
            num_prompt_tokens=len(prompt),
            params=sp,
            seed=j,
            stop_ids=frozenset({1}),
        )
        for j in range(n)
    ]


def fake_token(seq, position):
    """A deterministic 'model': never the stop id 1."""
    return 10 + (seq.seq_id * 7 + position) % 50


def run(scheduler, token_fn=fake_token, max_steps=1000):
    """Drive the scheduler to completion; return (finished in order, batches, prefill spans as
    (seq_id, start, end, num_samplers, tokens in the sequence then))."""
    finished, batches, spans = [], [], []
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            return finished, batches, spans
        batch = scheduler.schedule()
        batches.append(batch)
        spans += [(c.seq.seq_id, c.start, c.end, len(c.samplers), c.seq.num_tokens) for c in batch.chunks]
        if batch.is_prefill:
            samplers = [s for c in batch.chunks for s in c.samplers]
            ids = [[token_fn(s, s.num_tokens - 1)] for s in samplers]
        else:
            ids = [[token_fn(s, s.num_tokens - 1 + k) for k in range(batch.num_steps)] for s in batch.seqs]
        finished += scheduler.postprocess(batch, ids, [[0.0] * len(x) for x in ids])
    raise AssertionError("scheduler did not finish")


def test_group_prefills_once_and_shares_prompt_blocks():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=1)
    group = make_group(range(2, 8), n=3, max_new_tokens=2)  # 6 tokens: one full + one partial block
    sched.add(group)
    batch = sched.schedule()
    assert len(batch.chunks) == 1
    chunk = batch.chunks[0]
    assert (chunk.seq, chunk.start, chunk.end, chunk.samplers) == (group[0], 0, 6, group)
    assert all(s.block_table == group[0].block_table for s in group)
    assert [bm.ref_counts[b] for b in group[0].block_table] == [3, 3]
    sched.postprocess(batch, [[20], [21], [22]], [[0.0]] * 3)
    assert [s.output_ids for s in group] == [[20], [21], [22]]
    assert all(s.num_computed == 6 for s in group)
    full, partial = group[0].block_table
    decode = sched.schedule()
    assert not decode.is_prefill and decode.seqs == group
    # Two samples copy the shared partial block before writing position 6; the last writes in place.
    assert [src for src, _ in decode.copies] == [partial, partial]
    assert [s.block_table[0] for s in group] == [full] * 3 and bm.ref_counts[full] == 3
    assert len({s.block_table[1] for s in group}) == 3 and group[2].block_table[1] == partial
    finished = sched.postprocess(decode, [[30], [31], [32]], [[0.0]] * 3)
    assert [s.finish_reason for s in finished] == ["length"] * 3
    assert bm.num_free_blocks == 32


def test_decode_rows_go_longest_context_first():
    """Three prompts of 3, 9 and 5 tokens (admitted in that order) decode as 9, 5, 3, and stay in
    that order as they grow; a later, longer prompt takes the first row."""
    sched = Scheduler(BlockManager(num_blocks=64, block_size=4), max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=2)
    groups = [make_group(range(2, 2 + n), prompt_index=i, first_id=i, max_new_tokens=8) for i, n in enumerate((3, 9, 5))]
    for group in groups:
        sched.add(group)
    prefill = sched.schedule()
    sched.postprocess(prefill, [[20]] * 3, [[0.0]] * 3)
    for _ in range(2):
        decode = sched.schedule()
        assert [s.prompt_index for s in decode.seqs] == [1, 2, 0]
        sched.postprocess(decode, [[21] * decode.num_steps] * 3, [[0.0] * decode.num_steps] * 3)
    sched.add(make_group(range(2, 16), prompt_index=3, first_id=3, max_new_tokens=8))
    sched.postprocess(sched.schedule(), [[20]], [[0.0]])
    assert [s.prompt_index for s in sched.schedule().seqs] == [3, 1, 2, 0]


def test_token_budget_chunks_a_long_prompt():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_decode_steps=1)
    long = make_group(range(2, 27), n=2, max_new_tokens=1)  # 25 tokens
    short = make_group([3, 4, 5], prompt_index=1, first_id=2, max_new_tokens=1)
    sched.add(long)
    sched.add(short)
    spans = []
    for _ in range(3):
        batch = sched.schedule()
        spans.append([(c.seq.seq_id, c.start, c.end, len(c.samplers)) for c in batch.chunks])
        ids = [[40] for c in batch.chunks for _ in c.samplers]
        sched.postprocess(batch, ids, [[0.0]] * len(ids))
    assert spans == [[(0, 0, 10, 0)], [(0, 10, 20, 0)], [(0, 20, 25, 2), (2, 0, 3, 1)]]
    assert not sched.has_unfinished() and bm.num_free_blocks == 32


def test_max_num_seqs_caps_running_and_splits_groups():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=3, max_num_batched_tokens=100, max_decode_steps=1)
    sched.add(make_group([5, 6], n=5, max_new_tokens=3))
    first = sched.schedule()
    assert [len(c.samplers) for c in first.chunks] == [3]
    sched.postprocess(first, [[40]] * 3, [[0.0]] * 3)
    finished, batches, spans = run(sched)
    assert max(len(b.seqs) for b in batches if not b.is_prefill) == 3
    assert sorted(s.sample_index for s in finished) == [0, 1, 2, 3, 4]
    # The last two samples were admitted later as their own group, with their own prefill.
    assert [(seq_id, n) for seq_id, _, _, n, _ in spans] == [(3, 2)]


def test_decode_runs_several_steps_but_never_past_max_new_tokens():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_decode_steps=4)
    sched.add(make_group([5, 6, 7], max_new_tokens=11))
    sched.add(make_group([8], prompt_index=1, first_id=1, max_new_tokens=3))
    finished, batches, _ = run(sched)
    steps = [(len(b.seqs), b.num_steps) for b in batches if not b.is_prefill]
    # After prefill each has one token: remaining 10 and 2 -> 2 steps, then 8 left alone: 4, 4.
    assert steps == [(2, 2), (1, 4), (1, 4)]
    assert {s.seq_id: s.num_output_tokens for s in finished} == {1: 3, 0: 11}
    assert all(s.finish_reason == "length" for s in finished)


def test_stop_ids_finish_only_after_min_new_tokens():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_decode_steps=4)
    sched.add(make_group([5, 6], max_new_tokens=10, min_new_tokens=2))
    # The 'model' emits the stop id from the first generated token on.
    finished, _, _ = run(sched, token_fn=lambda s, pos: 1)
    (seq,) = finished
    # Tokens 1 and 2 are within min_new_tokens (the sampler masks them; here they count as text).
    assert seq.output_ids == [1, 1, 1] and seq.finish_reason == "stop"
    assert bm.num_free_blocks == 64


def test_tokens_sampled_past_a_stop_in_one_decode_window_are_dropped():
    bm = BlockManager(num_blocks=64, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=100, max_decode_steps=8)
    sched.add(make_group([5, 6], max_new_tokens=20))
    finished, _, _ = run(sched, token_fn=lambda s, pos: 1 if pos == 4 else 30)
    (seq,) = finished
    assert seq.output_ids == [30, 30, 30, 1] and seq.finish_reason == "stop"
    assert len(seq.logprobs) == 4


def test_preemption_frees_blocks_and_recomputes_with_identical_results():
    def outputs(num_blocks):
        bm = BlockManager(num_blocks=num_blocks, block_size=2)
        sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=2)
        for i in range(3):
            sched.add(make_group([2 + i, 3, 4], n=2, prompt_index=i, first_id=2 * i, max_new_tokens=8))
        finished, _, spans = run(sched)
        assert bm.num_free_blocks == num_blocks
        recomputed = [span for span in spans if span[4] > 3]
        return {s.seq_id: s.output_ids for s in finished}, sched.num_preemptions, recomputed

    big, big_preemptions, _ = outputs(64)
    small, small_preemptions, recomputed = outputs(9)  # 3 prompts x 2 samples x 6 blocks will not fit
    assert big_preemptions == 0 and small_preemptions > 0
    assert small == big
    # A preempted sequence comes back as a prefill of its prompt and every token it had generated.
    assert recomputed and all(start == 0 and end == total and n == 1 for _, start, end, n, total in recomputed)


def test_abort_all_frees_every_block_and_marks_the_sequences():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=5, max_decode_steps=2)
    sched.add(make_group([5, 6, 7], n=2, max_new_tokens=8))
    sched.add(make_group(range(2, 14), prompt_index=1, first_id=2, max_new_tokens=8))  # chunked
    sched.add(make_group([9], prompt_index=2, first_id=3, max_new_tokens=8))
    batch = sched.schedule()
    sched.postprocess(batch, [[40], [41]], [[0.0]] * 2)
    assert sched.running and sched.prefilling and sched.waiting
    aborted = sched.abort_all()
    assert sorted(s.seq_id for s in aborted) == [0, 1, 2, 3]
    assert all(s.finish_reason == "abort" for s in aborted)
    assert not sched.has_unfinished() and bm.num_free_blocks == 32


def test_admission_backs_off_after_a_preemption(monkeypatch):
    """Long-tailed lengths on a cache they outgrow: without the reservation, blocks freed by a
    finished sequence readmit a preempted one whose context is computed again, only to be
    preempted again. With it, a fraction of the preemptions and of the recomputed tokens, the same
    outputs; a cache that holds everything reserves nothing and schedules exactly as before."""
    from colocate.rollout.native import scheduler

    lengths = [8, 90, 12, 60, 30, 110, 15, 45, 70, 20, 100, 25, 35, 80, 10, 55] * 2

    def outputs(num_blocks, fade):
        monkeypatch.setattr(scheduler, "RESERVE_FADE_TOKENS", fade)
        bm = BlockManager(num_blocks=num_blocks, block_size=4)
        sched = Scheduler(bm, max_num_seqs=16, max_num_batched_tokens=256, max_decode_steps=4)
        for i, n in enumerate(lengths):
            sched.add(make_group([2 + i, 3, 4, 5, 6, 7, 8, 9], prompt_index=i, first_id=i, max_new_tokens=n))
        finished, batches, spans = run(sched, max_steps=5000)
        recomputed = sum(end - start for _, start, end, _, total in spans if total > 8)
        schedule = [([c.seq.seq_id for c in b.chunks], [s.seq_id for s in b.seqs], b.num_steps) for b in batches]
        return {s.seq_id: s.output_ids for s in finished}, sched.num_preemptions, recomputed, schedule

    backing_off = outputs(120, 1024)
    greedy = outputs(120, 1e-9)  # the reservation gone as soon as it is made
    assert backing_off[0] == greedy[0] and len(backing_off[0]) == len(lengths)
    assert greedy[1] >= 3 * backing_off[1] and greedy[2] >= 3 * backing_off[2], (greedy[1:3], backing_off[1:3])
    roomy = outputs(2000, 1024)
    assert roomy[1] == 0 and roomy[0] == greedy[0] and roomy[3] == outputs(2000, 1e-9)[3]


def test_a_held_sequence_keeps_its_history_and_prefills_only_the_observation():
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=4)
    group = make_group(range(2, 8), n=2, max_new_tokens=3)  # 6 prompt tokens, blocks shared by both
    for seq in group:
        seq.hold = True
    sched.add(group)
    finished, _, _ = run(sched)
    assert finished == group and sched.parked == group and not sched.has_unfinished()
    first = group[0]
    held = list(first.block_table)
    assert first.num_computed == 8 and first.num_tokens == 9  # the turn's last token was never fed back
    sched.resume(first, [90, 91, 92], max_new_tokens=2)
    assert sched.parked == [group[1]] and first.finish_reason is None
    batch = sched.schedule()
    # Only the last sampled token and the observation are computed; the history's blocks stay.
    assert [(c.start, c.end, c.samplers) for c in batch.chunks] == [(8, 12, [first])]
    assert first.block_table[: len(held)] == held and batch.copies == []
    finished = sched.postprocess(batch, [[40]], [[-1.0]])
    batch = sched.schedule()
    finished += sched.postprocess(batch, [[41] * batch.num_steps], [[-2.0] * batch.num_steps])
    assert finished == [first] and first.turn_ids == [40, 41]
    assert first.loss_mask == [1, 1, 1, 0, 0, 0, 1, 1] and first.logprobs[3:6] == [0.0, 0.0, 0.0]
    assert (sched.history_tokens, sched.reused_tokens) == (8, 8)
    for seq in group:
        sched.release(seq)
    assert bm.num_free_blocks == 32 and not sched.parked


def test_parked_sequences_give_their_blocks_up_before_a_running_one_is_preempted():
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=1)
    parked = make_group(range(2, 10), max_new_tokens=1, first_id=0)[0]  # 8 prompt tokens: 2 blocks
    parked.hold = True
    sched.add([parked])
    run(sched)
    assert sched.parked == [parked] and len(parked.block_table) == 2
    runner = make_group(range(2, 10), max_new_tokens=12, first_id=5)[0]  # grows to 20 tokens: 5 blocks
    sched.add([runner])
    finished, _, _ = run(sched)
    assert finished == [runner] and runner.num_output_tokens == 12
    assert sched.num_evictions == 1 and sched.num_preemptions == 0
    assert parked.block_table == [] and parked.num_computed == 0 and sched.parked == [parked]
    sched.resume(parked, [70], max_new_tokens=1)
    batch = sched.schedule()
    assert [(c.start, c.end) for c in batch.chunks] == [(0, 10)]  # recomputed from the start
    assert (sched.history_tokens, sched.reused_tokens) == (8, 0)


def test_a_resumed_sequence_waiting_for_room_gives_its_history_up_to_a_running_one():
    """B's next turn waits for admission holding its history; A, running, needs those blocks to
    grow: B's are freed (B is recomputed later) instead of A preempting itself into a failure."""
    bm = BlockManager(num_blocks=6, block_size=4)
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, max_decode_steps=1)
    a = make_group(range(2, 10), max_new_tokens=16, first_id=0)[0]  # grows to 24 tokens: all 6 blocks
    b = make_group(range(2, 6), max_new_tokens=1, first_id=5, prompt_index=1)[0]
    b.hold = True
    sched.add([a])
    sched.add([b])
    batch = sched.schedule()
    assert sched.postprocess(batch, [[20], [21]], [[0.0], [0.0]]) == [b] and sched.parked == [b]
    sched.resume(b, list(range(30, 38)), max_new_tokens=2)
    assert b.block_table  # its history waits with it
    finished, _, _ = run(sched)
    assert finished == [a, b] and a.num_output_tokens == 16 and b.turn_ids == [fake_token(b, 12), fake_token(b, 13)]
    assert sched.num_evictions == 1 and sched.num_preemptions == 0
    assert (sched.history_tokens, sched.reused_tokens) == (4, 0)
    sched.release(b)
    assert bm.num_free_blocks == 6
