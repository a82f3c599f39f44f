"""LoRA in the whole loop on the toy task: `python -m colocate.train` with rank-8 adapters on the
frozen toy model, GRPO and PPO (a LoRA critic), on CPU and on one GPU with both offloads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from colocate.metrics import read_metrics


def _toy_run(tmp_path, *flags: str) -> dict:
    """The default run with rank-8 adapters on the frozen toy model (`flags` added); its rows by step."""
    env = {**os.environ, "COLOCATE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    out = tmp_path / "lora"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "colocate.train",
            "--config",
            "configs/default.yaml",
            "--output-dir",
            str(out),
            "--model.lora-rank",
            "8",
            "--train.lr",
            "4e-3",
            "--offload.offload-rollout",
            "True",
            *flags,
        ],  # the engine keeps its weights
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return {r["step"]: r for r in read_metrics(out)}


def _check_learns(rows: dict) -> None:
    """Reward and greedy eval accuracy rise as in the full run (docs/lora.md: 0.15 -> 0.67, eval 0.03 ->
    1.0 at lr 4e-3), and every push after the first sends the 2 blocks' 7 merged projections."""
    rewards = [rows[s]["rollout/raw_reward"] for s in sorted(rows)]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert len(rewards) == 40 and last - first >= 0.3, rewards
    evals = [rows[s]["eval/toy/avg@1"] for s in sorted(rows) if "eval/toy/avg@1" in rows[s]]
    assert evals[-1] - evals[0] >= 0.5, evals
    partial = [rows[s]["perf/sync_tensors"] for s in sorted(rows)]
    assert set(partial) == {14}, partial


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_toy_task_learns_with_lora(tmp_path, estimator):
    """GRPO, and PPO with a LoRA critic (2 CPU cores, first to last fifth: 0.15 -> 0.61, eval
    0.03 -> 0.73)."""
    _check_learns(_toy_run(tmp_path, "--algorithm.advantage-estimator", estimator))


@pytest.mark.gpu
def test_gpu_toy_task_learns_with_lora_actor_and_critic_and_offload(tmp_path):
    """On one GPU with both offloads: the engine releases its KV cache and keeps its weights."""
    rows = _toy_run(tmp_path, "--algorithm.advantage-estimator", "gae", "--offload.offload-train", "True")
    _check_learns(rows)
    for r in rows.values():
        assert "handoff/engine_resume_weights_s" not in r and r["handoff/engine_resume_cache_gib"] > 0
        assert r["handoff/trainer_onload_gib"] > 0
