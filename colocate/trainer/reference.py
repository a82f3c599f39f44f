"""The frozen reference policy for KL terms: FSDP2-sharded like the actor, no optimizer, stored
in the compute dtype, and kept in host memory except while its log-probs are computed."""

from __future__ import annotations

import torch
from torch import nn

from colocate.trainer.actor import response_logprobs
from colocate.trainer.batch import RolloutBatch
from colocate.trainer.offload import OffloadStats, StateOffloader
from colocate.trainer.passes import no_grad_pass


class Reference:
    def __init__(self, model: nn.Module, offloader: StateOffloader, tag: str, *, temperature: float):
        self.model, self.offloader, self.tag = model, offloader, tag
        self.temperature = temperature
        self.last_onload = self.last_offload = OffloadStats()

    def logprobs(self, batch: RolloutBatch, parts: list[list[int]]) -> torch.Tensor:
        """(T,) reference log-probs of every response token; the weights visit the GPU only here."""
        self.last_onload = self.offloader.onload([self.tag])
        out = no_grad_pass(self.model, batch, parts,
                           lambda mb: response_logprobs(self.model, mb, self.temperature)[0])
        self.last_offload = self.offloader.offload([self.tag])
        return out

    @property
    def offloaded(self) -> bool:
        return self.offloader.is_offloaded(self.tag)
