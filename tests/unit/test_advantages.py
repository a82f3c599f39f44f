"""Advantage estimators against hand-worked numbers and plain per-sequence loops."""

import math

import pytest
import torch

from colocate.algo import (
    broadcast_to_tokens,
    dapo_overlong_penalty,
    discounted_returns,
    dr_grpo,
    gae,
    grpo,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
    token_rewards,
    whiten,
)


def _flat(seqs, seq_numbers=None):
    """Build the flat layout from per-sequence lists of (mask, value) pairs.

    Returns (seq_index, mask, values) as float64/long tensors, and the per-sequence token spans.
    """
    seq_numbers = list(range(len(seqs))) if seq_numbers is None else seq_numbers
    seq_index, mask, values, spans = [], [], [], []
    for number, seq in zip(seq_numbers, seqs):
        start = len(mask)
        for m, v in seq:
            seq_index.append(number)
            mask.append(float(m))
            values.append(float(v))
        spans.append((start, len(mask)))
    return (torch.tensor(seq_index), torch.tensor(mask, dtype=torch.float64), torch.tensor(values, dtype=torch.float64), spans)


def _whiten_list(xs):
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / len(xs)
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


def test_grpo_group_stats_hand_computed():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    adv = grpo(rewards, group_size=4)
    # Group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / 0.57735 = +-0.866025.
    # Group 2: mean 0.75, unbiased std sqrt(0.75 / 3) = 0.5 -> 0.5, 0.5, 0.5, -1.5.
    # Group 3: all equal -> 0 (no NaN).
    expected = [0.866025, -0.866025, -0.866025, 0.866025, 0.5, 0.5, 0.5, -1.5, 0, 0, 0, 0]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=0)


def test_grpo_without_std_and_dr_grpo_center_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75])
    torch.testing.assert_close(dr_grpo(rewards, 4), expected)
    torch.testing.assert_close(grpo(rewards, 4, normalize_std=False), expected)


def test_grpo_accepts_integer_rewards():
    adv = grpo(torch.tensor([1, 0, 0, 1]), group_size=2)
    torch.testing.assert_close(adv, torch.tensor([0.707106, -0.707106, -0.707106, 0.707106]), atol=1e-5, rtol=0)


def test_rloo_leave_one_out():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0, 1.0])
    adv = rloo(rewards, group_size=3)
    # Group [1, 0, 0]: 1 - 0 = 1, 0 - 0.5 = -0.5, -0.5. Group [1, 3, 1]: 1 - 2, 3 - 1, 1 - 2.
    torch.testing.assert_close(adv, torch.tensor([1.0, -0.5, -0.5, -1.0, 2.0, -1.0]))


@pytest.mark.parametrize("fn", [grpo, dr_grpo, rloo])
def test_group_size_must_divide_num_seqs(fn):
    with pytest.raises(ValueError, match="group_size"):
        fn(torch.zeros(6), 4)


def test_rloo_and_grpo_need_two_members():
    with pytest.raises(ValueError, match="group_size"):
        rloo(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="group_size"):
        grpo(torch.zeros(4), 1)
    torch.testing.assert_close(dr_grpo(torch.tensor([3.0, 4.0]), 1), torch.zeros(2))


def test_broadcast_to_tokens():
    seq_index = torch.tensor([0, 0, 0, 1, 1, 2])
    mask = torch.tensor([False, True, True, False, True, True])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0, 0.5]), seq_index, mask)
    torch.testing.assert_close(out, torch.tensor([0.0, 2.0, 2.0, 0.0, -1.0, 0.5]))


