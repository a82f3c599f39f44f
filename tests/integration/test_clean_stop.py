"""SIGINT and SIGTERM stop a run cleanly: the step in flight trains, a checkpoint is saved, the run
exits 130 or 143 with one line saying where to resume, and the same command resumes from it.

The single-process runs signal themselves from a reward function at a chosen point (a step's
generation, or an evaluation between steps), so the step a stop lands on is known exactly. The
two-process runs go through launch.sh, which forwards the signal to the ranks torchrun started.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from colocate.checkpoint_manifest import checkpoint_dirs

ROOT = Path(__file__).resolve().parents[2]

# Sends a signal to its own process from the reward function, at its `at`-th call of one kind: the
# default config scores each step's 128 responses in one call, and each evaluation's 64 in one.
HOOK = """
import os, signal
from colocate.rollout.rewards import toy_reward

calls = {{"train": 0, "eval": 0}}

def reward(prompts, responses, labels, metadata):
    kind = "eval" if len(responses) == {eval_size} else "train"
    calls[kind] += 1
    if kind == "{kind}" and calls[kind] == {at}:
        os.kill(os.getpid(), signal.{signal})
    return toy_reward(prompts, responses, labels, metadata)
"""


def run_module(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def _steps(out: Path) -> list[int]:
    lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
    return [json.loads(line)["step"] for line in lines]


def _checkpoints(out: Path) -> list[int]:
    return [step for step, _ in checkpoint_dirs(out / "checkpoints", warn=False)]


def _run(tmp_path: Path, out: Path, *flags: str, kind: str = "train", at: int = 3, sig: str = "SIGINT"):
    hook = tmp_path / "stop_hook.py"
    hook.write_text(HOOK.format(kind=kind, at=at, signal=sig, eval_size=64))
    config = yaml.safe_load((ROOT / "configs/default.yaml").read_text())
    config["rollout"]["reward"] = config["eval"]["datasets"][0]["reward"] = f"{hook}:reward"
    (tmp_path / "stop.yaml").write_text(yaml.safe_dump(config))
    return run_module(
        "colocate.train", "--config", str(tmp_path / "stop.yaml"), "--output-dir", str(out), "--logging.console", "True", *flags
    )


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_signal_during_a_step_saves_that_step_and_resumes(tmp_path, sig, code):
    out = tmp_path / "run"
    # Rollout batch 3 of the run is step 2's (each step scores one batch with the default config).
    proc = _run(tmp_path, out, "--train.num_rollout", "40", "--eval.interval", "1000", at=3, sig=sig)
    assert proc.returncode == code, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert _steps(out) == [0, 1, 2]  # the step in flight finished and logged its record
    assert _checkpoints(out) == [2]
    last = proc.stdout.strip().splitlines()[-1]
    assert last == (
        f"stopped by {sig} after step 2: checkpoint {out / 'checkpoints' / 'rollout_000002'}; "
        "run the same command to resume from it"
    )
    resumed = run_module(
        "colocate.train",
        "--config",
        str(ROOT / "configs/default.yaml"),
        "--output-dir",
        str(out),
        "--train.num_rollout",
        "5",
        "--logging.console",
        "False",
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _steps(out) == [0, 1, 2, 3, 4]
    assert _checkpoints(out) == [2, 4]  # save_on_exit saves the run's last step too


@pytest.mark.slow
def test_signal_between_steps_saves_the_last_trained_step(tmp_path):
    out = tmp_path / "run"
    # Evaluations run before step 0 and after every second step: the second is after step 1, so the
    # stop lands between steps 1 and 2, with step 1 trained and not saved (no save_interval).
    proc = _run(tmp_path, out, "--train.num_rollout", "40", "--eval.interval", "2", kind="eval", at=2)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert _steps(out) == [0, 1]
    assert _checkpoints(out) == [1]
    assert proc.stdout.strip().splitlines()[-1].startswith("stopped by SIGINT after step 1: checkpoint ")
    # The weights step 1 trained are version 2 (the first sync pushes 1), as step 1's own save records.
    meta = json.loads((out / "checkpoints" / "rollout_000001" / "meta.json").read_text())
    assert meta["extra"]["weight_version"] == 2


@pytest.mark.slow
def test_save_on_exit_off_stops_without_saving(tmp_path):
    out = tmp_path / "run"
    proc = _run(tmp_path, out, "--train.num_rollout", "40", "--eval.interval", "1000", "--checkpoint.save_on_exit", "False", at=2)
    assert proc.returncode == 130, proc.stderr[-3000:]
    assert _steps(out) == [0, 1] and _checkpoints(out) == []
    assert "nothing saved (checkpoint.save_on_exit is off)" in proc.stdout.strip().splitlines()[-1]


def _launch(out: Path, env: dict) -> subprocess.Popen:
    cmd = [
        "./launch.sh",
        "configs/default.yaml",
        "--output-dir",
        str(out),
        "--train.num_rollout",
        "400",
        "--logging.console",
        "False",
    ]
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )  # its own process group, like a terminal's job


def _wait_for_steps(out: Path, proc: subprocess.Popen, num_steps: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_steps(out)) < num_steps:
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the run did not reach its steps in time"
        time.sleep(0.5)


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_two_process_run_stops_cleanly(tmp_path, sig, code):
    """Ctrl-C signals the launcher's whole process group; SIGTERM goes to the launcher alone."""
    out = tmp_path / "run"
    env = {**os.environ, "NPROC": "2", "PYTHON": sys.executable}
    proc = _launch(out, env)
    try:
        _wait_for_steps(out, proc, 2, timeout=240)
        if sig == "SIGINT":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, output[-3000:]
    assert "Traceback" not in output and "ChildFailedError" not in output
    steps = _steps(out)
    assert steps == list(range(len(steps))) and _checkpoints(out) == [steps[-1]]
    log = (out / "log.txt").read_text().strip().splitlines()
    path = out / "checkpoints" / f"rollout_{steps[-1]:06d}"
    assert log[-1].endswith(f"stopped by {sig} after step {steps[-1]}: checkpoint {path}; run the same command to resume from it")


@pytest.mark.slow
def test_second_sigint_exits_at_once(tmp_path):
    """The first SIGINT asks for a clean stop, the second ends the process there and then."""
    script = tmp_path / "second.py"
    script.write_text(
        "import os, signal, time\n"
        "from colocate.stopping import StopSignals\n"
        "stop = StopSignals().install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "assert stop.signum == signal.SIGINT and stop.requested()\n"
        "print('first handled', flush=True)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
        "print('not reached')\n"
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline() == "first handled\n"
    handled = time.monotonic()  # the imports are behind: what is left is the second signal and the exit
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - handled < 10 and out == ""
    assert "second SIGINT: exiting at once" in err and "Traceback" not in err
