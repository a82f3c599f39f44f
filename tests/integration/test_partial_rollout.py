"""Partial rollout on CPU: the native engine aborts samples and continues them."""

from __future__ import annotations

import torch

from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import Request, SamplingParams
from tests.helpers import write_hf_model


def test_abort_returns_tokens_so_far_and_continuing_equals_the_uninterrupted_sample(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen3")
    engine = NativeEngine(str(path), device="cpu", block_size=4, max_kv_tokens=512)
    short = Request([3, 5, 7], SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1))
    long = Request([2, 4, 6, 8, 10], SamplingParams(n=3, max_new_tokens=12, ignore_eos=True, seed=5))
    full = engine.generate_requests([short, long])
    assert [len(c.output_ids) for c in full] == [3, 12, 12, 12]

    seen = []
    cut = engine.generate_requests([short, long], stop=lambda done: seen.append(len(done)) or True)
    assert seen == [1]  # the short request finished first, then everything else was aborted
    assert [(c.prompt_index, c.sample_index, c.finish_reason) for c in cut] == [
        (0, 0, "length"), (1, 0, "abort"), (1, 1, "abort"), (1, 2, "abort")]
    for aborted, whole in zip(cut[1:], full[1:]):
        assert len(aborted.output_ids) == 3 == len(aborted.logprobs)
        assert aborted.output_ids == whole.output_ids[:3]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks

    resumed = engine.generate_requests([
        Request(long.prompt_ids, SamplingParams(max_new_tokens=12, ignore_eos=True, seed=5), c.output_ids,
                c.logprobs, sample_index=c.sample_index) for c in cut[1:]])
    for again, whole in zip(resumed, full[1:]):
        assert again.sample_index == whole.sample_index and again.finish_reason == "length"
        assert again.output_ids == whole.output_ids
        torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(whole.logprobs), atol=1e-5, rtol=0)
        assert again.logprobs[:3] == cut[1 + again.sample_index].logprobs  # kept ones are handed back as given