def test_whiten_hand_computed():
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    mask = torch.tensor([1.0, 1.0, 1.0, 0.0])
    # mean 2, biased var 2/3, std 0.816497 -> -1.224745, 0, 1.224745; masked token 0.
    torch.testing.assert_close(whiten(x, mask), torch.tensor([-1.224745, 0.0, 1.224745, 0.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(whiten(x, mask, shift_mean=False), torch.tensor([0.775255, 2.0, 3.224745, 0.0]), atol=1e-5, rtol=0)


def test_token_rewards_places_reward_on_last_masked_token():
    # seq 0: prompt, resp, resp, tool, resp, tool ; seq 1: prompt, resp ; seq 2: prompt only.
    seq_index = torch.tensor([0, 0, 0, 0, 0, 0, 1, 1, 2])
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 1, 0], dtype=torch.float64)
    kl = torch.tensor([9, 0.1, 0.2, 9, 0.3, 9, 9, 0.4, 9], dtype=torch.float64)
    out = token_rewards(torch.tensor([1.0, -1.0, 5.0], dtype=torch.float64), seq_index, mask, kl, kl_coef=0.5)
    expected = [0, -0.05, -0.1, 0, 1 - 0.15, 0, 0, -1 - 0.2, 0]
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def test_discounted_returns_hand_computed():
    seq_index = torch.tensor([0, 0, 0, 0, 0, 1, 1])
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 1], dtype=torch.float64)
    r = torch.tensor([7, 0, 0, 7, 1, 7, 2], dtype=torch.float64)
    # gamma 0.5 over the masked steps of seq 0 (the tool token is skipped): 0.25, 0.5, 1.
    out = discounted_returns(r, seq_index, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([0, 0.25, 0.5, 0, 1, 0, 2], dtype=torch.float64))


def _reinforce_pp_reference(seq_rewards, seqs, kl_coef, gamma):
    """Per-sequence loop: token rewards, discounted return-to-go over masked tokens, whiten."""
    returns_per_seq = []
    for reward, seq in zip(seq_rewards, seqs):
        masked_kl = [kl for m, kl in seq if m]
        r = [-kl_coef * kl for kl in masked_kl]
        if r:
            r[-1] += reward
        g, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            running = r[t] + gamma * running
            g[t] = running
        returns_per_seq.append(g)
    white = _whiten_list([g for gs in returns_per_seq for g in gs])
    out, k = [], 0
    for seq in seqs:
        for m, _ in seq:
            out.append(white[k] if m else 0.0)
            k += bool(m)
    return out


SEQS = [
    [(0, 0), (1, 0.1), (1, -0.2), (0, 0), (0, 0), (1, 0.3)],
    [(0, 0), (0, 0), (1, 0.05), (1, 0.0)],
    [(0, 0), (1, 0.2), (1, 0.1), (1, -0.1), (1, 0.4)],
    [(0, 0), (1, -0.3)],
]


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus_matches_loop(gamma):
    seq_index, mask, kl, _ = _flat(SEQS)
    rewards = [1.0, 0.0, 0.5, 1.0]
    out = reinforce_plus_plus(torch.tensor(rewards, dtype=torch.float64), seq_index, mask, kl, kl_coef=0.1, gamma=gamma)
    expected = _reinforce_pp_reference(rewards, SEQS, kl_coef=0.1, gamma=gamma)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def test_reinforce_plus_plus_without_kl():
    seq_index, mask, _, _ = _flat(SEQS)
    rewards = [1.0, 0.0, 0.5, 1.0]
    out = reinforce_plus_plus(torch.tensor(rewards, dtype=torch.float64), seq_index, mask, None, kl_coef=0.1)
    expected = _reinforce_pp_reference(rewards, SEQS, kl_coef=0.0, gamma=1.0)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))


def test_reinforce_plus_plus_baseline_subtracts_group_mean():
    seq_index, mask, kl, _ = _flat(SEQS)
    rewards = [1.0, 0.0, 0.5, 1.0]
    out = reinforce_plus_plus_baseline(torch.tensor(rewards, dtype=torch.float64), 2, seq_index, mask, kl, kl_coef=0.1)
    centered = [0.5, -0.5, -0.25, 0.25]  # group means 0.5 and 0.75
    expected = _reinforce_pp_reference(centered, SEQS, kl_coef=0.1, gamma=1.0)
    torch.testing.assert_close(out, torch.tensor(expected, dtype=torch.float64))
    with pytest.raises(ValueError, match="group_size"):
        reinforce_plus_plus_baseline(torch.zeros(4), 3, seq_index, mask, kl, 0.1)


def test_gae_hand_computed():
    seq_index = torch.tensor([0, 0, 0])
    mask = torch.tensor([0.0, 1.0, 1.0], dtype=torch.float64)
    r = torch.tensor([5.0, 0.0, 1.0], dtype=torch.float64)
    v = torch.tensor([5.0, 0.5, 0.2], dtype=torch.float64)
    adv, ret = gae(r, v, seq_index, mask, gamma=0.9, lam=0.8)
    # delta_2 = 1 - 0.2 = 0.8; delta_1 = 0 + 0.9 * 0.2 - 0.5 = -0.32; A_1 = -0.32 + 0.72 * 0.8.
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.256, 0.8], dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor([0.0, 0.756, 1.0], dtype=torch.float64))


