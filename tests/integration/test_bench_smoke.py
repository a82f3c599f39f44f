"""The benchmark scripts that have a CPU mode run end to end on CPU, so they cannot rot between
GPU sessions: the GRPO-step bench writes per-phase timings for every variant it was asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _e2e_smoke(tmp_path, *flags: str) -> tuple[dict, str]:
    """bench/e2e.py --cpu-smoke with these flags: its JSON results and its stdout."""
    out = tmp_path / "e2e.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--cpu-smoke", "--skip-trl", *flags,
                           "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return json.loads(out.read_text()), done.stdout


@pytest.mark.slow
def test_e2e_bench_cpu_smoke_writes_every_variant(tmp_path):
    ours = _e2e_smoke(tmp_path, "--offload", "both", "--max-tokens-per-gpu", "64,4096")[0]["ours"]
    assert set(ours) == {f"offload_{o}_tokens_{t}" for o in ("on", "off") for t in (64, 4096)}
    for name, run in ours.items():
        assert run["config"]["train"]["max_tokens_per_gpu"] == int(name.rsplit("_", 1)[1])
        assert run["step_median_s"] > 0 and run["response_len_mean"] == 16, name
        assert list(run["phase_median_s"]) == ["generate", "to_train", "train", "to_rollout"], name
        # On CPU the trainer moves nothing; with offload on, the engine's moves are timed.
        moves = ["engine_release", "engine_resume_cache", "engine_resume_weights"] if "_on_" in name else []
        assert sorted(run["handoff_median_s"]) == moves, name


@pytest.mark.slow
def test_e2e_bench_cpu_smoke_runs_full_and_lora_side_by_side(tmp_path):
    results, stdout = _e2e_smoke(tmp_path, "--offload", "off", "--lora-rank", "4")
    ours = results["ours"]
    assert set(ours) == {"full_offload_off", "lora4_offload_off"}
    assert ours["full_offload_off"]["config"]["model"]["lora_rank"] == 0
    assert ours["lora4_offload_off"]["config"]["model"]["lora_rank"] == 4
    # The engine keeps its weights: a LoRA push sends the 2 blocks' 7 merged projections only.
    assert ours["full_offload_off"]["sync_tensors"] == 26 and ours["lora4_offload_off"]["sync_tensors"] == 14
    for run in ours.values():
        assert run["step_median_s"] > 0 and run["kv_cache_tokens"] == 65536 and run["peak_device_used_gib"] > 0
    assert set(results["ratio_full_over_lora"]) == {"lora4_offload_off"}
    assert "full/LoRA lora4_offload_off" in stdout
