"""CUDA graphs of the decode step, one per batch-size bucket and sampler variant.

A decode step is ~24 layers of small kernels plus the sampler; launched one by one from Python,
the launches cost more than the GPU work. Each (bucket, variant) step — forward, fp32 logits,
sampling, feeding the sample back — is captured once and replayed on the runner's static buffers;
rows past the real batch are inert (position -1). The plain sampler variant is captured for every
bucket when the engine starts, largest first so that every smaller graph fits into the memory pool
of the largest; other variants (truncation, a stop-id mask) on first use, into the same pool.
"""

from __future__ import annotations

import torch

from colocate.rollout.native.sampler import Variant


def graph_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, 16, then steps of 16, up to and including max_batch_size."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch_size]
    buckets += list(range(16, max_batch_size + 1, 16))
    if buckets[-1] != max_batch_size:
        buckets.append(max_batch_size)
    return buckets


class DecodeGraphs:
    def __init__(self, runner, max_batch_size: int):
        self.runner = runner
        self.buckets = graph_buckets(max_batch_size)
        self.graphs: dict[tuple[int, Variant], torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.num_bytes = 0
        """Device memory the captured graphs hold (measured as the drop in free memory)."""

    @property
    def captured(self) -> bool:
        return bool(self.graphs)

    def capture(self, variant: Variant, buckets: list[int] | None = None) -> None:
        """Capture the decode step of `variant` for `buckets` (default: all). Leaves every row inert."""
        runner = self.runner
        device = runner.device
        buckets = sorted(buckets or self.buckets, reverse=True)
        runner.reset_rows()  # warm-up and capture must not write the KV cache
        runner.static_sampling(variant)  # its buffers: allocated here, not on the warm-up stream
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        # Warm up every shape first: Triton and inductor compile per launch configuration and
        # cuBLAS sets up its workspace, none of which may happen during capture.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream), torch.no_grad():
            for bs in buckets:
                runner.decode_step(bs, variant)
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        with torch.no_grad():
            for bs in buckets:
                graph = torch.cuda.CUDAGraph()
                with runner.memory.graph_capture(graph, self.pool):
                    runner.decode_step(bs, variant)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[bs, variant] = graph
        torch.cuda.synchronize(device)
        runner.reset_rows()
        self.num_bytes += max(0, free_before - torch.cuda.mem_get_info(device)[0])

    def bucket(self, batch_size: int) -> int | None:
        """The smallest bucket holding `batch_size` rows, or None (run eagerly)."""
        return next((b for b in self.buckets if b >= batch_size), None)

    def get(self, bucket: int, variant: Variant) -> torch.cuda.CUDAGraph:
        """The graph of this bucket and variant, captured now if it is not yet."""
        if (bucket, variant) not in self.graphs:
            self.capture(variant, [bucket])
        return self.graphs[bucket, variant]

    def drop(self) -> None:
        """Forget the graphs and free their pool (they point at tensors that are going away)."""
        self.graphs.clear()
        self.pool = None
        self.num_bytes = 0
