import random

import pytest

from colocate.trainer.packing import balanced_partition, pack_micro_batches, step_slices


def _loads(parts, lengths):
    return [sum(lengths[i] for i in p) for p in parts]


def test_balanced_partition_longest_first_to_lightest():
    lengths = [10, 9, 8, 7, 6, 5, 4]
    # 10->p0, 9->p1, 8->p2, 7->p2 (15), 6->p1 (15), 5->p0 (15), 4->p0 (tie: lowest part) = 19.
    assert balanced_partition(lengths, 3) == [[0, 5, 6], [1, 4], [2, 3]]
    assert balanced_partition([3, 1], 4) == [[0], [1], [], []]


def test_balanced_partition_spread_is_within_the_longest_item():
    rng = random.Random(0)
    for _ in range(20):
        lengths = [rng.randint(1, 500) for _ in range(rng.randint(5, 60))]
        k = rng.randint(1, 8)
        parts = balanced_partition(lengths, k)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        loads = _loads(parts, lengths)
        assert max(loads) - min(loads) <= max(lengths)


def test_pack_respects_budget_and_isolates_long_samples():
    lengths = [5, 30, 7, 12, 3, 9, 14, 2, 40]
    parts = pack_micro_batches(lengths, max_tokens=20)
    assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
    assert [1] in parts and [8] in parts  # 30 and 40 exceed the budget: alone
    for p in parts:
        assert len(p) == 1 or sum(lengths[i] for i in p) <= 20
    # 52 tokens of short samples need at least 3 micro-batches of 20; greedy finds exactly 3.
    assert len(parts) == 2 + 3


def test_pack_fewest_micro_batches_when_they_divide_evenly():
    parts = pack_micro_batches([5] * 8, max_tokens=10)
    assert len(parts) == 4 and _loads(parts, [5] * 8) == [10, 10, 10, 10]


def test_pack_to_an_agreed_count_rebalances_then_pads():
    lengths = [5] * 8
    parts = pack_micro_batches(lengths, max_tokens=10, num_micro_batches=6)
    assert len(parts) == 6
    assert sorted(_loads(parts, lengths)) == [5, 5, 5, 5, 10, 10]
    parts = pack_micro_batches([3, 4], max_tokens=100, num_micro_batches=4)
    assert parts == [[1], [0], [], []]
    assert pack_micro_batches([], max_tokens=10, num_micro_batches=2) == [[], []]
    with pytest.raises(ValueError, match="num_micro_batches"):
        pack_micro_batches([5] * 8, max_tokens=10, num_micro_batches=3)


def test_pack_rejects_bad_input():
    with pytest.raises(ValueError, match="max_tokens"):
        pack_micro_batches([1, 2], max_tokens=0)
    with pytest.raises(ValueError, match="at least one token"):
        pack_micro_batches([1, 0], max_tokens=4)


def test_step_slices_split_and_pad_to_the_agreed_count():
    assert step_slices(10, None) == [range(10)]
    assert step_slices(10, 4) == [range(0, 4), range(4, 8), range(8, 10)]
    assert step_slices(8, 4, num_steps=3) == [range(0, 4), range(4, 8), range(8, 8)]
    assert step_slices(0, 4) == [range(0)]
    with pytest.raises(ValueError, match="num_steps"):
        step_slices(10, 4, num_steps=2)


def test_micro_batch_packs_samples_in_the_given_order():
    """Three samples (one without response tokens) packed as [2, 0, 1], written out by hand."""
    import torch

    from colocate.rollout.sample import Sample
    from colocate.trainer.batch import RolloutBatch, build_micro_batch

    samples = [
        Sample([5, 6], [7, 8, 9], [0.0] * 3, [1] * 3, 0, 0),
        Sample([1], [], [], [], 0, 1),
        Sample([2, 3], [4], [0.0], [1], 0, 2),
    ]
    mb = build_micro_batch(RolloutBatch.from_samples(samples, torch.device("cpu")), [2, 0, 1], torch.device("cpu"))
    assert mb.input_ids.tolist() == [2, 3, 4, 5, 6, 7, 8, 9, 1]
    assert mb.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0]
    assert mb.cu_seqlens.tolist() == [0, 3, 8, 9] and mb.max_seqlen == 5 and mb.num_tokens == 9
    assert mb.logit_index.tolist() == [1, 4, 5, 6]  # the positions that predict each response token
    assert mb.targets.tolist() == [4, 7, 8, 9]
    assert mb.token_index.tolist() == [3, 0, 1, 2]  # where those tokens sit in the batch's flat layout
    assert mb.seq_index.tolist() == [0, 1, 1, 1]  # dense over the samples that have response tokens
    empty = build_micro_batch(RolloutBatch.from_samples(samples, torch.device("cpu")), [], torch.device("cpu"))
    assert empty.input_ids.tolist() == [0, 0] and empty.cu_seqlens.tolist() == [0, 2] and empty.num_tokens == 0
    assert empty.logit_index.numel() == empty.token_index.numel() == 0


def test_token_ids_outside_the_vocabulary_are_named_on_the_host():
    import torch

    from colocate.rollout.sample import Sample
    from colocate.trainer.batch import RolloutBatch

    samples = [Sample([5, 6], [7, 8], [0.0] * 2, [1] * 2, 0, 0), Sample([1], [9, 10], [0.0] * 2, [1] * 2, 1, 0)]
    RolloutBatch.from_samples(samples, torch.device("cpu"), vocab_size=11)
    with pytest.raises(ValueError, match=r"sample 1 \(group 1\) has token id 10, outside .* \[0, 10\)"):
        RolloutBatch.from_samples(samples, torch.device("cpu"), vocab_size=10)
    samples[0].prompt_ids[0] = -3
    with pytest.raises(ValueError, match="sample 0 .* token id -3"):
        RolloutBatch.from_samples(samples, torch.device("cpu"), vocab_size=11)


def test_steps_leave_out_samples_with_no_token_in_the_loss():
    """Sample 1 is all masked: no micro-batch runs it, yet it counts in the step's samples; a
    sample with one token in the loss (3) still runs."""
    import torch

    from colocate.rollout.sample import Sample
    from colocate.trainer.batch import RolloutBatch
    from colocate.trainer.passes import plan_steps

    samples = [
        Sample([5, 6], [7, 8, 9], [0.0] * 3, mask, 0, j) for j, mask in enumerate(([1, 1, 1], [0, 0, 0], [1, 0, 1], [0, 0, 1]))
    ]
    (plan,) = plan_steps(RolloutBatch.from_samples(samples, torch.device("cpu")), max_tokens=10, samples_per_step=None)
    assert sorted(i for p in plan.parts for i in p) == [0, 2, 3]
    assert (plan.num_tokens, plan.num_seqs, plan.num_skipped) == (6.0, 4.0, 1.0)
    first, second = plan_steps(
        RolloutBatch.from_samples(samples[1:2] * 2 + samples[:1], torch.device("cpu")), max_tokens=10, samples_per_step=2
    )
    assert first.parts == [[]] and (first.num_seqs, first.num_skipped) == (2.0, 2.0)  # a dummy micro-batch
    assert second.parts == [[2]] and (second.num_seqs, second.num_skipped) == (1.0, 0.0)
