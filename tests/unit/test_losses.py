"""Losses, importance-sampling corrections and aggregation against hand-worked numbers."""

import math

import pytest
import torch

from colocate.algo import (
    AGGREGATION_MODES,
    aggregate,
    aggregate_metrics,
    kl_estimate,
    mis_mask,
    policy_loss,
    truncated_is_weights,
    value_loss,
)

F64 = torch.float64


def _t(values):
    return torch.tensor(values, dtype=F64)


def _ppo_case(ratios, advantages, **kwargs):
    """One token per ratio, all masked; returns (loss, d loss / d lp, metrics)."""
    old = torch.zeros(len(ratios), dtype=F64)
    lp = torch.log(_t(ratios)).requires_grad_()
    mask = torch.ones(len(ratios), dtype=F64)
    loss, metrics = policy_loss(lp, old, _t(advantages), mask, torch.arange(len(ratios)), **kwargs)
    loss.sum().backward()
    return loss.detach(), lp.grad, metrics


def test_kl_estimators_hand_computed():
    lp = torch.log(_t([0.5, 0.25]))
    ref = torch.log(_t([0.25, 0.25]))
    ln2 = math.log(2.0)
    torch.testing.assert_close(kl_estimate(lp, ref, "k1"), _t([ln2, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "k2"), _t([0.5 * ln2**2, 0.0]))
    # d = ref - lp = -ln 2: exp(d) - d - 1 = 0.5 + ln 2 - 1.
    torch.testing.assert_close(kl_estimate(lp, ref, "k3"), _t([ln2 - 0.5, 0.0]))
    torch.testing.assert_close(kl_estimate(lp, ref, "low_var_kl"), _t([ln2 - 0.5, 0.0]))


def test_low_var_kl_is_clamped_and_finite():
    # float32: exp(200) overflows, as a far-off token would in training.
    lp = torch.tensor([-200.0, 0.0], requires_grad=True)
    ref = torch.tensor([0.0, -5.0])
    k3 = kl_estimate(lp.detach(), ref, "k3")
    assert math.isinf(k3[0].item()) and k3[1].item() == pytest.approx(math.exp(-5) + 5 - 1)
    low = kl_estimate(lp, ref, "low_var_kl")
    torch.testing.assert_close(low.detach(), torch.tensor([10.0, math.exp(-5) + 5 - 1]))
    low.sum().backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0].item() == 0.0


