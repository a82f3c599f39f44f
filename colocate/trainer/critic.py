"""The critic for PPO/GAE: the policy's transformer family with a scalar value head.

V_t is read at the same position as the policy's log-prob of response token t (the hidden state
of the prefix before it), so values, log-probs and rewards line up token for token. The value
head `value_head` (Linear(hidden, 1)) starts at zero — V = 0 everywhere until the critic learns —
unless the critic's checkpoint already has one. With `model.lora_rank` > 0 the critic's backbone
is a frozen base with adapters, as the actor's, and only the adapters and the value head train.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from colocate.algo import aggregate, value_loss
from colocate.config import AlgorithmConfig
from colocate.kernels.ops import Ops
from colocate.lora.identity import LoRASpec
from colocate.models.config import ArchConfig
from colocate.models.layers import STANDARD
from colocate.models.transformer import Backbone, CausalLM
from colocate.trainer.batch import MicroBatch, RolloutBatch
from colocate.trainer.lora import add_adapters
from colocate.trainer.memory import StateArrival
from colocate.trainer.optim import OptimizerStep
from colocate.trainer.parallelize import local_tensor
from colocate.trainer.passes import StepPlan, gradient_step, no_grad_pass


class ValueModel(nn.Module):
    """Backbone (HF `model.` names) + `value_head`; forward gives one fp32 value per position asked."""

    hidden_states = CausalLM.hidden_states
    """The policy's packed forward up to the final norm; it only reads `self.model`."""
    set_ops = CausalLM.set_ops
    ops: Ops = STANDARD
    """The backbone's table of operations (colocate/kernels/ops.py), as the policy's."""

    def __init__(self, cfg: ArchConfig, ops: Ops | None = None):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.value_head = nn.Linear(cfg.hidden_size, 1)
        if ops is not None:
            self.set_ops(ops)

    def forward(self, input_ids: torch.Tensor, value_index: torch.Tensor, **kwargs) -> torch.Tensor:
        """input_ids (N,) packed, value_index (T,) positions to read -> values (T,) fp32."""
        hidden = self.hidden_states(input_ids, **kwargs)  # (N, H)
        values = self.value_head(hidden.index_select(0, value_index))  # (T, 1)
        # sum over the size-1 dim, not squeeze: FSDP hooks the output and must not get a view.
        return values.float().sum(-1)  # (T,)


def add_critic_adapters(model: ValueModel, spec: LoRASpec) -> None:
    """LoRA on the critic's backbone (colocate/trainer/lora.py); the value head stays trained
    whole, in fp32 like the adapters."""
    add_adapters(model, spec)
    model.value_head.to(torch.float32).requires_grad_(True)


@torch.no_grad()
def zero_value_head_(model: ValueModel) -> None:
    for p in model.value_head.parameters():
        local_tensor(p).zero_()


class Critic:
    def __init__(
        self,
        model: ValueModel,
        opt: OptimizerStep,
        arrival: StateArrival,
        algo: AlgorithmConfig,
        *,
        norm_len: int | None,
        keep_gathered: bool = False,
    ):
        self.model, self.opt, self.arrival, self.algo = model, opt, arrival, algo
        self.gathered = model if keep_gathered else None
        self.norm_len = norm_len if algo.loss_agg_mode == "seq_mean_token_sum" else None

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        return self.model(mb.input_ids, mb.logit_index, **mb.model_inputs())

    def values(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        """(T,) values of every response token under the current critic, without gradient."""
        return no_grad_pass(self.model, batch, parts, self._values)

    def train(self, batch: RolloutBatch, plans: list[StepPlan]) -> list[dict[str, float]]:
        """One optimizer step per plan on the clipped value loss against batch["returns"]."""
        return [
            gradient_step(self.opt, self.arrival, batch, plan, functools.partial(self._loss, batch), self.gathered)[0]
            for plan in plans
        ]

    def _loss(self, batch: RolloutBatch, mb: MicroBatch, plan: StepPlan) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        idx = mb.token_index
        mask = batch.mask[idx]
        agg = functools.partial(
            aggregate,
            mask=mask,
            seq_index=mb.seq_index,
            global_num_tokens=max(plan.num_tokens, 1.0),
            global_num_seqs=max(plan.num_seqs, 1.0),
        )
        loss_tok, metrics = value_loss(self._values(mb), batch["values"][idx], batch["returns"][idx], mask, self.algo.value_clip)
        loss = agg(loss_tok, mode=self.algo.loss_agg_mode, norm_len=self.norm_len)
        shares = {"critic/value_loss": loss.detach(), "critic/value_clipfrac": agg(metrics["value_clipfrac"], mode="token_mean")}
        return loss, shares
