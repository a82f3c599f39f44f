import math

import pytest
import torch
from torch import nn

from colocate.trainer.optim import DivergedError, LRSchedule, OptimizerStep, clip_grad_norm, init_optimizer_state


def test_schedules_match_their_formulas():
    total, warmup, r = 20, 4, 0.1
    for s in range(warmup):
        for kind in ("constant", "linear", "cosine"):
            assert LRSchedule(kind, warmup, total, r)(s) == pytest.approx((s + 1) / warmup)
    for s in range(warmup, total + 3):
        p = min(1.0, (s - warmup) / (total - warmup))
        assert LRSchedule("constant", warmup, total, r)(s) == 1.0
        assert LRSchedule("linear", warmup, total, r)(s) == pytest.approx(r + (1 - r) * (1 - p))
        assert LRSchedule("cosine", warmup, total, r)(s) == pytest.approx(r + (1 - r) * 0.5 * (1 + math.cos(math.pi * p)))
    assert LRSchedule("cosine", 0, 10, 0.0)(0) == 1.0
    assert LRSchedule("linear", 0, 10, 0.25)(10) == pytest.approx(0.25)


def test_schedule_rejects_bad_fields():
    with pytest.raises(ValueError, match="lr_schedule"):
        LRSchedule("step")
    with pytest.raises(ValueError, match="min_lr_ratio"):
        LRSchedule("cosine", 0, 10, 1.5)
    with pytest.raises(ValueError, match="lr_warmup_steps"):
        LRSchedule("linear", -1, 10)


def _model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def _loss(model):
    x = torch.arange(8.0).view(2, 4) / 8
    return model(x).square().sum()


def test_optimizer_step_follows_the_schedule_and_frees_grads():
    model = _model()
    sched = LRSchedule("linear", warmup_steps=2, total_steps=6, min_lr_ratio=0.0)
    opt = OptimizerStep(
        model, lr=0.5, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, grad_clip=None, schedule=sched, max_skipped_steps=10
    )
    lrs = []
    for _ in range(6):
        loss = _loss(model)
        loss.backward()
        out = opt.step(loss.detach())
        lrs.append(out["lr"])
        assert out["skipped"] == 0.0
        assert all(p.grad is None for p in model.parameters())
    assert lrs == pytest.approx([0.5 * sched(s) for s in range(6)])
    # Weight decay on matrices only.
    decays = {id(p): g["weight_decay"] for g in opt.optimizer.param_groups for p in g["params"]}
    assert decays[id(model[0].weight)] == 0.1 and decays[id(model[0].bias)] == 0.0
    assert decays[id(model[1].weight)] == 0.0


def test_steps_match_torch_adamw_under_every_setting():
    """Four steps with every setting away from torch's defaults (betas, eps, weight decay on the
    matrices only, a clip that every step's gradient exceeds, warm-up then cosine decay to
    min_lr_ratio), against torch.optim.AdamW on a copy of the model, clipped and scheduled by hand
    from the formulas. Adam's update hardly depends on the gradient's scale unless eps is of the
    order of the gradients: it is here, so a dropped clip shows; beta1 and beta2 show from the
    second step on."""
    lr, betas, eps, weight_decay, clip, r = 0.05, (0.6, 0.9), 0.05, 0.3, 0.2, 0.4
    model, ref = _model(), _model()
    opt = OptimizerStep(
        model,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        grad_clip=clip,
        schedule=LRSchedule("cosine", 1, 4, r),
        max_skipped_steps=10,
    )
    matrices = [p for p in ref.parameters() if p.ndim >= 2]
    vectors = [p for p in ref.parameters() if p.ndim < 2]
    ref_opt = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": weight_decay}, {"params": vectors, "weight_decay": 0.0}],
        lr=lr,
        betas=betas,
        eps=eps,
        foreach=False,
    )
    for s in range(4):
        loss = _loss(model)
        loss.backward()
        out = opt.step(loss.detach())
        _loss(ref).backward()
        norm = float(torch.sqrt(sum(p.grad.square().sum() for p in ref.parameters())))
        assert norm > 2 * clip and out["grad_norm"] == pytest.approx(norm, rel=1e-5)
        for p in ref.parameters():
            p.grad.mul_(clip / norm)
        scale = 1.0 if s == 0 else r + (1 - r) * 0.5 * (1 + math.cos(math.pi * (s - 1) / 3))
        assert out["lr"] == pytest.approx(lr * scale)
        for g in ref_opt.param_groups:
            g["lr"] = lr * scale
        ref_opt.step()
        ref_opt.zero_grad()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_clip_grad_norm_returns_the_global_norm_and_clips():
    model = _model()
    _loss(model).backward()
    params = list(model.parameters())
    expected = torch.sqrt(sum(p.grad.square().sum() for p in params))
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, max_norm=0.5 * float(expected))
    assert float(norm) == pytest.approx(float(expected), rel=1e-6)
    after = torch.sqrt(sum(p.grad.square().sum() for p in params))
    assert float(after) == pytest.approx(0.5 * float(expected), rel=1e-4)
    assert all(torch.allclose(p.grad, g * 0.5, rtol=1e-4) for p, g in zip(params, before))


