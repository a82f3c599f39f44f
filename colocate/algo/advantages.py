"""Advantage estimators as pure functions on tensors.

Layout shared with the trainer: per-token tensors are flat over the tokens of a batch, shape (T,);
`seq_index` (T,) long gives each token's sequence number 0..S-1 (each sequence is one contiguous
run); `mask` (T,) float or bool marks the response tokens that count (prompt and tool-output
tokens are 0). Per-sequence tensors are (S,). A group is the `group_size` consecutive sequences
sampled from one prompt.

Per-token results are 0 where mask is 0. Estimators that run over time (reinforce++, GAE) step
over the masked tokens of a sequence only: a tool output between two assistant turns is part of
the environment's transition, not an action, so it neither receives credit nor counts as a step.

Call these on the whole batch of a rollout step (before it is cut into micro-batches): group
statistics need whole groups, and whitening uses the mean/std of every token it is given.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """(S,) -> (S / group_size, group_size), checking that whole groups are present."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (S,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.shape[0] % group_size != 0:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the number of sequences {rewards.shape[0]}")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    return rewards.view(-1, group_size)  # (num_groups, group_size)


def grpo(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g(r)) / (std_g(r) + eps), per sequence (S,).

    std_g is the unbiased (Bessel-corrected, divide by G - 1) standard deviation of the group, as
    `torch.std` computes it by default and as slime and verl use; a group with equal rewards gets
    A = 0. With `normalize_std=False` this is `dr_grpo`.
    """
    grouped = _grouped(rewards, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)  # (num_groups, G)
    if normalize_std:
        if group_size < 2:
            raise ValueError(f"group_size={group_size} must be >= 2 to normalize by the group std")
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def dr_grpo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean_g(r), per sequence (S,); no std division, which would weigh
    easy and hard prompts differently."""
    grouped = _grouped(rewards, group_size)
    return (grouped - grouped.mean(dim=1, keepdim=True)).reshape(-1)


