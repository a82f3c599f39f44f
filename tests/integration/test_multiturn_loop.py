"""The multi-turn toy run end to end on CPU: it learns, resumes exactly, and in the true on-policy
mode its trainer and engine log-probs agree bit for bit over every turn."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "configs/multiturn-toy.yaml"


def train(tmp_path: Path, out: Path, *flags: str) -> tuple[subprocess.CompletedProcess, dict[int, dict]]:
    env = {**os.environ, "COLOCATE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, "-m", "colocate.train", "--config", CONFIG, "--output-dir", str(out), *flags],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row["step"], {}).update(row)
    return done, rows


@pytest.mark.slow
def test_the_multiturn_toy_learns_with_every_episode_s_history_cached(tmp_path):
    done, rows = train(tmp_path, tmp_path / "run")
    steps = sorted(rows)
    rewards = [rows[s]["rollout/raw_reward"] for s in steps]
    fifth = len(rewards) // 5
    first, last = sum(rewards[:fifth]) / fifth, sum(rewards[-fifth:]) / fifth
    assert last - first >= 0.3, rewards
    assert f"reward {first:.3f} (first fifth of the steps) -> {last:.3f} (last fifth)" in done.stdout
    for s in steps:
        assert rows[s]["rollout/kv_reuse"] == 1.0 and rows[s]["env/end/error"] == 0.0
        assert 1 <= rows[s]["env/turns_mean"] <= 6
    # A policy that names each symbol at once finishes in as many turns as the answer has symbols (3-5).
    assert rows[steps[-1]]["env/end/done"] > rows[steps[0]]["env/end/done"]
    assert rows[steps[-1]]["env/turns_mean"] < rows[steps[0]]["env/turns_mean"]
    evals = [rows[s]["eval/toy_turns/avg@1"] for s in steps if "eval/toy_turns/avg@1" in rows[s]]
    assert len(evals) >= 2 and evals[-1] - evals[0] >= 0.3, evals


DETERMINISTIC = ("rollout/raw_reward", "env/turns_mean", "env/episode_tokens_mean", "train/pg_loss", "train/grad_norm")


@pytest.mark.slow
def test_a_multiturn_run_resumed_mid_training_continues_exactly(tmp_path):
    common = ("--checkpoint.save-interval", "2", "--logging.console", "False")
    _, full = train(tmp_path, tmp_path / "full", "--train.num-rollout", "4", *common)
    train(tmp_path, tmp_path / "cut", "--train.num-rollout", "2", *common)
    _, resumed = train(tmp_path, tmp_path / "cut", "--train.num-rollout", "4", *common)
    for step in (2, 3):
        for key in DETERMINISTIC:
            assert resumed[step][key] == pytest.approx(full[step][key], rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.slow
def test_multiturn_log_probs_are_bitwise_on_policy_in_the_mode(tmp_path):
    _, rows = train(
        tmp_path, tmp_path / "run", "--train.num-rollout", "3", "--algorithm.true-on-policy", "--logging.console", "False"
    )
    for step, r in rows.items():
        assert r["env/turns_mean"] > 1, step  # episodes of several turns, observations between them
        assert r["train/train_rollout_logprob_abs_diff"] == 0.0 and r["train/ppo_kl"] == 0.0, step
        assert r["train/mismatch/abs_diff_max"] == 0.0 and r["train/mismatch/nonzero_frac"] == 0.0, step


@pytest.mark.gpu
def test_the_multiturn_toy_on_a_gpu_learns_and_is_bitwise_on_policy_in_the_mode(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    _, rows = train(tmp_path, tmp_path / "run", "--logging.console", "False", "--eval.interval", "None")
    rewards = [rows[s]["rollout/raw_reward"] for s in sorted(rows)]
    assert sum(rewards[-4:]) / 4 - sum(rewards[:4]) / 4 >= 0.3, rewards
    assert all(r["rollout/kv_reuse"] == 1.0 for r in rows.values())
    _, rows = train(
        tmp_path,
        tmp_path / "mode",
        "--train.num-rollout",
        "3",
        "--algorithm.true-on-policy",
        "--logging.console",
        "False",
        "--eval.interval",
        "None",
    )
    for step, r in rows.items():
        assert r["env/turns_mean"] > 1 and r["train/mismatch/abs_diff_max"] == 0.0, step


@pytest.mark.slow
def test_a_step_whose_every_episode_fails_stops_the_run_with_one_line(tmp_path):
    env_file = tmp_path / "broken.py"
    env_file.write_text(
        "class Broken:\n    def reset(self, row):\n        raise RuntimeError('no sandbox here')\n"
        "    def step(self, state, action): pass\n    def reward(self, state): return 0.0\n"
    )
    env = {**os.environ, "COLOCATE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "2"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "colocate.train",
            "--config",
            CONFIG,
            "--output-dir",
            str(tmp_path / "run"),
            "--rollout.env",
            f"{env_file}:Broken",
            "--eval.interval",
            "None",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: rollout.env: every episode of step 0 failed, e.g. reset: RuntimeError: no sandbox here"
    )


@pytest.mark.slow
def test_episodes_train_with_dynamic_sampling_lora_and_tis(tmp_path):
    _, rows = train(
        tmp_path,
        tmp_path / "run",
        "--train.num-rollout",
        "3",
        "--rollout.dynamic-sampling",
        "--model.lora-rank",
        "8",
        "--algorithm.use-tis",
        "--eval.interval",
        "None",
        "--logging.console",
        "False",
    )
    assert sorted(rows) == [0, 1, 2]
    for step, r in rows.items():
        assert r["env/turns_mean"] > 1 and r["rollout/kv_reuse"] == 1.0, step
        assert "rollout/dynamic_filtered_groups" in r and r["train/grad_norm"] > 0, step
        assert r["train/mismatch/abs_diff_max"] < 1e-3, step  # the engine runs the merged adapters


@pytest.mark.slow
def test_two_gloo_ranks_run_episodes_and_agree_on_their_metrics(tmp_path, monkeypatch):
    """Each rank runs its own prompts' episodes; env/* metrics are reduced over both (one rank's
    episodes name a reward part the other's may not: the names are gathered first)."""
    from tests.integration.test_loop import by_step, torchrun

    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "two"
    torchrun(ROOT / CONFIG, out, "--train.num-rollout", "2", "--eval.interval", "None", "--logging.console", "False")
    rows = by_step(out)
    assert sorted(rows) == [0, 1]
    for r in rows.values():
        assert r["rollout/num_samples"] == 128 and r["rollout/kv_reuse"] == 1.0
        assert 1 <= r["env/turns_mean"] <= 6 and 0 <= r["env/reward/correct"] <= 5
        assert sum(r[f"env/end/{k}"] for k in ("done", "max_turns", "token_budget", "error")) == pytest.approx(1.0)
