"""The frozen reference policy for KL terms: FSDP2-sharded like the actor, no optimizer, stored
in the compute dtype, and kept in host memory except while its log-probs are computed.

With LoRA the reference is the actor's own model with its adapters off (`scope`): no second copy
of the model, and no memory group of its own, so nothing moves for its pass."""

from __future__ import annotations

from typing import Callable, ContextManager

import torch
from torch import nn

from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch
from colocate.trainer.memory import TrainerMemory
from colocate.trainer.offload import OffloadStats
from colocate.trainer.passes import no_grad_pass


class Reference:
    def __init__(
        self,
        model: nn.Module,
        memory: TrainerMemory,
        tag: str,
        *,
        temperature: float,
        scope: Callable[[], ContextManager] | None = None,
    ):
        self.model, self.memory, self.tag = model, memory, tag
        self.temperature = temperature
        self.scope = scope
        self.last_onload = self.last_offload = OffloadStats()

    def logprobs(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        """(T,) reference log-probs of every response token; the weights visit the GPU only here."""
        if self.scope is not None:
            with self.scope():
                return self._pass(batch, parts)
        self.last_onload = self.memory.onload(self.tag)
        out = self._pass(batch, parts)
        self.last_offload = self.memory.offload(self.tag)
        return out

    def _pass(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        return no_grad_pass(self.model, batch, parts, lambda mb: response_logprobs(self.model, mb, self.temperature)[0])

    @property
    def offloaded(self) -> bool:
        return self.memory.is_offloaded(self.tag)
