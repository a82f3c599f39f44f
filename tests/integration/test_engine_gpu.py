"""The native engine on a GPU: memory release, CUDA graphs, the production sampler, and bf16
log-probs measured against an fp32 forward of the same weights."""

import collections

import pytest
import torch

from colocate.kernels import reference_token_logprobs, token_logprobs
from colocate.models import ModelConfig, from_config, load_weights
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
SAMPLERS = {
    "plain": dict(temperature=1.0),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k_min_p": dict(temperature=1.2, top_k=20, min_p=0.02),
}


def random_model(cfg, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    model = from_config(cfg, dtype, "cuda", init=True)
    with torch.no_grad():  # larger weights than N(0, 0.02): peaked distributions, fewer near-ties
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model


def fp32_copy(model):
    ref = from_config(model.config, torch.float32, "cuda")
    load_weights(ref, model.state_dict().items(), source="bf16 model")
    return ref.eval()


def prompts(num, length, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(num)]


@pytest.fixture(autouse=True)
def full_fp32_matmuls():
    """The fp32 reference must not run its GEMMs in TF32."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(before)


def forward_logprobs(model, prompt, output, temperature):
    """Log-probs of `output` after `prompt` from one forward of `model`: for the bf16 model the
    trainer's path (colocate.kernels.token_logprobs: bf16 inputs, fp32 accumulation), for an fp32
    model the fp32 reference (full fp32 logits)."""
    ids = torch.tensor(prompt + output, device="cuda")
    targets = torch.tensor(output, device="cuda")
    with torch.no_grad():
        hidden = model.hidden_states(ids)[len(prompt) - 1:-1]  # (T, H)
        weight = model.lm_head.weight
        if hidden.dtype == torch.float32:
            logprobs, _ = reference_token_logprobs(hidden, weight, targets, temperature)
        else:
            logprobs, _ = token_logprobs(hidden, weight, targets, temperature)
    return logprobs.double().cpu()


def logprob_errors(model, ref, prompt_list, completions, temperature):
    """|diff| (mean, max) between the engine's, the trainer's (bf16) and the fp32 reference's
    log-probs of the engine's sampled tokens."""
    engine = torch.cat([torch.tensor(c.logprobs, dtype=torch.float64) for c in completions])
    trainer = torch.cat([forward_logprobs(model, prompt_list[c.prompt_index], c.output_ids, temperature)
                         for c in completions])
    fp32 = torch.cat([forward_logprobs(ref, prompt_list[c.prompt_index], c.output_ids, temperature)
                      for c in completions])
    pairs = {"engine-fp32": (engine, fp32), "trainer-fp32": (trainer, fp32), "engine-trainer": (engine, trainer)}
    return {name: ((a - b).abs().mean().item(), (a - b).abs().max().item()) for name, (a, b) in pairs.items()}


def assert_engine_as_precise_as_trainer(errors, label):
    """bf16 noise is inherent, and in a deep random model it is amplified layer after layer; what
    must not happen is the engine being much further from fp32 than the trainer's own bf16 forward
    (a wrong rope position, KV slot or stale cache would make it so)."""
    print(f"\n{label}: " + ", ".join(f"{k} mean {m:.2e} max {x:.2e}" for k, (m, x) in errors.items()))
    engine_mean, trainer_mean = errors["engine-fp32"][0], errors["trainer-fp32"][0]
    assert engine_mean <= 2 * trainer_mean + 1e-3, errors


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


def _rows(params, num_rows, vocab, stop=frozenset(), prompt_len=10, done=0):
    return [(params[i % len(params)], 1000 + 7919 * i, stop, prompt_len, done) for i in range(num_rows)]


def _graphed(fn):
    """Run `fn` (device work only) captured in a CUDA graph, as the engine runs its sampler."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    return out


@pytest.mark.parametrize("case", ["plain", "greedy_mix", "top_p", "top_k", "min_p", "all_truncations"])
def test_production_sampler_equals_eager_sampler(case):
    """What the engine runs on CUDA (compiled vocabulary pass, eager sort/cumsum truncation, inside
    a CUDA graph) samples the same ids as the plain eager definition."""
    b, v = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(b, v, device="cuda", generator=g) * 4
    params = {
        "plain": [SamplingParams(temperature=1.0)],
        "greedy_mix": [SamplingParams(temperature=t) for t in (0.0, 0.5, 1.0, 1.7)],
        "top_p": [SamplingParams(temperature=1.0, top_p=p) for p in (0.9, 0.5, 1.0)],
        "top_k": [SamplingParams(temperature=1.0, top_k=k) for k in (50, 1, -1)],
        "min_p": [SamplingParams(temperature=1.0, min_p=p) for p in (0.02, 0.3, 0.0)],
        "all_truncations": [SamplingParams(temperature=0.7, top_k=100, top_p=0.8, min_p=0.01),
                            SamplingParams(temperature=0.0, top_p=0.5)],
    }[case]
    batch = SamplingBatch.build(_rows(params, b, v), v, torch.device("cuda"))
    assert batch.truncate == (case not in ("plain", "greedy_mix"))
    counter = torch.arange(b, device="cuda") + 100
    ids_g, lp_g = _graphed(lambda: batch.sample(logits, counter))
    ids_p, lp_p = batch.sample(logits, counter)
    ids_e, lp_e = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed,
                                counter, truncate=batch.truncate, fused=False)
    assert torch.equal(ids_g, ids_p) and torch.equal(lp_g, lp_p)
    assert torch.equal(ids_p, ids_e)
    assert (lp_p - lp_e).abs().max().item() <= 1e-4
    # The log-prob is the untruncated one, and truncation keeps what it must.
    scaled = logits / torch.where(batch.temperature == 0, 1.0, batch.temperature)[:, None]
    assert (lp_e - scaled.log_softmax(-1).gather(1, ids_e[:, None]).squeeze(1)).abs().max().item() <= 1e-4
    above = logits > logits.gather(1, ids_e[:, None])  # (B, V) tokens ranked above the sample
    assert (above.sum(-1) < batch.top_k).all()  # within the top-k
    assert (above.sum(-1)[batch.temperature == 0] == 0).all()  # greedy rows take the argmax
    probs = scaled.softmax(-1)  # (B, V)
    pure_top_p = (batch.top_p < 1) & (batch.top_k == v) & (batch.min_p == 0)
    mass_above = (probs * above).sum(-1)  # (B,)
    assert (mass_above[pure_top_p] < batch.top_p[pure_top_p] + 1e-6).all()  # within the top-p set
    pure_min_p = (batch.min_p > 0) & (batch.top_k == v) & (batch.top_p == 1)
    ratio = probs.gather(1, ids_e[:, None]).squeeze(1) / probs.max(-1).values  # (B,)
    assert (ratio[pure_min_p] >= batch.min_p[pure_min_p] * (1 - 1e-4)).all()  # within the min-p set


def test_production_sampler_masks_stop_ids_until_min_new_tokens():
    b, v = 64, 151936
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(b, v, device="cuda", generator=g) * 4
    plain = SamplingBatch.build(_rows([SamplingParams()], b, v), v, torch.device("cuda"))
    # Row i samples at position 10 + i % 8 after a 10-token prompt; min_new_tokens=4 masks the stop
    # ids at positions < 13. Each row's stop ids include what it samples without a mask.
    counter = 10 + torch.arange(b, device="cuda") % 8
    free_ids, _ = plain.sample(logits, counter)
    stop = frozenset(free_ids.tolist()[:5])
    rows = [(SamplingParams(min_new_tokens=4), 1000 + 7919 * i, stop | {free_ids[i].item()}, 10, 0) for i in range(b)]
    batch = SamplingBatch.build(rows, v, torch.device("cuda"))
    assert batch.suppress_ids is not None and not batch.truncate
    ids_g, lp_g = _graphed(lambda: batch.sample(logits, counter))
    ids_e, lp_e = sample_tokens(logits, batch.temperature, batch.top_k, batch.top_p, batch.min_p, batch.seed,
                                counter, batch.suppress_ids, batch.suppress_until, fused=False)
    assert torch.equal(ids_g, ids_e) and (lp_g - lp_e).abs().max().item() <= 1e-4
    masked = counter < 13
    stop_rows = [set(r[2]) for r in rows]
    assert all(ids_g[i].item() not in stop_rows[i] for i in range(b) if masked[i])
    assert torch.equal(ids_g[~masked], free_ids[~masked])  # unmasked rows: the same draw as without a mask


def _frequent_tokens(model, batch, num):
    engine = NativeEngine(model, max_kv_tokens=1 << 15, cuda_graph=False)
    outs = engine.generate(batch, SamplingParams(temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=9))
    counts = collections.Counter(t for c in outs for t in c.output_ids)
    return tuple(t for t, _ in counts.most_common(num))


@pytest.mark.parametrize("case", ["plain", "top_p", "top_k_min_p", "stop_mask", "mixed"])
def test_cuda_graph_decode_equals_eager_decode(case):
    """16 rows (a graph bucket, so both run the same shapes) of 8 prompts x 2 samples: the graphed
    decode step (forward, sampler, feedback) equals the same step run eagerly."""
    model = random_model(SMALL)
    batch = prompts(8, 24, SMALL.vocab_size)
    if case == "stop_mask":  # frequent tokens, masked for the whole completion: nobody stops early
        stop = _frequent_tokens(model, batch, 3)
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, min_new_tokens=40, stop_token_ids=stop, seed=2)
    elif case == "mixed":
        sp = [SamplingParams(n=2, max_new_tokens=40, ignore_eos=True, seed=2 + i, **params)
              for i, params in enumerate([*SAMPLERS.values(), dict(temperature=0.0)] * 2)]
    else:
        sp = SamplingParams(n=2, max_new_tokens=40, ignore_eos=True, seed=2, **SAMPLERS[case])
    graphed = NativeEngine(model, max_kv_tokens=1 << 15, cuda_graph=True)
    eager = NativeEngine(model, max_kv_tokens=1 << 15, cuda_graph=False)
    assert graphed.runner.graphs.captured and eager.runner.graphs is None
    a, b = graphed.generate(batch, sp), eager.generate(batch, sp)
    assert [c.output_ids for c in a] == [c.output_ids for c in b]
    assert all(len(c.output_ids) == 40 for c in a)
    diff = max(abs(x - y) for ca, cb in zip(a, b) for x, y in zip(ca.logprobs, cb.logprobs))
    assert diff <= 1e-5
    if case == "stop_mask":
        assert not set(stop) & {t for c in a for t in c.output_ids}


@pytest.mark.parametrize("case", ["plain", "top_p"])
def test_padded_graph_rows_are_inert(case):
    """12 and 9 sequences replay the 16-row graph with 4 and 7 inert rows: their completions equal
    those of the same prompts among 16 live rows (one prompt per prefill step, so every run
    computes the same shapes)."""
    model = random_model(SMALL)
    batch = prompts(16, 24, SMALL.vocab_size)
    engine = NativeEngine(model, max_kv_tokens=1 << 15, max_num_batched_tokens=24)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True, seed=5, **SAMPLERS[case])
    full = engine.generate(batch, sp)
    for num in (12, 9):
        assert engine.runner.graphs.bucket(num) == 16
        part = engine.generate(batch[:num], sp)
        assert [c.output_ids for c in part] == [c.output_ids for c in full[:num]]
        assert [c.logprobs for c in part] == [c.logprobs for c in full[:num]]


@pytest.mark.parametrize("case", ["top_p", "stop_mask"])
def test_graphs_captured_mid_generation_change_nothing(case):
    """Prompts with different lengths to generate shrink the batch through several buckets; a
    variant's graph for each is captured on first use, between two decode windows. A second run,
    with every graph already there, gives the same completions."""
    model = random_model(SMALL)
    batch = prompts(16, 20, SMALL.vocab_size)
    if case == "stop_mask":  # masked until the last two tokens, so the mask stays on as the batch shrinks
        stop = _frequent_tokens(model, batch, 3)
        sp = [SamplingParams(max_new_tokens=8 + 4 * i, min_new_tokens=6 + 4 * i, stop_token_ids=stop, seed=i)
              for i in range(16)]
    else:
        sp = [SamplingParams(max_new_tokens=8 + 4 * i, ignore_eos=True, seed=i, **SAMPLERS[case]) for i in range(16)]
    engine = NativeEngine(model, max_kv_tokens=1 << 15, max_decode_steps=4)
    first = engine.generate(batch, sp)
    captured = set(engine.runner.graphs.graphs)
    second = engine.generate(batch, sp)
    assert set(engine.runner.graphs.graphs) == captured
    assert len({bucket for bucket, variant in captured if variant != (False, 0)}) >= 3
    assert [c.output_ids for c in first] == [c.output_ids for c in second]
    assert [c.logprobs for c in first] == [c.logprobs for c in second]
    assert all(len(c.output_ids) >= p.min_new_tokens for c, p in zip(first, sp))


@pytest.mark.parametrize("case", ["plain", "uncompiled", "shared_prefix", "chunked_prefill", "preemption"])
def test_bf16_logprobs_as_precise_as_the_trainer(case):
    """Every paging path must produce log-probs as close to an fp32 forward as the trainer's own
    bf16 forward is; a paging bug (wrong block, wrong causal alignment) breaks that."""
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
    assert_engine_as_precise_as_trainer(logprob_errors(model, fp32_copy(model), batch, outs, 1.0), case)


def test_bf16_logprob_error_at_0_5b_shape():
    """A random 24-layer model amplifies bf16 rounding layer after layer, so engine and trainer
    differ by far more here than on the small model; both must still be equally far from fp32,
    compiled decode or not. A control with the generated tokens' rope positions off by one shows
    that the criterion catches a real defect."""
    model = random_model(QWEN25_05B)
    ref = fp32_copy(model)
    batch = prompts(16, 64, QWEN25_05B.vocab_size)
    for compiled in (True, False):
        engine = NativeEngine(model, max_kv_tokens=1 << 17, compile_decode=compiled)
        for temperature in (1.0, 0.7):
            sp = SamplingParams(temperature=temperature, max_new_tokens=64, ignore_eos=True, seed=4)
            outs = engine.generate(batch, sp)
            errors = logprob_errors(model, ref, batch, outs, temperature)
            assert_engine_as_precise_as_trainer(errors, f"0.5B shape, compiled={compiled}, T={temperature}")
        engine.shutdown()
    # Control: the trainer's forward with every generated token one position too far.
    shifted = []
    for c in outs:
        prompt = batch[c.prompt_index]
        ids = torch.tensor(prompt + c.output_ids, device="cuda")
        positions = torch.arange(len(ids), device="cuda") + (torch.arange(len(ids), device="cuda") >= len(prompt))
        with torch.no_grad():
            hidden = model.hidden_states(ids, positions=positions,
                                         cu_seqlens=torch.tensor([0, len(ids)], device="cuda", dtype=torch.int32),
                                         max_seqlen=len(ids))[len(prompt) - 1:-1]
            logprobs, _ = token_logprobs(hidden, model.lm_head.weight, torch.tensor(c.output_ids, device="cuda"), 0.7)
        shifted.append(logprobs.double().cpu())
    control = (torch.cat(shifted) - torch.cat([forward_logprobs(ref, batch[c.prompt_index], c.output_ids, 0.7)
                                               for c in outs])).abs().mean().item()
    trainer_mean = errors["trainer-fp32"][0]
    print(f"\ncontrol (rope positions of generated tokens +1): |diff| to fp32 mean {control:.2e}")
    assert control > 2 * trainer_mean + 1e-3
