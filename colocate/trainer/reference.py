"""The frozen reference policy for KL terms: FSDP2-sharded like the actor, no optimizer, stored
in the compute dtype, and kept in host memory except while its log-probs are computed."""

from __future__ import annotations

import torch
from torch import nn

from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch
from colocate.trainer.memory import TrainerMemory
from colocate.trainer.offload import OffloadStats
from colocate.trainer.passes import no_grad_pass


class Reference:
    def __init__(self, model: nn.Module, memory: TrainerMemory, tag: str, *, temperature: float):
        self.model, self.memory, self.tag = model, memory, tag
        self.temperature = temperature
        self.last_onload = self.last_offload = OffloadStats()

    def logprobs(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        """(T,) reference log-probs of every response token; the weights visit the GPU only here."""
        self.last_onload = self.memory.onload(self.tag)
        out = no_grad_pass(self.model, batch, parts,
                           lambda mb: response_logprobs(self.model, mb, self.temperature)[0])
        self.last_offload = self.memory.offload(self.tag)
        return out

    @property
    def offloaded(self) -> bool:
        return self.memory.is_offloaded(self.tag)
