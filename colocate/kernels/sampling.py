"""Gumbel-max sampling over the full vocabulary in one pass over the logits.

Row b samples argmax(logits[b] / T_b + g_b) with g_b[v] standard Gumbel noise that is a pure
function of (seed_b, counter_b, v): a counter-based 32-bit hash, no RNG state (see
colocate/rollout/native/sampler.py for why). Alongside it returns the sampled token's log-prob
under log_softmax(logits / T) over the full vocabulary. Greedy rows (T = 0) take the plain argmax
and raw-logit log-probs. `suppress_ids` (B, S) are excluded from the argmax (not from the
log-softmax) while `suppress_left` > 0: stop ids before min_new_tokens.

The reference (`reference_gumbel_sample`, the CPU path and the test oracle) materialises the noise
as a (B, V) tensor. The Triton kernel streams each row's vocabulary in slices, one program per
(row, slice), carrying per lane an online sum-exp (against the slice's running max) and the running
best of logits / T + noise; a second kernel merges the slices. The hash is computed in uint32 lanes
(the reference's int64 lanes hold the same 32-bit values), so the noise bits are identical on both
paths.

The batch-invariant mode (colocate/kernels/batch_invariant.py) launches the same kernels with a
fixed number of slices per row (INVARIANT_CONFIG, whatever the batch) on logits already divided by
the temperature: `invariant_gumbel_sample` for the engine, and `invariant_logsumexp` (no sampling;
`invariant_logsumexp_and_entropy` with the entropy) for the trainer's log-prob, so both subtract the
same log-sum-exp bits. The mode's table (kernels/ops.py) holds `invariant_sample` and
`invariant_row_logsumexp` where the default one holds `gumbel_sample` and `row_logsumexp`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

MASK32 = 0xFFFFFFFF
VOCAB_SALT = 0x9E3779B9
_PROGRAMS_PER_SM = 16
_MAX_SPLITS = 64


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finaliser (bijective on [0, 2^32)); int64 lanes hold the 32-bit values."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(seed: torch.Tensor, counter: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise (B, V) from seeds (B,) int64 >= 0 and positions (B,) int64."""
    key = _mix32((seed & MASK32) ^ _mix32((seed >> 32) ^ _mix32(counter & MASK32)))  # (B,)
    vocab = _mix32(torch.arange(vocab_size, device=seed.device) ^ VOCAB_SALT)  # (V,)
    bits = _mix32(key[:, None] ^ vocab[None, :]) >> 9  # (B, V), 23 random bits
    u = (bits.float() + 0.5) * (1.0 / (1 << 23))  # in (0, 1), exactly representable
    return -torch.log(-torch.log(u))


