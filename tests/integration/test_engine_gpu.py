"""The native engine on a GPU: memory release, CUDA graphs, bf16 log-probs against the trainer's."""

import copy

import pytest
import torch

from colocate.models import ModelConfig, from_config
from colocate.rollout.native import NativeEngine
from colocate.rollout.native.sampler import SamplingBatch, sample_tokens
from colocate.rollout.protocol import SamplingParams

pytestmark = pytest.mark.gpu

QWEN25_05B = ModelConfig(
    model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
    num_attention_heads=14, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
    tie_word_embeddings=True, attention_bias=True, eos_token_id=151643)
SMALL = ModelConfig(
    model_type="qwen3", vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, qk_norm=True, eos_token_id=1)


def random_model(cfg, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model = from_config(cfg, dtype, "cuda", init=True)
    with torch.no_grad():  # larger weights than N(0, 0.02): peaked distributions, fewer near-ties
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model


def prompts(num, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(num)]


def trainer_logprobs(model, prompt, output, temperature):
    """The trainer's definition: fp32 logits of the bf16 model, log_softmax(logits / T)."""
    ids = torch.tensor(prompt + output, device="cuda")
    with torch.no_grad():
        hidden = model.hidden_states(ids)[len(prompt) - 1:-1]  # (T, H)
        logits = torch.mm(hidden, model.lm_head.weight.T, out_dtype=torch.float32)
    logits = logits / (temperature or 1.0)
    return logits.log_softmax(-1).gather(1, torch.tensor(output, device="cuda")[:, None]).squeeze(1).cpu()


def logprob_mismatch(model, prompt_list, completions, temperature):
    diffs = torch.cat([
        (torch.tensor(c.logprobs)
         - trainer_logprobs(model, prompt_list[c.prompt_index], c.output_ids, temperature)).abs()
        for c in completions])
    return diffs.mean().item(), diffs.max().item()


def test_release_returns_weight_and_kv_memory():
    model = random_model(QWEN25_05B)
    engine = NativeEngine(model, max_kv_tokens=1 << 18)
    engine.generate(prompts(8, 32, QWEN25_05B.vocab_size), SamplingParams(max_new_tokens=16, ignore_eos=True))
    stats = engine.memory_stats()
    expected = stats["weights_bytes"] + stats["kv_cache_bytes"]
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    engine.flush_cache()
    engine.release_memory()
    free_released = torch.cuda.mem_get_info()[0]
    engine.resume_memory()
    free_resumed = torch.cuda.mem_get_info()[0]
    returned, taken = free_released - free_before, free_released - free_resumed
    print(f"\nmemory: {stats}; release returned {returned / 2**30:.2f} GiB, resume took {taken / 2**30:.2f} GiB, "
          f"of weights + KV {expected / 2**30:.2f} GiB")
    assert returned >= 0.95 * expected
    assert taken >= 0.95 * expected


def test_release_resume_update_keeps_generation_identical():
    model = random_model(SMALL)
    engine = NativeEngine(model, max_kv_tokens=1 << 15)
    batch = prompts(16, 20, SMALL.vocab_size)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=1)
    before = engine.generate(batch, sp)
    engine.release_memory(["kv_cache", "weights", "cuda_graph"])
    engine.resume_memory(["weights"])
    engine.begin_weight_update()
    engine.update_weights(model.state_dict().items())
    engine.end_weight_update(version=1)
    engine.resume_memory(["cuda_graph", "kv_cache"])
    after = engine.generate(batch, sp)
    assert [c.output_ids for c in after] == [c.output_ids for c in before]
    assert all(c.weight_version == 1 for c in after)


def test_cuda_graph_decode_equals_eager_decode():
    model = random_model(SMALL)
    batch = prompts(16, 24, SMALL.vocab_size)  # 16 rows: a graph bucket, so both run the same shapes
    sp = SamplingParams(temperature=1.0, max_new_tokens=48, ignore_eos=True, seed=2)
    graphed = NativeEngine(model, max_kv_tokens=1 << 15, cuda_graph=True)
    eager = NativeEngine(model, max_kv_tokens=1 << 15, cuda_graph=False)
    assert graphed.runner.graphs.captured and eager.runner.graphs is None
    a, b = graphed.generate(batch, sp), eager.generate(batch, sp)
    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    diff = max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert diff <= 1e-5


