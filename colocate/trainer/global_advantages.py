"""Advantages (and critic targets) of a rank's rollout batch, from the colocate.algo estimators.

Group estimators (grpo, dr_grpo, rloo) only need whole groups, which every rank has. Estimators
that whiten over the batch (reinforce++, its group-baseline variant, and GAE's advantages) whiten
with the mean and variance of ALL ranks' tokens, so the result does not depend on how the batch
was split over ranks; the returns that train the critic are not whitened.
"""

from __future__ import annotations

import torch

from colocate import dist
from colocate.algo import (
    broadcast_to_tokens,
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    kl_estimate,
    rloo,
    token_rewards,
)
from colocate.algo.advantages import WHITEN_EPS
from colocate.config import AlgorithmConfig
from colocate.trainer.batch import RolloutBatch


def global_whiten(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(x - mu) / sqrt(var + eps) over the masked tokens of every rank; 0 where mask is 0.

    The same definition as `colocate.algo.whiten` (biased variance), with sums all-reduced.
    """
    m = mask.to(x.dtype)
    sums = dist.all_reduce_sum(torch.stack([(x * m).sum(), m.sum()]).double(), x.device)
    count = sums[1].clamp(min=1.0)
    mean = (sums[0] / count).to(x.dtype)
    # Two passes (mean, then centred squares) keep the variance accurate when |mean| >> std.
    sq = dist.all_reduce_sum(((x - mean).square() * m).sum().double().reshape(1), x.device)[0]
    var = (sq / count).to(x.dtype)
    return (x - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def global_masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(x.dtype)
    sums = dist.all_reduce_sum(torch.stack([(x * m).sum(), m.sum()]).double(), x.device)
    return float(sums[0] / sums[1].clamp(min=1.0))


def compute_advantages(batch: RolloutBatch, algo: AlgorithmConfig, group_size: int) -> None:
    """Set batch["advantages"] (and batch["returns"] for gae) from rewards, old/ref log-probs and
    values already in the batch.

    With kl_in_reward, each token is penalised by kl_reward_coef * KL(old || ref) (the configured
    kl_estimator, per token): token-level
    estimators add it to the token rewards; the group estimators (whose reward is per sequence)
    subtract the sequence's summed penalty from its reward before the group statistics.
    """
    est = algo.advantage_estimator
    mask, seq_index, rewards = batch.mask, batch.seq_index, batch.rewards
    kl = None
    if algo.kl_in_reward:
        kl = kl_estimate(batch["old_logprobs"], batch["ref_logprobs"], algo.kl_estimator) * mask  # (T,)
    coef = algo.kl_reward_coef if kl is not None else 0.0

    if est in ("grpo", "dr_grpo", "rloo"):
        if kl is not None:
            rewards = rewards - coef * torch.zeros_like(rewards).index_add(0, seq_index, kl)  # (S,)
        if est == "grpo":
            seq_adv = grpo(rewards, group_size, normalize_std=algo.normalize_advantage_std)
        elif est == "dr_grpo":
            seq_adv = dr_grpo(rewards, group_size)
        else:
            seq_adv = rloo(rewards, group_size)
        batch["advantages"] = broadcast_to_tokens(seq_adv, seq_index, mask)
    elif est in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        gamma = algo.gamma
        if est == "reinforce_plus_plus_baseline":
            rewards, gamma = dr_grpo(rewards, group_size), 1.0
        r_tok = token_rewards(rewards, seq_index, mask, kl, coef)  # (T,)
        batch["advantages"] = global_whiten(discounted_returns(r_tok, seq_index, mask, gamma), mask)
    else:
        r_tok = token_rewards(rewards, seq_index, mask, kl, coef)
        adv, returns = gae(r_tok, batch["values"], seq_index, mask, algo.gamma, algo.lam)
        batch["advantages"] = global_whiten(adv, mask)
        batch["returns"] = returns
