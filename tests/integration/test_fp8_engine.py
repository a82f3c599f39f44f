"""The native engine with FP8 weights (rollout.weight_dtype fp8) and an FP8 KV cache
(rollout.kv_cache_dtype fp8_e4m3): weight updates quantize what is pushed, the engine computes what
its quantized model computes, the FP8 cache stays within its rounding on every paging path, and the
configuration refuses what FP8 cannot do. CPU here; the GPU cases carry the gpu marker."""

from __future__ import annotations

import pytest
import torch

from colocate.config import AlgorithmConfig, Config, RolloutConfig
from colocate.config_checks import validate
from colocate.kernels.fp8 import E4M3, quantize_rowwise
from colocate.models import from_pretrained
from colocate.rollout.native import NativeEngine
from colocate.rollout.protocol import SamplingParams
from tests.helpers import hf_logprobs, write_hf_model
from tests.integration.test_engine_gpu import HF_MEDIUM, prompts, transformers_pair
from tests.parity.test_engine_parity import teacher_forced_logprobs

PROMPTS = [[3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [20], [7, 7, 7, 7, 7, 7, 7]]
SMALL = dict(block_size=4, max_kv_tokens=512)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # Qwen2 (q/k/v biases) with GQA; larger weights than the default init: peaked distributions.
    path, hf = write_hf_model(tmp_path_factory.mktemp("fp8"), "qwen2", num_key_value_heads=2, initializer_range=0.2)
    return path


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == E4M3 else t


def _quantized(path):
    model = from_pretrained(path, dtype="float32")
    model.quantize_projections()
    return model


def test_updates_quantize_every_pushed_projection_and_copy_the_rest(model_dir):
    engine = NativeEngine(str(model_dir), weight_dtype="fp8", **SMALL)
    plain = NativeEngine(str(model_dir), **SMALL)
    assert engine.memory_stats()["weights_bytes"] < 0.7 * plain.memory_stats()["weights_bytes"]
    trained = {n: (t * 1.1 + 0.01) for n, t in from_pretrained(model_dir, dtype="float32").state_dict().items()}
    engine.begin_weight_update()
    engine.update_weights(trained.items())
    engine.end_weight_update(version=1)  # scales count as written: no "parameters unwritten" error
    params = dict(engine.model.named_parameters())
    projections = [n for n in trained if n.endswith("proj.weight")]
    assert len(projections) == 2 * 7
    for name, tensor in trained.items():
        if name in projections:
            w8, scale = quantize_rowwise(tensor)
            assert params[name].dtype == E4M3
            assert torch.equal(params[name].view(torch.uint8), w8.view(torch.uint8)), name
            assert torch.equal(params[name + "_scale"], scale), name
        elif name in params:
            assert torch.equal(params[name], tensor), name
    # A partial update (LoRA's adapted modules) quantizes only what it pushes.
    name = "model.layers.0.self_attn.q_proj.weight"
    before = {n: p.detach().clone() for n, p in params.items()}
    engine.begin_weight_update(partial=True)
    engine.update_weights([(name, trained[name] * 2)])
    engine.end_weight_update(version=2)
    changed = {n for n, p in params.items() if not torch.equal(_bits(p), _bits(before[n]))}
    # Doubling a row doubles its scale and keeps its e4m3 values: only the scales change.
    assert changed == {name + "_scale"}
    torch.testing.assert_close(params[name + "_scale"], quantize_rowwise(trained[name] * 2)[1])


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_fp8_weights_give_the_quantized_models_logprobs(model_dir, temperature):
    """Prefill, decode and sampling on FP8 weights compute what the quantized model's plain
    forward computes (activations are quantized per token, so batching changes nothing)."""
    engine = NativeEngine(str(model_dir), weight_dtype="fp8", **SMALL)
    model = _quantized(model_dir)
    sp = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=5)
    for c in engine.generate(PROMPTS, sp):
        ref = teacher_forced_logprobs(model, PROMPTS[c.prompt_index], c.output_ids, temperature)
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-4


