"""True on-policy mode on CUDA in bf16, with the engine's decode graphs on: every sampled token's
engine log-prob equals, bit for bit, the trainer's first forward's."""

from __future__ import annotations

import os

import pytest
import torch

from colocate.kernels import batch_invariant
from colocate.kernels.ops import Ops
from colocate.models import ArchConfig, from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sample import Sample
from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch, build_micro_batch
from colocate.trainer.packing import pack_micro_batches
from tests.integration.test_engine_gpu import SMALL
from tests.parity.test_true_on_policy import assert_toy_run_has_no_mismatch

pytestmark = pytest.mark.gpu

QWEN25_15B = ArchConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=True,
    attention_bias=True,
    eos_token_id=151643,
)


@pytest.fixture
def invariant():
    """The mode's table (built as colocate.train builds it)."""
    yield Ops.true_on_policy(torch.device("cuda"))
    batch_invariant.disable()


def _random_model(cfg: ArchConfig, ops: Ops) -> torch.nn.Module:
    torch.manual_seed(0)
    model = from_config(cfg, torch.bfloat16, "cuda", init=True)
    model.set_ops(ops)
    with torch.no_grad():  # peaked distributions, as a trained model's are
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model.eval()


def _prompts(num: int, vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(2, vocab_size, (int(torch.randint(8, 100, (1,), generator=g)),), generator=g).tolist() for _ in range(num)
    ]


def _trainer_logprobs(model, samples: list[Sample], temperature: float, max_tokens: int) -> torch.Tensor:
    device = torch.device("cuda")
    batch = RolloutBatch.from_samples(samples, device)
    out = torch.zeros(batch.mask.shape, dtype=torch.float32, device=device)
    for part in pack_micro_batches(batch.lengths, max_tokens):
        mb = build_micro_batch(batch, part, device)
        with torch.no_grad():
            out[mb.token_index] = response_logprobs(model, mb, temperature)[0]
    return out.cpu()


@pytest.mark.parametrize(
    "cfg, num_prompts, max_new_tokens",
    [
        pytest.param(SMALL, 16, 64, id="qwen3-small"),
        pytest.param(QWEN25_15B, 64, 256, id="qwen2-1.5b-shape", marks=pytest.mark.slow),
    ],
)
def test_engine_and_trainer_logprobs_are_bitwise_equal_on_cuda(invariant, cfg, num_prompts, max_new_tokens):
    model = _random_model(cfg, invariant)
    prompts = _prompts(num_prompts, cfg.vocab_size)
    engine = NativeEngine(
        model,
        dtype=torch.bfloat16,
        device="cuda",
        cuda_graph=True,
        max_num_seqs=512,
        cuda_graph_max_bs=512,
        seed=3,
        ops=invariant,
    )
    assert engine.runner.graphs is not None
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=max_new_tokens, ignore_eos=True, seed=1)
    outs = engine.generate(prompts, sampling)
    rollout = torch.tensor([lp for c in outs for lp in c.logprobs])
    assert len(rollout) == num_prompts * 8 * max_new_tokens
    samples = [
        Sample(prompts[c.prompt_index], c.output_ids, c.logprobs, [1] * len(c.output_ids), c.prompt_index, c.sample_index)
        for c in outs
    ]
    for max_tokens in (2048, 16384):  # two packings of the same samples
        trainer = _trainer_logprobs(model, samples, 1.0, max_tokens)
        mismatch = (trainer != rollout).float().mean().item()
        assert torch.equal(trainer, rollout), f"{mismatch:.2%} of tokens differ (max_tokens {max_tokens})"
    alone = engine.generate(prompts[:3], sampling)  # a smaller batch: other decode buckets and prefill mixes
    assert torch.equal(
        torch.tensor([lp for c in alone for lp in c.logprobs]), torch.tensor([lp for c in outs[:24] for lp in c.logprobs])
    )
    for layer in model.model.layers:  # model.compile: compiled blocks keep the mode's kernels whole
        layer.forward = torch.compile(layer.forward, dynamic=True)
    assert torch.equal(_trainer_logprobs(model, samples, 1.0, 16384), rollout), "compiled blocks"


@pytest.mark.parametrize("compile", ["False", "True"])
def test_a_20_step_grpo_run_on_cuda_logs_no_mismatch_at_all(tmp_path, compile):
    """The toy task in bf16 on the GPU (the default config's dtype there), decode graphs on, the
    trainer's blocks eager or compiled."""
    assert_toy_run_has_no_mismatch(tmp_path, 20, dict(os.environ), ("--model.compile", compile))


def test_a_lora_run_on_cuda_logs_no_mismatch_at_all(tmp_path):
    """LoRA in bf16, compiled blocks: the trainer multiplies the merged weight the engine receives."""
    rows = assert_toy_run_has_no_mismatch(tmp_path, 10, dict(os.environ), ("--model.lora-rank", "16", "--model.compile", "True"))
    assert all(r["train/grad_norm"] > 0 for r in rows)
