"""Policy, value and KL losses per token, importance-sampling corrections, and the aggregation
that turns per-token losses into a global-batch loss exactly across micro-batches and ranks.

Layout as in `colocate.algo.advantages`: flat per-token tensors (T,), `seq_index` (T,) long
numbering the sequences of a micro-batch, `mask` (T,) float or bool for the tokens that count.
Each loss returns (loss per token (T,), {metric name: per-token tensor (T,)}); both are 0 where
mask is 0, metrics carry no gradient. Unmasked tokens are excluded with `torch.where`, so garbage
there (e.g. prompt log-probs) cannot turn into NaN. `aggregate` / `aggregate_metrics` reduce them.
"""

from __future__ import annotations

import torch

KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
POLICY_LOSS_KINDS = ("ppo", "gspo", "cispo")
AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _check_flat(**tensors: torch.Tensor | None) -> None:
    """Every given tensor must be 1-D with the same number of tokens."""
    length = None
    for name, t in tensors.items():
        if t is None:
            continue
        if t.dim() != 1:
            raise ValueError(f"{name} must be 1-D (T,), got shape {tuple(t.shape)}")
        if length is not None and t.shape[0] != length:
            raise ValueError(f"{name} has {t.shape[0]} tokens, expected {length}")
        length = t.shape[0]


def _per_seq_sum(x: torch.Tensor, seq_index: torch.Tensor) -> torch.Tensor:
    """Sum of x per sequence. The buffer has T rows (S <= T), so no device-to-host sync."""
    return x.new_zeros(x.shape[0]).index_add(0, seq_index, x)  # (T,), rows >= S are 0