def _rounded_kv_logprobs(model, prompt, output):
    """Teacher-forced log-probs (T = 1, fp32 on the CPU) of `output` as an FP8 cache computes them:
    the prompt's rows attend exactly (its prefill attends the keys it computed), every later row (a
    decode step) attends keys and values rounded as the cache stores them (e4m3, one scale per token
    and head)."""

    def rounded(x):
        scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / 448
        return (x / scale).to(E4M3).float() * scale

    def causal(q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        out = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
        )
        return out.transpose(0, 1)

    def attn(_module, q, k, v):
        p = len(prompt)
        return torch.cat([causal(q, k, v)[:p], causal(q, rounded(k), rounded(v))[p:]])

    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        hidden = model.hidden_states(ids, positions=torch.arange(len(ids)), attn=attn)
        logits = model.lm_head(hidden)[len(prompt) - 1 : -1].double()
    return logits.log_softmax(-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


@pytest.mark.parametrize("n", [1, 4])
def test_fp8_kv_cache_decodes_from_the_rounded_keys_and_values(model_dir, n):
    """A prompt's prefill attends its keys as computed (the first sampled token is the exact
    model's); every decode step reads the e4m3 cache, so the tokens after it are those of a forward
    whose keys and values are all rounded per token and head. With n = 4 the prompt's blocks are
    shared (and the partial one copied on write, scales included)."""
    engine = NativeEngine(str(model_dir), kv_cache_dtype="fp8_e4m3", **SMALL)
    assert engine.runner.kv.dtype == E4M3 and engine.runner.kv_scale.shape == engine.runner.kv.shape[:-1]
    model = from_pretrained(model_dir, dtype="float32")
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    moved = 0.0
    for c in engine.generate(PROMPTS, sp):
        ours = torch.tensor(c.logprobs, dtype=torch.float64)
        prompt = PROMPTS[c.prompt_index]
        exact = teacher_forced_logprobs(model, prompt, c.output_ids, 1.0)
        rounded = _rounded_kv_logprobs(model, prompt, c.output_ids)
        assert abs(ours[0] - exact[0]).item() <= 1e-4
        assert (ours[1:] - rounded[1:]).abs().max().item() <= 1e-4
        moved = max(moved, (rounded - exact).abs().max().item())
    assert moved > 1e-3  # the rounding is visible: the cache really is e4m3


@pytest.mark.parametrize("case", ["chunked_prefill", "preemption"])
def test_fp8_kv_cache_chunked_and_recomputed_prefills_stay_near_the_exact_forward(model_dir, case):
    """A later prefill chunk (or a preempted sequence's recompute) attends the cached part rounded and
    its own new keys as computed, a mix of the two forwards above that no simple reference reproduces:
    bounded here as the plain path is (its largest move from the exact forward on this model is
    about 0.2 nats); a lost scale, a wrong block or a misaligned prefix moves log-probs by nats."""
    kwargs = dict(max_num_batched_tokens=3) if case == "chunked_prefill" else dict(max_kv_tokens=4 * 12, max_num_seqs=8)
    engine = NativeEngine(str(model_dir), kv_cache_dtype="fp8_e4m3", **{**SMALL, **kwargs})
    model = from_pretrained(model_dir, dtype="float32")
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)
    outs = engine.generate(PROMPTS * 2, sp)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    diffs = torch.cat(
        [
            torch.tensor(c.logprobs, dtype=torch.float64)
            - teacher_forced_logprobs(model, (PROMPTS * 2)[c.prompt_index], c.output_ids, 1.0)
            for c in outs
        ]
    ).abs()
    print(f"{case}: |log-prob - exact| mean {diffs.mean():.3f}, max {diffs.max():.3f} over {diffs.numel()} tokens")
    assert diffs.mean().item() <= 0.1 and diffs.max().item() <= 0.5


