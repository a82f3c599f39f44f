"""launch.sh, README's first command, on CPU: with PYTHON set to an interpreter that has colocate
installed it skips its set-up, probes the machine once and runs one process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from colocate.metrics import read_metrics
from tests.integration.test_loop import ROOT, toy_config

pytestmark = pytest.mark.skipif(
    subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0,
    reason="launch.sh checks the PYTHON interpreter's packages with pip, which this one lacks",
)


def launch(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NNODES", "LD_PRELOAD")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="2", **env_vars)
    return subprocess.run([str(ROOT / "launch.sh"), *args], env=env, capture_output=True, text=True, timeout=300)


def test_launch_runs_the_config_with_its_flags_in_one_process(tmp_path):
    config = toy_config(tmp_path, train={"num_rollout": 3}, eval={"interval": None}, checkpoint={"save_interval": None})
    done = launch(str(config), "--output-dir", str(tmp_path / "run"), "--train.num_rollout", "2")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1]  # the flag overrode the config's 3 steps
    startup = rows[0]
    assert startup["perf/startup/process_s"] > 0.5  # at least torch's import precedes main
    assert {"perf/startup/config_s", "perf/startup/dist_s", "perf/startup/trainer_actor_s"} <= set(startup)


def test_a_config_the_probe_cannot_read_ends_with_the_runs_one_line_error(tmp_path):
    config = toy_config(tmp_path)
    done = launch(str(config), "--output-dir", str(tmp_path / "run"), "--rollout.top_p", "1.5")
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "rollout.top_p" in last, last
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_process_count_that_does_not_divide_the_batch_is_the_last_line_before_torchrun(tmp_path):
    config = toy_config(tmp_path)
    done = launch(str(config), "--output-dir", str(tmp_path / "run"), NPROC="3")
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert done.stderr.strip().splitlines() == ["error: rollout.rollout_batch_size=8 must be divisible by the world size 3"]
    assert not (tmp_path / "run").exists()  # no rank started


def test_help_after_a_config_is_the_runs_help(tmp_path):
    done = launch(str(toy_config(tmp_path)), "--help")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "--overwrite, --no-overwrite" in done.stdout and "--train.num-rollout" in done.stdout


def test_a_command_passes_through_to_colocate(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "rollout/raw_reward": 0.5}\n{"step": 1, "rollout/raw_reward": 0.75}\n')
    done = launch("plot", str(tmp_path))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert done.stdout.splitlines()[-1] == str(tmp_path / "plots" / "rollout.png")
    done = launch("plot", str(tmp_path / "none"))
    assert (done.returncode, done.stderr.splitlines()[-1]) == (
        2,
        f"error: no metrics file at {tmp_path / 'none' / 'metrics.jsonl'}",
    )


def test_the_test_command_runs_only_the_files_it_is_given():
    done = launch("test", "--co", "-q", "tests/unit/test_layering.py")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    files = [line.split(":")[0] for line in done.stdout.splitlines() if line.startswith("tests/")]
    assert files == ["tests/unit/test_layering.py"], done.stdout[-2000:]  # pytest -qq: one "file: count" line each