def _seq_mean(x: torch.Tensor, seq_index: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Per-token value of the mean of x over the masked tokens of the token's sequence, (T,)."""
    sums = _per_seq_sum(torch.where(m > 0, x * m, 0.0), seq_index)
    counts = _per_seq_sum(m, seq_index).clamp(min=1.0)
    return (sums / counts)[seq_index]


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, with d = ref - lp:
    k1 = -d = lp - ref            unbiased, high variance, can be negative
    k2 = d^2 / 2                  biased, low variance
    k3 = exp(d) - d - 1           unbiased, >= 0, low variance (Schulman's estimator)
    low_var_kl = clamp(k3, -10, 10) with d clamped to [-20, 20] first, so a token far from
                 the reference cannot blow up the loss (nor exp(d) overflow to inf).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {KL_KINDS}")
    d = ref_logprobs - logprobs
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d.square()
    if kind == "low_var_kl":
        d = d.clamp(min=-20.0, max=20.0)
        return (torch.exp(d) - d - 1.0).clamp(min=-10.0, max=10.0)
    return torch.exp(d) - d - 1.0


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    *,
    kind: str = "ppo",
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
    tis_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped policy-gradient loss per token, with [lo, hi] = [1 - eps_clip, 1 + eps_clip_high]
    (eps_clip_high defaults to eps_clip; a larger one is DAPO's clip-higher). eps_clip >= 1 leaves
    no lower bound (lo = 0 < every ratio), e.g. the wide CISPO setting eps_clip 1, eps_clip_high 4.

    ppo:   r_t = exp(lp_t - old_t);  l_t = max(-A_t r_t, -A_t clip(r_t, lo, hi)).
           dual_clip_c = c > 1: for A_t < 0, l_t = min(l_t, -c A_t), so a huge ratio on a
           negative-advantage token cannot dominate the batch.
    gspo:  s_i = exp(mean over sequence i's masked tokens of (lp - old)), and the token form
           s_it = sg(s_i) * exp(lp_t - sg(lp_t)) (value s_i, gradient s_i * grad lp_t) replaces
           r_t in the ppo formula; one ratio and one clip decision per sequence.
    cispo: l_t = -sg(clip(r_t, lo, hi)) * A_t * lp_t: the IS weight is clipped but every token
           keeps its REINFORCE gradient (ppo drops clipped tokens entirely).
    tis_weights (no gradient) multiply l_t when given.

    Metrics: pg_clipfrac = 1 on tokens whose gradient the clipping changed (ppo/gspo: zeroed by
    the ratio clip or the dual clip; cispo: weight clipped); ppo_kl = old_t - lp_t.
    """
    if kind not in POLICY_LOSS_KINDS:
        raise ValueError(f"kind={kind!r} must be one of {POLICY_LOSS_KINDS}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    if eps_clip < 0:
        raise ValueError(f"eps_clip={eps_clip} must be >= 0 (1 or more: no lower bound)")
    if eps_high < 0:
        raise ValueError(f"eps_clip_high={eps_clip_high} must be >= 0")
    if dual_clip_c is not None:
        if kind != "ppo":
            raise ValueError(f"dual_clip_c applies to kind='ppo' only, got kind={kind!r}")
        if dual_clip_c <= 1:
            raise ValueError(f"dual_clip_c={dual_clip_c} must be > 1")
    _check_flat(
        logprobs=logprobs,
        old_logprobs=old_logprobs,
        advantages=advantages,
        mask=mask,
        seq_index=seq_index,
        tis_weights=tis_weights,
    )
    lo, hi = max(1.0 - eps_clip, 0.0), 1.0 + eps_high
    m = mask.to(logprobs.dtype)
    keep = m > 0
    log_ratio = torch.where(keep, logprobs - old_logprobs, 0.0)  # (T,)

    if kind == "cispo":
        ratio = torch.exp(log_ratio).detach()
        loss = -ratio.clamp(min=lo, max=hi) * advantages * logprobs
        clipped = (ratio < lo) | (ratio > hi)
    else:
        if kind == "ppo":
            ratio = torch.exp(log_ratio)
        else:
            seq_ratio = torch.exp(_seq_mean(log_ratio.detach(), seq_index, m))  # (T,)
            ratio = seq_ratio * torch.exp(logprobs - logprobs.detach())
        unclipped = -advantages * ratio
        clipped_obj = -advantages * ratio.clamp(min=lo, max=hi)
        loss = torch.maximum(unclipped, clipped_obj)
        clipped = clipped_obj > unclipped
        if dual_clip_c is not None:
            cap = -dual_clip_c * advantages
            capped = (advantages < 0) & (loss > cap)
            loss = torch.where(capped, cap, loss)
            clipped = clipped | capped

    if tis_weights is not None:
        loss = loss * tis_weights.detach()
    metrics = {
        "pg_clipfrac": clipped.to(m.dtype) * m,
        "ppo_kl": torch.where(keep, -log_ratio.detach(), 0.0),
    }
    return torch.where(keep, loss, 0.0), metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped critic loss per token:
        l_t = 0.5 * max((V_t - R_t)^2, (clip(V_t, old_t - clip, old_t + clip) - R_t)^2)
    The pessimistic max keeps one update from moving the value far from the rollout-time value.
    Metric value_clipfrac = 1 where the clipped term is the larger (its gradient is then 0).
    """
    if clip <= 0:
        raise ValueError(f"clip={clip} must be > 0")
    _check_flat(values=values, old_values=old_values, returns=returns, mask=mask)
    m = mask.to(values.dtype)
    v_clipped = old_values + (values - old_values).clamp(min=-clip, max=clip)
    unclipped = (values - returns).square()
    clipped = (v_clipped - returns).square()
    loss = 0.5 * torch.maximum(unclipped, clipped)
    metrics = {"value_clipfrac": (clipped > unclipped).to(m.dtype) * m}
    return torch.where(m > 0, loss, 0.0), metrics


@torch.no_grad()
def truncated_is_weights(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor, clip: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance sampling between the rollout engine and the trainer:
        w_t = min(exp(old_t - rollout_t), clip)   (no gradient; 0 where mask is 0)
    The engine samples from its own numerics (kernels, precision), not exactly from the
    trainer's pi_old; w corrects for that mismatch, and the truncation bounds its variance.
    Metric tis_clipfrac = 1 where the weight was truncated.
    """
    if clip <= 0:
        raise ValueError(f"clip={clip} must be > 0")
    _check_flat(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, mask=mask)
    m = mask.to(old_logprobs.dtype)
    ratio = torch.exp(torch.where(m > 0, old_logprobs - rollout_logprobs, 0.0))  # (T,)
    weights = ratio.clamp(max=clip) * m
    return weights, {"tis_clipfrac": (ratio > clip).to(m.dtype) * m}


@torch.no_grad()
def mis_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Masked importance sampling: drop whole sequences whose trainer/engine mismatch is large.

    The sequence ratio is the geometric mean rho_i = exp(mean over masked tokens of
    (old - rollout)); unlike the product exp(sum(...)), it does not depend on the length, so one
    [low, high] suits short and long responses. Returns the mask (T,) = mask_t * [low <= rho_i <=
    high] (multiply it into the loss mask) and metric mis_dropfrac = 1 on masked tokens of
    dropped sequences.
    """
    if not 0 <= low <= 1 <= high:
        raise ValueError(f"low={low}, high={high} must satisfy 0 <= low <= 1 <= high")
    _check_flat(old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs, seq_index=seq_index, mask=mask)
    m = mask.to(old_logprobs.dtype)
    rho = torch.exp(_seq_mean(old_logprobs - rollout_logprobs, seq_index, m))  # (T,)
    kept = ((rho >= low) & (rho <= high)).to(m.dtype)
    return kept * m, {"mis_dropfrac": (1.0 - kept) * m}


def aggregate(
    loss_tok: torch.Tensor,
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: int | float | torch.Tensor,
    global_num_seqs: int | float | torch.Tensor,
    norm_len: int | float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the global-batch loss (scalar).

    With l the per-token loss, m the mask, n_i the masked tokens of sequence i, and N / S the
    masked tokens / sequences of the WHOLE global batch (all micro-batches, all ranks):
        token_mean:          sum_t l_t m_t / N
        seq_mean_token_mean: sum_i (sum_{t in i} l_t m_t / n_i) / S
        seq_mean_token_sum:  sum_t l_t m_t / (S * norm_len)    (Dr. GRPO; norm_len defaults to 1)
    Each is a sum of per-token or per-sequence terms over fixed global denominators, so summing
    the shares of every micro-batch and rank gives the global loss and its gradient exactly,
    whatever the split. Sequences must not be split across micro-batches. The shares' gradients
    must be SUMMED across ranks (FSDP averages by default: scale by the world size). S counts the
    sequences the mean is over; one with no masked token adds 0 to the numerator.
    """
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode={mode!r} must be one of {AGGREGATION_MODES}")
    if norm_len is not None and mode != "seq_mean_token_sum":
        raise ValueError(f"norm_len={norm_len} applies to mode='seq_mean_token_sum' only")
    if norm_len is not None and norm_len <= 0:
        raise ValueError(f"norm_len={norm_len} must be > 0")
    _check_flat(loss_tok=loss_tok, mask=mask, seq_index=seq_index)
    m = mask.to(loss_tok.dtype)
    masked = torch.where(m > 0, loss_tok * m, 0.0)  # (T,)
    if mode == "token_mean":
        return masked.sum() / global_num_tokens
    if mode == "seq_mean_token_sum":
        return masked.sum() / (global_num_seqs * (1.0 if norm_len is None else norm_len))
    seq_sum = _per_seq_sum(masked, seq_index)
    seq_len = _per_seq_sum(m, seq_index).clamp(min=1.0)
    return (seq_sum / seq_len).sum() / global_num_seqs


@torch.no_grad()
def aggregate_metrics(
    metrics: dict[str, torch.Tensor],
    mask: torch.Tensor,
    seq_index: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: int | float | torch.Tensor,
    global_num_seqs: int | float | torch.Tensor,
    norm_len: int | float | None = None,
) -> dict[str, torch.Tensor]:
    """{name: per-token tensor} -> {"train/<name>": this micro-batch's share (0-dim tensor)}.

    Uses `aggregate`, so summing the shares over micro-batches and ranks gives the global value;
    they stay on device (sum them, all-reduce once, then `.item()`). Fractions such as
    pg_clipfrac read as fractions under token_mean (of tokens) or seq_mean_token_mean (mean per
    sequence); seq_mean_token_sum gives per-sequence sums instead.
    """
    return {
        f"train/{name}": aggregate(
            value.detach(),
            mask,
            seq_index,
            mode,
            global_num_tokens=global_num_tokens,
            global_num_seqs=global_num_seqs,
            norm_len=norm_len,
        )
        for name, value in metrics.items()
    }
