"""Start-up: the decode graphs a run can reach, and the start-up line."""

from __future__ import annotations

from colocate.config import Config
from colocate.rollout.factory import reachable_batch_size
from colocate.train import _startup_line


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
    line = _startup_line({"perf/startup/inputs_s": 1.25, "perf/startup/trainer_s": 2.0,
                          "perf/startup/engine_s": 3.0, "perf/startup/engine_weights_s": 1.0,
                          "perf/startup/engine_cuda_graphs_s": 1.5, "perf/startup/first_sync_s": 0.25})
    assert line == ("start-up 6.5 s: inputs 1.2, trainer 2.0, engine 3.0 (weights 1.0, cuda graphs 1.5), "
                    "first sync 0.2")
