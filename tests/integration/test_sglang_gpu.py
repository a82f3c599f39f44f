"""The SGLang adapter on a GPU with sglang 0.5.23 installed: log-prob parity with transformers,
memory really returned by release, weights really replaced by a sync, ports, clean shutdown."""

from __future__ import annotations

import importlib.util
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sglang.process import engine_ports, visible_device_index
from tests.helpers import write_hf_model

pytestmark = pytest.mark.gpu
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed (pip install 'colocate[sglang]')", allow_module_level=True)

GIB = 1 << 30
MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.05
)  # head_dim 64: every attention backend has it
PROMPTS = [[3, 17, 42, 99, 7], [250, 11], [5, 6, 7, 8, 9, 10, 11]]


def reference_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token (unscaled when greedy), by transformers in fp32."""
    ids = torch.tensor([prompt + output], device="cuda")
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (len(output), V)
    logp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return logp, logp.gather(1, torch.tensor(output, device="cuda")[:, None])[:, 0]


def check_parity(engine, model, sampling: SamplingParams, version: int) -> float:
    """Engine log-probs vs transformers on the engine's own tokens; returns the mean |diff|."""
    diffs = []
    completions = engine.generate(PROMPTS, sampling)
    assert [(c.prompt_index, c.sample_index) for c in completions] == [
        (i, j) for i in range(len(PROMPTS)) for j in range(sampling.n)
    ]
    for c in completions:
        assert c.weight_version == version and c.finish_reason in ("stop", "length")
        assert len(c.output_ids) == len(c.logprobs) >= 1
        full, ref = reference_logprobs(model, PROMPTS[c.prompt_index], c.output_ids, sampling.temperature)
        got = torch.tensor(c.logprobs, device="cuda")
        assert (got - ref).abs().max().item() < 0.1, (got, ref)
        if sampling.temperature == 0:  # greedy picks the argmax, up to bf16 near-ties
            assert (ref >= full.max(dim=-1).values - 0.05).all()
        diffs.append((got - ref).abs().mean().item())
    return sum(diffs) / len(diffs)


def wait_free_at_least(target: int, timeout_s: float = 20.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (free := torch.cuda.mem_get_info()[0]) < target and time.monotonic() < deadline:
        time.sleep(0.2)
    return free


def test_sglang_engine_on_gpu(tmp_path):
    from transformers import AutoModelForCausalLM

    from colocate.rollout.sglang.engine import SGLangEngine

    dir_a, _ = write_hf_model(tmp_path / "a", "qwen2", seed=0, **MODEL)
    dir_b, _ = write_hf_model(tmp_path / "b", "qwen2", seed=1, **MODEL)
    model_a = AutoModelForCausalLM.from_pretrained(dir_a, dtype=torch.float32).cuda().eval()
    model_b = AutoModelForCausalLM.from_pretrained(dir_b, dtype=torch.float32).cuda().eval()
    env_before, sigterm_before = dict(os.environ), signal.getsignal(signal.SIGTERM)
    free_before = torch.cuda.mem_get_info()[0]

    engine = SGLangEngine(
        model_path=str(dir_a),
        dtype="bfloat16",
        seed=0,
        rank=0,
        local_rank=0,
        device_index=visible_device_index(0),
        mem_fraction_static=0.3,
        max_running_requests=32,
        cuda_graph_max_bs=8,
        release_cuda_graph=True,
        eos_token_ids=[],
        load_dummy=False,
        log_level="warning",
    )
    try:
        assert dict(os.environ) == env_before and signal.getsignal(signal.SIGTERM) == sigterm_before
        assert (engine.port, engine.nccl_port) == engine_ports(0)
        assert engine._engine.server_args.nccl_port == engine.nccl_port
        free_running = torch.cuda.mem_get_info()[0]
        footprint = free_before - free_running
        assert footprint > 10 * GIB  # mostly KV cache: 0.3 of the free memory

        check_parity(engine, model_a, SamplingParams(temperature=0, max_new_tokens=24), version=0)
        check_parity(engine, model_a, SamplingParams(n=4, temperature=0.8, max_new_tokens=24), version=0)

        engine.release_memory()
        free_released = wait_free_at_least(free_running + footprint - 4 * GIB)
        assert free_released - free_running > footprint - 4 * GIB  # all but context, NCCL, untagged buffers

        engine.resume_memory(["weights"])
        engine.begin_weight_update()
        named = [(n, p.detach().to(torch.bfloat16).contiguous()) for n, p in model_b.named_parameters()]
        engine.update_weights(named[: len(named) // 2])
        engine.update_weights(named[len(named) // 2 :])
        del named
        engine.end_weight_update(1)
        engine.resume_memory(["cuda_graph", "kv_cache"])
        assert abs(torch.cuda.mem_get_info()[0] - free_running) < 2 * GIB

        check_parity(engine, model_b, SamplingParams(temperature=0, max_new_tokens=24), version=1)
        (c,) = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_new_tokens=8))
        _, old = reference_logprobs(model_a, PROMPTS[0], c.output_ids, 0.0)
        assert (old - torch.tensor(c.logprobs, device="cuda")).abs().mean().item() > 0.1  # A's weights are gone

        children = engine._engine.get_all_child_pids()
    finally:
        engine.shutdown()
    assert all(
        not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
        for pid in children
    )
    assert wait_free_at_least(free_before - GIB) >= free_before - GIB
    assert dict(os.environ) == env_before and signal.getsignal(signal.SIGTERM) == sigterm_before
