"""Sampling on the device, reproducible by construction.

Each row samples with the Gumbel-max trick: argmax(logits / T + g), where the noise g for vocabulary
entry v is a function of (the sample's seed, the position being sampled from, v) alone — a
counter-based hash, computed on the device, with no RNG state. So a completion's tokens do not
depend on which other requests share the batch, on preemption and recompute, or on how many decode
steps run per host round trip, and no host sync is needed to draw them.

Log-probs follow the protocol: log_softmax(logits / T) over the full vocabulary (raw logits when
greedy), before top-k / top-p / min-p and before the min_new_tokens stop-id mask. The sampler and
its log-sum-exp come from the engine's table of operations (colocate/kernels/ops.py): in the true on-
policy mode, those whose log-prob is the trainer's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from colocate.kernels.ops import Ops
from colocate.kernels.sampling import reference_gumbel_sample, suppress
from colocate.rollout.protocol import SamplingParams


def sample_tokens(
    logits: torch.Tensor,  # (B, V) fp32
    temperature: torch.Tensor,  # (B,) fp32, 0 = greedy
    top_k: torch.Tensor,  # (B,) int64, V = no limit
    top_p: torch.Tensor,  # (B,) fp32
    min_p: torch.Tensor,  # (B,) fp32
    seed: torch.Tensor,  # (B,) int64
    counter: torch.Tensor,  # (B,) int64: position of the token whose logits these are
    suppress_ids: torch.Tensor | None = None,  # (B, S) int64 stop ids, padded by repetition
    suppress_left: torch.Tensor | None = None,  # (B,) int64: mask suppress_ids while > 0
    truncate: bool = False,
    logsumexp: Callable | None = None,  # the log-prob's row log-sum-exp (a table's row_logsumexp)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids (B,) int64 and their log-probs (B,) fp32, in plain torch."""
    exclude = None
    if truncate:
        scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]  # (B, V)
        scaled = suppress(scaled, suppress_ids, suppress_left)  # stop ids before min_new_tokens: out first
        values, order = scaled.sort(dim=-1, descending=True)  # (B, V)
        rank = torch.arange(logits.shape[-1], device=logits.device)
        values = values.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
        probs = values.softmax(dim=-1)  # after top-k, as top-p sees it
        mass_before = probs.cumsum(dim=-1) - probs
        # top_p = 1 must keep everything, even where rounding lets the cumulative mass reach 1.
        cut = ((mass_before >= top_p[:, None]) & (top_p < 1)[:, None]) | (probs < min_p[:, None] * probs[:, :1])
        exclude = torch.empty_like(cut).scatter_(1, order, cut | values.isneginf())
    return reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, suppress_left, exclude, logsumexp)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device, built once per scheduled batch."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    seed: torch.Tensor
    suppress_ids: torch.Tensor | None
    suppress_left: torch.Tensor | None
    """Tokens still to generate before stop ids are allowed; counts down one per decode step."""
    truncate: bool
    unit_temperature: bool = False
    """Every row's temperature is 0 or 1: its logits are already the scaled ones."""
    ops: Ops = Ops.standard()
    """The engine's table of operations: its sampler and log-sum-exp."""

    @classmethod
    def build(
        cls,
        rows: list[tuple[SamplingParams, int, frozenset[int], int]],
        vocab_size: int,
        device: torch.device,
        ops: Ops | None = None,
    ) -> "SamplingBatch":
        """rows: (params, seed, stop ids, tokens generated so far) per sampled row; `ops`: the
        engine's table (default `Ops.standard()`)."""
        params = [r[0] for r in rows]
        suppress = [(sorted(stop), p.min_new_tokens - done) for p, _, stop, done in rows]
        any_suppress = any(stop and left > 0 for stop, left in suppress)
        width = max((len(stop) for stop, _ in suppress), default=0)
        suppress_ids = suppress_left = None
        if any_suppress:
            # Pad each row with its own first id: duplicate scatter writes then agree.
            ids = [(stop + stop[:1] * (width - len(stop))) if stop else [0] * width for stop, _ in suppress]
            left = [left if stop else 0 for stop, left in suppress]
            suppress_ids = torch.tensor(ids, dtype=torch.int64).to(device, non_blocking=True)
            suppress_left = torch.tensor(left, dtype=torch.int64).to(device, non_blocking=True)

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seed=tensor([r[1] for r in rows], torch.int64),
            suppress_ids=suppress_ids,
            suppress_left=suppress_left,
            truncate=any(p.top_p < 1 or 0 < p.top_k < vocab_size or p.min_p > 0 for p in params),
            unit_temperature=all(p.temperature in (0.0, 1.0) for p in params),
            ops=Ops.standard() if ops is None else ops,
        )

    def sample(self, logits: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row from logits (B, V) at positions `counter` (B,)."""
        logits = logits.float()
        if not self.truncate:  # one streaming pass over the logits on CUDA (colocate/kernels/sampling.py)
            return self.ops.sample(
                logits, self.temperature, self.seed, counter, self.suppress_ids, self.suppress_left, self.unit_temperature
            )
        # The top-k/top-p sort and scan stay eager: inductor (torch 2.11) fails to compile the scan.
        return sample_tokens(
            logits,
            self.temperature,
            self.top_k,
            self.top_p,
            self.min_p,
            self.seed,
            counter,
            self.suppress_ids,
            self.suppress_left,
            truncate=True,
            logsumexp=self.ops.row_logsumexp,
        )

    def advance(self) -> None:
        """One token was generated per row (multi-step decode)."""
        if self.suppress_left is not None:
            self.suppress_left.sub_(1)
