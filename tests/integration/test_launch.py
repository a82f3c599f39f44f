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
    reason="launch.sh checks the PYTHON interpreter's packages with pip, which this one lacks")


def launch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "NNODES", "LD_PRELOAD")}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="2")
    return subprocess.run([str(ROOT / "launch.sh"), *args], env=env, capture_output=True, text=True, timeout=300)


def test_launch_runs_the_config_with_its_flags_in_one_process(tmp_path):
    config = toy_config(tmp_path, train={"num_rollout": 3}, eval={"interval": None},
                        checkpoint={"save_interval": None})
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
