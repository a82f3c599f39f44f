"""Where a profiled trainer step's device time goes, from a torch.profiler trace: device busy and
idle time, idle time per trainer phase, the largest idle gaps with what the host was doing, device time per
kernel category, and the matmuls by input shape (used by bench/trainer_throughput.py --profile)."""

from __future__ import annotations

import json
import pathlib
import re
import tempfile

CATEGORIES = [
    ("inductor", r"^triton_"),
    ("attention", r"flash|fmha|cudnn_sdpa|sm90_flash"),
    ("gemm", r"gemm|cutlass|nvjet|xmma|cublas"),
    ("log-prob kernel", r"^(stats|grad)$"),
    ("nccl", r"nccl"),
    ("foreach", r"multi_tensor|adam"),
    ("memcpy/memset", r"^Memcpy|^Memset"),
]
"""Kernel name -> category, first match (foreach: the optimizer, clipping, some FSDP copies;
attention before gemm: flash kernel names carry cutlass types)."""


def category(name: str) -> str:
    return next((c for c, pattern in CATEGORIES if re.search(pattern, name, re.IGNORECASE)), "other")


PHASES = ("train.prepare", "micro_batch.inputs", "micro_batch.forward", "micro_batch.backward", "optimizer.step")
"""The trainer's record_function labels (colocate.trainer.passes / step); they do not nest."""


def device_spans(events: list[dict]) -> list[tuple[float, float, str]]:
    return sorted(
        (e["ts"], e["ts"] + e["dur"], e["name"])
        for e in events
        if e.get("ph") == "X" and "dur" in e and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )


def busy_us(gpu: list[tuple[float, float, str]]) -> float:
    """Length of the union of the device spans."""
    busy, cursor = 0.0, float("-inf")
    for a, b, _ in gpu:
        if b > cursor:
            busy += b - max(a, cursor)
            cursor = b
    return busy


def trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_bytes())["traceEvents"]


def timeline(events: list[dict]) -> tuple[list[str], dict]:
    """Device busy/idle time over the profiled window, idle time per trainer phase, the largest
    idle gaps with what the host was doing, and device time per kernel category."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = device_spans(events)
    host = [e for e in spans if e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver")]
    phases = [e for e in spans if e.get("cat") == "user_annotation" and e["name"] in PHASES]
    begin, end = min(e["ts"] for e in host), max(b for _, b, _ in gpu)
    busy, gaps, cursor = busy_us(gpu), [], begin
    for a, b, _ in gpu:
        if a > cursor:
            gaps.append((cursor, a))
        cursor = max(cursor, b)
    window = end - begin
    stalls = sum(b - a for a, b in gaps if b - a > 100)
    idle: dict[str, float] = {}
    for a, b in gaps:
        rest = b - a
        for e in phases:
            overlap = min(b, e["ts"] + e["dur"]) - max(a, e["ts"])
            if overlap > 0:
                idle[e["name"]] = idle.get(e["name"], 0.0) + overlap
                rest -= overlap
        idle["(between phases)"] = idle.get("(between phases)", 0.0) + rest
    by_category: dict[str, float] = {}
    for a, b, name in gpu:
        by_category[category(name)] = by_category.get(category(name), 0.0) + b - a

    def ms(d: dict) -> str:
        return ", ".join(f"{k} {v / 1e3:.1f}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))

    lines = [
        f"window {window / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms, idle {1 - busy / window:.1%} "
        f"({stalls / 1e3:.1f} ms of it in gaps over 0.1 ms)",
        f"device idle by trainer phase (ms): {ms(idle)}",
        f"device time by kernel category (ms, streams overlap): {ms(by_category)}",
        "largest idle gaps: at ms, length ms, phase | host op running when the device ran dry "
        "| longest host ops started in the gap (ms)",
    ]
    for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:12]:
        phase = next((e["name"] for e in phases if e["ts"] <= a < e["ts"] + e["dur"]), "-")
        running = [e for e in host if e["ts"] <= a < e["ts"] + e["dur"]]
        inner = max(running, key=lambda e: e["ts"])["name"] if running else "-"
        started = sorted((e for e in host if a < e["ts"] < b), key=lambda e: -e["dur"])[:3]
        lines.append(
            f"  {(a - begin) / 1e3:8.1f} {(b - a) / 1e3:6.2f}  {phase:20s} | {inner} | "
            + "; ".join(f"{e['name']} ({e['dur'] / 1e3:.2f})" for e in started)
        )
    summary = dict(
        window_ms=window / 1e3,
        gpu_idle_fraction=1 - busy / window,
        idle_ms_in_long_gaps=stalls / 1e3,
        idle_ms_by_phase={k: v / 1e3 for k, v in idle.items()},
        device_ms_by_category={k: v / 1e3 for k, v in by_category.items()},
    )
    return lines, summary


def matmul_shapes(prof, row_limit: int = 40) -> list[str]:
    """aten::mm / aten::addmm grouped by input shapes, by device time: one line each."""
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::mm", "aten::addmm")]
    rows.sort(key=lambda e: e.device_time_total, reverse=True)
    return [
        f"  {e.key:12s} {e.count:6d} calls {e.device_time_total / 1e3:9.1f} ms "
        f"{e.device_time_total / max(e.count, 1) / 1e3:7.3f} ms/call  {e.input_shapes}"
        for e in rows[:row_limit]
    ]