def test_ppo_clip_symmetric():
    loss, grad, metrics = _ppo_case([1.1, 1.3, 0.7, 0.9, 0.7], [1.0, 1.0, -2.0, -2.0, 2.0])
    # r=1.1,A=1: -1.1 (inside); r=1.3,A=1: clipped to -1.2; r=0.7,A=-2: max(1.4, 1.6) = 1.6
    # (clipped); r=0.9,A=-2: 1.8 (inside); r=0.7,A=2: max(-1.4, -1.6) = -1.4 (pessimistic, inside).
    torch.testing.assert_close(loss, _t([-1.1, -1.2, 1.6, 1.8, -1.4]))
    # d/dlp of -A r = -A r on unclipped tokens, 0 on clipped ones.
    torch.testing.assert_close(grad, _t([-1.1, 0.0, 0.0, 1.8, -1.4]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([0, 1, 1, 0, 0]))
    torch.testing.assert_close(metrics["ppo_kl"], -torch.log(_t([1.1, 1.3, 0.7, 0.9, 0.7])))


def test_ppo_clip_higher_is_asymmetric():
    ratios, adv = [1.25, 1.3, 0.75, 0.85], [1.0, 1.0, -1.0, -1.0]
    loss, grad, metrics = _ppo_case(ratios, adv, eps_clip=0.2, eps_clip_high=0.28)
    # Upper bound 1.28: 1.25 passes, 1.3 is clipped. Lower bound stays 0.8: 0.75 is clipped.
    torch.testing.assert_close(loss, _t([-1.25, -1.28, 0.8, 0.85]))
    torch.testing.assert_close(grad, _t([-1.25, 0.0, 0.0, 0.85]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([0, 1, 1, 0]))
    # The same 1.25 ratio is clipped with the symmetric 0.2.
    _, sym_grad, _ = _ppo_case(ratios, adv, eps_clip=0.2)
    assert sym_grad[0].item() == 0.0


def test_ppo_dual_clip():
    loss, grad, metrics = _ppo_case([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], dual_clip_c=3.0)
    # A=-1, r=5: max(5, 1.2) = 5, capped at -c A = 3 (no gradient); r=2: 2 < 3 unchanged;
    # A=+1 is never dual-clipped: r=5 gives the ordinary clipped -1.2.
    torch.testing.assert_close(loss, _t([3.0, 2.0, -1.2]))
    torch.testing.assert_close(grad, _t([0.0, 2.0, 0.0]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([1, 0, 1]))
    with pytest.raises(ValueError, match="dual_clip_c"):
        _ppo_case([1.0], [1.0], dual_clip_c=1.0)
    with pytest.raises(ValueError, match="dual_clip_c"):
        _ppo_case([1.0], [1.0], kind="gspo", dual_clip_c=3.0)


def test_policy_loss_masks_tokens_and_applies_tis():
    lp = _t([0.0, math.log(1.1), 50.0]).requires_grad_()
    old = _t([0.0, 0.0, -50.0])  # the unmasked token has an absurd ratio: must not leak
    mask = _t([1.0, 1.0, 0.0])
    loss, metrics = policy_loss(
        lp, old, _t([1.0, 2.0, 1.0]), mask, torch.zeros(3, dtype=torch.long), tis_weights=_t([0.5, 2.0, 1.0])
    )
    torch.testing.assert_close(loss.detach(), _t([-0.5, -4.4, 0.0]))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, _t([-0.5, -4.4, 0.0]))
    torch.testing.assert_close(metrics["ppo_kl"], _t([0.0, -math.log(1.1), 0.0]))


def test_gspo_matches_sequence_level_objective():
    """Token-level GSPO with seq_mean_token_mean equals the paper's sequence-level loss
    -1/S sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(mean_t(lp - old)), in value and gradient."""
    gen = torch.Generator().manual_seed(1)
    # seq 0: inside the clip range; seq 1: ratio 1.65 with A > 0, clipped (no gradient);
    # seq 2: ratio 1.65 with A < 0, not clipped (pessimistic side). Token 0 of each is a prompt.
    lengths, shifts, seq_adv = [4, 3, 5], [0.05, 0.5, 0.5], [1.0, 2.0, -1.5]
    seq_index = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    mask = torch.cat([_t([0.0] + [1.0] * (n - 1)) for n in lengths])
    old = -torch.rand(seq_index.shape[0], generator=gen, dtype=F64)
    noise = 0.1 * torch.randn(seq_index.shape[0], generator=gen, dtype=F64)
    raw = torch.cat([torch.full((n,), s, dtype=F64) for n, s in zip(lengths, shifts)])
    # Centre the noise per sequence over the masked tokens, so mean(lp - old) is exactly `shift`.
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    for start, n in zip(starts, lengths):
        noise[start + 1 : start + n] -= noise[start + 1 : start + n].mean()
    lp = (old + raw + noise).requires_grad_()
    adv = _t(seq_adv)[seq_index] * mask

    loss_tok, metrics = policy_loss(lp, old, adv, mask, seq_index, kind="gspo", eps_clip=0.2)
    total = aggregate(loss_tok, mask, seq_index, "seq_mean_token_mean", global_num_tokens=9, global_num_seqs=3)
    (grad,) = torch.autograd.grad(total, lp)

    lp_ref = lp.detach().clone().requires_grad_()
    ref = 0.0
    for start, n, a in zip(starts, lengths, seq_adv):
        s = torch.exp((lp_ref[start + 1 : start + n] - old[start + 1 : start + n]).mean())
        ref = ref - torch.minimum(s * a, s.clamp(0.8, 1.2) * a) / 3
    (ref_grad,) = torch.autograd.grad(ref, lp_ref)
    torch.testing.assert_close(total, ref)
    torch.testing.assert_close(grad, ref_grad)
    # Per token: gradient s_i * (-A_i) / (n_i * S) on masked tokens of unclipped sequences.
    s0, s2 = math.exp(0.05), math.exp(0.5)
    torch.testing.assert_close(grad[1:4], torch.full((3,), -s0 * 1.0 / 9, dtype=F64))
    torch.testing.assert_close(grad[4:7], torch.zeros(3, dtype=F64))
    torch.testing.assert_close(grad[8:], torch.full((4,), s2 * 1.5 / 12, dtype=F64))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 0]))


