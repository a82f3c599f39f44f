"""`bench/e2e.py`'s worker for our side: one variant's loop in this process, its step and phase
times after warm-up, and the progress lines the parent echoes while it runs (built, then each step)."""

from __future__ import annotations

import time
from pathlib import Path

from bench import e2e_tail
from bench.common import machine, median

PROGRESS = "e2e progress:"
"""Lines of a worker that start with this are echoed by the parent as they come."""
LOOP_PHASES = ("generate", "to_train", "train", "save", "to_rollout", "eval")
"""The loop's perf/<phase>_time keys in step order; other perf/*_time keys time parts of these."""


def _profile_last_step(loop, num_steps: int, trace: Path):
    """A profiler (use it as a context around `loop.run()`) that records only the last of the
    loop's `num_steps` steps and writes it to `trace` (Chrome JSON, gzipped) plus a table of the
    ops with the most device time next to it."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    def write(prof):
        prof.export_chrome_trace(str(trace))
        table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=50, max_name_column_width=70)
        trace.with_name(trace.name.replace(".json.gz", ".txt")).write_text(table)

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(
        activities=activities, schedule=schedule(wait=num_steps - 1, warmup=0, active=1, repeat=1), on_trace_ready=write
    )
    log = loop.log.log

    def log_and_step(*args, **kwargs):
        log(*args, **kwargs)
        prof.step()

    loop.log.log = log_and_step
    return prof


STEP_KEYS = (
    "perf/generate_time",
    "perf/engine_prefill_time",
    "rollout/prefill_tokens",
    "rollout/preemptions",
    "rollout/decode_utilization",
    "perf/train_time",
    "train/loss_free_samples",
)
"""A step's figures kept for every step, warm-up included: how a partial rollout's steps change
as their carried samples pile up, and how many of the trained samples had no token in the loss."""


def _report_steps(loop, num_steps: int, name: str) -> None:
    """Print a progress line as each of the loop's metric records (one per step) is logged, with
    the step's figures of STEP_KEYS."""
    log, start = loop.log.log, time.perf_counter()

    def log_and_report(step, metrics, *args, **kwargs):
        log(step, metrics, *args, **kwargs)
        figures = ", ".join(f"{key.split('/')[1]} {metrics[key]:.4g}" for key in STEP_KEYS if key in metrics)
        print(
            f"{PROGRESS} {name} step {step + 1}/{num_steps} logged at {time.perf_counter() - start:.1f} s"
            f"{f' ({figures})' if figures else ''}",
            flush=True,
        )

    loop.log.log = log_and_report


def run_ours(config_path: Path, warmup: int, trace: Path | None = None, tail: str | None = None) -> dict:
    """Run the loop in this process; per-phase and per-step seconds of the steps after warm-up.
    With `trace`, the last step is profiled into it and left out of the timings; with `tail`
    (a shape of e2e_tail), samples get the tail's lengths and lost groups are looked for."""
    import contextlib

    import torch

    from colocate import dist
    from colocate.config_loading import load_config
    from colocate.metrics import read_metrics, startup_phases
    from colocate.train import Loop

    cfg = load_config(["--config", str(config_path)])
    info = dist.init()
    torch.manual_seed(cfg.train.seed)
    loop = Loop(cfg, info)
    try:
        start = time.perf_counter()
        loop.build()
        build_s = time.perf_counter() - start
        print(f"{PROGRESS} {config_path.stem} built in {build_s:.1f} s", flush=True)
        _report_steps(loop, cfg.train.num_rollout, config_path.stem)
        stats = loop.engine.memory_stats() if hasattr(loop.engine, "memory_stats") else None
        kv_tokens = stats["num_kv_blocks"] * stats["block_size"] if stats else None
        record = e2e_tail.install(loop, tail) if tail else None
        start = time.time()  # metric records carry time.time() stamps
        profiler = _profile_last_step(loop, cfg.train.num_rollout, trace) if trace else contextlib.nullcontext()
        with profiler:
            loop.run()
        groups = e2e_tail.groups_report(record, loop) if tail else None
        plan = loop.trainer.memory_plan
    finally:
        closing = time.perf_counter()
        loop.close()
        dist.destroy()
        # Seen on an H100: the tail run's process went on for over 110 s after its last step.
        print(f"{PROGRESS} {config_path.stem} closed in {time.perf_counter() - closing:.1f} s", flush=True)
    rows = read_metrics(cfg.output_dir)
    stamps = [start] + [r["time"] for r in rows]
    end = len(rows) - (1 if trace else 0)
    steps = [b - a for a, b in zip(stamps, stamps[1:])][warmup:end]
    timed = rows[warmup:end]
    timers = {k[len("perf/") : -len("_time")] for r in timed for k in r if k.startswith("perf/") and k.endswith("_time")}
    phases = [p for p in LOOP_PHASES if p in timers]

    def med(key):
        return median([r[key] for r in timed if r.get(key) is not None])

    partial = [
        {k[len("rollout/partial/") :]: v for k, v in sorted(r.items()) if k.startswith("rollout/partial/")}
        for r in timed
        if "rollout/partial/carried_groups" in r
    ]

    def peak(kind):  # over the phases of the timed steps, as the ledger read them
        return max(
            (v for r in timed for k, v in r.items() if k.startswith("memory/") and k.endswith(f"/{kind}_gib") and v is not None),
            default=None,
        )

    return {
        "device": machine()["device"],
        "build_s": build_s,
        "startup_s": startup_phases(rows[0]) if rows else {},
        "steps_s": steps,
        "step_median_s": median(steps),
        "phase_median_s": {p: med(f"perf/{p}_time") for p in phases},
        "phase_sum_median_s": median([sum(r.get(f"perf/{p}_time") or 0.0 for p in phases) for r in timed]),
        "sub_phase_median_s": {p: med(f"perf/{p}_time") for p in sorted(timers - set(phases))},
        "handoff_median_s": {
            k[len("handoff/") : -len("_s")]: med(k)
            for k in sorted({k for r in timed for k in r})
            if k.startswith("handoff/") and k.endswith("_s")
        },
        "response_len_mean": med("rollout/response_len/mean"),
        "truncated_ratio": med("rollout/truncated_ratio"),
        "decode_utilization": med("rollout/decode_utilization"),
        "groups": groups,
        "partial_per_step": partial or None,
        "every_step": [{key.split("/")[1]: r.get(key) for key in STEP_KEYS} for r in rows[:end]],
        "rollout_tokens_per_s": med("perf/rollout_tokens_per_s"),
        "grad_norm": med("train/grad_norm"),
        # How far the engine's log-probs are from the trainer's (FP8 rollout moves them: TIS corrects).
        "mismatch_median": {k.split("/")[-1]: med(k) for k in ("train/mismatch/abs_diff_max", "train/mismatch/ppl_ratio")},
        "tis_clipfrac": med("train/tis_clipfrac"),
        "peak_allocated_gib": peak("allocated"),
        "peak_device_used_gib": peak("device_used"),
        "kv_cache_tokens": kv_tokens,
        "sync_tensors": med("perf/sync_tensors"),
        # The allocator's high-water mark over the whole run, beside the start-up's forecast of the
        # training phase's peak (colocate/sizing.py) and the sizes it chose.
        "max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
        "memory_plan": {
            "reason": plan.reason,
            **plan.forecast,
            "max_tokens_per_gpu": plan.max_tokens_per_gpu,
            "recompute_rest": cfg.model.recompute_rest,
            "kv_cache_tokens": plan.kv_cache_tokens,
        },
    }
