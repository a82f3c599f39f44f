"""Sampling on the device, reproducible by construction.

Each row samples with the Gumbel-max trick: argmax(logits / T + g), where the noise g for vocabulary
entry v is a function of (the sample's seed, the position being sampled from, v) alone — a
counter-based hash, computed on the device, with no RNG state. So a completion's tokens do not
depend on which other requests share the batch, on preemption and recompute, or on how many decode
steps run per host round trip, and no host sync is needed to draw them.

Log-probs follow the protocol: log_softmax(logits / T) over the full vocabulary (raw logits when
greedy), before top-k / top-p / min-p and before the min_new_tokens stop-id mask.

On CUDA the work that reads the whole (B, V) logits — scaling, logsumexp, the stop-id mask, the
noise hash and the argmax — is one torch.compile'd function (`fused=True`), about one read of the
logits. Top-k / top-p / min-p truncation (a sort and a cumulative sum) always runs eagerly before
it: inductor cannot compile a scan over a dimension this long on every version (torch 2.11 fails
in the codegen of the cumsum), and the sort dominates that path anyway. Either way the whole
sampler runs inside the decode CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from colocate.rollout.protocol import SamplingParams

_MASK32 = 0xFFFFFFFF
_VOCAB_SALT = 0x9E3779B9

Variant = tuple[bool, int]
"""What changes the sampler's code path: (truncate, stop-id mask width; 0 = no mask)."""
PLAIN: Variant = (False, 0)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (bijective on [0, 2^32)); int64 lanes hold the 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise (B, V) from seeds (B,) int64 >= 0 and positions (B,) int64."""
    key = _mix32((seed & _MASK32) ^ _mix32((seed >> 32) ^ _mix32(counter & _MASK32)))  # (B,)
    vocab = _mix32(torch.arange(vocab_size, device=seed.device) ^ _VOCAB_SALT)  # (V,)
    bits = _mix32(key[:, None] ^ vocab[None, :]) >> 9  # (B, V), 23 random bits
    u = (bits.float() + 0.5) * (1.0 / (1 << 23))  # in (0, 1), exactly representable
    return -torch.log(-torch.log(u))


def stop_id_mask(counter: torch.Tensor, suppress_ids: torch.Tensor, suppress_until: torch.Tensor,
                 vocab_size: int) -> torch.Tensor:
    """(B, V) bool: the stop ids of rows whose position `counter` is still below `suppress_until`.

    Elementwise comparisons (one per stop-id column) rather than a scatter, so that the compiled
    sampler fuses the mask into its pass over the logits instead of writing a (B, V) tensor.
    """
    vocab = torch.arange(vocab_size, device=counter.device)[None, :]  # (1, V)
    hit = vocab == suppress_ids[:, :1]  # (B, V)
    for j in range(1, suppress_ids.shape[1]):
        hit = hit | (vocab == suppress_ids[:, j:j + 1])
    return hit & (counter < suppress_until)[:, None]


def truncated_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                     min_p: torch.Tensor) -> torch.Tensor:
    """`scaled` (B, V) with -inf outside each row's top-k, then top-p, then min-p set."""
    vocab_size = scaled.shape[-1]
    values, order = scaled.sort(dim=-1, descending=True)  # (B, V)
    rank = torch.arange(vocab_size, device=scaled.device)
    values = values.masked_fill(rank[None, :] >= top_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)  # after top-k, as top-p sees it
    mass_before = probs.cumsum(dim=-1) - probs
    # top_p = 1 must keep everything, even where rounding lets the cumulative mass reach 1.
    cut = ((mass_before >= top_p[:, None]) & (top_p < 1)[:, None]) | (probs < min_p[:, None] * probs[:, :1])
    return torch.empty_like(scaled).scatter_(1, order, values.masked_fill(cut, float("-inf")))


