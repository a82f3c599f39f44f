"""Start-up: the decode graphs a run can reach, the start-up lines, and when generate compiles decode."""

from __future__ import annotations

import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from colocate.config import Config
from colocate.generate import COMPILE_DECODE_MIN_STEPS, compile_decode, decode_steps, startup_line
from colocate.metrics import split_startup, startup_phases
from colocate.metrics import startup_line as startup_line_of
from colocate.rollout.factory import reachable_batch_size


def test_graphs_stop_at_the_largest_batch_the_run_decodes():
    cfg = Config()  # 16 prompts x 8 samples, at most 256 running requests
    assert reachable_batch_size(cfg, world_size=1) == 128
    assert reachable_batch_size(cfg, world_size=4) == 32
    cfg.rollout.over_sampling_batch_size = 24
    assert reachable_batch_size(cfg, world_size=2) == 12 * 8
    assert reachable_batch_size(cfg, world_size=2, eval_prompts=200) == 200  # eval: one sample each
    cfg.rollout.max_running_requests = 64
    assert reachable_batch_size(cfg, world_size=1, eval_prompts=200) == 64


def test_startup_line_sums_the_top_level_parts():
    line = startup_line_of(
        startup_phases(
            {
                "perf/startup/process_s": 2.0,
                "perf/startup/inputs_s": 1.25,
                "perf/startup/trainer_s": 2.0,
                "perf/startup/trainer_actor_s": 1.75,
                "perf/startup/engine_s": 3.0,
                "perf/startup/engine_weights_s": 1.0,
                "perf/startup/engine_cuda_graphs_s": 1.5,
                "perf/startup/first_sync_s": 0.25,
                "train/loss": 0.5,
            }
        )
    )
    assert line == (
        "start-up 8.5 s: process 2.0, inputs 1.2, trainer 2.0 (actor 1.8), "
        "engine 3.0 (weights 1.0, cuda graphs 1.5), first sync 0.2"
    )


def test_a_part_is_nested_only_under_a_part_that_exists():
    top, subs = split_startup({"first_sync": 0.5, "engine": 3.0, "engine_cuda_graphs": 1.0, "dist": 0.25, "trainer_actor": 2.0})
    assert top == {"first_sync": 0.5, "engine": 3.0, "dist": 0.25, "trainer_actor": 2.0}
    assert subs == {"engine": {"cuda_graphs": 1.0}}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_process_age_counts_from_the_process_start():
    code = "import time; time.sleep(0.5); from colocate.timing import process_age_s; print(process_age_s())"
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    wall = time.perf_counter() - start
    assert 0.5 <= float(out) <= wall + 0.02, (out, wall)  # the kernel's clock ticks are 10 ms


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc")
def test_process_age_starts_at_a_launchers_exec():
    """A shell that becomes Python with exec hands it its own start time; launch.sh's mark of the
    exec's moment keeps the shell's work (here a 1 s sleep) out of the age."""
    code = (
        "import os; from colocate.timing import process_age_s; own = process_age_s(); "
        "os.environ.pop('COLOCATE_EXEC_UPTIME'); print(own, process_age_s())"
    )
    script = 'sleep 1; read -r up _ < /proc/uptime; COLOCATE_EXEC_UPTIME=$up exec "$0" -c "$1"'
    out = subprocess.run(["bash", "-c", script, sys.executable, code], capture_output=True, text=True, check=True).stdout
    own, with_the_shell = map(float, out.split())
    assert with_the_shell - own >= 0.99, out  # the kernel's clock ticks are 10 ms


def test_generate_compiles_decode_only_for_jobs_long_enough_to_pay_for_it():
    assert decode_steps(256, 1, 256) == 256  # one wave of 256 sequences
    assert decode_steps(257, 1, 256) == 512
    assert decode_steps(64, 8, 1024) == 2 * 1024
    assert compile_decode("auto", decode_steps(256, 1, 256)) is False
    assert compile_decode("auto", COMPILE_DECODE_MIN_STEPS - 1) is False
    assert compile_decode("auto", COMPILE_DECODE_MIN_STEPS) is None  # the engine's default: on CUDA only
    assert compile_decode("on", 1) is True and compile_decode("off", 10**9) is False


def test_generate_startup_line_names_the_engine_parts_and_the_compile():
    engine = SimpleNamespace(
        startup_seconds={"weights": 0.4, "runner": 0.25, "cuda_graphs": 1.75}, runner=SimpleNamespace(compiled_decode=False)
    )
    assert startup_line(3.125, engine) == (
        "start-up 3.1 s: inputs 0.7, engine 2.4 (weights 0.4, runner 0.2, cuda graphs 1.8), decode not compiled"
    )
    assert startup_line(3.125, engine, process_s=1.5) == (
        "start-up 4.6 s: process 1.5, inputs 0.7, engine 2.4 (weights 0.4, runner 0.2, cuda graphs 1.8), decode not compiled"
    )
