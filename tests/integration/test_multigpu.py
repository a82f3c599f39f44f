"""Several GPUs of one box (`multigpu` marker; skipped with fewer than 2): the colocated loop on
every GPU with NCCL, every rank's memory ledger, kill and resume with the same and with fewer
processes, and every rank's engine holding the cast masters after a weight sync.

Run on such a machine with `bench/gpu_suite.sh OUT multigpu`."""

from __future__ import annotations

import json

import pytest
import torch

from colocate.metrics import read_metrics
from tests.distributed import run_ranks
from tests.helpers import write_hf_model
from tests.integration.test_loop import (
    DETERMINISTIC,
    assert_every_step_logged,
    by_step,
    kill_after_first_checkpoint,
    torchrun,
    toy_config,
)

NPROC = torch.cuda.device_count()
pytestmark = [pytest.mark.multigpu, pytest.mark.skipif(NPROC < 2, reason="needs 2 or more CUDA devices")]

QWEN25_15B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    tie_word_embeddings=True,
)


def _ledgers(out, nproc: int) -> list[list[dict]]:
    return [[json.loads(line) for line in (out / f"memory_rank{r}.jsonl").read_text().splitlines()] for r in range(nproc)]


def _offloaded(tmp_path, **sections):
    return toy_config(
        tmp_path,
        offload={"offload_rollout": True, "offload_train": True},
        rollout={"gpu_memory_fraction": 0.3, "cuda_graph_max_bs": 32},
        **sections,
    )


def test_toy_loop_on_every_gpu_releases_on_every_rank(tmp_path):
    out = tmp_path / "run"
    torchrun(_offloaded(tmp_path, train={"num_rollout": 5}), out, nproc=NPROC)
    assert sorted(by_step(out)) == list(range(5))
    for rank, ledger in enumerate(_ledgers(out, NPROC)):
        used = {(r["step"], r["phase"]): r["device_used"] for r in ledger}
        for step in range(5):  # the engine's KV cache (30% of the free memory) leaves for training
            assert used[(step, "to_train")] < used[(step, "generate")] - (4 << 30), (rank, step)


def _qwen15b(tmp_path, toy_model_dir):
    """A Qwen2.5-1.5B-shaped random model that speaks the toy tokenizer."""
    import shutil

    from transformers import Qwen2Config

    from colocate.models import ArchConfig, from_config, save_pretrained

    hf = Qwen2Config(**QWEN25_15B, eos_token_id=0, bos_token_id=0, max_position_embeddings=4096)
    cfg = ArchConfig.from_hf_dict({**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
    out = save_pretrained(from_config(cfg, torch.float32, "cuda", init=True), tmp_path / "model15b")
    for f in toy_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def test_one_and_a_half_billion_shape_trains_with_offload(tmp_path):
    config = _offloaded(
        tmp_path, train={"num_rollout": 5, "lr": 1e-6}, eval={"interval": None}, checkpoint={"save_interval": None}
    )
    model = _qwen15b(tmp_path, tmp_path / "toy" / "model")
    out = tmp_path / "run"
    torchrun(config, out, "--model.path", str(model), nproc=NPROC)
    rows = by_step(out)
    assert sorted(rows) == list(range(5)) and all(r["train/skipped_steps"] == 0 for r in rows.values())
    assert all(r["handoff/engine_release_gib"] > 4 for r in rows.values())


def test_kill_and_resume_with_the_same_and_with_fewer_processes(tmp_path):
    config = _offloaded(tmp_path)
    full = tmp_path / "full"
    torchrun(config, full, nproc=NPROC)
    rows = by_step(full)
    same = tmp_path / "same"
    kill_after_first_checkpoint(config, same, NPROC)
    torchrun(config, same, nproc=NPROC)
    resumed = by_step(same)
    for step in range(2, 6):
        for key in DETERMINISTIC:
            assert resumed[step][key] == pytest.approx(rows[step][key], rel=1e-3, abs=1e-5), (step, key)
    fewer = tmp_path / "fewer"
    kill_after_first_checkpoint(config, fewer, NPROC)
    logged_before_kill = [r["step"] for r in read_metrics(fewer)]
    torchrun(config, fewer, nproc=NPROC // 2)  # DCP reshards the model and optimizer to fewer ranks
    assert_every_step_logged(fewer, logged_before_kill)
    assert all(by_step(fewer)[s]["train/skipped_steps"] == 0 for s in range(2, 6))


def _engines_hold_cast_masters(rank, world_size, path):
    from torch.distributed.fsdp import fully_shard

    from colocate.colocation.weight_sync import sync_weights
    from colocate.models import from_pretrained
    from colocate.rollout.native import NativeEngine

    device = torch.device("cuda", rank)
    model = from_pretrained(path, dtype="float32", device=device)
    g = torch.Generator(device=device).manual_seed(5)  # the same change on every rank
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, device=device))
    engine = NativeEngine(str(path), dtype=torch.bfloat16, device=device, max_kv_tokens=1024, cuda_graph=False)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    sync_weights(model, engine, version=1, dtype=torch.bfloat16, bucket_bytes=1 << 16)
    names = dict(model.named_parameters())
    for name, p in engine.model.named_parameters():
        assert torch.equal(p.detach(), names[name].full_tensor().to(torch.bfloat16)), (rank, name)


def test_every_ranks_engine_holds_the_bf16_cast_of_the_gathered_masters(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_engines_hold_cast_masters, NPROC, path)