def test_cispo_keeps_gradient_of_clipped_tokens():
    old = torch.full((3,), -1.0, dtype=F64)
    lp = (old + torch.log(_t([1.5, 1.1, 0.5]))).requires_grad_()
    adv = _t([2.0, -1.0, 1.0])
    loss, metrics = policy_loss(
        lp, old, adv, torch.ones(3, dtype=F64), torch.zeros(3).long(), kind="cispo", eps_clip=0.2, eps_clip_high=0.28
    )
    # Weights sg(clip(r)) = 1.28, 1.1, 0.8; loss = -w A lp; gradient -w A even where clipped
    # (no gradient through the weight itself).
    w = _t([1.28, 1.1, 0.8])
    torch.testing.assert_close(loss.detach(), -w * adv * lp.detach())
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, _t([-2.56, 1.1, -0.8]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([1, 0, 1]))


def test_eps_clip_of_one_or_more_leaves_no_lower_bound():
    ratios = [0.01, 0.5, 3.0, 6.0]
    # cispo, eps_clip 1 and eps_clip_high 4: weights clip(r, 0, 5) = 0.01, 0.5, 3, 5; loss -w A lp
    # with lp = log r here, and gradient -w A.
    loss, grad, metrics = _ppo_case(ratios, [1.0, -1.0, 2.0, 1.0], kind="cispo", eps_clip=1.0, eps_clip_high=4.0)
    w, adv = _t([0.01, 0.5, 3.0, 5.0]), _t([1.0, -1.0, 2.0, 1.0])
    torch.testing.assert_close(loss, -w * adv * torch.log(_t(ratios)))
    torch.testing.assert_close(grad, _t([-0.01, 0.5, -6.0, -5.0]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([0, 0, 0, 1]))
    # ppo, eps_clip 1.5: with A < 0 a small ratio is no longer raised to a lower bound, so its
    # gradient stays; r = 6 > 5 with A > 0 is still clipped.
    loss, grad, metrics = _ppo_case(ratios, [-1.0, -1.0, 2.0, 1.0], eps_clip=1.5, eps_clip_high=4.0)
    torch.testing.assert_close(loss, _t([0.01, 0.5, -6.0, -5.0]))
    torch.testing.assert_close(grad, _t([0.01, 0.5, -6.0, 0.0]))
    torch.testing.assert_close(metrics["pg_clipfrac"], _t([0, 0, 0, 1]))
    # With the default eps_clip 0.2, the first two are clipped to 0.8 and lose their gradient.
    loss, grad, _ = _ppo_case(ratios, [-1.0, -1.0, 2.0, 1.0], eps_clip_high=4.0)
    torch.testing.assert_close(loss[:2], _t([0.8, 0.8]))
    torch.testing.assert_close(grad[:2], _t([0.0, 0.0]))


def test_policy_loss_bad_input():
    x = torch.zeros(3, dtype=F64)
    idx = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="kind"):
        policy_loss(x, x, x, x, idx, kind="trpo")
    with pytest.raises(ValueError, match=r"eps_clip=-0.1 must be >= 0 \(1 or more: no lower bound\)"):
        policy_loss(x, x, x, x, idx, eps_clip=-0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(4, dtype=F64), x, idx)
    with pytest.raises(ValueError, match="kind"):
        kl_estimate(x, x, "k4")


