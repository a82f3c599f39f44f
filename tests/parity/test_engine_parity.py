"""The native engine against transformers and against our own model, on tiny random models (CPU)."""

import pytest
import torch

from colocate.models import from_pretrained, iter_safetensors
from colocate.rollout.native import NativeEngine
from colocate.rollout.native.sampler import sample_tokens
from colocate.rollout.protocol import SamplingParams
from tests.helpers import FAMILIES, write_hf_model

PROMPTS = [[3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22], [20], [7, 7, 7, 7, 7, 7, 7]]
SMALL = dict(block_size=4, max_kv_tokens=512)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> (directory, transformers model); qwen2 gets GQA here (2 kv heads for 4 q heads)."""
    root = tmp_path_factory.mktemp("engine_models")
    out = {family: write_hf_model(root, family) for family in FAMILIES}
    out["qwen2"] = write_hf_model(root, "qwen2", num_key_value_heads=2)
    out["other"] = write_hf_model(root / "other", "qwen3", seed=1)
    return out


def teacher_forced_logprobs(model, prompt, output, temperature):
    """log_softmax(logits / T) of each output token under our model, in one forward."""
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        logits = model(ids)[len(prompt) - 1 : -1].double()  # (T, V)
    scaled = logits / (temperature if temperature > 0 else 1.0)
    return scaled.log_softmax(-1).gather(1, torch.tensor(output)[:, None]).squeeze(1)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_equals_transformers_generate(models, family):
    path, hf = models[family]
    engine = NativeEngine(str(path), **SMALL)
    outs = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for prompt, completion in zip(PROMPTS, outs):
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)[
            0, len(prompt) :
        ].tolist()
        assert completion.output_ids == ref
        assert completion.finish_reason == "length" and len(completion.logprobs) == 10


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forced_logprobs(models, temperature):
    path, _ = models["llama"]
    engine = NativeEngine(str(path), **SMALL)
    model = from_pretrained(path, dtype="float32")
    sp = SamplingParams(n=2, temperature=temperature, max_new_tokens=12, ignore_eos=True, seed=3)
    outs = engine.generate(PROMPTS[:2], sp)
    assert [(c.prompt_index, c.sample_index) for c in outs] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for c in outs:
        ref = teacher_forced_logprobs(model, PROMPTS[c.prompt_index], c.output_ids, temperature)
        assert (torch.tensor(c.logprobs, dtype=torch.float64) - ref).abs().max().item() <= 1e-4


def test_shared_prefix_sampling_equals_separate_requests(models):
    path, _ = models["qwen2"]
    # 11 prompt tokens in blocks of 4: two shared full blocks and a partial one copied on write.
    prompt = PROMPTS[1]
    together = NativeEngine(str(path), **SMALL).generate(
        [prompt], SamplingParams(n=4, temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=11)
    )
    separate = NativeEngine(str(path), **SMALL).generate(
        [prompt] * 4, [SamplingParams(temperature=1.0, max_new_tokens=10, ignore_eos=True, seed=11 + j) for j in range(4)]
    )
    assert [c.output_ids for c in together] == [c.output_ids for c in separate]
    assert len({tuple(c.output_ids) for c in together}) > 1  # the samples did diverge
    for a, b in zip(together, separate):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_preemption_gives_the_same_outputs(models):
    path, _ = models["qwen3"]
    sp = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, ignore_eos=True, seed=5)
    large = NativeEngine(str(path), **SMALL)
    tight = NativeEngine(str(path), block_size=4, max_kv_tokens=48)
    ref = large.generate(PROMPTS[:3], sp)
    out = tight.generate(PROMPTS[:3], sp)
    assert tight.stats["preemptions"] == tight.scheduler.num_preemptions > 0 == large.stats["preemptions"]
    assert tight.stats["prefill_tokens"] > large.stats["prefill_tokens"]  # the preempted ones' recompute
    assert [c.output_ids for c in out] == [c.output_ids for c in ref]
    for a, b in zip(out, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_chunked_prefill_and_single_step_decode_give_the_same_outputs(models):
    path, _ = models["llama"]
    sp = SamplingParams(n=2, temperature=0.8, max_new_tokens=9, ignore_eos=True, seed=2)
    ref = NativeEngine(str(path), **SMALL).generate(PROMPTS, sp)
    chunked = NativeEngine(str(path), max_num_batched_tokens=3, max_decode_steps=1, **SMALL)
    out = chunked.generate(PROMPTS, sp)
    assert chunked.stats["prefill_steps"] >= 8
    assert [c.output_ids for c in out] == [c.output_ids for c in ref]
    for a, b in zip(out, ref):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5


def test_same_seed_same_output_and_other_seeds_differ(models):
    path, _ = models["qwen3"]
    engine = NativeEngine(str(path), **SMALL)

    def run(seed):
        sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=seed)
        return [c.output_ids for c in engine.generate(PROMPTS[:2], sp)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    # Without a seed, the engine's own seed decides: two engines with seed 0 agree.
    unseeded = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True)
    first = [c.output_ids for c in NativeEngine(str(path), seed=0, **SMALL).generate(PROMPTS, unseeded)]
    assert first == [c.output_ids for c in NativeEngine(str(path), seed=0, **SMALL).generate(PROMPTS, unseeded)]


def test_truncation_to_one_token_equals_greedy(models):
    path, _ = models["qwen2"]
    engine = NativeEngine(str(path), **SMALL)
    greedy = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True))
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999)):
        sp = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=4, **params)
        assert [c.output_ids for c in engine.generate(PROMPTS, sp)] == [c.output_ids for c in greedy], params


def test_sampler_truncation_keeps_the_expected_tokens():
    # probs 0.5, 0.25, 0.15, 0.1: top_p=0.7 keeps the first two (0.75 >= 0.7), top_k=3 the first
    # three, min_p=0.25 those with p >= 0.125 (the first three).
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log().repeat(4000, 1)
    b = logits.shape[0]
    seeds = torch.arange(b)

    def support(top_k=4, top_p=1.0, min_p=0.0):
        ids, logprobs = sample_tokens(
            logits,
            torch.ones(b),
            torch.full((b,), top_k),
            torch.full((b,), top_p),
            torch.full((b,), min_p),
            seeds,
            torch.zeros(b, dtype=torch.int64),
            truncate=True,
        )
        assert torch.allclose(logprobs, logits[0].log_softmax(-1)[ids], atol=1e-6)  # untruncated
        return torch.bincount(ids, minlength=4) / b

    assert (support(top_p=0.7)[2:] == 0).all() and (support(top_p=0.7)[:2] > 0).all()
    assert (support(top_k=3)[3] == 0) and (support(top_k=3)[:3] > 0).all()
    assert (support(min_p=0.25)[3] == 0) and (support(min_p=0.25)[:3] > 0).all()
    # Renormalised top-p: 0.5 / 0.75 of the mass on token 0.
    assert abs(support(top_p=0.7)[0].item() - 2 / 3) < 0.03


def test_sampling_frequencies_follow_the_distribution():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.05, 0.05])
    b = 20000
    # Every (seed, position) pair draws fresh noise: vary both.
    seeds = torch.arange(b) // 100
    positions = torch.arange(b) % 100
    ids, _ = sample_tokens(
        probs.log().repeat(b, 1), torch.full((b,), 0.5), torch.full((b,), 5), torch.ones(b), torch.zeros(b), seeds, positions
    )
    expected = probs.pow(2) / probs.pow(2).sum()  # temperature 0.5 squares the probabilities
    observed = torch.bincount(ids, minlength=5) / b
    assert (observed - expected).abs().max().item() < 0.015


def test_stop_ids_and_min_new_tokens(models):
    path, _ = models["llama"]
    engine = NativeEngine(str(path), **SMALL)
    greedy = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    tokens = greedy[0].output_ids
    stop = tokens[3]
    first = tokens.index(stop)
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    assert out[0].output_ids == tokens[: first + 1] and out[0].finish_reason == "stop"
    # min_new_tokens masks the stop id: it cannot appear among the first min_new_tokens tokens
    # (counted down on the device across decode windows of 2 steps).
    windows = NativeEngine(str(path), max_decode_steps=2, **SMALL)
    held = windows.generate(
        [PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12, min_new_tokens=first + 2, stop_token_ids=(stop,))
    )
    assert stop not in held[0].output_ids[: first + 2]
    assert held[0].output_ids[:first] == tokens[:first]
    # eos from the config stops generation unless ignore_eos.
    eos_engine = NativeEngine(str(path), eos_token_ids=[stop], **SMALL)
    assert (
        eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12))[0].output_ids == tokens[: first + 1]
    )
    assert (
        eos_engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))[0].output_ids
        == tokens
    )


def test_release_resume_update_round_trip_equals_a_fresh_engine(models):
    path, _ = models["qwen3"]
    other, _ = models["other"]
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=9)
    engine = NativeEngine(str(path), **SMALL)
    engine.generate(PROMPTS[:2], sp)
    engine.release_memory()
    assert engine.memory_stats()["released"] == ["cuda_graph", "kv_cache", "weights"]
    with pytest.raises(RuntimeError, match="resume_memory"):
        engine.generate(PROMPTS[:2], sp)
    engine.resume_memory(["weights"])
    engine.begin_weight_update()
    engine.update_weights(iter_safetensors(other))
    engine.end_weight_update(version=3)
    engine.resume_memory(["cuda_graph", "kv_cache"])
    out = engine.generate(PROMPTS[:2], sp)
    ref = NativeEngine(str(other), **SMALL).generate(PROMPTS[:2], sp)
    assert [c.output_ids for c in out] == [c.output_ids for c in ref]
    assert all(c.weight_version == 3 for c in out)


def test_weights_must_be_updated_after_release(models):
    path, _ = models["qwen3"]
    engine = NativeEngine(str(path), **SMALL)
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="update them"):
        engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="outside begin_weight_update"):
        engine.update_weights([])


def test_weight_update_checks_names_shapes_and_coverage(models):
    path, _ = models["qwen2"]  # tied embeddings
    engine = NativeEngine(str(path), **SMALL)
    state = dict(iter_safetensors(path))
    engine.begin_weight_update()
    with pytest.raises(ValueError, match="unknown parameter 'model.nope'"):
        engine.update_weights([("model.nope", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(3))])
    engine.update_weights([(n, t) for n, t in state.items() if n != "model.norm.weight"])
    engine.update_weights([("lm_head.weight", state["model.embed_tokens.weight"])])  # tied: accepted
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        engine.end_weight_update(version=1)
    engine.update_weights([("model.norm.weight", state["model.norm.weight"].double())])  # cast on copy
    engine.end_weight_update(version=1)
    assert engine.weight_version == 1


def test_release_or_update_while_running_is_refused(models):
    path, _ = models["qwen3"]
    engine = NativeEngine(str(path), **SMALL)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=20, ignore_eos=True))
    engine.step()
    assert engine.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="while requests are running"):
        engine.release_memory(["kv_cache"])
    with pytest.raises(RuntimeError, match="while requests are running"):
        engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="while requests are running"):
        engine.flush_cache()
    while engine.has_unfinished_requests():
        engine.step()
    engine.flush_cache()
    engine.release_memory(["kv_cache"])
    engine.resume_memory(["kv_cache"])
    # abort: the partial completions come back, every block is free again.
    engine.add_request(PROMPTS[1], SamplingParams(n=2, max_new_tokens=20, ignore_eos=True))
    engine.step()
    engine.step()
    aborted = engine.abort()
    assert [(c.sample_index, c.finish_reason) for c in aborted] == [(0, "abort"), (1, "abort")]
    assert all(0 < len(c.output_ids) < 20 and len(c.logprobs) == len(c.output_ids) for c in aborted)
    engine.flush_cache()


def test_engine_copies_a_model_instead_of_sharing_it(models):
    path, _ = models["llama"]
    model = from_pretrained(path, dtype="float32")
    engine = NativeEngine(model, **SMALL)
    sp = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    before = [c.output_ids for c in engine.generate(PROMPTS, sp)]
    ours = {p.data_ptr() for p in engine.model.parameters()}
    assert not ours & {p.data_ptr() for p in model.parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    assert [c.output_ids for c in engine.generate(PROMPTS, sp)] == before


def test_bad_requests_name_the_prompt(models):
    path, _ = models["llama"]
    engine = NativeEngine(str(path), block_size=4, max_kv_tokens=64)
    with pytest.raises(ValueError, match=r"prompt 1: token ids \[101\]"):
        engine.generate([[1, 2], [101]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="prompt 0: 60 prompt \\+ 8 new tokens exceed"):
        engine.generate([[1] * 60], SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="prompt 0: empty prompt"):
        engine.generate([[]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        NativeEngine(str(path), max_num_seqs=0)
    assert not engine.has_unfinished_requests()


def test_generate_cli_writes_completions_in_input_order(tmp_path, capsys):
    import json

    from colocate.generate import main
    from colocate.toy import write_toy

    model_dir = write_toy(tmp_path / "toy") / "model"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "a b c say d :"}) + "\n\n" + json.dumps({"input_ids": [5, 6, 7]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "--model",
                str(model_dir),
                "--prompts",
                str(prompts),
                "--out",
                str(out),
                "--n",
                "2",
                "--temperature",
                "0",
                "--max-new-tokens",
                "5",
                "--ignore-eos",
                "--max-kv-tokens",
                "256",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert "start-up " in capsys.readouterr().err
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(model_dir)).encode("a b c say d :")
    ref = NativeEngine(str(model_dir), max_kv_tokens=256).generate(
        [ids, [5, 6, 7]], SamplingParams(n=2, temperature=0, max_new_tokens=5, ignore_eos=True)
    )
    assert [r["output_ids"] for r in rows] == [c.output_ids for c in ref]
    assert all(len(r["logprobs"]) == 5 and r["finish_reason"] == "length" and "text" in r for r in rows)
    prompts.write_text(json.dumps({"input_ids": [1]}) + "\n" + json.dumps({"text": "x"}) + "\n")
    before = out.read_bytes()
    capsys.readouterr()
    assert main(["--model", str(model_dir), "--prompts", str(prompts), "--out", str(out), "--overwrite"]) == 2
    assert "prompts.jsonl:2: needs a 'prompt' or an 'input_ids'" in capsys.readouterr().err
    assert main(["--model", str(model_dir), "--prompts", str(prompts), "--out", str(out)]) == 2
    assert f"output {out} exists: choose another path, or replace it with --overwrite" in capsys.readouterr().err
    assert out.read_bytes() == before  # neither failure touched the earlier output


@pytest.mark.slow
def test_only_prefills_of_the_threshold_run_compiled(models):
    """With the decode compiled, a prefill below `compiled_prefill_min_tokens` tokens runs eager (no
    graph is compiled for it); one of that many tokens compiles the prefill layer. One new token per
    prompt, so no decode runs."""
    from torch._dynamo.utils import counters

    path, _ = models["qwen3"]
    torch._dynamo.reset()
    counters.clear()
    engine = NativeEngine(str(path), compile_decode=True, **SMALL)
    tokens = sum(len(p) for p in PROMPTS)
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    engine.runner.compiled_prefill_min_tokens = tokens + 1
    engine.generate(PROMPTS, sp)
    assert counters["stats"]["unique_graphs"] == 0
    engine.runner.compiled_prefill_min_tokens = tokens
    engine.generate(PROMPTS, sp)
    assert counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_compiled_decode_equals_eager_decode(models):
    """torch.compile of the decode and prefill forwards (the CUDA default) fuses around the
    attention ops; here on CPU it must sample exactly what the eager forwards sample. The first
    batch fills the engine and equals the hidden size, as a GPU's largest graph bucket of 256 would a
    model's hidden size or block-table width: neither the whole buffers nor an equal size may fix the
    batch in the graphs. Prefills of 8 tokens chunk the 11-token prompt, so that some prefills
    continue a cached prefix (the prefill layer's second graph)."""
    from torch._dynamo.utils import counters

    path, hf = models["qwen3"]
    rows = hf.config.hidden_size
    assert rows % len(PROMPTS) == 0
    sp = SamplingParams(n=rows // len(PROMPTS), temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=1)
    small = dict(SMALL, max_num_batched_tokens=8)
    eager = NativeEngine(str(path), compile_decode=False, **small).generate(PROMPTS, sp)
    torch._dynamo.reset()  # graphs an earlier test compiled would be reused, not counted
    counters.clear()
    engine = NativeEngine(str(path), compile_decode=True, max_num_seqs=rows, **small)
    engine.runner.compiled_prefill_min_tokens = 1  # these prompts' prefills are compiled too
    compiled = engine.generate(PROMPTS, sp)  # as many rows as the engine holds
    engine.generate(PROMPTS[:2], sp)  # half as many: the same graphs serve them
    assert engine.model.config.num_hidden_layers >= 2
    # Decode: embedding, the layer every layer shares, head. Prefill: the layer every layer
    # shares, with and without a cached prefix.
    assert counters["stats"]["unique_graphs"] == 5
    assert [c.output_ids for c in compiled] == [c.output_ids for c in eager]
    assert max(abs(x - y) for a, b in zip(compiled, eager) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
