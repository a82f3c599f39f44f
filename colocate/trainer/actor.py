"""The policy being trained: log-probs of response tokens and the policy-gradient update.

Log-probs follow the engine's definition (colocate.rollout.protocol): log_softmax of
(hidden @ lm_head.T) / temperature at the position before each response token, computed by
kernels.token_logprobs on the packed hidden states without ever holding the full logits (the
model's table of operations, `model.ops`, holds the true on-policy mode's version in the mode).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from colocate.algo import aggregate, kl_estimate, mis_mask, policy_loss, truncated_is_weights
from colocate.config import AlgorithmConfig
from colocate.trainer.batch import MicroBatch, RolloutBatch
from colocate.trainer.memory import StateArrival
from colocate.trainer.optim import OptimizerStep
from colocate.trainer.passes import StepPlan, gradient_step, no_grad_pass


def response_logprobs(
    model: nn.Module, mb: MicroBatch, temperature: float, with_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(T_mb,) fp32 log-probs of the micro-batch's response tokens (and their entropies)."""
    hidden = model.hidden_states(mb.input_ids, **mb.model_inputs())  # (N, H)
    predictors = hidden.index_select(0, mb.logit_index)  # (T_mb, H)
    weight = model.lm_head.weight  # (V, H), gathered by the root's forward (see parallelize)
    return model.ops.token_logprobs(predictors, weight, mb.targets, temperature, with_entropy=with_entropy)


class Actor:
    """FSDP2 policy + its optimizer; `logprobs` for the no-grad pass, `train` for the update."""

    def __init__(
        self,
        model: nn.Module,
        opt: OptimizerStep,
        arrival: StateArrival,
        algo: AlgorithmConfig,
        *,
        temperature: float,
        norm_len: int | None,
        keep_gathered: bool = False,
        use_tis: bool = False,
    ):
        """use_tis: algorithm.use_tis with its default resolved (`Config.tis_on`)."""
        self.model, self.opt, self.arrival, self.algo = model, opt, arrival, algo
        self.use_tis = use_tis
        self.gathered = model if keep_gathered else None
        self.temperature = temperature
        self.norm_len = norm_len if algo.loss_agg_mode == "seq_mean_token_sum" else None

    def logprobs(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        """(T,) log-probs of every response token under the current weights, without gradient."""
        return no_grad_pass(self.model, batch, parts, lambda mb: response_logprobs(self.model, mb, self.temperature)[0])

    def train(self, batch: RolloutBatch, plans: list[StepPlan]) -> tuple[list[dict[str, float]], int]:
        """One optimizer step per plan; returns each step's metrics and this rank's token count.

        With a single step, the old log-probs are the current ones (detached): no update has
        happened yet, so the ratio is exactly 1 (ppo_kl 0) whatever the numerics of a separate pass.
        """
        use_old_pass = len(plans) > 1
        if use_old_pass and "old_logprobs" not in batch.per_token:
            raise ValueError("several optimizer steps need the old log-probs pass first")
        loss_fn = functools.partial(self._loss, batch, use_old_pass)
        results, num_tokens = [], 0
        for plan in plans:
            metrics, tokens = gradient_step(self.opt, self.arrival, batch, plan, loss_fn, self.gathered)
            metrics["train/mismatch/ppl_ratio"] = math.exp(metrics.pop("train/mismatch/log_ppl_ratio"))
            results.append(metrics)
            num_tokens += tokens
        return results, num_tokens

    def _loss(
        self, batch: RolloutBatch, use_old_pass: bool, mb: MicroBatch, plan: StepPlan
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a = self.algo
        idx = mb.token_index
        logprobs, entropy = response_logprobs(self.model, mb, self.temperature, with_entropy=True)
        old = batch["old_logprobs"][idx] if use_old_pass else logprobs.detach()
        rollout = batch.rollout_logprobs[idx]
        mask = batch.mask[idx]  # (T_mb,)
        agg = functools.partial(
            aggregate,
            seq_index=mb.seq_index,
            global_num_tokens=max(plan.num_tokens, 1.0),
            global_num_seqs=max(plan.num_seqs, 1.0),
        )
        shares = {}
        loss_mask = mask
        if a.use_mis:
            # A dropped sequence adds zero to every term of the loss (policy, KL, entropy) but
            # still counts in the denominators.
            loss_mask, mis = mis_mask(old, rollout, mb.seq_index, mask, a.mis_low, a.mis_high)
            shares["train/mis_dropfrac"] = agg(mis["mis_dropfrac"], mask, mode="token_mean")
        tis = None
        if self.use_tis:
            tis, tis_metrics = truncated_is_weights(old, rollout, mask, a.tis_clip)
            shares["train/tis_clipfrac"] = agg(tis_metrics["tis_clipfrac"], mask, mode="token_mean")
        pg_tok, pg_metrics = policy_loss(
            logprobs,
            old,
            batch["advantages"][idx],
            loss_mask,
            mb.seq_index,
            kind=a.policy_loss,
            eps_clip=a.eps_clip,
            eps_clip_high=a.eps_clip_high,
            dual_clip_c=a.dual_clip_c,
            tis_weights=tis,
        )
        loss = agg(pg_tok, mask, mode=a.loss_agg_mode, norm_len=self.norm_len)
        shares["train/pg_loss"] = loss.detach()
        if a.use_kl_loss:
            kl = agg(
                kl_estimate(logprobs, batch["ref_logprobs"][idx], a.kl_estimator),
                loss_mask,
                mode=a.loss_agg_mode,
                norm_len=self.norm_len,
            )
            loss = loss + a.kl_loss_coef * kl
            shares["train/kl_loss"] = kl.detach()
        ent = agg(entropy if a.entropy_coef else entropy.detach(), loss_mask, mode=a.loss_agg_mode, norm_len=self.norm_len)
        if a.entropy_coef:
            loss = loss - a.entropy_coef * ent
        shares["train/entropy_loss"] = ent.detach()
        for name in ("pg_clipfrac", "ppo_kl"):
            shares[f"train/{name}"] = agg(pg_metrics[name], mask, mode="token_mean")
        shares.update(_mismatch(old, rollout, mask, agg))
        return loss, shares


def _mismatch(train: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, agg) -> dict[str, torch.Tensor]:
    """How far the trainer's log-probs of the sampled tokens (before any update) are from the
    engine's, as shares of the step's token means (and a maximum):
        train_rollout_logprob_abs_diff, mismatch/abs_diff_max   mean and max |train - rollout|
        mismatch/kl_k3              k3 estimate of KL(rollout || train) (the tokens are rollout samples)
        mismatch/log_ppl_ratio      log(ppl_train / ppl_rollout) = mean(rollout - train); the actor
                                    reports its exp, mismatch/ppl_ratio
        mismatch/nonzero_frac       share of tokens whose two log-probs differ at all
    """
    delta = train - rollout  # (T_mb,)
    on = mask > 0
    return {
        "train/train_rollout_logprob_abs_diff": agg(delta.abs(), mask, mode="token_mean"),
        "train/mismatch/abs_diff_max": torch.where(on, delta.abs(), 0.0).max() if on.numel() else delta.new_zeros(()),
        "train/mismatch/kl_k3": agg(kl_estimate(rollout, train, "k3"), mask, mode="token_mean"),
        "train/mismatch/log_ppl_ratio": agg(-delta, mask, mode="token_mean"),
        "train/mismatch/nonzero_frac": agg((delta != 0).to(mask.dtype), mask, mode="token_mean"),
    }
