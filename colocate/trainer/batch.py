"""The tensors the trainer works on: a rollout batch flattened over response tokens, and packed
micro-batches that index into it.

Layout (shared with colocate.algo): every per-token quantity of a rank's rollout batch (loss mask,
rollout/old/ref log-probs, values, advantages, returns) is one flat (T,) tensor over the response
tokens of all its samples, sample after sample; `seq_index` (T,) gives each token's sample number.
A micro-batch packs whole samples (prompt + response, no padding) into one varlen sequence of N
tokens and carries, for each of its T_mb response tokens, the position whose hidden state predicts
it (`logit_index`, into N), the token itself (`targets`) and where it lives in the batch
(`token_index`, into T): per-token results are gathered and scattered through that index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from colocate.rollout.sample import Sample


@dataclass
class RolloutBatch:
    """One rank's samples of a rollout step, flattened over their response tokens."""

    samples: list[Sample]
    response_offsets: list[int]
    """(S + 1) starts of each sample's response tokens in the flat layout."""
    mask: torch.Tensor  # (T,) fp32, the samples' loss masks
    seq_index: torch.Tensor  # (T,) long
    rollout_logprobs: torch.Tensor  # (T,) fp32
    rewards: torch.Tensor  # (S,) fp32
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    """Computed (T,) tensors by name: old_logprobs, ref_logprobs, values, advantages, returns."""

    @classmethod
    def from_samples(cls, samples: list[Sample], device: torch.device) -> "RolloutBatch":
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise ValueError(f"sample {i} (group {s.group_index}) has an empty prompt: the first "
                                 "response token needs a preceding token to be predicted from")
        offsets = [0]
        for s in samples:
            offsets.append(offsets[-1] + s.response_len)
        lengths = torch.tensor([s.response_len for s in samples], dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(samples)), lengths)
        mask = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float32)
        rollout = torch.tensor([lp for s in samples for lp in s.rollout_logprobs], dtype=torch.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        return cls(samples, offsets, mask.to(device), seq_index.to(device), rollout.to(device),
                   rewards.to(device))

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        """Total tokens (prompt + response) of each sample: what a micro-batch's budget counts."""
        return [len(s.prompt_ids) + s.response_len for s in self.samples]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.per_token[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        assert value.shape == self.mask.shape, f"{name}: {tuple(value.shape)} vs {tuple(self.mask.shape)}"
        self.per_token[name] = value


@dataclass
class MicroBatch:
    """Whole samples packed into one varlen sequence, with the indices that tie it to the batch."""

    input_ids: torch.Tensor  # (N,) long
    positions: torch.Tensor  # (N,) long
    cu_seqlens: torch.Tensor  # (k + 1,) int32
    max_seqlen: int
    logit_index: torch.Tensor  # (T_mb,) long, into N
    targets: torch.Tensor  # (T_mb,) long
    token_index: torch.Tensor  # (T_mb,) long, into the batch's T
    seq_index: torch.Tensor  # (T_mb,) long, 0.. numbering this micro-batch's non-empty samples
    sample_indices: list[int]
    num_tokens: int
    """Real tokens N (0 for an empty micro-batch, which runs a dummy sequence)."""

    def model_inputs(self) -> dict:
        return dict(positions=self.positions, cu_seqlens=self.cu_seqlens, max_seqlen=self.max_seqlen)


def build_micro_batch(batch: RolloutBatch, indices: list[int], device: torch.device) -> MicroBatch:
    """Pack the samples `indices` of `batch`; with no indices, a two-token dummy whose forward and
    backward still run (FSDP's collectives must line up across ranks) but touch no loss term.
    (Two, not one: compiled blocks specialise on size-1 dimensions and would recompile.)"""
    ids, positions, cu, logit_index, targets, token_index, seq_index = [], [], [0], [], [], [], []
    num_seqs = 0
    for i in indices:
        s = batch.samples[i]
        start, p, r = cu[-1], len(s.prompt_ids), s.response_len
        ids += s.prompt_ids + s.response_ids
        positions += range(p + r)
        cu.append(start + p + r)
        logit_index += range(start + p - 1, start + p + r - 1)
        targets += s.response_ids
        token_index += range(batch.response_offsets[i], batch.response_offsets[i + 1])
        # Dense numbering over samples that have response tokens keeps every id below T_mb.
        seq_index += [num_seqs] * r
        num_seqs += r > 0
    num_tokens = len(ids)
    if not indices:
        ids, positions, cu = [0, 0], [0, 1], [0, 2]
    long = dict(dtype=torch.long)
    return MicroBatch(
        input_ids=torch.tensor(ids, **long).to(device, non_blocking=True),
        positions=torch.tensor(positions, **long).to(device, non_blocking=True),
        cu_seqlens=torch.tensor(cu, dtype=torch.int32).to(device, non_blocking=True),
        max_seqlen=max(b - a for a, b in zip(cu, cu[1:])),
        logit_index=torch.tensor(logit_index, **long).to(device, non_blocking=True),
        targets=torch.tensor(targets, **long).to(device, non_blocking=True),
        token_index=torch.tensor(token_index, **long).to(device, non_blocking=True),
        seq_index=torch.tensor(seq_index, **long).to(device, non_blocking=True),
        sample_indices=list(indices),
        num_tokens=num_tokens,
    )
