"""The LoRA merge benchmark of bench/kernel_bench.py: W + scale * B A (colocate/kernels/lora_merge.py)
for every adapted projection of the 1.5B shape at rank 64, device time against the same merge in
torch ops and the bytes' roofline, and the host time of launching one forward's merges."""

from __future__ import annotations

import statistics
import time

import torch

from bench.common import peak_hbm_bytes_per_s


def bench_lora_merge(do_bench, rank=64, layers=28, hidden_size=1536, kv_size=256, intermediate_size=8960) -> dict:
    """Every adapted projection of the 1.5B shape merged once (a forward's or a weight push's merges):
    the one-pass kernel of merged_weight against the same merge in torch ops (tensor-core product into
    fp32, scale, add, rounding), and the bytes the kernel must move at the device's peak bandwidth."""
    from colocate.kernels.lora_merge import lora_merge

    shapes = [
        (hidden_size, hidden_size),
        (kv_size, hidden_size),
        (kv_size, hidden_size),
        (hidden_size, hidden_size),
        (intermediate_size, hidden_size),
        (intermediate_size, hidden_size),
        (hidden_size, intermediate_size),
    ]
    g = torch.Generator(device="cuda").manual_seed(0)
    parts = [(0.02 * torch.randn(o, i, device="cuda", generator=g)).bfloat16() for o, i in shapes]
    adapters = [
        (torch.randn(rank, i, device="cuda", generator=g) / 40, torch.randn(o, rank, device="cuda", generator=g) / 100)
        for o, i in shapes
    ]

    def torch_ops(w, a, b):
        merged = torch.mm(b.to(w.dtype), a.to(w.dtype), out_dtype=torch.float32)
        return merged.mul_(0.5).add_(w).to(w.dtype)

    def model(merge):
        for _ in range(layers):
            for w, (a, b) in zip(parts, adapters):
                merge(w, a, b)

    def kernel(w, a, b):
        return lora_merge(w, a, b, 0.5, w.dtype)

    def compiled_blocks(merge):
        block = torch.compile(lambda ws, abs_: [merge(w, a, b) for w, (a, b) in zip(ws, abs_)], fullgraph=True)
        return lambda: [block(parts, adapters) for _ in range(layers)]

    weights = layers * sum(o * i for o, i in shapes)
    return {
        "rank": rank,
        "layers": layers,
        "weights": weights,
        "kernel_ms": do_bench(lambda: model(kernel)),
        "torch_ops_ms": do_bench(lambda: model(torch_ops)),
        "roofline_ms": 4 * weights / peak_hbm_bytes_per_s() * 1e3,
        "host_ms": {
            "kernel_compiled": _host_ms(compiled_blocks(kernel)),
            "torch_ops_compiled": _host_ms(compiled_blocks(torch_ops)),
            "kernel_direct": _host_ms(lambda: model(kernel)),
        },
    }


def _host_ms(fn, repeats: int = 30) -> float:
    """Median host time of one call of `fn` (the device idle at each start, so launches never wait
    for a full queue); the first calls compile."""
    times = []
    for _ in range(repeats + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times[3:]) * 1e3
