"""Where the engine's device memory lives, and how it is given back and taken again.

With torch_memory_saver (CUDA), weights, KV cache and CUDA-graph memory are allocated inside
regions tagged "weights", "kv_cache" and "cuda_graph": pausing a tag unmaps its physical pages
and resuming maps fresh pages at the same virtual addresses, so tensors and captured graphs stay
valid (contents are not kept). Graph memory is pausable only in the library's preload mode (its
hook library in LD_PRELOAD when the process starts); in its torch-hook mode, graph pools bypass
the regions, so graph memory simply stays allocated. Without the library (CPU, or not installed)
the owner frees and reallocates its tensors instead, and graphs must be captured again.
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch

from colocate.memory_saver import handle as memory_saver_handle
from colocate.memory_saver import preload_active


class DeviceMemory:
    def __init__(self, device: torch.device, memory_saver: bool | str = "auto"):
        if memory_saver not in ("auto", True, False):
            raise ValueError(f"memory_saver={memory_saver!r} must be 'auto', True or False")
        available = device.type == "cuda" and importlib.util.find_spec("torch_memory_saver") is not None
        if memory_saver is True and not available:
            raise ValueError("memory_saver=True needs a CUDA device and the torch_memory_saver package")
        self.device = device
        self._saver = None
        self.preload = False
        if available and memory_saver:
            self.preload = preload_active()
            self._saver = memory_saver_handle()

    @property
    def mode(self) -> str:
        if self._saver is None:
            return "reallocate"
        return "torch_memory_saver (preload)" if self.preload else "torch_memory_saver (torch hooks)"

    @property
    def keeps_addresses(self) -> bool:
        """Weights and KV cache keep their addresses across release/resume (graphs stay valid)."""
        return self._saver is not None

    @property
    def graphs_pausable(self) -> bool:
        return self._saver is not None and self.preload

    def region(self, tag: str):
        """Allocations made inside belong to `tag` (a no-op without torch_memory_saver)."""
        return self._saver.region(tag=tag) if self._saver is not None else contextlib.nullcontext()

    def graph_capture(self, graph: "torch.cuda.CUDAGraph", pool):
        """Capture into `pool`, with pausable memory when the preload hook is active."""
        if self.graphs_pausable:
            return self._saver.cuda_graph(graph, pool=pool, tag="cuda_graph")
        return torch.cuda.graph(graph, pool=pool)

    def pause(self, tag: str) -> None:
        assert self._saver is not None
        torch.cuda.synchronize(self.device)
        self._saver.pause(tag)

    def resume(self, tag: str) -> None:
        assert self._saver is not None
        self._saver.resume(tag)
