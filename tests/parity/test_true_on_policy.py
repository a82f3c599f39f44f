"""True on-policy mode (CPU fp32; tests/parity/test_true_on_policy_gpu.py has CUDA bf16): the
engine's log-prob of every sampled token equals, bit for bit, the trainer's, whatever the batch,
the packing, prefix sharing or preemption."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from colocate.kernels import batch_invariant
from colocate.kernels.ops import Ops
from colocate.models import from_pretrained
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sample import Sample
from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch, build_micro_batch
from colocate.trainer.packing import pack_micro_batches
from tests.helpers import write_hf_model

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 60)), [3, 4], [90, 12, 33, 71, 2]]
"""Prompt lengths on both sides of the attention chunk (16): 7, 40, 2 and 5 tokens."""


@pytest.fixture
def invariant():
    """The mode's table, handed to the models and engines below (built as colocate.train builds it)."""
    yield Ops.true_on_policy(torch.device("cpu"))
    batch_invariant.disable()


def _samples(outs, prompts) -> list[Sample]:
    return [
        Sample(prompts[c.prompt_index], c.output_ids, c.logprobs, [1] * len(c.output_ids), c.prompt_index, c.sample_index)
        for c in outs
    ]


def _trainer_logprobs(model, samples: list[Sample], temperature: float, max_tokens: int) -> torch.Tensor:
    """The actor's log-probs of every response token, micro-batches packed under `max_tokens`."""
    batch = RolloutBatch.from_samples(samples, torch.device("cpu"))
    out = torch.zeros_like(batch.mask)
    for part in pack_micro_batches(batch.lengths, max_tokens):
        mb = build_micro_batch(batch, part, torch.device("cpu"))
        with torch.no_grad():
            out[mb.token_index] = response_logprobs(model, mb, temperature)[0]
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_engine_and_trainer_logprobs_are_bitwise_equal(tmp_path, family, invariant):
    path, _ = write_hf_model(tmp_path, family)
    model = from_pretrained(path, dtype="float32", device="cpu").eval()
    model.set_ops(invariant)
    sampling = SamplingParams(n=3, temperature=0.7, top_p=0.9, max_new_tokens=24, ignore_eos=True, seed=1)
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=3, ops=invariant)
    together = engine.generate(PROMPTS, sampling)  # one batch, each prompt's prefix shared by its 3 samples
    alone = {i: engine.generate([PROMPTS[i]], sampling) for i in (2, 0, 3, 1)}  # one prompt at a time
    tight = NativeEngine(path, dtype=torch.float32, device="cpu", block_size=4, max_kv_tokens=72, seed=3, ops=invariant)
    preempted = tight.generate(PROMPTS, sampling)
    assert tight.scheduler.num_preemptions > 0
    rollout = torch.tensor([lp for c in together for lp in c.logprobs])
    assert len(rollout) == 4 * 3 * 24
    assert torch.equal(torch.tensor([lp for i in range(4) for c in alone[i] for lp in c.logprobs]), rollout)
    assert torch.equal(torch.tensor([lp for c in preempted for lp in c.logprobs]), rollout)
    samples = _samples(together, PROMPTS)
    for max_tokens in (64, 160, 4096):  # one sequence per micro-batch, a few, all of them
        assert torch.equal(_trainer_logprobs(model, samples, 0.7, max_tokens), rollout), max_tokens


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_compiled_blocks_give_the_engine_s_bits(tmp_path, family, invariant):
    """model.compile in the mode: each block compiled as the trainer compiles it, the mode's
    operations kept whole inside (kernels/invariant_ops.py)."""
    path, _ = write_hf_model(tmp_path, family)
    model = from_pretrained(path, dtype="float32", device="cpu").eval()
    model.set_ops(invariant)
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=3, ops=invariant)
    outs = engine.generate(PROMPTS, SamplingParams(n=2, temperature=0.7, max_new_tokens=24, ignore_eos=True, seed=1))
    rollout = torch.tensor([lp for c in outs for lp in c.logprobs])
    from torch._dynamo.utils import counters

    counters.clear()
    for layer in model.model.layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)
    for max_tokens in (64, 4096):
        assert torch.equal(_trainer_logprobs(model, _samples(outs, PROMPTS), 0.7, max_tokens), rollout), max_tokens
    assert not counters["graph_break"], dict(counters["graph_break"])  # whole blocks compiled, none eager


