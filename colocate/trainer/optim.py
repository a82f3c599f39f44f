"""AdamW, learning-rate schedules, global grad-norm clipping and the guarded optimizer step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class LRSchedule:
    """Multiplier of the base learning rate for the optimizer step about to be taken.

    Step s (0-based) in warmup (s < warmup_steps): (s + 1) / warmup_steps, so the first step already
    moves. After warmup, with progress p = (s - warmup_steps) / (total_steps - warmup_steps) clamped
    to [0, 1] and r = min_lr_ratio:
        constant: 1
        linear:   r + (1 - r) (1 - p)
        cosine:   r + (1 - r) (1 + cos(pi p)) / 2
    The schedule is rebuilt from the config on resume; a checkpoint only carries the step count.
    """

    kind: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 1
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule={self.kind!r} must be one of {LR_SCHEDULES}")
        if self.warmup_steps < 0:
            raise ValueError(f"lr_warmup_steps={self.warmup_steps} must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return 1.0
        decay_steps = max(1, self.total_steps - self.warmup_steps)
        progress = min(1.0, max(0.0, (step - self.warmup_steps) / decay_steps))
        r = self.min_lr_ratio
        if self.kind == "linear":
            return r + (1.0 - r) * (1.0 - progress)
        return r + (1.0 - r) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float
) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm weights and biases are not decayed).

    Fused (CUDA and CPU): one kernel per dtype/device group instead of a loop over parameters,
    and the update can be skipped on the device (`found_inf`) without the host reading a flag.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=bool(params))


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state now instead of at the first step.

    Done with one step on zero gradients at learning rate 0 (so no parameter moves), after which
    the step counters are reset. This lets the state be allocated where the caller chooses (e.g.
    inside a memory-saver region) and lets a checkpoint be loaded before any training step.
    """
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None
    for state in optimizer.state.values():
        if "step" in state:
            step = state["step"]
            if torch.is_tensor(step):
                step.zero_()
            else:
                state["step"] = 0


@torch.no_grad()
def clip_grad_norm(params: list[nn.Parameter], max_norm: float | None) -> torch.Tensor:
    """The global L2 norm of all gradients (0-dim fp32 tensor); scales them to `max_norm` if given.

    FSDP2 gradients are DTensor shards: their norm comes back as a partial result, and
    `full_tensor()` reduces it over ranks, so every rank sees (and clips with) the global norm.
    A non-finite norm is returned as is; the caller then skips the step.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if hasattr(total, "full_tensor"):
        total = total.full_tensor()
    if max_norm is not None and max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total.float()


class DivergedError(ValueError):
    """Training diverged under the user's settings (a learning rate too high, most often): a user
    error, reported in one line naming the settings to change."""


class OptimizerStep:
    """AdamW + LR schedule + clipping for one model, and the step that skips non-finite updates;
    `max_skipped_steps` skips in a row stop training (DivergedError): the model is then broken, not
    unlucky, and every further step would be skipped too. `lr_field` names the learning rate's
    config field in that error."""

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        grad_clip: float | None,
        schedule: LRSchedule,
        max_skipped_steps: int,
        lr_field: str = "train.lr",
    ):
        if max_skipped_steps < 1:
            raise ValueError(f"max_skipped_steps={max_skipped_steps} must be >= 1")
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(model, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.schedule = schedule
        # A plain function, not the dataclass: LambdaLR would save a callable object's fields,
        # and the config (not an old checkpoint) decides the schedule.
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: schedule(step))
        self.grad_clip = grad_clip
        self.max_skipped_steps = max_skipped_steps
        self.peak_lr, self.lr_field = lr, lr_field
        self.num_skipped = 0
        self.num_skipped_in_a_row = 0

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self, loss: torch.Tensor, before_update: Callable[[], None] | None = None) -> dict[str, float]:
        """Clip and step unless the global `loss` (same on every rank) or the grad norm is not
        finite; the gradients are freed either way. Returns grad_norm, lr (of this step), skipped.
        `before_update` runs right before the optimizer reads its state (e.g. to wait for it).
        Raises DivergedError when this is the `max_skipped_steps`-th skipped step in a row.

        The fused optimizer takes the verdict as a device tensor (`found_inf`: parameters, moments
        and step counts stay as they were), so the update is queued before the host reads it:
        the device goes from the backward to the update without waiting for the host."""
        grad_norm = clip_grad_norm(self.params, self.grad_clip)
        not_finite = ~(torch.isfinite(grad_norm.to(loss.device)) & torch.isfinite(loss))
        lr = self.lr
        if self.params:
            if before_update is not None:
                before_update()
            self.optimizer.found_inf = not_finite.float()
            self.optimizer.step()
        self.zero_grad()
        skipped = bool(not_finite)
        if skipped:
            self.num_skipped += 1
            self.num_skipped_in_a_row += 1
            if self.num_skipped_in_a_row >= self.max_skipped_steps:
                raise DivergedError(
                    f"{self.num_skipped_in_a_row} optimizer steps in a row (train.max_skipped_steps) were skipped "
                    f"for a non-finite loss ({float(loss)}) or grad norm ({float(grad_norm)}): training diverged; "
                    f"lower {self.lr_field} (now {self.peak_lr:g})"
                )
        else:
            self.num_skipped_in_a_row = 0
            self.scheduler.step()
        return {"grad_norm": float(grad_norm), "lr": lr, "skipped": float(skipped)}