def test_truncated_is_weights():
    old = torch.log(_t([1.0, 1.0, 1.0, 1.0])).requires_grad_()
    rollout = torch.log(_t([2.0, 0.5, 0.25, 1e-9]))
    mask = _t([1.0, 1.0, 1.0, 0.0])
    weights, metrics = truncated_is_weights(old, rollout, mask, clip=3.0)
    # exp(old - rollout) = 0.5, 2, 4 -> clipped to 3; the unmasked token gets 0.
    torch.testing.assert_close(weights, _t([0.5, 2.0, 3.0, 0.0]))
    torch.testing.assert_close(metrics["tis_clipfrac"], _t([0.0, 0.0, 1.0, 0.0]))
    assert not weights.requires_grad
    with pytest.raises(ValueError, match="clip"):
        truncated_is_weights(old, rollout, mask, clip=0.0)


def test_mis_mask_drops_whole_sequences_by_geometric_mean():
    seq_index = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2])
    mask = _t([0, 1, 1, 0, 1, 1, 1, 1])
    # old - rollout on masked tokens: seq 0: 0.1, 0.3 -> rho = e^0.2 = 1.22 (kept);
    # seq 1: 1.0, 0.6 -> e^0.8 = 2.23 (dropped); seq 2: -0.9, -0.5 -> e^-0.7 = 0.50 (dropped).
    # The prompt tokens carry values that would change every mean if they were counted.
    diff = _t([5.0, 0.1, 0.3, -5.0, 1.0, 0.6, -0.9, -0.5])
    keep, metrics = mis_mask(diff, torch.zeros(8, dtype=F64), seq_index, mask, low=0.6, high=2.0)
    torch.testing.assert_close(keep, _t([0, 1, 1, 0, 0, 0, 0, 0]))
    torch.testing.assert_close(metrics["mis_dropfrac"], _t([0, 0, 0, 0, 1, 1, 1, 1]))
    keep_wide, _ = mis_mask(diff, torch.zeros(8, dtype=F64), seq_index, mask, low=0.4, high=2.5)
    torch.testing.assert_close(keep_wide, mask)
    with pytest.raises(ValueError, match="low"):
        mis_mask(diff, diff, seq_index, mask, low=1.5, high=2.0)


def test_value_loss_hand_computed():
    values = _t([1.0, 0.0, 2.0, 0.5]).requires_grad_()
    old = _t([0.0, 0.0, 0.0, 0.0])
    returns = _t([2.0, 1.0, 0.0, 0.0])
    mask = _t([1.0, 1.0, 1.0, 0.0])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    # v=1,R=2: max(1, (0.5-2)^2 = 2.25) -> 1.125 (clipped term wins, no gradient);
    # v=0,R=1: both 1 -> 0.5; v=2,R=0: max(4, 0.25) -> 2 (unclipped); unmasked -> 0.
    torch.testing.assert_close(loss.detach(), _t([1.125, 0.5, 2.0, 0.0]))
    torch.testing.assert_close(metrics["value_clipfrac"], _t([1.0, 0.0, 0.0, 0.0]))
    loss.sum().backward()
    torch.testing.assert_close(values.grad, _t([0.0, -1.0, 2.0, 0.0]))


def _batch():
    """Five sequences with prompt tokens, a tool block and one all-prompt sequence."""
    gen = torch.Generator().manual_seed(3)
    layouts = [[0, 0, 1, 1, 1], [0, 1, 1, 0, 0, 1, 1, 1], [0, 0, 0], [0, 1], [0, 1, 1, 1, 1, 1]]
    seq_of_token = torch.cat([torch.full((len(l),), i) for i, l in enumerate(layouts)])
    mask = torch.cat([_t(l) for l in layouts])
    n = mask.shape[0]
    lp = (-torch.rand(n, generator=gen, dtype=F64)).requires_grad_()
    old = lp.detach() + 0.3 * torch.randn(n, generator=gen, dtype=F64)
    adv = torch.randn(n, generator=gen, dtype=F64)
    return layouts, seq_of_token, mask, lp, old, adv