def test_greedy_logprobs_are_bitwise_equal_too(tmp_path, invariant):
    path, _ = write_hf_model(tmp_path, "qwen3")
    model = from_pretrained(path, dtype="float32", device="cpu").eval()
    model.set_ops(invariant)
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, ops=invariant)
    outs = engine.generate(PROMPTS, SamplingParams(n=1, temperature=0.0, max_new_tokens=20, ignore_eos=True))
    rollout = torch.tensor([lp for c in outs for lp in c.logprobs])
    assert torch.equal(_trainer_logprobs(model, _samples(outs, PROMPTS), 0.0, 4096), rollout)


def test_the_mode_is_refused_off_cpu_and_cuda_and_can_be_left():
    with pytest.raises(ValueError, match="algorithm.true_on_policy: .* CPU and CUDA paths, not meta"):
        Ops.true_on_policy(torch.device("meta"))
    assert not batch_invariant.enabled()
    ops = Ops.true_on_policy(torch.device("cpu"))
    assert Ops.true_on_policy(torch.device("cpu")) is ops  # idempotent
    assert ops.invariant and not Ops.standard().invariant
    a, b = torch.randn(3, 56), torch.randn(56, 72)
    assert batch_invariant.enabled() and torch.equal(a @ b, torch.cat([a[i : i + 1] @ b for i in range(3)]))
    batch_invariant.disable()
    assert not batch_invariant.enabled()


def test_the_table_reaches_every_layer_and_the_engine_keeps_its_own_choice(tmp_path, invariant):
    """`set_ops` hands one table to every module that computes with one; an engine built from a
    CausalLM takes its table unless given another, and reads it once."""
    from colocate.models.layers import Linear, RMSNorm

    path, _ = write_hf_model(tmp_path, "qwen3")
    model = from_pretrained(path, dtype="float32", device="cpu")
    assert model.ops is Ops.standard()
    model.set_ops(invariant)
    tables = [m for m in model.modules() if isinstance(m, (Linear, RMSNorm)) or hasattr(m, "ops")]
    assert len(tables) > 10 and all(m.ops is invariant for m in tables)
    engine = NativeEngine(model, dtype=torch.float32, device="cpu", max_kv_tokens=256)
    assert engine.runner.ops is invariant and engine.model.model.layers[0].mlp.ops is invariant
    assert not engine.runner.compiled_decode
    plain = NativeEngine(model, dtype=torch.float32, device="cpu", max_kv_tokens=256, ops=Ops.standard())
    assert plain.runner.ops is Ops.standard() and plain.model.model.norm.ops is Ops.standard()


def test_attention_matches_sdpa_and_ignores_chunks_past_the_query():
    torch.manual_seed(0)
    q, k, v = torch.randn(37, 6, 20), torch.randn(37, 2, 20), torch.randn(37, 2, 20)
    got = batch_invariant.attention(q, k, v, torch.arange(37), 20**-0.5)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # The last query alone, with its own keys only, gives the same bits as inside the whole sequence.
    last = batch_invariant.attention(q[-1:], k, v, torch.tensor([36]), 20**-0.5)
    assert torch.equal(last, got[-1:])
    first = batch_invariant.attention(q[:1], k[:1], v[:1], torch.tensor([0]), 20**-0.5)
    assert torch.equal(first, got[:1])