def test_non_finite_loss_or_grad_skips_the_step():
    model = _model()
    sched = LRSchedule()
    opt = OptimizerStep(
        model, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, grad_clip=1.0, schedule=sched, max_skipped_steps=10
    )
    before = [p.detach().clone() for p in model.parameters()]
    loss = _loss(model)
    loss.backward()
    out = opt.step(torch.tensor(float("nan")))
    assert out["skipped"] == 1.0 and opt.num_skipped == 1
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(float(st["step"]) == 0 and not st["exp_avg"].any() for st in opt.optimizer.state.values())
    assert all(p.grad is None for p in model.parameters())
    assert opt.scheduler.last_epoch == 0  # a skipped step does not advance the schedule
    (_loss(model) * float("inf")).backward()
    out = opt.step(torch.tensor(1.0))
    assert out["skipped"] == 1.0 and not math.isfinite(out["grad_norm"])
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_consecutive_skipped_steps_stop_training_at_the_limit():
    model = _model()
    opt = OptimizerStep(
        model, lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.0, grad_clip=1.0, schedule=LRSchedule(), max_skipped_steps=3
    )

    def step(loss_scale: float) -> dict:
        loss = _loss(model) * loss_scale
        loss.backward()
        return opt.step(loss.detach())

    # Two skips, a good step (the count starts over), two more skips: still under the limit.
    assert [step(s)["skipped"] for s in (float("nan"), float("nan"), 1.0, float("inf"), float("nan"))] == [
        1.0,
        1.0,
        0.0,
        1.0,
        1.0,
    ]
    with pytest.raises(DivergedError) as info:  # a ValueError: the run ends in this one line
        step(float("nan"))
    assert str(info.value) == (
        "3 optimizer steps in a row (train.max_skipped_steps) were skipped for a non-finite "
        "loss (nan) or grad norm (nan): training diverged; lower train.lr (now 0.1)"
    )
    assert opt.num_skipped == 5
    with pytest.raises(ValueError, match="max_skipped_steps=0 must be >= 1"):
        OptimizerStep(
            model,
            lr=0.1,
            betas=(0.9, 0.99),
            eps=1e-8,
            weight_decay=0.0,
            grad_clip=1.0,
            schedule=LRSchedule(),
            max_skipped_steps=0,
        )


def test_eager_state_init_moves_nothing_and_matches_a_fresh_first_step():
    a, b = _model(), _model()
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (a, b)]
    init_optimizer_state(opts[0])
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert all(float(s["step"]) == 0 for s in opts[0].state.values())
    for model, opt in zip((a, b), opts):
        _loss(model).backward()
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_scheduler_state_round_trip_keeps_the_step_and_the_configured_schedule():
    def make(kind):
        return OptimizerStep(
            _model(),
            lr=1.0,
            betas=(0.9, 0.99),
            eps=1e-8,
            weight_decay=0.0,
            grad_clip=None,
            schedule=LRSchedule(kind, 1, 10, 0.2),
            max_skipped_steps=10,
        )

    opt = make("cosine")
    for _ in range(3):
        opt.optimizer.step()  # no gradients: moves nothing, keeps the scheduler's order check quiet
        opt.scheduler.step()
    state = opt.scheduler.state_dict()
    assert all(f is None for f in state["lr_lambdas"])  # nothing of the schedule itself is saved
    other = make("linear")
    other.scheduler.load_state_dict(state)
    assert other.scheduler.last_epoch == 3
    other.optimizer.step()
    other.scheduler.step()
    assert other.lr == pytest.approx(LRSchedule("linear", 1, 10, 0.2)(4))