def _gae_reference(r, v, spans, mask, gamma, lam):
    adv, ret = [0.0] * len(r), [0.0] * len(r)
    for start, end in spans:
        steps = [t for t in range(start, end) if mask[t]]
        running, next_value = 0.0, 0.0
        for t in reversed(steps):
            delta = r[t] + gamma * next_value - v[t]
            running = delta + gamma * lam * running
            adv[t], ret[t] = running, running + v[t]
            next_value = v[t]
    return adv, ret


@pytest.mark.parametrize("seq_numbers", [[0, 1, 2, 3, 4], [3, 0, 4, 1, 2]])
def test_gae_matches_per_sequence_loop(seq_numbers):
    gen = torch.Generator().manual_seed(0)
    layouts = [[0, 0, 1, 1, 1, 0, 0, 1, 1], [0, 1], [0, 0, 0], [1, 1, 1, 1, 1, 1, 1], [0, 1, 0, 1]]
    seqs = [[(m, 0.0) for m in layout] for layout in layouts]
    seq_index, mask, _, spans = _flat(seqs, seq_numbers)
    r = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    adv, ret = gae(r, v, seq_index, mask, gamma=0.95, lam=0.9)
    exp_adv, exp_ret = _gae_reference(r.tolist(), v.tolist(), spans, mask.tolist(), 0.95, 0.9)
    torch.testing.assert_close(adv, torch.tensor(exp_adv, dtype=torch.float64))
    torch.testing.assert_close(ret, torch.tensor(exp_ret, dtype=torch.float64))


def test_gae_with_unit_gamma_lambda_gives_return_to_go():
    seq_index, mask, _, _ = _flat(SEQS)
    r = torch.arange(mask.shape[0], dtype=torch.float64)
    v = torch.full_like(r, 0.3)
    adv, ret = gae(r, v, seq_index, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(ret, discounted_returns(r, seq_index, mask, 1.0))
    torch.testing.assert_close(adv, (ret - 0.3) * mask)


def test_batch_without_masked_tokens_gives_zeros():
    seq_index = torch.tensor([0, 0, 1, 1])
    zeros = torch.zeros(4)
    adv, ret = gae(torch.ones(4), torch.ones(4), seq_index, zeros, gamma=0.9, lam=0.9)
    torch.testing.assert_close(adv, zeros)
    torch.testing.assert_close(ret, zeros)
    out = reinforce_plus_plus(torch.ones(2), seq_index, zeros, None, 0.0, gamma=0.5)
    torch.testing.assert_close(out, zeros)


def test_dapo_overlong_penalty():
    lengths = torch.tensor([50, 80, 90, 95, 100, 120])
    out = dapo_overlong_penalty(lengths, max_response_len=100, buffer_len=20, penalty_factor=1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.5, -0.75, -1.0, -1.0]))
    half = dapo_overlong_penalty(lengths, max_response_len=100, buffer_len=20, penalty_factor=0.5)
    torch.testing.assert_close(half, torch.tensor([0.0, 0.0, -0.25, -0.375, -0.5, -0.5]))
    with pytest.raises(ValueError, match="buffer_len"):
        dapo_overlong_penalty(lengths, max_response_len=100, buffer_len=0, penalty_factor=1.0)


@pytest.mark.gpu
def test_gae_and_reinforce_plus_plus_on_cuda_match_cpu():
    seq_index, mask, kl, _ = _flat(SEQS)
    gen = torch.Generator().manual_seed(2)
    r = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    v = torch.randn(mask.shape[0], generator=gen, dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.0], dtype=torch.float64)
    cpu = (*gae(r, v, seq_index, mask, 0.95, 0.9), reinforce_plus_plus(rewards, seq_index, mask, kl, 0.1, gamma=0.9))
    dev = [t.cuda() for t in (r, v, seq_index, mask, kl, rewards)]
    r, v, seq_index, mask, kl, rewards = dev
    cuda = (*gae(r, v, seq_index, mask, 0.95, 0.9), reinforce_plus_plus(rewards, seq_index, mask, kl, 0.1, gamma=0.9))
    for a, b in zip(cpu, cuda):
        torch.testing.assert_close(b.cpu(), a)