def _reference_total(layouts, loss_tok, mode, norm_len):
    """Per-sequence loop over the whole batch."""
    num_tokens = sum(sum(l) for l in layouts)
    total, start = 0.0, 0
    for layout in layouts:
        seq = [loss_tok[start + k] for k, m in enumerate(layout) if m]
        start += len(layout)
        if mode == "token_mean":
            total += sum(seq) / num_tokens
        elif mode == "seq_mean_token_mean":
            total += (sum(seq) / len(seq) if seq else 0.0) / len(layouts)
        else:
            total += sum(seq) / len(layouts) / norm_len
    return total


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregation_is_exact_across_micro_batch_splits(mode):
    layouts, seq_of_token, mask, lp, old, adv = _batch()
    norm_len = 8 if mode == "seq_mean_token_sum" else None
    splits = [[[0, 1, 2, 3, 4]], [[0], [1], [2], [3], [4]], [[3, 1], [0, 4, 2]]]
    num_tokens, num_seqs = int(mask.sum()), len(layouts)
    totals, grads, metric_totals = [], [], []
    for split in splits:
        total, metric_total = 0.0, 0.0
        for micro in split:
            # Tokens of the chosen sequences, renumbered 0..k-1 inside the micro-batch.
            tok = torch.cat([torch.nonzero(seq_of_token == s).squeeze(-1) for s in micro])
            local = torch.cat([torch.full((len(layouts[s]),), j) for j, s in enumerate(micro)])
            loss_tok, metrics = policy_loss(lp[tok], old[tok], adv[tok], mask[tok], local, eps_clip=0.2, eps_clip_high=0.28)
            kwargs = dict(global_num_tokens=num_tokens, global_num_seqs=num_seqs, norm_len=norm_len)
            total = total + aggregate(loss_tok, mask[tok], local, mode, **kwargs)
            metric_total += aggregate_metrics(metrics, mask[tok], local, mode, **kwargs)["train/pg_clipfrac"]
        (grad,) = torch.autograd.grad(total, lp)
        totals.append(total.detach())
        grads.append(grad)
        metric_totals.append(metric_total)

    full_loss, full_metrics = policy_loss(lp.detach(), old, adv, mask, seq_of_token, eps_clip=0.2, eps_clip_high=0.28)
    expected = _reference_total(layouts, full_loss.tolist(), mode, norm_len)
    expected_clipfrac = _reference_total(layouts, full_metrics["pg_clipfrac"].tolist(), mode, norm_len)
    assert 0 < expected_clipfrac < 1 or mode == "seq_mean_token_sum"
    for total, grad, clipfrac in zip(totals, grads, metric_totals):
        torch.testing.assert_close(total, torch.tensor(expected, dtype=F64))
        torch.testing.assert_close(grad, grads[0], rtol=0, atol=1e-14)
        torch.testing.assert_close(clipfrac, torch.tensor(expected_clipfrac, dtype=F64))
    assert grads[0].abs().sum() > 0
    assert (grads[0][mask == 0] == 0).all()


def test_aggregate_bad_input():
    x = torch.ones(3, dtype=F64)
    idx = torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="mode"):
        aggregate(x, x, idx, "sum", global_num_tokens=3, global_num_seqs=1)
    with pytest.raises(ValueError, match="norm_len"):
        aggregate(x, x, idx, "token_mean", global_num_tokens=3, global_num_seqs=1, norm_len=4)
    out = aggregate(x, x, idx, "seq_mean_token_sum", global_num_tokens=3, global_num_seqs=2, norm_len=4)
    assert out.item() == pytest.approx(3 / 8)
    metrics = aggregate_metrics({"ppo_kl": x}, x, idx, "token_mean", global_num_tokens=6, global_num_seqs=1)
    assert list(metrics) == ["train/ppo_kl"] and metrics["train/ppo_kl"].item() == 0.5


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ppo", "gspo", "cispo"])
def test_policy_loss_and_aggregate_on_cuda_match_cpu(kind):
    _, seq_of_token, mask, lp, old, adv = _batch()
    results = []
    for device in ("cpu", "cuda"):
        x = lp.detach().to(device).requires_grad_()
        args = [t.to(device) for t in (old, adv, mask, seq_of_token)]
        loss_tok, _ = policy_loss(x, *args, kind=kind)
        total = aggregate(loss_tok, args[2], args[3], "seq_mean_token_mean", global_num_tokens=int(mask.sum()), global_num_seqs=5)
        (grad,) = torch.autograd.grad(total, x)
        results.append((total.detach().cpu(), grad.cpu()))
    torch.testing.assert_close(results[1], results[0])
