"""Rollout/train mismatch metrics: each against its formula, and maxima kept across micro-batches."""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from colocate.algo import aggregate
from colocate.trainer import passes
from colocate.trainer.actor import _mismatch
from colocate.trainer.memory import TrainerMemory
from colocate.trainer.optim import LRSchedule, OptimizerStep
from colocate.trainer.passes import StepPlan, gradient_step


def test_mismatch_metrics_follow_their_formulas():
    train = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.25])
    rollout = torch.tensor([-1.0, -2.5, -0.75, -2.0, -9.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0])  # the last token is not a response token
    agg = functools.partial(aggregate, seq_index=torch.zeros(5, dtype=torch.long), global_num_tokens=4.0, global_num_seqs=1.0)
    m = {k: float(v) for k, v in _mismatch(train, rollout, mask, agg).items()}
    d = [0.0, 0.5, 0.25, -1.0]  # train - rollout on the masked tokens
    assert m["train/train_rollout_logprob_abs_diff"] == pytest.approx(1.75 / 4)
    assert m["train/mismatch/abs_diff_max"] == 1.0  # not 8.75: masked tokens do not count
    assert m["train/mismatch/kl_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 4)
    assert m["train/mismatch/log_ppl_ratio"] == pytest.approx(-sum(d) / 4)
    assert m["train/mismatch/nonzero_frac"] == 0.75  # three of the four differ


def test_gradient_step_keeps_the_largest_max_share_and_sums_the_rest(monkeypatch):
    model = nn.Linear(2, 1)
    opt = OptimizerStep(
        model, lr=0.0, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, grad_clip=None, schedule=LRSchedule(), max_skipped_steps=10
    )
    arrival = TrainerMemory("pinned", torch.device("cpu")).add_optimizer("g", opt, model)
    maxima = iter([3.0, 7.0, 5.0])
    monkeypatch.setattr(passes, "build_micro_batch", lambda batch, part, device: SimpleNamespace(num_tokens=2))

    def loss_fn(mb, plan):
        return model(torch.ones(1, 2)).sum() * 0, {"a_max": torch.tensor(next(maxima)), "b": torch.tensor(1.0)}

    plan = StepPlan(parts=[[0], [1], [2]], num_tokens=3.0, num_seqs=3.0)
    out, tokens = gradient_step(opt, arrival, SimpleNamespace(mask=torch.ones(3)), plan, loss_fn)
    assert out["a_max"] == 7.0 and out["b"] == 3.0 and tokens == 6
