"""The benchmark scripts that have a CPU mode run end to end on CPU, so they cannot rot between
GPU runs: the GRPO-step bench writes per-phase timings for every variant it was asked for, the
rollout bench's long-tail case its lengths, utilization and decode roofline probes, the prefill
bench its compiled and eager rates, the trainer bench's peers every configuration, the tuned ones
with the default's loss, and the true on-policy bench the mode's cost with bitwise-equal log-probs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import true_on_policy

ROOT = Path(__file__).resolve().parents[2]


def _bench(tmp_path, name: str, *args: str, timeout: float = 240) -> tuple[dict, subprocess.CompletedProcess]:
    """`python -m bench.<name>` with `args` and `--out` a JSON file, from the repository root: the
    results it wrote, which name the machine they came from, and the finished process."""
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "-m", f"bench.{name}", *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    results = json.loads(out.read_text())
    machine = results.get("machine", results)
    assert machine["device"] == "cpu" and machine["host"] and machine["torch"], machine
    return results, done


def _e2e_smoke(tmp_path, *flags: str) -> tuple[dict, str]:
    """`python -m bench.e2e --cpu-smoke` with these flags: its JSON results and its stdout. Each variant's
    progress (built, every step, closed, result written) reaches stderr as it runs, and the result
    is taken before the process ends."""
    results, done = _bench(tmp_path, "e2e", "--cpu-smoke", "--skip-trl", *flags)
    progress = [line.split()[2:4] for line in done.stderr.splitlines() if line.startswith("e2e progress:")]
    steps = results["warmup_steps"] + results["timed_steps"]
    each = [["built"]] + [["step"]] * steps + [["closed"], ["result"]]
    assert progress == [[name, *p] for name in results["ours"] for p in each], done.stderr[-3000:]
    assert all(0 < run["result_s"] <= run["process_s"] for run in results["ours"].values())
    return results, done.stdout


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
def test_rollout_bench_tail_cpu_smoke_reports_the_tail_and_the_roofline_probes(tmp_path):
    r, done = _bench(tmp_path, "rollout_throughput", "--cases", "tail", "--cpu-smoke")
    # 16 lognormal lengths (median 16, capped at 64), fixed by their seeds: one reaches the cap.
    assert r["lengths"] == {"mean": 17.875, "median": 14.5, "max": 64, "at_cap": 1, "total": 286}
    assert r["tail"]["output_tokens"] == 286 and r["tail"]["decode_steps"] == 63  # the longest sample's
    assert r["full_batch"]["output_tokens"] == 16 * 18 and r["full_batch"]["decode_steps"] == 17
    assert r["decode_batch_occupancy"] == pytest.approx((286 - 16) / 63 / 16)  # one token each from prefill
    assert r["utilization"] > 0 and r["engine"]["preemptions"] == 0
    assert set(r["engine"]["init_parts_seconds"]) == {"weights", "runner"}  # no CUDA graphs on the CPU
    assert set(r["roofline"]) == {"b16_ctx64", "b2_ctx256"}
    floor = r["hbm_floor"]  # 63 steps under continuous batching, 18 with all 16 seats busy, 18 equal
    assert floor["continuous_batching_s"] > floor["full_seats_s"] > floor["equal_lengths_s"] > 0
    # Equal lengths: 16 x 18 tokens after 16-token prompts, KV of 2 layers x 2 heads x 16 dims x K, V in fp32.
    kv_reads, kv_bytes = 16 * (16 * 18 + 18 * 17 // 2), 2 * 2 * 16 * 2 * 4
    weights = r["engine"]["memory"]["weights_bytes"]
    assert floor["equal_lengths_s"] == pytest.approx((18 * weights + kv_reads * kv_bytes) / 4.8e12)
    assert floor["utilization_ceiling"] == pytest.approx(floor["equal_lengths_s"] / floor["full_seats_s"])
    for probe in r["roofline"].values():
        assert probe["ms_per_decode_step"] > 0 and probe["roofline_fraction"] == pytest.approx(
            probe["roofline_ms"] / probe["ms_per_decode_step"]
        )
    assert done.stdout.startswith("rollout tail (tiny shape, 16 samples, lengths median 14 mean 18, 1 at 64)")


@pytest.mark.slow
def test_prefill_bench_cpu_smoke_times_compiled_and_eager_prefills(tmp_path):
    r, done = _bench(tmp_path, "prefill", "--cpu-smoke", "--repeats", "2")
    assert r["compiled_graphs"] == 1  # the prefill layer every layer shares; one token each, so no decode
    prompts, carried = r["cases"]["prompts"], r["cases"]["carried"]
    assert (prompts["prompts"], prompts["tokens"]) == (512, 512 * 16)
    assert carried["prompts"] == 96 and 96 * 19 <= carried["tokens"] <= 96 * 437
    for case in (prompts, carried):
        assert all(len(case["seconds"][v]) == 2 and min(case["seconds"][v]) > 0 for v in ("compiled", "eager"))
        rate = case["tokens_per_s"]
        assert case["compiled_over_eager"] == pytest.approx(rate["compiled"] / rate["eager"])
    assert done.stdout.startswith("prompts: 8192 tokens, compiled ")


@pytest.mark.slow
def test_startup_bench_cpu_smoke_times_every_case_cold_and_warm(tmp_path):
    r = _bench(tmp_path, "startup", "--cpu-smoke", timeout=300)[0]
    for label in ("cold", "warm"):
        toy, gen = r[f"toy_{label}"], r[f"generate_{label}"]
        assert toy["steps"] == r["toy_steps"] == 10
        phases = toy["phases_s"]
        assert {"process", "config", "dist", "inputs", "trainer", "trainer_actor", "engine", "first_sync"} <= set(phases)
        assert phases["process"] > 0.5, phases  # at least the imports of torch come before main
        assert 0 < toy["startup_s"] < toy["first_step_done_s"] < toy["wall_s"], toy
        before, after = toy["outside_s"]["before_startup"], toy["outside_s"]["after_last_step"]
        # The phases cover the process from its start; records' times are rounded to the millisecond.
        assert -0.1 < before < 1.0 and after > -1e-3, toy
        assert gen["output_tokens"] == 8 * 8 and gen["wall_s"] > 0
        assert gen["startup_line"].startswith("start-up ") and gen["startup_line"].endswith("not compiled")
        assert r[f"generate_compiled_{label}"]["startup_line"].endswith(", decode compiled")  # on CPU too when asked
        engine = r[f"rollout_engine_{label}"]
        assert set(engine["init_parts_s"]) == {"weights", "runner"}  # the CPU captures no graphs
        assert 0 < engine["init_s"] < engine["wall_s"] and engine["tokens_per_s"] > 0, engine


@pytest.mark.slow
def test_startup_bench_4b_case_cpu_smoke_logs_the_start_up_of_one_step_cold_and_warm(tmp_path):
    r = _bench(tmp_path, "startup", "--cases", "qwen3_4b", "--cpu-smoke", timeout=300)[0]
    assert r["device"] == "cpu" and r["qwen3_4b_batch"]["prompts"] == 4
    for label in ("cold", "warm"):
        run = r[f"qwen3_4b_{label}"]
        assert run["steps"] == 1 and 0 < run["startup_s"] < run["first_step_done_s"] < run["wall_s"], run
        assert {"inputs", "trainer", "trainer_actor", "engine", "first_sync"} <= set(run["phases_s"]), run


@pytest.mark.slow
def test_e2e_bench_tail_cpu_smoke_loses_no_group_with_partial_rollout_off_or_on(tmp_path):
    results = _bench(tmp_path, "e2e", "--tail", "--cpu-smoke", "--over-sampling", "3", timeout=400)[0]
    ours = results["ours"]
    assert set(ours) == {"offload_on_partial_on", "offload_on_partial_off"} and results["trl"] == {"skipped": True}
    for name, run in ours.items():
        rollout = run["config"]["rollout"]
        assert rollout["partial_rollout"] == name.endswith("_on") and "custom_generate" not in rollout
        assert 0 < run["decode_utilization"] <= 1 and run["step_median_s"] > 0, name
        assert (run["partial_per_step"] is None) == name.endswith("_off"), name
        assert {"inputs", "trainer", "engine", "first_sync"} <= set(run["startup_s"]), name
        every = run["every_step"]
        assert len(every) == results["warmup_steps"] + results["timed_steps"], name
        prompts = results["batch"]["prompts"] * results["batch"]["prompt_tokens"]  # a step's at least
        assert all(
            r["prefill_tokens"] >= prompts and r["preemptions"] >= 0 and r["generate_time"] > 0 and r["train_time"] > 0
            for r in every
        ), (name, every)
        loss_free = [r["loss_free_samples"] for r in every]
        assert loss_free == [0] * len(every) if name.endswith("_off") else max(loss_free) > 0, (name, every)
    # Two steps of 4 groups each; with partial rollout 12 are drawn first (3x in flight), 4 more
    # for the second step, and 8 stay in flight.
    off, on = ours["offload_on_partial_off"]["groups"], ours["offload_on_partial_on"]["groups"]
    assert off == {"drawn": 8, "trained": 8, "in_flight_at_end": 0, "trained_beyond_drawn": 0, "nothing_lost": True}
    assert on == {"drawn": 16, "trained": 8, "in_flight_at_end": 8, "trained_beyond_drawn": 0, "nothing_lost": True}
    assert ours["offload_on_partial_on"]["config"]["rollout"]["over_sampling_batch_size"] == 12


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


@pytest.mark.slow
def test_train_bench_cpu_smoke_tuned_peers_match_the_default_peers_loss(tmp_path):
    results, done = _bench(tmp_path, "trainer_throughput", "--cpu-smoke")
    assert results["torchtitan"].startswith("not run: torchtitan 0.3.0 has no Qwen2 model")
    peers = results["models"]["tiny"]["peers"]
    assert [(p["peer"], p["recompute"], p["num_sequences"], p["compile"], p["fused_loss"], p["loss_kind"]) for p in peers] == [
        ("default", False, 8, False, False, "fp32 logits"),
        ("tuned", False, 8, False, True, "chunked (plain torch)"),
        ("tuned", True, 8, True, True, "chunked (plain torch)"),
        ("tuned", True, 4, False, True, "chunked (plain torch)"),
    ]
    default = peers[0]
    assert default["first_loss"] == pytest.approx(math.log(512), abs=0.05)  # random init: about uniform
    # Same weights and batch: the chunked loss (six chunks) and its gradients are the full fp32
    # logits', with and without recompute and compile.
    for p in peers[1:3]:
        assert p["first_loss"] == pytest.approx(default["first_loss"], abs=1e-4)
        assert p["first_grad_norm"] == pytest.approx(default["first_grad_norm"], rel=1e-4)
    assert [p["micro_batches_per_step"] for p in peers] == [1, 1, 1, 2]  # 512 tokens a step
    assert all(p["tokens_per_s"] > 0 and p["mfu"] > 0 and p["peak_gib"] is None for p in peers)
    assert "best peer of 4/4 configurations" in done.stdout


@pytest.mark.slow
def test_true_on_policy_bench_cpu_smoke_reports_both_modes_and_bitwise_equal_logprobs(tmp_path):
    results, done = _bench(
        tmp_path, "true_on_policy", "--cpu-smoke", "--profile", str(tmp_path / "profile.txt"), "--max-tokens-per-gpu", "4096"
    )
    assert results["device"] == "cpu" and results["torch"]
    r = results["models"]["tiny"]
    assert r["bitwise_equal_frac"] == 1.0
    rollout, train = r["rollout"], r["train"]
    assert set(train) == {"off", "off_uncompiled", "on", "on_uncompiled", "slowdown", "slowdown_uncompiled"}
    for run in (rollout["off"], rollout["on"], train["off"], train["off_uncompiled"], train["on"], train["on_uncompiled"]):
        assert run["tokens_per_s"] > 0, run
    assert not rollout["on"]["compile_decode"] and not train["on"]["compile"]
    assert len(rollout["on"]["runs_tokens_per_s"]) == len(train["on"]["step_s"]) == results["reps"] == 3
    assert train["off"]["step_tokens"] == train["on"]["step_tokens"]  # the same batches in every case
    assert rollout["slowdown"] == pytest.approx(rollout["off"]["tokens_per_s"] / rollout["on"]["tokens_per_s"])
    assert train["slowdown"] == pytest.approx(train["off"]["tokens_per_s"] / train["on"]["tokens_per_s"])
    assert train["slowdown_uncompiled"] == pytest.approx(
        train["off_uncompiled"]["tokens_per_s"] / train["on_uncompiled"]["tokens_per_s"]
    )
    assert r["targets"] == {"rollout_slowdown": 1.3, "train_slowdown": 1.15}
    assert r["met"] == {"rollout": rollout["slowdown"] <= 1.3, "train": train["slowdown"] <= 1.15}
    assert r["plan"]["max_tokens_per_gpu"] == 4096 and r["plan"]["source"].endswith("micro-batch overridden")
    assert "tiny: rollout " in done.stdout and "bitwise equal log-probs 100.00% of tokens" in done.stdout
    sections = [line for line in (tmp_path / "profile.tiny.txt").read_text().splitlines() if line.startswith("== ")]
    assert sections == [
        "== train step, mode off, uncompiled",
        "== train step, mode off, uncompiled",
        "== train step, mode on, uncompiled",
        "== train step, mode on, uncompiled",
        "== generate, mode off",
        "== generate, mode on",
    ]  # training first: no engine pools held


def test_true_on_policy_bench_reports_a_failed_training_case_and_keeps_the_others(monkeypatch):
    ran = []

    def run_train(mcfg, plan, on, compiled, *rest):
        ran.append((on, compiled))
        if on and not compiled:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.07 GiB.")
        return {"compile": compiled, "tokens_per_s": 100.0 if on else 250.0}

    monkeypatch.setattr(true_on_policy, "run_train", run_train)
    monkeypatch.setattr(
        true_on_policy,
        "run_rollout",
        lambda mcfg, on, *rest: {"tokens_per_s": 50.0 if on else 100.0, **({"bitwise_equal_frac": 1.0} if on else {})},
    )
    monkeypatch.setattr(true_on_policy, "train_batches", lambda *args: [])
    args = SimpleNamespace(cpu_smoke=False, profile=None, reps=1, step_tokens=512)
    r = true_on_policy.run_shape(
        "tiny", SimpleNamespace(vocab_size=512), true_on_policy.GRID["0.5b"][0], "test", args, SimpleNamespace(device=None)
    )
    assert ran == [(False, True), (False, False), (True, True), (True, False)]
    train = r["train"]
    assert train["on_uncompiled"] == {"error": "OutOfMemoryError: CUDA out of memory. Tried to allocate 1.07 GiB."}
    assert train["slowdown"] == 2.5 and train["slowdown_uncompiled"] is None
    assert r["met"] == {"rollout": False, "train": False}
    line = true_on_policy.summary("tiny", r)
    assert "2.50x slower" in line and "-> failed, n/a" in line and "on_uncompiled failed: OutOfMemoryError" in line


@pytest.mark.slow
def test_multiturn_bench_cpu_smoke_keeps_every_history_cached_and_reports_the_ratios(tmp_path):
    results, done = _bench(tmp_path, "multiturn", "--cpu-smoke", "--tool-ms", "5,20")
    shape = results["shapes"]["tiny"]
    w = shape["workload"]
    sampled = w["prompts"] * w["samples"] * w["turns"] * w["turn_tokens"]
    assert shape["single_turn"]["sampled_tokens"] == sampled
    for ms in ("5", "20"):
        m = shape["by_tool_ms"][ms]
        assert m["ours"]["sampled_tokens"] == m["resubmit"]["sampled_tokens"] == sampled
        assert m["ours"]["kv_reuse"] == 1.0 and m["ours"]["evictions"] == 0
        # Every turn of the resubmitting modes computes its whole history again; ours only the observations.
        assert m["resubmit"]["prefill_tokens"] > m["ours"]["prefill_tokens"]
        ours = m["ours"]["tokens_per_s"]
        assert m["ratio_vs_single_turn"] == pytest.approx(ours / shape["single_turn"]["tokens_per_s"])
        assert m["ratio_vs_turn_by_turn"] == pytest.approx(ours / m["turn_by_turn"]["tokens_per_s"])
        assert m["ratio_vs_resubmit"] == pytest.approx(ours / m["resubmit"]["tokens_per_s"])
    assert "multiturn tiny: 5 ms tools" in done.stdout