def _scale(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    return logits / torch.where(temperature == 0, 1.0, temperature)[:, None]  # (B, V)


def _pick(logits, temperature, seed, counter, masked, suppress_ids, suppress_until):
    """Ids (B,) and log-probs (B,): argmax of (masked, or the scaled logits) + noise."""
    vocab_size = logits.shape[-1]
    greedy = temperature == 0
    scaled = _scale(logits, temperature)  # (B, V)
    lse = torch.logsumexp(scaled, dim=-1)  # (B,)
    if masked is None:
        masked = scaled
        if suppress_ids is not None:
            masked = masked.masked_fill(stop_id_mask(counter, suppress_ids, suppress_until, vocab_size),
                                        float("-inf"))
    noise = gumbel_noise(seed, counter, vocab_size) * (~greedy)[:, None]  # (B, V)
    ids = (masked + noise).argmax(dim=-1)  # (B,)
    return ids, scaled.gather(1, ids[:, None]).squeeze(1) - lse


@functools.cache
def _compiled_pick():
    # Fused, the hash, the mask and the two vocabulary reductions cost about one read of the
    # logits; eager they would be a dozen full (B, V) int64 kernels per step.
    return torch.compile(_pick, dynamic=True)


def sample_tokens(
    logits: torch.Tensor,  # (B, V) fp32
    temperature: torch.Tensor,  # (B,) fp32, 0 = greedy
    top_k: torch.Tensor,  # (B,) int64, V = no limit
    top_p: torch.Tensor,  # (B,) fp32
    min_p: torch.Tensor,  # (B,) fp32
    seed: torch.Tensor,  # (B,) int64
    counter: torch.Tensor,  # (B,) int64: position of the token whose logits these are
    suppress_ids: torch.Tensor | None = None,  # (B, W) int64 stop ids, padded by repetition
    suppress_until: torch.Tensor | None = None,  # (B,) int64: mask suppress_ids while counter < this
    truncate: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids (B,) int64 and their log-probs (B,) fp32. `fused` (CUDA) compiles the vocabulary
    pass; the result is the same sample up to fp32 rounding."""
    masked = None
    if truncate:  # eager on every device; see the module docstring
        masked = _scale(logits, temperature)
        if suppress_ids is not None:
            masked = masked.masked_fill(stop_id_mask(counter, suppress_ids, suppress_until, logits.shape[-1]),
                                        float("-inf"))
        masked = truncated_logits(masked, top_k, top_p, min_p)
        suppress_ids = suppress_until = None
    pick = _compiled_pick() if fused else _pick
    return pick(logits, temperature, seed, counter, masked, suppress_ids, suppress_until)


@dataclass
class SamplingBatch:
    """Per-row sampling parameters on the device. A batch's rows stay valid for as long as its
    sequences run together: nothing in it changes from one decode step to the next."""

    temperature: torch.Tensor  # (B,) fp32
    top_k: torch.Tensor  # (B,) int64
    top_p: torch.Tensor  # (B,) fp32
    min_p: torch.Tensor  # (B,) fp32
    seed: torch.Tensor  # (B,) int64
    suppress_ids: torch.Tensor | None  # (B, W) int64, W a power of two
    suppress_until: torch.Tensor | None  # (B,) int64
    """Stop ids are masked while the sampled-from position is below this: prompt + min_new_tokens - 1."""
    truncate: bool

    @classmethod
    def build(cls, rows: list[tuple[SamplingParams, int, frozenset[int], int, int]], vocab_size: int,
              device: torch.device) -> "SamplingBatch":
        """rows: (params, seed, stop ids, prompt tokens, tokens generated so far) per sampled row."""
        params = [r[0] for r in rows]
        suppress_ids = suppress_until = None
        if any(stop and p.min_new_tokens > done for p, _, stop, _, done in rows):
            width = _pow2(max(len(stop) for _, _, stop, _, _ in rows))
            # Pad each row with its own first id (or 0 for rows without stop ids, never masked).
            ids = [[*sorted(stop), *[min(stop)] * (width - len(stop))] if stop else [0] * width
                   for _, _, stop, _, _ in rows]
            until = [n + p.min_new_tokens - 1 if stop else 0 for p, _, stop, n, _ in rows]
            suppress_ids = _to(ids, torch.int64, device)
            suppress_until = _to(until, torch.int64, device)
        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in params]
        return cls(
            temperature=_to([p.temperature for p in params], torch.float32, device),
            top_k=_to(top_k, torch.int64, device),
            top_p=_to([p.top_p for p in params], torch.float32, device),
            min_p=_to([p.min_p for p in params], torch.float32, device),
            seed=_to([r[1] for r in rows], torch.int64, device),
            suppress_ids=suppress_ids,
            suppress_until=suppress_until,
            truncate=any(p.top_p < 1 or 0 < p.top_k < vocab_size or p.min_p > 0 for p in params),
        )

    @classmethod
    def static(cls, num_rows: int, vocab_size: int, device: torch.device, variant: Variant) -> "SamplingBatch":
        """Buffers for `num_rows` rows of one variant, filled with neutral parameters (rows that
        no request fills still sample something harmless)."""
        truncate, width = variant
        dev = dict(device=device)
        return cls(
            temperature=torch.ones(num_rows, **dev), top_k=torch.full((num_rows,), vocab_size, **dev),
            top_p=torch.ones(num_rows, **dev), min_p=torch.zeros(num_rows, **dev),
            seed=torch.zeros(num_rows, dtype=torch.int64, **dev),
            suppress_ids=torch.zeros((num_rows, width), dtype=torch.int64, **dev) if width else None,
            suppress_until=torch.zeros(num_rows, dtype=torch.int64, **dev) if width else None,
            truncate=truncate,
        )

    @property
    def variant(self) -> Variant:
        return self.truncate, 0 if self.suppress_ids is None else self.suppress_ids.shape[1]

    def head(self, num_rows: int) -> "SamplingBatch":
        """The first `num_rows` rows (views)."""
        return dataclasses.replace(self, **{f: getattr(self, f)[:num_rows] for f in _ROW_FIELDS
                                            if getattr(self, f) is not None})

    def copy_(self, other: "SamplingBatch") -> None:
        """Write `other`'s rows into the first rows of these buffers (same variant)."""
        assert other.variant == self.variant
        n = other.temperature.shape[0]
        for f in _ROW_FIELDS:
            if getattr(other, f) is not None:
                getattr(self, f)[:n].copy_(getattr(other, f), non_blocking=True)

    def sample(self, logits: torch.Tensor, counter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row from logits (B, V) fp32 at positions `counter` (B,): the path
        the engine runs (fused on CUDA)."""
        return sample_tokens(logits, self.temperature, self.top_k, self.top_p, self.min_p, self.seed, counter,
                             self.suppress_ids, self.suppress_until, self.truncate, fused=logits.is_cuda)


_ROW_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "suppress_ids", "suppress_until")


def _to(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _pow2(n: int) -> int:
    """Smallest power of two >= n: few mask widths, so few compiled variants and graphs."""
    return 1 << max(n - 1, 0).bit_length()
