"""Wall-clock timing of a block of work, with the device's queued kernels counted in it."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch


@contextmanager
def timed(out: dict[str, float], key: str, device: torch.device | None = None) -> Iterator[None]:
    """Store the block's seconds in out[key]. On CUDA the current stream is synchronised at the
    end, so kernels the block queued are counted here and not in whatever is timed next. Copies
    queued on a side stream to overlap later work (the trainer's parameters coming home under the
    first forward) count where that work waits for them."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.current_stream(device).synchronize()
    out[key] = time.perf_counter() - start


# /proc/uptime's seconds when a launcher replaced itself with this interpreter (exec), set by launch.sh.
EXEC_UPTIME_ENV = "COLOCATE_EXEC_UPTIME"


def process_age_s() -> float | None:
    """Seconds since this Python process started (to 10 ms: the kernel's clock ticks), read from
    Linux's /proc; None where /proc is not there. Counts what no timer inside the program can: the
    interpreter's start and the imports before the first line of `main`.

    exec keeps a process's start time, so a shell script that ends by exec-ing Python would count
    its own work (launch.sh's set-up and probe) here: $COLOCATE_EXEC_UPTIME, the uptime at the exec,
    bounds the age. A process started later that inherits the variable is younger than it, and the
    smaller of the two ages is its own."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22; the fields after ")" start at 3
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    try:
        age = min(age, uptime - float(os.environ[EXEC_UPTIME_ENV]))
    except (KeyError, ValueError):
        pass
    return max(age, 0.0)