def rloo(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = r_i - (sum_g(r) - r_i) / (G - 1), per sequence (S,).

    The baseline leaves out the sample itself, so it is independent of that sample and the
    estimate stays unbiased; this equals G / (G - 1) * (r_i - mean_g(r)).
    """
    if group_size < 2:
        raise ValueError(f"group_size={group_size} must be >= 2 for rloo (leave-one-out baseline)")
    grouped = _grouped(rewards, group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def broadcast_to_tokens(seq_values: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A_t = v[seq_index[t]] * mask[t]: each token takes its sequence's value, (S,) -> (T,)."""
    return seq_values[seq_index] * mask.to(seq_values.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(x - mu) / sqrt(var + 1e-8) over the masked tokens, 0 where mask is 0.

    mu and var are the masked mean and the masked (biased, divide by N) variance. With
    `shift_mean=False` the mean is added back, so only the scale changes.
    """
    m = mask.to(x.dtype)
    count = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / count
    var = ((x - mean).square() * m).sum() / count
    out = (x - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        out = out + mean
    return out * m


def token_rewards(
    rewards: torch.Tensor,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> torch.Tensor:
    """Per-token rewards (T,): r_t = -kl_coef * kl_t * mask_t, plus the sequence reward R_i on
    the last masked token of sequence i (a sequence with no masked token gets no reward).

    This is the reward stream of PPO (fed to `gae`) and reinforce++ when the KL penalty is part
    of the reward rather than of the loss.
    """
    m = mask.to(rewards.dtype if rewards.is_floating_point() else torch.float32)
    num_tokens = seq_index.shape[0]
    positions = torch.arange(num_tokens, device=seq_index.device)  # (T,)
    masked_pos = torch.where(m > 0, positions, -1)  # (T,)
    last = torch.full((rewards.shape[0],), -1, dtype=positions.dtype, device=positions.device)
    last = last.scatter_reduce(0, seq_index, masked_pos, reduce="amax")  # (S,)
    is_last = (positions == last[seq_index]).to(m.dtype) * m  # (T,)
    out = is_last * rewards.to(m.dtype)[seq_index]  # (T,)
    if kl is not None:
        out = out - kl_coef * kl.to(m.dtype) * m
    return out


def _masked_layout(
    seq_index: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]]:
    """Where each masked token goes in an (S, L) grid that holds, per row, only the masked
    tokens of one sequence in order (L = most masked tokens in any sequence).

    Returns (positions (N,), rows (N,), cols (N,), (S, L)); unfilled cells are at row ends.
    """
    positions = (mask != 0).nonzero().squeeze(-1)  # (N,)
    rows = seq_index[positions]  # (N,)
    if positions.numel() == 0:
        return positions, rows, rows.clone(), (0, 0)
    num_rows = int(rows.max()) + 1
    counts = torch.bincount(rows, minlength=num_rows)  # (S,)
    starts = torch.cumsum(counts, 0) - counts  # (S,)
    # A stable sort keeps time order within each row even if sequences are not numbered in order.
    order = torch.argsort(rows, stable=True)  # (N,)
    cols = torch.empty_like(rows)
    cols[order] = torch.arange(rows.shape[0], device=rows.device) - starts[rows[order]]
    return positions, rows, cols, (num_rows, int(counts.max()))


def _to_grid(x: torch.Tensor, layout) -> torch.Tensor:
    positions, rows, cols, shape = layout
    grid = x.new_zeros(shape)  # (S, L)
    grid[rows, cols] = x[positions]
    return grid


def _from_grid(grid: torch.Tensor, layout, num_tokens: int) -> torch.Tensor:
    positions, rows, cols, _ = layout
    out = grid.new_zeros(num_tokens)  # (T,)
    out[positions] = grid[rows, cols]
    return out


def _reverse_discounted_cumsum(x: torch.Tensor, factor: float) -> torch.Tensor:
    """y_t = x_t + factor * y_{t+1} along the last dim of (S, L), y_L = 0.

    One step per column (L is a response length, not the flat token count); factor 1 is a plain
    reversed cumsum. Trailing zero cells keep the carry at 0, so row ends are true sequence ends.
    """
    if factor == 1.0 or x.shape[1] == 0:
        return x.flip(-1).cumsum(-1).flip(-1)
    carry = x.new_zeros(x.shape[0])  # (S,)
    columns = []
    for t in range(x.shape[1] - 1, -1, -1):
        carry = x[:, t] + factor * carry
        columns.append(carry)
    return torch.stack(columns[::-1], dim=1)  # (S, L)


def discounted_returns(token_rewards: torch.Tensor, seq_index: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go G_t = sum_{k >= t} gamma^(k - t) r_k over the masked tokens of t's sequence
    (steps counted in masked tokens), (T,), 0 where mask is 0."""
    layout = _masked_layout(seq_index, mask)
    grid = _reverse_discounted_cumsum(_to_grid(token_rewards, layout), gamma)  # (S, L)
    return _from_grid(grid, layout, token_rewards.shape[0])


def reinforce_plus_plus(
    rewards: torch.Tensor,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
    gamma: float = 1.0,
) -> torch.Tensor:
    """REINFORCE++: A = whiten(G) with G the discounted return-to-go of `token_rewards`
    (-kl_coef * kl per token, the sequence reward on its last masked token), (T,).

    Whitening uses the mean and std of every masked token passed in: call on the whole batch.
    """
    r_tok = token_rewards(rewards, seq_index, mask, kl, kl_coef)  # (T,)
    return whiten(discounted_returns(r_tok, seq_index, mask, gamma), mask)


def reinforce_plus_plus_baseline(
    rewards: torch.Tensor,
    group_size: int,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None,
    kl_coef: float,
) -> torch.Tensor:
    """REINFORCE++ with a group baseline: R_i <- R_i - mean_g(R), then `reinforce_plus_plus`
    with gamma = 1 (whitened), (T,). The group mean removes the prompt's difficulty; whitening
    over the batch replaces GRPO's per-group std."""
    return reinforce_plus_plus(dr_grpo(rewards, group_size), seq_index, mask, kl, kl_coef)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    seq_index: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation per token: (advantages (T,), returns (T,)).

    Over the masked tokens t of one sequence, with t+1 the next masked token:
        delta_t = r_t + gamma * V_{t+1} - V_t,   V after the last masked token = 0
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                       (the critic's target)
    Rewards and values on unmasked tokens are not read. Both outputs are 0 where mask is 0.
    """
    layout = _masked_layout(seq_index, mask)
    r = _to_grid(token_rewards, layout)  # (S, L)
    v = _to_grid(values.to(r.dtype), layout)  # (S, L)
    next_v = torch.cat([v[:, 1:], v.new_zeros(v.shape[0], 1)], dim=1)  # (S, L)
    # Cells past a row's end hold r = V = 0, so delta is 0 there and the last real cell sees V = 0.
    delta = r + gamma * next_v - v  # (S, L)
    adv = _reverse_discounted_cumsum(delta, gamma * lam)  # (S, L)
    num_tokens = token_rewards.shape[0]
    return _from_grid(adv, layout, num_tokens), _from_grid(adv + v, layout, num_tokens)


def dapo_overlong_penalty(
    response_lengths: torch.Tensor, max_response_len: int, buffer_len: int, penalty_factor: float
) -> torch.Tensor:
    """DAPO soft overlong punishment, a reward addition per sequence (S,):
        0                                               if L <= max - buffer
        -penalty_factor * (L - (max - buffer)) / buffer  if max - buffer < L <= max
        -penalty_factor                                 if L > max
    so responses close to the length limit lose reward gradually instead of abruptly.
    """
    if not 0 < buffer_len <= max_response_len:
        raise ValueError(f"buffer_len={buffer_len} must be in (0, max_response_len={max_response_len}]")
    excess = response_lengths.float() - (max_response_len - buffer_len)  # (S,)
    return -penalty_factor * (excess / buffer_len).clamp(min=0.0, max=1.0)