def test_a_fresh_prompt_attends_its_own_keys_whatever_it_is_batched_with():
    """In one prefill, sequence 0 continues a cached 4-token prefix (so every key is gathered from
    the e4m3 cache) and sequence 1 is new: sequence 1's output is exactly what it gets alone (its
    keys as computed), and sequence 0's new queries see the rounded prefix and their own keys as
    computed."""
    from colocate.kernels.paged_attention import gather_kv, store_kv
    from colocate.rollout.native.attention_ops import attention_per_sequence, prefill_attention

    torch.manual_seed(0)
    hq, hk, d, bs, nb = 4, 2, 16, 4, 8
    kv = torch.zeros(2, nb, bs, hk, d, dtype=E4M3)
    kv_scale = torch.zeros(2, nb, bs, hk)
    prefix_k, prefix_v = torch.randn(4, hk, d), torch.randn(4, hk, d)
    store_kv(prefix_k, prefix_v, kv[0], kv[1], torch.arange(4), kv_scale[0], kv_scale[1])  # block 0
    q, k, v = torch.randn(3 + 5, hq, d), torch.randn(3 + 5, hk, d), torch.randn(3 + 5, hk, d)
    slots = torch.tensor([4, 5, 6, 8, 9, 10, 11, 12])  # sequence 0: block 1; sequence 1: blocks 2-3
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 7, 12], dtype=torch.int32)
    gather = torch.tensor([0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12])
    out = prefill_attention(q, k, v, kv, kv_scale, slots, cu_q, cu_k, torch.tensor([5, 7]), gather, 0.25)
    alone = attention_per_sequence(q[3:], k[3:], v[3:], [5], [5], 0.25)
    assert torch.equal(out[3:], alone)
    cached_k, cached_v = gather_kv(kv[0], kv[1], torch.arange(4), torch.float32, kv_scale[0], kv_scale[1])
    assert not torch.equal(cached_k, prefix_k)  # the prefix is read rounded
    first = attention_per_sequence(q[:3], torch.cat([cached_k, k[:3]]), torch.cat([cached_v, v[:3]]), [3], [7], 0.25)
    assert torch.equal(out[:3], first)


def test_release_resume_and_update_keep_fp8_generation_identical(model_dir):
    engine = NativeEngine(str(model_dir), weight_dtype="fp8", kv_cache_dtype="fp8_e4m3", **SMALL)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=9)
    before = engine.generate(PROMPTS, sp)
    engine.release_memory(["kv_cache", "weights", "cuda_graph"])
    engine.resume_memory(["weights"])
    engine.begin_weight_update()
    engine.update_weights(from_pretrained(model_dir, dtype="float32").state_dict().items())
    engine.end_weight_update(version=1)
    engine.resume_memory(["cuda_graph", "kv_cache"])
    after = engine.generate(PROMPTS, sp)
    assert [c.output_ids for c in after] == [c.output_ids for c in before]
    assert [c.logprobs for c in after] == [c.logprobs for c in before]


def test_the_config_refuses_fp8_where_it_cannot_run_and_turns_tis_on():
    for field in ("weight_dtype", "kv_cache_dtype"):
        value = "fp8" if field == "weight_dtype" else "fp8_e4m3"
        with pytest.raises(ValueError, match=f"rollout.{field} fp8 needs rollout.engine=native"):
            validate(Config(rollout=RolloutConfig(engine="sglang", **{field: value})))
        with pytest.raises(ValueError, match=f"rollout.{field} fp8 is not bitwise .* algorithm.true_on_policy"):
            validate(Config(rollout=RolloutConfig(**{field: value}), algorithm=AlgorithmConfig(true_on_policy=True)))
        assert Config(rollout=RolloutConfig(**{field: value})).tis_on
        assert not Config(rollout=RolloutConfig(**{field: value}), algorithm=AlgorithmConfig(use_tis=False)).tis_on
    assert not Config().tis_on and Config(algorithm=AlgorithmConfig(use_tis=True)).tis_on
    with pytest.raises(ValueError, match="weight_dtype must be one of"):
        NativeEngine("unused", weight_dtype="int4")


# ---------------------------------------------------------------- on the GPU


@pytest.fixture(scope="module")
def medium(tmp_path_factory):
    """test_engine_gpu's medium model: a random Qwen3 with bf16-exact weights, fp32 and bf16 transformers."""
    return transformers_pair(write_hf_model(tmp_path_factory.mktemp("hf"), "qwen3", bf16_weights=True, **HF_MEDIUM))


