"""Tolerances for bf16 results, set by a measured bf16 error rather than by fixed numbers.

A bf16 computation of ours is compared with an fp32 reference next to a second bf16 computation
of the same thing (transformers' forward, or our own eager path) on the same inputs: ours must be
about as far from the reference as that baseline is. The GPU tests use these helpers; the unit
tests check them on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

K_MEAN = 1.5
"""Our mean log-prob error may be this many times the baseline's. Our kernels fuse and round
differently (fp32 logits, compiled element-wise work, Triton attention), so equal error is not
expected, but the same order is; a paging or masking defect costs nats, not a factor of 1.5."""
K_P99 = 2.0
"""As K_MEAN for the 99th percentile, which a few thousand tokens estimate less steadily."""
EPS = 1e-6
"""Absolute slack on every bound (nats): below it fp32 accumulation order alone differs."""
MAX_BASELINE_MEAN = 1.0
"""The baseline's own mean error must stay under this (nats): a larger one means the reference is
a different model or the inputs are misaligned, and every bound derived from it is vacuous. bf16
rounding alone reaches 0.23 nats on a 24-layer random model at temperature 1 (H200, Qwen2.5-0.5B
shape); log-probs of another model differ by several nats."""
MIN_TOKENS = 2000
"""Tokens needed before a 99th percentile is more than the few largest errors."""
K_GRAD = 3.0
"""A compiled gradient may differ from the eager one by this many times the eager bf16 noise: by
the triangle inequality that allows the compiled path twice eager's own distance to fp32."""
GRAD_FLOOR = 1e-3
"""Per-parameter slack as a fraction of the whole fp32 gradient's norm, for gradients that are
zero in exact arithmetic (a key bias: softmax ignores a shift shared by every key), where the
rounding noise of either path is all there is."""


@dataclass(frozen=True)
class ErrorStats:
    """|values - reference| over matching tokens."""

    mean: float
    p99: float
    max: float
    num: int

    def __str__(self) -> str:
        return f"mean {self.mean:.2e} p99 {self.p99:.2e} max {self.max:.2e} over {self.num} tokens"


def error_stats(values: torch.Tensor, reference: torch.Tensor) -> ErrorStats:
    """Summarise |values - reference| of two (T,) tensors, computed in fp64."""
    if values.shape != reference.shape or values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"need two equal non-empty (T,) tensors, got {tuple(values.shape)} and {tuple(reference.shape)}")
    err = (values.double() - reference.double()).abs().cpu()
    return ErrorStats(err.mean().item(), torch.quantile(err, 0.99).item(), err.max().item(), err.numel())


def check_baseline(mean: float, label: str) -> None:
    """Bounds derived from a baseline's mean error mean something: it measured some error, a
    finite one, and not so large that the reference itself must be wrong."""
    assert math.isfinite(mean), f"{label}: baseline error is not finite ({mean})"
    assert mean > 0, f"{label}: baseline equals the reference exactly: no bf16 error was measured"
    assert mean <= MAX_BASELINE_MEAN, (
        f"{label}: baseline is {mean:.3f} nats from the reference on average (limit "
        f"{MAX_BASELINE_MEAN}): the reference cannot be the same model on the same tokens"
    )


def assert_mean_within_noise(ours_mean: float, baseline_mean: float, label: str) -> None:
    """Our mean error (a scalar, e.g. a trainer metric) against the baseline's on the same tokens."""
    check_baseline(baseline_mean, label)
    bound = K_MEAN * baseline_mean + EPS
    assert math.isfinite(ours_mean) and ours_mean <= bound, (
        f"{label}: mean error {ours_mean:.3e} > {K_MEAN} x baseline mean {baseline_mean:.3e} + {EPS}"
    )


def assert_within_noise(ours: ErrorStats, baseline: ErrorStats, label: str) -> None:
    """Mean and 99th percentile of our error against the baseline's, on enough tokens."""
    assert ours.num == baseline.num, f"{label}: {ours.num} tokens against a baseline of {baseline.num}"
    assert ours.num >= MIN_TOKENS, f"{label}: {ours.num} tokens are too few for a 99th percentile"
    assert math.isfinite(baseline.max), f"{label}: baseline error is not finite ({baseline})"
    assert_mean_within_noise(ours.mean, baseline.mean, label)
    bound = K_P99 * baseline.p99 + EPS
    assert ours.p99 <= bound, f"{label}: p99 error {ours.p99:.3e} > {K_P99} x baseline p99 {baseline.p99:.3e} + {EPS} ({ours})"


def assert_grads_within_noise(
    candidate: dict[str, torch.Tensor], eager: dict[str, torch.Tensor], fp32: dict[str, torch.Tensor], label: str
) -> dict[str, float]:
    """Per parameter: |candidate - eager| <= K_GRAD * |eager - fp32| + GRAD_FLOOR * |fp32 (all)|,
    Frobenius norms, `eager` and `candidate` bf16-computed gradients and `fp32` the same
    gradients computed in fp32. Returns each parameter's distance over its bound."""
    assert set(candidate) == set(eager) == set(fp32), f"{label}: the runs have different parameters"
    norms = {
        name: (
            g.double().norm(),
            (eager[name].double() - g.double()).norm(),
            (candidate[name].double() - eager[name].double()).norm(),
        )
        for name, g in fp32.items()
    }
    total = math.sqrt(sum(n[0].item() ** 2 for n in norms.values()))
    total_noise = math.sqrt(sum(n[1].item() ** 2 for n in norms.values()))
    assert math.isfinite(total) and total > 0, f"{label}: the fp32 gradient is {total}"
    assert 0 < total_noise < total, (
        f"{label}: bf16 noise {total_noise:.3e} against an fp32 gradient of {total:.3e}: not a measure of rounding"
    )
    ratios = {}
    for name, (_, noise, dist) in norms.items():
        assert math.isfinite(dist.item()), f"{label}: {name} differs by {dist.item()}"
        ratios[name] = dist.item() / (K_GRAD * noise.item() + GRAD_FLOOR * total)
    worst = max(ratios, key=ratios.get)
    _, noise, dist = norms[worst]
    assert ratios[worst] <= 1.0, (
        f"{label}: {worst} differs from eager by {dist.item():.3e} > {K_GRAD} x its bf16 noise "
        f"{noise.item():.3e} + {GRAD_FLOOR} x the gradient norm {total:.3e}"
    )
    return ratios


def release_expectations(stats: dict, graphs_resume: bool) -> tuple[int, int]:
    """Bytes a full release must give the device and a full resume take back, from the engine's
    memory_stats() read before the release: weights and KV cache always; graph memory on release
    when the engine can release it, and on resume only where resuming maps it again (otherwise
    the graphs are captured anew by the next decode)."""
    base = stats["weights_bytes"] + stats["kv_cache_bytes"]
    graphs = stats["cuda_graph_bytes"]
    return base + (graphs if stats["cuda_graph_releasable"] else 0), base + (graphs if graphs_resume else 0)
