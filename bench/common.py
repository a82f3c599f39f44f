"""What the benchmarks share: where results go and which machine they came from, the command and
environment of a child process, and timing on the device."""

from __future__ import annotations

import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
CUDA = torch.device("cuda")
PEAK_HBM_BYTES_PER_S = {"H100": 3.35e12, "H200": 4.8e12}
"""Peak HBM bandwidth by device (the rooflines); any other device counts as an H200."""


def machine(device: torch.device | None = None) -> dict:
    """Which machine a result came from: the name of the device it measured on (`device`; by default
    the CUDA device where there is one), "cpu" for the CPU, the host and torch's version."""
    if device is None:
        device = CUDA if torch.cuda.is_available() else torch.device("cpu")
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "host": socket.gethostname(),
        "torch": torch.__version__,
    }


def write_result(result: dict, out: Path) -> None:
    """`result` as JSON at `out`, saying which machine it came from: this process's (`machine`)
    unless the result names one already (a `machine` entry of its own, or the device and host of
    the child processes that measured it)."""
    if "machine" not in result and not {"device", "host"} <= result.keys():
        result = {**machine(), **result}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")


def result_path(out: Path | None, default: Path, smoke: bool = False) -> Path:
    """Where a run writes its JSON: `out` when given, else `default`, or for a CPU smoke run a file
    of that name in a fresh temporary directory (a smoke run never replaces the stored results)."""
    if out is not None:
        return out
    return Path(tempfile.mkdtemp(prefix=f"{default.stem}_")) / default.name if smoke else default


def peak_hbm_bytes_per_s() -> float:
    """This device's peak HBM bandwidth (PEAK_HBM_BYTES_PER_S)."""
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return next((v for k, v in PEAK_HBM_BYTES_PER_S.items() if k in name), PEAK_HBM_BYTES_PER_S["H200"])


def module_command(module: str, *args: str) -> list[str]:
    """The command line that runs `module` (`bench.e2e`, `colocate.train`) with these arguments in a
    fresh interpreter like this one."""
    return [sys.executable, "-m", module, *args]


def child_env(*first: str | None, env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with the paths of `first` that are set, then the
    repository root, at the front of PYTHONPATH: a child imports the bench package, and the config
    hooks in it, from any working directory."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (*first, str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def sync(device: torch.device = CUDA) -> None:
    """Wait for the work queued on `device` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device = CUDA) -> float:
    """Wall seconds of `fn()`, with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def median(values: list[float]) -> float | None:
    """The median, or None of no values (a run that measured nothing)."""
    return statistics.median(values) if values else None


def free_memory() -> None:
    """Collect garbage and hand the cached device memory back, between measurements."""
    gc.collect()
    torch.cuda.empty_cache()


def guarded(fn: Callable, *args):
    """`fn(*args)`, or {"error": what it raised} (out of memory, a compile error): a failed
    measurement is recorded and the run goes on."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a benchmark reports what failed and moves on
        error = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    free_memory()  # after the except block, which drops the traceback (and the tensors its frames hold)
    return error
