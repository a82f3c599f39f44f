"""The tensors the trainer works on: a rollout batch flattened over response tokens, and packed
micro-batches that index into it.

Layout (shared with colocate.algo): every per-token quantity of a rank's rollout batch (loss mask,
rollout/old/ref log-probs, values, advantages, returns) is one flat (T,) tensor over the response
tokens of all its samples, sample after sample; `seq_index` (T,) gives each token's sample number.
A micro-batch packs whole samples (prompt + response, no padding) into one varlen sequence of N
tokens and carries, for each of its T_mb response tokens, the position whose hidden state predicts
it (`logit_index`, into N), the token itself (`targets`) and where it lives in the batch
(`token_index`, into T): per-token results are gathered and scattered through that index.

Inputs reach the device without making the host wait: each is built on the host, pinned, and
copied with non_blocking, so the copy queues behind the work already on the stream while the host
goes on (a pageable source would make the host wait for that work first, and the device would
then idle while the host prepares the next launches).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
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
    mask_sums: list[float] = field(default_factory=list)
    """(S) sum of each sample's loss mask, on the host (step planning needs it before any launch)."""

    @classmethod
    def from_samples(
        cls, samples: list[Sample], device: torch.device, vocab_size: int | None = None, stale_before: int | None = None
    ) -> "RolloutBatch":
        """With `vocab_size`, token ids outside [0, vocab_size) are an error here, on the host,
        instead of a device-side assertion in the embedding or the log-prob kernel. With
        `stale_before`, tokens sampled by a weight version older than that (partial rollout's
        carried tokens) are left out of the mask: they stay in the context, not in the loss."""
        for i, s in enumerate(samples):
            if not s.prompt_ids:
                raise ValueError(
                    f"sample {i} (group {s.group_index}) has an empty prompt: the first "
                    "response token needs a preceding token to be predicted from"
                )
        offsets = [0]
        for s in samples:
            offsets.append(offsets[-1] + s.response_len)
        lengths = torch.tensor([s.response_len for s in samples], dtype=torch.long)
        seq_index = torch.repeat_interleave(torch.arange(len(samples)), lengths)
        mask = _concatenated((s.loss_mask for s in samples), np.float32)
        if stale_before is not None:
            mask *= _concatenated((s.versions for s in samples), np.int64) >= stale_before
        rollout = _concatenated((s.rollout_logprobs for s in samples), np.float32)
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        mask_sums = torch.zeros(len(samples)).index_add_(0, seq_index, mask).tolist()
        batch = cls(
            samples,
            offsets,
            to_device(mask, device),
            to_device(seq_index, device),
            to_device(rollout, device),
            to_device(rewards, device),
            mask_sums=mask_sums,
        )
        if vocab_size is not None:
            batch._check_token_ids(vocab_size)
        return batch

    def _check_token_ids(self, vocab_size: int) -> None:
        tokens = self.host_layout[0]
        if not tokens.numel() or (int(tokens.min()) >= 0 and int(tokens.max()) < vocab_size):
            return
        for i, s in enumerate(self.samples):
            bad = [t for t in (*s.prompt_ids, *s.response_ids) if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"sample {i} (group {s.group_index}) has token id {bad[0]}, outside the model's vocabulary [0, {vocab_size})"
                )

    @property
    def num_samples(self) -> int:
        return len(self.samples)

    @property
    def lengths(self) -> list[int]:
        """Total tokens (prompt + response) of each sample: what a micro-batch's budget counts."""
        return [len(s.prompt_ids) + s.response_len for s in self.samples]

    @functools.cached_property
    def host_layout(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """What packing reads, built once, long, on the host: every sample's prompt and response
        tokens in order, then per sample (S,) its prompt length, response length, start in those
        tokens and the start of its response in the flat response-token layout."""
        tokens = _concatenated((part for s in self.samples for part in (s.prompt_ids, s.response_ids)), np.int64)
        prompt = torch.tensor([len(s.prompt_ids) for s in self.samples], dtype=torch.long)
        response = torch.tensor([s.response_len for s in self.samples], dtype=torch.long)
        starts = torch.cumsum(prompt + response, 0) - (prompt + response)
        return tokens, prompt, response, starts, torch.tensor(self.response_offsets[:-1], dtype=torch.long)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.per_token[name]

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        assert value.shape == self.mask.shape, f"{name}: {tuple(value.shape)} vs {tuple(self.mask.shape)}"
        self.per_token[name] = value


def _concatenated(lists: Iterable[Sequence], dtype: type) -> torch.Tensor:
    """Many Python lists as one flat host tensor: numpy reads the chained items at C speed, about
    four times faster than torch.tensor on a flattened list (~30k tokens a step, on the host while
    the device waits)."""
    return torch.from_numpy(np.fromiter(itertools.chain.from_iterable(lists), dtype=dtype))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A fresh host tensor on `device`; on CUDA through pinned memory, without a host wait."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


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


def _ranges(lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For consecutive ranges of these lengths: each element's range number and its offset in it."""
    starts = torch.cumsum(lengths, 0) - lengths
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    return owner, torch.arange(int(lengths.sum())) - starts[owner]


def build_micro_batch(batch: RolloutBatch, indices: list[int], device: torch.device) -> MicroBatch:
    """Pack the samples `indices` of `batch`; with no indices, a two-token dummy whose forward and
    backward still run (FSDP's collectives must line up across ranks) but touch no loss term.
    (Two, not one: compiled blocks specialise on size-1 dimensions and would recompile.)
    Built with a few vectorised host ops, not per token: the device waits while the host packs."""
    tokens, *per_sample = batch.host_layout
    prompt, response, starts, response_starts = (t[indices] for t in per_sample)
    lengths = prompt + response
    cu = torch.cumsum(torch.cat([torch.zeros(1, dtype=torch.long), lengths]), 0)
    owner, positions = _ranges(lengths)
    ids = tokens[starts[owner] + positions]
    r_owner, r_offset = _ranges(response)
    logit_index = (cu[:-1] + prompt - 1)[r_owner] + r_offset
    targets = ids[logit_index + 1]
    token_index = response_starts[r_owner] + r_offset
    # Dense numbering over samples that have response tokens keeps every id below T_mb.
    seq_index = (torch.cumsum((response > 0).long(), 0) - 1)[r_owner]
    num_tokens = len(ids)
    if not indices:
        ids, positions, cu = torch.zeros(2, dtype=torch.long), torch.arange(2), torch.tensor([0, 2])
    # One host buffer, one copy; the fields are views of the device copy.
    fields = (ids, positions, cu, logit_index, targets, token_index, seq_index)
    flat = to_device(torch.cat(fields), device)
    views = flat.split([len(f) for f in fields])
    return MicroBatch(
        input_ids=views[0],
        positions=views[1],
        cu_seqlens=views[2].to(torch.int32),
        max_seqlen=int((cu[1:] - cu[:-1]).max()),
        logit_index=views[3],
        targets=views[4],
        token_index=views[5],
        seq_index=views[6],
        sample_indices=list(indices),
        num_tokens=num_tokens,
    )
