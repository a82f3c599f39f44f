"""Passes over a rollout batch shared by the actor, the critic and the reference model: the
micro-batch plan agreed over ranks, a no-grad pass that fills a per-token tensor, and one
optimizer step accumulated over micro-batches.

Exact aggregation: before a step's micro-batches run, the step's masked-token and sample counts
are summed over ranks; each micro-batch's loss is its exact share of the global-batch loss under
those fixed denominators (colocate.algo.aggregate). FSDP averages gradients over ranks, so each
share is multiplied by the world size before backward: the sum over micro-batches and ranks is
then the gradient of the global-batch loss, whatever the token budget or the number of ranks.

A sample with no token in the loss (every token masked: tool output, or partial rollout's tokens
of older weights) adds exactly zero to every term and metric of a step, so no pass runs it: the
gradient steps leave it out of their micro-batches, and the no-grad passes (old and reference
log-probs, values) leave its tokens at 0, which only masked terms read (the KL penalty in the
reward, GAE and whitening mask them too). It still counts in the step's sample denominator, and
its reward still shapes its group's advantages. With long tails under partial rollout most trained
samples finished under older weights, and this is most of the train phase's work.

The micro-batch loop reads nothing back from the device (a read makes the host wait, and the
device then idles while the host catches up): metric shares stay on the device and are read once,
after the optimizer step. The phases are labelled (torch.profiler.record_function) so that a profile
attributes device time and idle gaps to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.profiler import record_function

from colocate import dist
from colocate.trainer.batch import MicroBatch, RolloutBatch, build_micro_batch
from colocate.trainer.memory import StateArrival
from colocate.trainer.optim import OptimizerStep
from colocate.trainer.packing import pack_micro_batches, step_slices
from colocate.trainer.parallelize import reshard_all


@dataclass
class StepPlan:
    parts: list[list[int]]
    """Sample indices of each micro-batch of this rank (the count is the same on every rank)."""
    num_tokens: float
    """Masked response tokens of this step over all ranks (token_mean's denominator)."""
    num_seqs: float
    """Samples of this step over all ranks (the sequence means' denominator)."""
    num_skipped: float = 0.0
    """Samples of this step over all ranks with no token in the loss, left out of `parts`."""


def agreed_micro_batches(lengths: list[int], indices: list[int], max_tokens: int) -> list[list[int]]:
    """Micro-batches of `indices` (sample indices with these `lengths`), as many as the rank that
    needs the most (at least one, so every rank runs a forward)."""
    parts = pack_micro_batches([lengths[i] for i in indices], max_tokens)
    count = dist.all_reduce_max(max(1, len(parts)))
    parts = pack_micro_batches([lengths[i] for i in indices], max_tokens, count)
    return [[indices[j] for j in p] for p in parts]


def in_loss(batch: RolloutBatch, indices: range) -> list[int]:
    """The samples of `indices` with at least one token in the loss."""
    return [i for i in indices if batch.mask_sums[i] > 0]


def pass_parts(batch: RolloutBatch, max_tokens: int) -> list[list[int]]:
    """Agreed micro-batches of a no-grad pass over the batch's samples in the loss."""
    return agreed_micro_batches(batch.lengths, in_loss(batch, range(batch.num_samples)), max_tokens)


def plan_steps(batch: RolloutBatch, max_tokens: int, samples_per_step: int | None) -> list[StepPlan]:
    """Consecutive slices of the batch, one per optimizer step (same count on every rank), each
    cut into agreed micro-batches of the samples in the loss, with the step's global normalizers."""
    local = step_slices(batch.num_samples, samples_per_step)
    slices = step_slices(batch.num_samples, samples_per_step, dist.all_reduce_max(len(local)))
    lengths = batch.lengths
    plans = []
    for sl in slices:
        trained = in_loss(batch, sl)
        counts = dist.all_reduce_sum([sum(batch.mask_sums[i] for i in sl), len(sl), len(sl) - len(trained)], batch.mask.device)
        parts = agreed_micro_batches(lengths, trained, max_tokens)
        plans.append(StepPlan(parts, float(counts[0]), float(counts[1]), float(counts[2])))
    return plans


@torch.no_grad()
def no_grad_pass(
    model: nn.Module, batch: RolloutBatch, parts: list[list[int]], fn: Callable[[MicroBatch], torch.Tensor]
) -> torch.Tensor:
    """Run `fn` (micro-batch -> (T_mb,) per response token) over every micro-batch and scatter
    the results into one (T,) fp32 tensor; then free the gathered parameters the root kept."""
    out = torch.zeros_like(batch.mask)  # (T,)
    for part in parts:
        mb = build_micro_batch(batch, part, batch.mask.device)
        out[mb.token_index] = fn(mb).float()
    reshard_all(model)
    return out


def gradient_step(
    opt: OptimizerStep,
    arrival: StateArrival,
    batch: RolloutBatch,
    plan: StepPlan,
    loss_fn: Callable[[MicroBatch, StepPlan], tuple[torch.Tensor, dict[str, torch.Tensor]]],
    gathered: nn.Module | None = None,
) -> tuple[dict[str, float], int]:
    """Accumulate the step's gradient over its micro-batches and take the guarded optimizer step.

    `loss_fn(mb, plan)` returns the micro-batch's loss share and metric shares (0-dim tensors,
    the same names on every micro-batch and rank). Returns the global metrics (shares summed over
    micro-batches and ranks, those named *_max maximised instead; plus grad_norm, lr, skipped) and
    the rank's real token count.
    With `gathered` (the FSDP root, built with reshard_after_forward=False), its parameters stay
    gathered and its gradients accumulate unreduced, in the reduce dtype, until the step's last
    micro-batch, whose backward reduces and reshards once.
    An optimizer state left on the host (`arrival`, see colocate/trainer/memory.py) streams home
    during the last backward and is waited for right before the update.
    """
    world = dist.get_info().world_size
    device = batch.mask.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    sums: dict[str, torch.Tensor] = {}
    maxima: dict[str, torch.Tensor] = {}
    num_tokens = 0
    for i, part in enumerate(plan.parts):
        last = i == len(plan.parts) - 1
        if gathered is not None:
            gathered.set_requires_gradient_sync(last)
            gathered.set_reshard_after_backward(last)
        with record_function("micro_batch.inputs"):
            mb = build_micro_batch(batch, part, device)
        with record_function("micro_batch.forward"):
            loss, shares = loss_fn(mb, plan)
        with record_function("micro_batch.backward"):
            if last:
                arrival.last_backward_begins()
            (loss * world).backward()
        loss_sum += loss.detach().double()
        for name, value in shares.items():
            value = value.detach().double()
            if name.endswith("_max"):
                maxima[name] = torch.maximum(maxima[name], value) if name in maxima else value
            else:
                sums[name] = sums.get(name, 0.0) + value
        num_tokens += mb.num_tokens
    with record_function("optimizer.step"):
        names = sorted(sums)
        totals = dist.all_reduce_sum(torch.stack([loss_sum] + [sums[n] for n in names]), device)
        out = opt.step(totals[0], before_update=arrival.wait)
        out.update({n: float(v) for n, v in zip(names, totals[1:].tolist())})
        if maxima:
            names = sorted(maxima)
            out.update(zip(names, dist.all_reduce_max_values(torch.stack([maxima[n] for n in names])).tolist()))
    return out, num_tokens
