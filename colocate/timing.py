"""Wall-clock timing of a block of work, with the device's queued kernels counted in it."""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def timed(out: dict[str, float], key: str, device: torch.device | None = None) -> Iterator[None]:
    """Store the block's seconds in out[key]. On CUDA the device is synchronised at the end, so
    kernels the block queued are counted here and not in whatever is timed next."""
    start = time.perf_counter()
    yield
    if torch.cuda.is_available() and (device is None or device.type == "cuda"):
        torch.cuda.synchronize(device)
    out[key] = time.perf_counter() - start