def _gpu_engine(path, **kwargs):
    return NativeEngine(str(path), dtype="bfloat16", max_kv_tokens=1 << 15, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("weights, kv", [("fp8", "auto"), ("auto", "fp8_e4m3"), ("fp8", "fp8_e4m3")])
def test_gpu_fp8_logprobs_follow_their_rounding(medium, weights, kv):
    """The bf16 engine on FP8 weights and/or an FP8 cache (FP8 GEMMs, the Triton cache kernels, the
    compiled and graphed decode) against two fp32 CPU forwards: the unquantized model, and the one
    that rounds as FP8 does (the row-quantized projections, per-token activations, the cache's
    rounded keys and values). It must be nearer the second: a rounding along the wrong axis, a lost
    scale or a misread block would not be. It cannot be within bf16's noise of it: e4m3 turns the
    bf16-vs-fp32 difference of a value near a rounding boundary into a whole e4m3 step (on an H100:
    0.21, 0.07 and 0.24 nats mean from the rounded forward, 0.31, 0.11 and 0.33 from the unquantized
    one, for weights, cache and both, against bf16's own 0.026). And the distance from the
    unquantized model stays bounded."""
    from tests.tolerances import error_stats

    path, hf32, hf16 = medium
    engine = _gpu_engine(path, weight_dtype=weights, kv_cache_dtype=kv)
    batch = prompts(80, 37, HF_MEDIUM["vocab_size"])
    outs = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3))
    sequences = [(batch[c.prompt_index], c.output_ids) for c in outs]
    ours = torch.tensor([lp for c in outs for lp in c.logprobs])
    model = _quantized(path) if weights == "fp8" else from_pretrained(path, dtype="float32")
    score = _rounded_kv_logprobs if kv == "fp8_e4m3" else lambda m, p, o: teacher_forced_logprobs(m, p, o, 1.0)
    rounded = error_stats(ours, torch.cat([score(model, p, o) for p, o in sequences]).float())
    baseline = error_stats(hf_logprobs(hf16, sequences), hf_logprobs(hf32, sequences))
    moved = error_stats(ours, hf_logprobs(hf32, sequences))
    print(f"\nweights {weights}, kv {kv}: |ours - rounded fp32| {rounded}; |ours - fp32| {moved}; |bf16 - fp32| {baseline}")
    assert rounded.mean < moved.mean
    assert moved.mean <= 0.5 and moved.p99 <= 1.5


@pytest.mark.gpu
def test_gpu_fp8_cuda_graph_decode_equals_eager_and_survives_release(medium):
    path = medium[0]
    batch = prompts(16, 24, HF_MEDIUM["vocab_size"])
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=2)
    graphed = _gpu_engine(path, weight_dtype="fp8", kv_cache_dtype="fp8_e4m3")
    eager = _gpu_engine(path, weight_dtype="fp8", kv_cache_dtype="fp8_e4m3", cuda_graph=False)
    a, b = graphed.generate(batch, sp), eager.generate(batch, sp)
    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    assert max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs)) <= 1e-5
    graphed.release_memory(["kv_cache", "weights", "cuda_graph"])
    graphed.resume_memory(["weights"])
    graphed.begin_weight_update()
    graphed.update_weights(from_pretrained(path, dtype="bfloat16", device="cuda").state_dict().items())
    graphed.end_weight_update(version=1)
    graphed.resume_memory(["cuda_graph", "kv_cache"])
    again = graphed.generate(batch, sp)
    assert [c.output_ids for c in again] == [c.output_ids for c in a]


@pytest.mark.gpu
def test_gpu_toy_task_learns_with_fp8_rollout(tmp_path):
    """The default run with FP8 weights and cache: reward and greedy eval rise as in bf16, with TIS
    on by default and the mismatch metrics reported."""
    import os
    import subprocess
    import sys

    from tests.integration.test_loop import ROOT, by_step

    out = tmp_path / "run"
    env = {**os.environ, "COLOCATE_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-m", "colocate.train", "--config", "configs/default.yaml", "--output-dir", str(out)]
    cmd += ["--rollout.weight-dtype", "fp8", "--rollout.kv-cache-dtype", "fp8_e4m3", "--logging.console", "False"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = by_step(out)
    rewards = [rows[s]["rollout/raw_reward"] for s in sorted(rows)]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    mismatch = [rows[s]["train/mismatch/abs_diff_max"] for s in sorted(rows)]
    median = sorted(mismatch)[len(mismatch) // 2]
    print(f"\nFP8 rollout: reward {first:.3f} -> {last:.3f}; train/mismatch/abs_diff_max median {median:.3f}")
    assert last - first >= 0.3, rewards
    assert all("train/tis_clipfrac" in rows[s] for s in rows)
    assert all(m > 0 for m in mismatch)  # FP8 rollout is not the trainer's bf16
