"""RL algorithm catalog: advantage estimators and losses as pure functions on flat per-token
tensors (see `advantages` for the layout)."""

from colocate.algo.advantages import (
    broadcast_to_tokens,
    dapo_overlong_penalty,
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    token_rewards,
    whiten,
)
from colocate.algo.losses import (
    AGGREGATION_MODES,
    KL_KINDS,
    POLICY_LOSS_KINDS,
    aggregate,
    aggregate_metrics,
    kl_estimate,
    mis_mask,
    policy_loss,
    truncated_is_weights,
    value_loss,
)

__all__ = [
    "AGGREGATION_MODES",
    "KL_KINDS",
    "POLICY_LOSS_KINDS",
    "aggregate",
    "aggregate_metrics",
    "broadcast_to_tokens",
    "dapo_overlong_penalty",
    "discounted_returns",
    "dr_grpo",
    "gae",
    "grpo",
    "kl_estimate",
    "mis_mask",
    "policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "token_rewards",
    "truncated_is_weights",
    "value_loss",
    "whiten",
]
