"""One GPU, offload on: the ledger must show the engine's memory released during training and the
trainer's state off the device during rollout."""

from __future__ import annotations

import shutil

import pytest
import torch

from colocate.metrics import read_metrics
from tests.integration.test_loop import torchrun, toy_config

pytestmark = pytest.mark.gpu

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def _half_billion_model(tmp_path, toy_model_dir):
    """A Qwen2.5-0.5B-shaped random model that speaks the toy tokenizer (its ids are a subset)."""
    from transformers import Qwen2Config

    from colocate.models import ArchConfig, from_config, save_pretrained

    hf = Qwen2Config(**QWEN25_05B, eos_token_id=0, bos_token_id=0, max_position_embeddings=4096)
    cfg = ArchConfig.from_hf_dict({**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
    model = from_config(cfg, torch.float32, "cuda", init=True)
    out = save_pretrained(model, tmp_path / "model05b")
    for f in toy_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_offloaded_loop_ledger_shows_both_releases(tmp_path):
    config = toy_config(
        tmp_path,
        train={"num_rollout": 3, "lr": 1e-5},
        offload={"offload_rollout": True, "offload_train": True},
        rollout={"gpu_memory_fraction": 0.3, "cuda_graph_max_bs": 32, "compile_decode": False},
        eval={"interval": None},
        checkpoint={"save_interval": None},
    )
    model = _half_billion_model(tmp_path, tmp_path / "toy" / "model")
    out = tmp_path / "run"
    torch.cuda.empty_cache()  # the model written above
    free_gib = torch.cuda.mem_get_info()[0] / 2**30  # what this process leaves to the run
    torchrun(config, out, "--model.path", str(model), nproc=1)
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        gen, to_train, train = (r[f"memory/{p}/device_used_gib"] for p in ("generate", "to_train", "train"))
        engine_gib = r["handoff/engine_release_gib"]
        trainer_gib = r["handoff/trainer_onload_gib"] + r["handoff/trainer_state_streamed_gib"]
        print(
            f"step {r['step']}: device used generate {gen:.1f} / to_train {to_train:.1f} / train {train:.1f} "
            f"GiB -> engine released {engine_gib:.1f} GiB, trainer back {trainer_gib:.1f} GiB; "
            f"phases " + " ".join(f"{k[5:-5]}={v:.3f}s" for k, v in r.items() if k.startswith("perf/") and k.endswith("_time"))
        )
        # 30% of the memory free at the engine's start went to its KV cache (the trainer's 0.5B
        # shape already held some of what is free now): it comes back at release, read from the
        # device, not from the engine's counters.
        assert engine_gib > 0.2 * free_gib and gen - to_train > 0.15 * free_gib, free_gib
        # fp32 params + grads + Adam state of 0.5B params (~7.4 GiB) return for training only: they
        # were off the device during rollout and release.
        assert trainer_gib > 5 and train > to_train
        assert r["train/ppo_kl"] == 0 or r["step"] > 0
