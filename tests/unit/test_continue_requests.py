"""Continuing a sample after its kept tokens: the request's checks and the scheduler's prefill."""

from __future__ import annotations

import pytest

from colocate.rollout.native.block_manager import BlockManager
from colocate.rollout.native.scheduler import Scheduler, Sequence
from colocate.rollout.protocol import Request, SamplingParams


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(output_ids=[1], logprobs=[0.0], sampling=SamplingParams(n=2)), "Request.output_ids continue one sample"),
        (
            dict(output_ids=[1, 2], logprobs=[0.0, 0.0], sampling=SamplingParams(max_new_tokens=2)),
            "Request.output_ids has 2 tokens, none left of max_new_tokens=2",
        ),
        (dict(output_ids=[1, 2], logprobs=[0.0]), "Request.logprobs has 1 entries for 2 output_ids"),
        (dict(sample_index=-1), "Request.sample_index must be >= 0, got -1"),
    ],
)
def test_request_checks_continuations(kwargs, message):
    kwargs.setdefault("sampling", SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match=message):
        Request([1, 2], **kwargs)


def test_scheduler_prefills_kept_tokens_and_decodes_the_rest():
    """A continued sample: one prefill over prompt + kept tokens, then only the tokens still allowed."""
    sched = Scheduler(BlockManager(num_blocks=16, block_size=4), max_num_seqs=4, max_num_batched_tokens=64, max_decode_steps=8)
    seq = Sequence(
        seq_id=0,
        prompt_index=0,
        sample_index=2,
        token_ids=[3, 4, 5, 20, 21],
        num_prompt_tokens=3,
        params=SamplingParams(max_new_tokens=6, ignore_eos=True),
        seed=9,
        stop_ids=frozenset(),
        logprobs=[-1.0, -2.0],
    )
    sched.add([seq])
    batch = sched.schedule()
    assert [(c.start, c.end, c.samplers) for c in batch.chunks] == [(0, 5, [seq])]
    assert sched.postprocess(batch, [[30]], [[-3.0]]) == []
    batch = sched.schedule()
    assert batch.num_steps == 3 and batch.seqs == [seq]
    assert sched.postprocess(batch, [[31, 32, 33]], [[-4.0, -5.0, -6.0]]) == [seq]
    assert seq.output_ids == [20, 21, 30, 31, 32, 33] and seq.finish_reason == "length"
    assert seq.logprobs == [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0]