def test_production_sampler_paths():
    """Plain sampling runs the streaming Triton kernel and equals the plain-torch sampler; truncating
    batches run eager and keep every token inside its top-k set."""
    b, v = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(b, v, device="cuda", generator=g) * 4
    cuda = dict(device="cuda")
    counter = torch.arange(b, **cuda) + 100
    args = (logits, torch.rand(b, **cuda) * (torch.arange(b, **cuda) % 4 > 0), torch.full((b,), v, **cuda),
            torch.ones(b, **cuda), torch.zeros(b, **cuda), torch.arange(b, **cuda) * 7919, counter)
    plain = SamplingBatch.build([(SamplingParams(temperature=float(t)), int(sd), frozenset(), 0)
                                 for t, sd in zip(args[1].tolist(), args[5].tolist())], v, torch.device("cuda"))
    assert not plain.truncate
    ids_c, lp_c = plain.sample(logits, counter)
    ids_e, lp_e = sample_tokens(*args, truncate=False)
    assert (ids_c == ids_e).float().mean().item() >= 0.98
    assert (lp_c - lp_e).abs().max().item() <= 1e-3
    rows = [(SamplingParams(top_k=50, top_p=0.9, min_p=0.02), 7919 * i, frozenset(), 0) for i in range(b)]
    batch = SamplingBatch.build(rows, v, torch.device("cuda"))
    assert batch.truncate
    ids, lp = batch.sample(logits, counter)
    assert bool((logits.topk(50, dim=-1).indices == ids[:, None]).any(-1).all())
    full = torch.log_softmax(logits, -1).gather(1, ids[:, None]).squeeze(1)
    assert (lp - full).abs().max().item() <= 1e-4  # untruncated log-prob, the protocol's definition


@pytest.mark.parametrize("case", ["plain", "uncompiled", "shared_prefix", "chunked_prefill", "preemption"])
def test_bf16_logprobs_match_the_trainer(case):
    """Every paging path must produce log-probs the trainer reproduces; a paging bug (wrong block,
    wrong causal alignment) shows up as a large mismatch."""
    model = random_model(SMALL)
    kwargs = dict(max_kv_tokens=1 << 15)
    n = 1
    if case == "uncompiled":
        kwargs["compile_decode"] = False
    elif case == "shared_prefix":
        n = 4
    elif case == "chunked_prefill":
        kwargs["max_num_batched_tokens"] = 7
    elif case == "preemption":
        kwargs.update(max_kv_tokens=16 * 24, max_num_seqs=64)
    engine = NativeEngine(model, **kwargs)
    batch = prompts(12, 37, SMALL.vocab_size)
    sp = SamplingParams(n=n, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)
    outs = engine.generate(batch, sp)
    if case == "preemption":
        assert engine.scheduler.num_preemptions > 0
    mean, worst = logprob_mismatch(model, batch, outs, 1.0)
    print(f"\n{case}: engine vs trainer bf16 log-prob |diff| mean {mean:.2e} max {worst:.2e}")
    assert mean <= 0.02 and worst <= 0.5


def test_bf16_logprob_mismatch_at_0_5b_shape():
    """Engine and trainer-style bf16 log-probs, both against an fp32 forward of the same weights: the
    engine may differ from the trainer by bf16 noise, but must not be further from fp32 than the
    trainer's own bf16 forward is (a paging defect would make it much worse)."""
    model = random_model(QWEN25_05B)
    reference = copy.deepcopy(model).float()  # the same bf16 weights, computed in fp32
    engine = NativeEngine(model, max_kv_tokens=1 << 17)
    batch = prompts(16, 64, QWEN25_05B.vocab_size)
    torch.backends.cuda.matmul.allow_tf32 = False
    for temperature in (1.0, 0.7):
        sp = SamplingParams(temperature=temperature, max_new_tokens=64, ignore_eos=True, seed=4)
        outs = engine.generate(batch, sp)
        engine_vs_fp32, trainer_vs_fp32 = [], []
        for c in outs:
            ref = trainer_logprobs(reference, batch[c.prompt_index], c.output_ids, temperature)
            mine = trainer_logprobs(model, batch[c.prompt_index], c.output_ids, temperature)
            engine_vs_fp32.append((torch.tensor(c.logprobs) - ref).abs())
            trainer_vs_fp32.append((mine - ref).abs())
        e, t = torch.cat(engine_vs_fp32), torch.cat(trainer_vs_fp32)
        print(f"\n0.5B shape, T={temperature}: |engine - fp32| mean {e.mean():.2e} max {e.max():.2e}; "
              f"|trainer bf16 - fp32| mean {t.mean():.2e} max {t.max():.2e}")
        assert e.mean().item() <= 2 * t.mean().item() + 1e-3
