"""CUDA graphs of the decode forward, one per batch-size bucket.

A decode step is ~24 layers of small kernels; launched one by one from Python, the launches cost
more than the GPU work. Each bucket's forward (token ids -> fp32 logits) is captured once, largest
first so that every smaller graph fits into the memory pool of the largest, and replayed on the
runner's static decode buffers. Rows past the real batch are inert: slot -1 (no K/V write) and
context length 0 (zero attention output).
"""

from __future__ import annotations

import time

import torch


def graph_buckets(max_batch_size: int) -> list[int]:
    """2, 4, 8, 16, then steps of 16, up to and including max_batch_size. No bucket of one (unless
    that is the maximum): a compiled decode forward specialises on a batch of one, so that bucket
    would cost a second compilation; one sequence replays the graph of two."""
    buckets = [b for b in (2, 4, 8) if b <= max_batch_size]
    buckets += list(range(16, max_batch_size + 1, 16))
    if not buckets or buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


class DecodeGraphs:
    def __init__(self, runner, max_batch_size: int):
        self.runner = runner
        self.buckets = graph_buckets(max_batch_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        self.num_bytes = 0
        """Device memory the captured graphs hold (measured as the drop in free memory)."""

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self) -> dict[str, float]:
        """Warm up, then capture, every bucket. Returns seconds: `first_decode`, the largest
        bucket's warm-up (the decode forward's compile when it is compiled, and the first launch of
        each Triton kernel it runs), and `cuda_graphs`, the other warm-ups and the captures."""
        runner = self.runner
        device = runner.device
        start = time.perf_counter()
        first_decode = 0.0
        runner.reset_padding(0)
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        # Warm up every shape first: Triton compiles per launch configuration and cuBLAS sets up
        # its workspace, neither of which may happen during capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for i, bs in enumerate(reversed(self.buckets)):
                runner.decode_forward(bs)
                if i == 0:
                    torch.cuda.synchronize(device)
                    first_decode = time.perf_counter() - start
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        with torch.no_grad():
            for bs in reversed(self.buckets):
                graph = torch.cuda.CUDAGraph()
                with runner.memory.graph_capture(graph, self.pool):
                    self.logits[bs] = runner.decode_forward(bs)  # (bs, V) fp32
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        self.num_bytes = max(0, free_before - torch.cuda.mem_get_info(device)[0])
        return {"first_decode": first_decode, "cuda_graphs": time.perf_counter() - start - first_decode}

    def bucket(self, batch_size: int) -> int | None:
        """The smallest captured bucket holding `batch_size` rows, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def replay(self, batch_size: int) -> torch.Tensor:
        bs = self.bucket(batch_size)
        self.graphs[bs].replay()
        return self.logits[bs][:batch_size]

    def drop(self) -> None:
        """Forget the graphs and free their pool (they point at tensors that are going away)."""
        self.graphs.clear()
        self.logits.clear()
        self.pool = None
        self.num_bytes = 0