def reference_gumbel_sample(
    logits: torch.Tensor,  # (B, V) fp32
    temperature: torch.Tensor,  # (B,) fp32, 0 = greedy
    seed: torch.Tensor,  # (B,) int64
    counter: torch.Tensor,  # (B,) int64
    suppress_ids: torch.Tensor | None = None,  # (B, S) int64
    suppress_left: torch.Tensor | None = None,  # (B,) int64
    exclude: torch.Tensor | None = None,  # (B, V) bool: also left out of the argmax (truncation)
    logsumexp=None,  # the log-prob's row log-sum-exp (the table's row_logsumexp); None: row_logsumexp
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled ids (B,) int64 and their log-probs (B,) fp32, with (B, V) intermediates."""
    greedy = temperature == 0
    scaled = scale_logits(logits, temperature)  # (B, V)
    masked = suppress(scaled, suppress_ids, suppress_left)
    if exclude is not None:
        masked = masked.masked_fill(exclude, float("-inf"))
    noise = gumbel_noise(seed, counter, logits.shape[-1]) * (~greedy)[:, None]  # (B, V)
    ids = (masked + noise).argmax(dim=-1)  # (B,)
    return ids, sampled_logprobs(scaled, ids, None if logsumexp is None else logsumexp(scaled))


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits (B, V) / temperature (B,), with the raw logits where the temperature is 0 (greedy)."""
    return logits / torch.where(temperature == 0, 1.0, temperature)[:, None]


def sampled_logprobs(scaled: torch.Tensor, ids: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """log_softmax(scaled)[id] per row: the protocol's log-prob, as the sampler computes it (and
    the trainer too, in batch-invariant mode). `lse`: each row's log-sum-exp of `scaled` (the
    table's `row_logsumexp`: the mode's passes `invariant_row_logsumexp`); None: `row_logsumexp`."""
    return scaled.gather(1, ids[:, None]).squeeze(1) - (row_logsumexp(scaled) if lse is None else lse)


def row_logsumexp(scaled: torch.Tensor) -> torch.Tensor:
    """logsumexp of each row of (B, V)."""
    return torch.logsumexp(scaled, dim=-1)


def invariant_row_logsumexp(scaled: torch.Tensor) -> torch.Tensor:
    """`row_logsumexp` in batch-invariant mode: CUDA sums each row in one fixed order (`invariant_logsumexp`)."""
    if scaled.is_cuda:
        return invariant_logsumexp(scaled)
    return torch.logsumexp(scaled, dim=-1)


def suppress(scores: torch.Tensor, suppress_ids: torch.Tensor | None, suppress_left: torch.Tensor | None) -> torch.Tensor:
    """scores (B, V) with suppress_ids set to -inf in the rows whose suppress_left > 0."""
    if suppress_ids is None:
        return scores
    blocked = torch.zeros_like(scores, dtype=torch.bool).scatter_(
        1, suppress_ids, (suppress_left > 0)[:, None].expand_as(suppress_ids)
    )  # (B, V)
    return scores.masked_fill(blocked, float("-inf"))


def gumbel_sample(
    logits, temperature, seed, counter, suppress_ids=None, suppress_left=None, unit_temperature=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring; the Triton kernel on CUDA, the reference elsewhere. `unit_temperature`:
    the caller knows every temperature is 0 or 1, so the scaled logits are the logits themselves."""
    _check_inputs(logits, temperature, seed, counter, suppress_ids, suppress_left)
    if not logits.is_cuda:
        return reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, suppress_left)
    return _gumbel_sample_triton(
        logits,
        temperature,
        seed,
        counter,
        suppress_ids,
        suppress_left,
        sample_config(logits.shape[0], logits.shape[1], logits.device),
    )


def invariant_sample(
    logits, temperature, seed, counter, suppress_ids=None, suppress_left=None, unit_temperature=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`gumbel_sample` in batch-invariant mode (its signature): on CUDA a launch fixed whatever the
    batch (`invariant_gumbel_sample`), so the log-prob subtracts the trainer's log-sum-exp, bit for
    bit; elsewhere the reference, whose log-sum-exp already is the trainer's."""
    _check_inputs(logits, temperature, seed, counter, suppress_ids, suppress_left)
    if not logits.is_cuda:
        return reference_gumbel_sample(
            logits, temperature, seed, counter, suppress_ids, suppress_left, logsumexp=invariant_row_logsumexp
        )
    # Division by 1 is exact: at unit temperatures the (B, V) quotient is skipped, not its bits.
    scaled = logits if unit_temperature else scale_logits(logits, temperature)
    return invariant_gumbel_sample(scaled, temperature, seed, counter, suppress_ids, suppress_left)


def _check_inputs(logits, temperature, seed, counter, suppress_ids, suppress_left) -> None:
    if logits.ndim != 2 or logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be (B, V) fp32 contiguous in V, got {tuple(logits.shape)} {logits.dtype}")
    batch = logits.shape[0]
    for name, t, dtype in (
        ("temperature", temperature, torch.float32),
        ("seed", seed, torch.int64),
        ("counter", counter, torch.int64),
    ):
        if t.shape != (batch,) or t.dtype != dtype:
            raise ValueError(f"{name} must be ({batch},) {dtype}, got {tuple(t.shape)} {t.dtype}")
    if (suppress_ids is None) != (suppress_left is None):
        raise ValueError("suppress_ids and suppress_left come together")
    if suppress_ids is not None:
        if suppress_ids.ndim != 2 or suppress_ids.shape[0] != batch or suppress_ids.dtype != torch.int64:
            raise ValueError(f"suppress_ids must be ({batch}, S) int64, got {tuple(suppress_ids.shape)}")
        if suppress_left.shape != (batch,) or suppress_left.dtype != torch.int64:
            raise ValueError(f"suppress_left must be ({batch},) int64, got {tuple(suppress_left.shape)}")
    devices = {t.device for t in (logits, temperature, seed, counter, suppress_ids, suppress_left) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"all inputs must share one device, got {devices}")


@dataclass(frozen=True)
class SampleConfig:
    """Launch shape of the Triton sampler: vocabulary slices per row, columns per loop iteration."""

    num_splits: int
    block: int = 1024
    num_warps: int = 8


INVARIANT_CONFIG = SampleConfig(num_splits=16)
"""The batch-invariant mode's launch: a fixed number of slices per row whatever the batch, so that
a row's sums (and the trainer's, through `invariant_logsumexp`) never depend on the rows beside it."""


def sample_config(batch: int, vocab_size: int, device: torch.device, programs_per_sm: int = _PROGRAMS_PER_SM) -> SampleConfig:
    """About `programs_per_sm` programs per SM, each slice at least one block (bench/kernel_bench.py
    --sample-sweep measures the alternatives)."""
    from colocate.kernels.paged_attention import _sm_count

    splits = max(1, min(programs_per_sm * _sm_count(device) // max(batch, 1), _MAX_SPLITS, -(-vocab_size // SampleConfig.block)))
    return SampleConfig(num_splits=splits)


def _gumbel_sample_triton(logits, temperature, seed, counter, suppress_ids, suppress_left, config: SampleConfig):
    ids, logprobs, _, _ = _launch(logits, config, (temperature, seed, counter, suppress_ids, suppress_left))
    return ids, logprobs


def invariant_gumbel_sample(
    scaled, temperature, seed, counter, suppress_ids=None, suppress_left=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch-invariant mode's sampler: ids as `gumbel_sample` draws them, from logits already
    divided by the temperature (`temperature` only tells greedy rows, T = 0), and log-probs
    `scaled[id] - invariant_logsumexp(scaled)`, bit for bit, in the same one pass."""
    ids, logprobs, _, _ = _launch(
        scaled, INVARIANT_CONFIG, (temperature, seed, counter, suppress_ids, suppress_left), divide=False
    )
    return ids, logprobs


def invariant_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """Each row's log-sum-exp of x (B, V) fp32 -> (B,) fp32 by the sampler's kernel in the mode's
    fixed launch (INVARIANT_CONFIG): a row's bits depend on the row alone, and equal the log-sum-exp
    `invariant_gumbel_sample` subtracts. Its gradient is softmax(x) times the incoming one."""
    return _InvariantLogSumExp.apply(x)


def invariant_logsumexp_and_entropy(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`invariant_logsumexp`'s values (the same bits) and each row's softmax entropy, in one pass
    over x (B, V) fp32 (forward only: the trainer's log-prob has its own backward). The entropy
    needs no invariance; it rides along to spare the full-vocabulary passes of its plain formula."""
    return _invariant_launch(x, with_entropy=True)


class _InvariantLogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        lse = _invariant_launch(x)
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    def backward(ctx, grad):
        x, lse = ctx.saved_tensors
        return grad[:, None] * torch.exp(x - lse[:, None])


def _invariant_launch(x: torch.Tensor, with_entropy: bool = False):
    """The log-sum-exp (and the entropy, with_entropy) of each row of x in the mode's launch."""
    if x.ndim != 2 or x.dtype != torch.float32 or x.stride(1) != 1:
        raise ValueError(f"logsumexp: x must be (B, V) fp32 contiguous in V, got {tuple(x.shape)} {x.dtype}")
    _, _, lse, entropy = _launch(x, INVARIANT_CONFIG, None, divide=False, entropy=with_entropy)
    return (lse, entropy) if with_entropy else lse


def _launch(logits, config: SampleConfig, sampling, divide: bool = True, entropy: bool = False):
    """The partial kernel over (row, slice), then the merge per row. `sampling`: (temperature, seed,
    counter, suppress_ids, suppress_left) to draw ids and their log-probs, or None for the
    log-sum-exp alone. Returns ids, log-probs (None without sampling), log-sum-exps and entropies
    (None unless `entropy`)."""
    partial_kernel, merge_kernel = _triton_kernels()
    batch, vocab_size = logits.shape
    device = logits.device
    lse = torch.empty(batch, dtype=torch.float32, device=device)
    ent = torch.empty(batch, dtype=torch.float32, device=device) if entropy else lse
    ids, logprobs = (
        (torch.empty(batch, dtype=torch.int64, device=device), torch.empty(batch, dtype=torch.float32, device=device))
        if sampling
        else (lse, lse)
    )
    if batch:
        splits = config.num_splits
        assert 1 <= splits <= _MAX_SPLITS and config.block & (config.block - 1) == 0
        # m, s, best, the scaled logit at best, and the entropy's sum
        stats = torch.empty((5 if entropy else 4, batch, splits), dtype=torch.float32, device=device)
        best_ids = torch.empty((batch, splits), dtype=torch.int32, device=device)
        temperature, seed, counter, suppress_ids, suppress_left = sampling or (lse, lse, lse, None, None)
        num_suppress = 0 if suppress_ids is None else suppress_ids.shape[1]
        cols_per_split = -(-vocab_size // (splits * config.block)) * config.block
        partial_kernel[(batch, splits)](
            logits,
            temperature,
            seed,
            counter,
            suppress_ids if num_suppress else best_ids,
            suppress_left if num_suppress else best_ids,
            stats,
            best_ids,
            logits.stride(0),
            suppress_ids.stride(0) if num_suppress else 0,
            vocab_size,
            cols_per_split,
            splits,
            batch * splits,
            NUM_SUPPRESS=num_suppress,
            BLOCK=config.block,
            DIVIDE=divide,
            SAMPLE=sampling is not None,
            ENTROPY=entropy,
            num_warps=config.num_warps,
        )
        merge_kernel[(batch,)](
            stats,
            best_ids,
            ids,
            logprobs,
            lse,
            ent,
            splits,
            batch * splits,
            MAX_SPLITS=_MAX_SPLITS,
            SAMPLE=sampling is not None,
            ENTROPY=entropy,
            num_warps=1,
        )
    if sampling is None:
        ids = logprobs = None
    return ids, logprobs, lse, (ent if entropy else None)


@functools.cache
def _triton_kernels():
    """Define the Triton kernels on first CUDA use, so CPU installs never import triton.

    Sizes that vary from call to call (the split count, rows x splits) are runtime values that
    Triton does not specialise on, so a changing batch size never compiles a kernel again."""
    global triton, tl, mix32  # the kernels resolve these as module globals, as Triton expects
    import triton
    import triton.language as tl

    @triton.jit
    def mix32(x):  # uint32 lanes: products wrap modulo 2^32, shifts are logical
        x = x ^ (x >> 16)
        x = (x * 0x7FEB352D).to(tl.uint32)
        x = x ^ (x >> 15)
        x = (x * 0x846CA68B).to(tl.uint32)
        return x ^ (x >> 16)

    @triton.jit(do_not_specialize=["num_splits", "num_rows"])
    def partial(
        logits_ptr,
        temp_ptr,
        seed_ptr,
        counter_ptr,
        sup_ptr,
        sup_left_ptr,
        stats_ptr,
        best_ids_ptr,
        stride_lb,
        stride_sb,
        vocab_size,
        cols_per_split,
        num_splits,
        num_rows,
        NUM_SUPPRESS: tl.constexpr,
        BLOCK: tl.constexpr,
        DIVIDE: tl.constexpr = True,
        SAMPLE: tl.constexpr = True,
        ENTROPY: tl.constexpr = False,
    ):
        # Per lane: the running sum of exp(scaled - m) (m, the slice's running max, is one scalar)
        # and the best candidate with its column and scaled logit. One reduction per block (the
        # max); the lanes merge once at the end. DIVIDE: the logits are divided by the row's
        # temperature here (else they come scaled); SAMPLE: the Gumbel argmax (else only the
        # log-sum-exp); ENTROPY: beside the sum, the lanes sum exp(scaled - m) * (scaled - m).
        row = tl.program_id(0)
        split = tl.program_id(1)
        if SAMPLE:
            temp = tl.load(temp_ptr + row)
            greedy = temp == 0.0
            divisor = tl.where(greedy, 1.0, temp)
            seed = tl.load(seed_ptr + row)
            counter = tl.load(counter_ptr + row)
            seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
            seed_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
            key = mix32(seed_lo ^ mix32(seed_hi ^ mix32((counter & 0xFFFFFFFF).to(tl.uint32))))
        suppress_on = False
        if NUM_SUPPRESS > 0:
            suppress_on = tl.load(sup_left_ptr + row) > 0
        start = split * cols_per_split
        end = tl.minimum(start + cols_per_split, vocab_size)
        offs = tl.arange(0, BLOCK)
        m = -1e30
        s = tl.zeros([BLOCK], dtype=tl.float32)
        t = tl.zeros([BLOCK], dtype=tl.float32)
        best = tl.full([BLOCK], -float("inf"), dtype=tl.float32)
        best_scaled = tl.zeros([BLOCK], dtype=tl.float32)
        best_col = tl.zeros([BLOCK], dtype=tl.int32)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_lb
        for block_start in range(start, end, BLOCK):
            cols = block_start + offs
            ok = cols < end
            scaled = tl.load(row_ptr + cols, mask=ok, other=-float("inf"))
            if DIVIDE:
                scaled = scaled / divisor
            m_new = tl.maximum(m, tl.max(scaled, axis=0))
            rescale = tl.exp(m - m_new)
            e = tl.exp(scaled - m_new)
            if ENTROPY:  # sum e (z - m) against the new max: rescale (t + (m - m_new) s), then add
                t = (t + (m - m_new) * s) * rescale + tl.where(e > 0, e * (scaled - m_new), 0.0)
            s = s * rescale + e
            m = m_new
            if SAMPLE:
                bits = mix32(key ^ mix32((cols.to(tl.uint32) ^ 0x9E3779B9).to(tl.uint32))) >> 9
                u = (bits.to(tl.float32) + 0.5) * (1.0 / 8388608.0)
                noise = tl.where(greedy, 0.0, -tl.log(-tl.log(u)))
                candidate = tl.where(ok, scaled + noise, -float("inf"))
                if NUM_SUPPRESS > 0:
                    for i in tl.static_range(NUM_SUPPRESS):
                        blocked_id = tl.load(sup_ptr + row.to(tl.int64) * stride_sb + i)
                        candidate = tl.where(suppress_on & (cols == blocked_id), -float("inf"), candidate)
                take = candidate > best  # strict: a lane keeps its earliest column on ties
                best = tl.where(take, candidate, best)
                best_scaled = tl.where(take, scaled, best_scaled)
                best_col = tl.where(take, cols, best_col)
        slot = row * num_splits + split
        tl.store(stats_ptr + slot, m)
        tl.store(stats_ptr + num_rows + slot, tl.sum(s, axis=0))
        if ENTROPY:
            tl.store(stats_ptr + 4 * num_rows + slot, tl.sum(t, axis=0))
        if SAMPLE:
            top = tl.max(best, axis=0)
            # The first column reaching the maximum, as a row-wide argmax picks.
            col = tl.min(tl.where(best == top, best_col, 2147483647), axis=0)
            at_col = (best == top) & (best_col == col)
            tl.store(stats_ptr + 2 * num_rows + slot, top)
            tl.store(stats_ptr + 3 * num_rows + slot, tl.sum(tl.where(at_col, best_scaled, 0.0), axis=0))
            tl.store(best_ids_ptr + slot, tl.where(top > -float("inf"), col, start))

    @triton.jit(do_not_specialize=["num_splits", "num_rows"])
    def merge(
        stats_ptr,
        best_ids_ptr,
        ids_ptr,
        logprobs_ptr,
        lse_ptr,
        entropy_ptr,
        num_splits,
        num_rows,
        MAX_SPLITS: tl.constexpr,
        SAMPLE: tl.constexpr = True,
        ENTROPY: tl.constexpr = False,
    ):
        row = tl.program_id(0)
        k = tl.arange(0, MAX_SPLITS)
        live = k < num_splits
        slot = row * num_splits + k
        m = tl.load(stats_ptr + slot, mask=live, other=-1e30)
        s = tl.load(stats_ptr + num_rows + slot, mask=live, other=0.0)
        top = tl.max(m, axis=0)
        weight = tl.exp(m - top)
        total = tl.sum(s * weight, axis=0)
        lse = top + tl.log(total)
        tl.store(lse_ptr + row, lse)
        if ENTROPY:  # -sum p log p = log(total) - sum(e (z - top)) / total, e against the row's max
            t = tl.load(stats_ptr + 4 * num_rows + slot, mask=live, other=0.0)
            tl.store(entropy_ptr + row, tl.log(total) - tl.sum(weight * (t + (m - top) * s), axis=0) / total)
        if SAMPLE:
            best = tl.load(stats_ptr + 2 * num_rows + slot, mask=live, other=-float("inf"))
            at_best = tl.load(stats_ptr + 3 * num_rows + slot, mask=live, other=0.0)
            winner = tl.argmax(best, axis=0)  # the first split on ties, as a row-wide argmax
            chosen = k == winner
            best_id = tl.sum(tl.where(chosen, tl.load(best_ids_ptr + slot, mask=live, other=0), 0), axis=0)
            tl.store(ids_ptr + row, best_id.to(tl.int64))
            tl.store(logprobs_ptr + row, tl.sum(tl.where(chosen, at_best, 0.0), axis=0) - lse)

    return partial, merge