def assert_toy_run_has_no_mismatch(tmp_path, steps: int, env: dict, args: tuple[str, ...] = ()) -> list[dict]:
    """`steps` GRPO steps of the toy task in the mode (plus `args`): the rollout and the trainer's first
    forward agree exactly at every step. Returns the steps' records."""
    out = tmp_path / "run"
    env = {**env, "COLOCATE_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "colocate.train",
            "--config",
            "configs/default.yaml",
            "--output-dir",
            str(out),
            "--train.num-rollout",
            str(steps),
            "--algorithm.true-on-policy",
            "True",
            "--logging.console",
            "False",
            *args,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/ppo_kl" in r]
    assert [r["step"] for r in rows] == list(range(steps))
    for r in rows:
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0 and r["train/ppo_kl"] == 0.0, r["step"]
        assert r["train/mismatch/abs_diff_max"] == 0.0 and r["train/mismatch/nonzero_frac"] == 0.0
        assert r["train/mismatch/kl_k3"] == 0.0 and r["train/mismatch/ppl_ratio"] == 1.0
    return rows


@pytest.mark.slow
def test_a_toy_run_in_the_mode_logs_no_mismatch_at_all(tmp_path):
    assert_toy_run_has_no_mismatch(tmp_path, 5, {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})


@pytest.mark.slow
def test_a_lora_run_in_the_mode_logs_no_mismatch_after_its_adapters_moved(tmp_path):
    """With LoRA the engine holds merged weights W + s B A: the trainer's forward multiplies the same
    merged weight in the mode (x W^T + x A^T B^T differs in the last bits once B is not zero: 70-81%
    of the tokens of steps 1-3 differed before)."""
    rows = assert_toy_run_has_no_mismatch(
        tmp_path, 4, {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}, ("--model.lora-rank", "8")
    )
    assert all(r["train/grad_norm"] > 0 for r in rows)  # the adapters train, so B moves from zero


@pytest.mark.slow
def test_a_compiled_lora_run_in_the_mode_logs_no_mismatch_and_the_eager_run_s_numbers(tmp_path):
    """model.compile with the mode (and LoRA's merged weights inside the compiled blocks): no
    mismatch at any step, and the same metrics as the eager run within fp32 summation order."""
    env = {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}
    lora = ("--model.lora-rank", "8")
    compiled = assert_toy_run_has_no_mismatch(tmp_path / "compiled", 4, env, (*lora, "--model.compile", "True"))
    eager = assert_toy_run_has_no_mismatch(tmp_path / "eager", 4, env, (*lora, "--model.compile", "False"))
    for c, e in zip(compiled, eager):
        assert c["train/grad_norm"] == pytest.approx(e["train/grad_norm"], rel=1e-4), c["step"]


@pytest.mark.slow
def test_two_compiled_lora_ranks_in_the_mode_log_no_mismatch_and_one_process_s_gradients(tmp_path):
    """FSDP2 over 2 gloo ranks, blocks compiled, LoRA: the sharded trainer keeps the engine's bits,
    and its gradient norms are the one-process run's."""
    from tests.integration.test_loop import torchrun

    flags = (
        "--train.num-rollout",
        "3",
        "--algorithm.true-on-policy",
        "True",
        "--model.compile",
        "True",
        "--model.lora-rank",
        "8",
        "--logging.console",
        "False",
    )
    torchrun(ROOT / "configs" / "default.yaml", tmp_path / "two", *flags)
    rows = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/ppo_kl" in r]
    assert [r["step"] for r in rows] == [0, 1, 2]
    one = assert_toy_run_has_no_mismatch(
        tmp_path / "one", 3, {"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"}, ("--model.lora-rank", "8")
    )
    for two, single in zip(rows, one):
        assert two["train/train_rollout_logprob_abs_diff"] == 0.0 and two["train/mismatch/nonzero_frac"] == 0.0
        assert two["train/grad_norm"] == pytest.approx(single["train/grad_norm"], rel=1e-4), two["step"]


def test_cuda_matrix_products_leave_the_modes_kernel_only_inside_a_backward_pass():
    """kernels/batch_invariant_cuda.py's aten::mm and aten::addmm: inside a backward node they are
    plain cuBLAS products (here on CPU tensors, the same aten ops), outside the mode's own kernel."""
    from colocate.kernels import batch_invariant_cuda

    g = torch.Generator().manual_seed(0)
    a, b, bias = torch.randn(5, 3, generator=g), torch.randn(3, 4, generator=g), torch.randn(4, generator=g)
    seen = {}

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"] = batch_invariant_cuda.in_backward()
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            seen["backward"] = batch_invariant_cuda.in_backward()
            seen["mm"] = batch_invariant_cuda.mm(a, b.T.contiguous().T)  # a transposed view, as linear's
            seen["addmm"] = batch_invariant_cuda.addmm(bias, a, b, beta=0.5, alpha=2.0)
            return grad

    Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
    assert seen["forward"] is False and seen["backward"] is True
    torch.testing.assert_close(seen["mm"], a @ b)
    torch.testing.assert_close(seen["addmm"], 0.5 * bias + 2.0 * (a @ b))
