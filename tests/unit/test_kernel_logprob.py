"""token_logprobs against the full-logits definition: values, gradients, chunking and bad input."""

import math

import pytest
import torch

from colocate.kernels import logprob
from colocate.kernels.logprob import reference_token_logprobs, token_logprobs


def _inputs(num_tokens, vocab_size, hidden_size, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(num_tokens, hidden_size, generator=gen)
    weight = torch.randn(vocab_size, hidden_size, generator=gen) / math.sqrt(hidden_size) * 3
    targets = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    grad_lp = torch.randn(num_tokens, generator=gen)
    grad_ent = torch.randn(num_tokens, generator=gen)
    to = dict(device=device)
    return (hidden.to(dtype=dtype, **to), weight.to(dtype=dtype, **to), targets.to(**to), grad_lp.to(**to), grad_ent.to(**to))


def _values_and_grads(fn, hidden, weight, targets, grad_lp, grad_ent, temperature, with_entropy, **kw):
    """Outputs and d(sum(g_lp*lp + g_ent*ent))/d(hidden, weight) of one implementation."""
    hidden = hidden.detach().clone().requires_grad_()
    weight = weight.detach().clone().requires_grad_()
    lp, ent = fn(hidden, weight, targets, temperature, with_entropy=with_entropy, **kw)
    loss = (lp * grad_lp).sum()
    if with_entropy:
        loss = loss + (ent * grad_ent).sum()
    grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
    return lp.detach(), None if ent is None else ent.detach(), grad_hidden, grad_weight


def _assert_matches_reference(inputs, temperature, with_entropy, atol, **kw):
    got = _values_and_grads(token_logprobs, *inputs, temperature, with_entropy, **kw)
    want = _values_and_grads(reference_token_logprobs, *inputs, temperature, with_entropy)
    for name, g, w in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, want):
        if w is None:
            assert g is None, name
            continue
        assert g.dtype == w.dtype, name
        torch.testing.assert_close(g, w, atol=atol, rtol=atol, msg=name)


@pytest.mark.parametrize(
    "num_tokens, vocab_size, hidden_size, temperature, with_entropy, chunk_size",
    [
        (7, 50, 8, 1.0, False, 4096),  # one chunk holds the whole vocabulary
        (33, 300, 16, 1.0, True, 64),  # 300 is not a multiple of 64
        (20, 257, 24, 0.7, True, 100),
        (16, 128, 8, 1.6, False, 32),  # exact multiple of the chunk
        (5, 97, 12, 0.3, True, 1),  # one vocabulary entry per chunk
    ],
)
def test_values_and_grads_match_reference(num_tokens, vocab_size, hidden_size, temperature, with_entropy, chunk_size):
    inputs = _inputs(num_tokens, vocab_size, hidden_size)
    _assert_matches_reference(inputs, temperature, with_entropy, atol=1e-5, chunk_size=chunk_size)


def test_token_chunks_give_the_same_result_and_bound_the_tile(monkeypatch):
    """With a tiny budget both loops run several times and no fp32 tile exceeds the budget."""
    monkeypatch.setattr(logprob, "MAX_CHUNK_ELEMENTS", 160)
    tiles = []
    matmul = logprob._matmul_f32

    def recording_matmul(a, b):
        out = matmul(a, b)
        tiles.append(out.numel())
        return out

    monkeypatch.setattr(logprob, "_matmul_f32", recording_matmul)
    inputs = _inputs(45, 210, 4)  # token chunk 160 // 32 = 5 -> 9 token chunks, 7 vocab chunks
    _assert_matches_reference(inputs, 0.9, True, atol=1e-5, chunk_size=32)
    assert max(tiles) <= 160
    assert len(tiles) >= 9 * 7


def test_true_on_policy_row_chunks_change_no_bit_and_train_like_the_reference(monkeypatch):
    """algorithm.true_on_policy's log-prob goes through the rows in recomputed chunks: the values
    equal those of one chunk bit for bit, and values and gradients match the reference."""
    from colocate.kernels import batch_invariant
    from colocate.kernels.ops import Ops

    inputs = _inputs(45, 210, 4)
    ops = Ops.true_on_policy(torch.device("cpu"))
    try:
        whole = _values_and_grads(ops.token_logprobs, *inputs, 0.9, True)
        monkeypatch.setattr(logprob, "INVARIANT_CHUNK_ELEMENTS", 210 * 8)  # 6 chunks of 8 rows (the last 5)
        chunked = _values_and_grads(ops.token_logprobs, *inputs, 0.9, True)
    finally:
        batch_invariant.disable()
    want = _values_and_grads(reference_token_logprobs, *inputs, 0.9, True)
    assert torch.equal(chunked[0], whole[0]) and torch.equal(chunked[1], whole[1])
    for name, g, w in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), chunked, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)


def test_true_on_policy_backward_does_not_run_the_mode_s_lm_head_product_again(monkeypatch):
    """The mode's forward runs its lm_head product once per row chunk; the backward recomputes the
    logits with the default path's chunked product (gradients need no invariance)."""
    from colocate.kernels import batch_invariant
    from colocate.kernels.ops import Ops

    calls = []
    product = batch_invariant.logits
    monkeypatch.setattr(batch_invariant, "logits", lambda h, w: calls.append(h.shape[0]) or product(h, w))
    monkeypatch.setattr(logprob, "INVARIANT_CHUNK_ELEMENTS", 210 * 8)
    inputs = _inputs(45, 210, 4)
    ops = Ops.true_on_policy(torch.device("cpu"))
    try:
        got = _values_and_grads(ops.token_logprobs, *inputs, 0.9, True)
    finally:
        batch_invariant.disable()
    assert calls == [8] * 5 + [5]
    want = _values_and_grads(token_logprobs, *inputs, 0.9, True)  # the default path
    for name, g, w in zip(("logprobs", "entropy", "grad_hidden", "grad_weight"), got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5, msg=name)


def test_uniform_logits_by_hand():
    """A zero lm_head gives every token probability 1/V: logprob = -log V, entropy = log V."""
    hidden = torch.randn(4, 8)
    weight = torch.zeros(10, 8)
    lp, ent = token_logprobs(hidden, weight, torch.tensor([0, 3, 9, 5]), 0.5, with_entropy=True, chunk_size=3)
    torch.testing.assert_close(lp, torch.full((4,), -math.log(10)))
    torch.testing.assert_close(ent, torch.full((4,), math.log(10)))


def test_two_token_vocabulary_by_hand():
    """Logits (0, 2) at temperature 2 are (0, 1): p1 = e / (1 + e), H = -sum p log p."""
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [2.0]])
    lp, ent = token_logprobs(hidden, weight, torch.tensor([1]), 2.0, with_entropy=True, chunk_size=1)
    p1 = math.e / (1 + math.e)
    assert lp.item() == pytest.approx(math.log(p1), abs=1e-6)
    assert ent.item() == pytest.approx(-(p1 * math.log(p1) + (1 - p1) * math.log(1 - p1)), abs=1e-6)


def test_temperature_zero_uses_unscaled_logits():
    hidden, weight, targets, _, _ = _inputs(6, 40, 8)
    greedy = token_logprobs(hidden, weight, targets, 0.0, with_entropy=True)
    plain = token_logprobs(hidden, weight, targets, 1.0, with_entropy=True)
    torch.testing.assert_close(greedy, plain)
    scaled, _ = token_logprobs(hidden, weight, targets, 0.5)
    assert (scaled - plain[0]).abs().max() > 1e-2


def test_entropy_only_loss_backpropagates():
    hidden, weight, targets, _, grad_ent = _inputs(9, 70, 8)
    grads = []
    for fn in (token_logprobs, reference_token_logprobs):
        h = hidden.clone().requires_grad_()
        w = weight.clone().requires_grad_()
        _, ent = fn(h, w, targets, 1.2, with_entropy=True)
        grads.append(torch.autograd.grad((ent * grad_ent).sum(), [h, w]))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_weight_without_grad_gives_only_hidden_grad():
    hidden, weight, targets, grad_lp, _ = _inputs(8, 60, 8)
    h = hidden.clone().requires_grad_()
    lp, _ = token_logprobs(h, weight, targets, chunk_size=16)
    (lp * grad_lp).sum().backward()
    h_ref = hidden.clone().requires_grad_()
    ref, _ = reference_token_logprobs(h_ref, weight, targets)
    (ref * grad_lp).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=1e-5, rtol=1e-5)


def test_bf16_inputs_give_fp32_outputs_near_the_fp32_reference():
    hidden, weight, targets, _, _ = _inputs(12, 90, 16, dtype=torch.bfloat16)
    lp, ent = token_logprobs(hidden, weight, targets, 0.8, with_entropy=True, chunk_size=32)
    ref_lp, ref_ent = reference_token_logprobs(hidden, weight, targets, 0.8, with_entropy=True)
    assert lp.dtype == ent.dtype == torch.float32
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=1e-5)


def test_no_tokens():
    weight = torch.randn(30, 8, requires_grad=True)
    hidden = torch.zeros(0, 8, requires_grad=True)
    lp, ent = token_logprobs(hidden, weight, torch.zeros(0, dtype=torch.long), with_entropy=True)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert weight.grad.abs().sum() == 0 and hidden.grad.shape == (0, 8)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden=torch.randn(2, 3, 8)), "hidden"),
        (dict(weight=torch.randn(30, 7)), "weight"),
        (dict(targets=torch.zeros(5, dtype=torch.long)), "targets"),
        (dict(targets=torch.zeros(4, dtype=torch.int32)), "targets"),
        (dict(targets=torch.tensor([0, 1, 30, 2])), "targets"),
        (dict(targets=torch.tensor([0, -1, 3, 2])), "targets"),
        (dict(weight=torch.randn(30, 8, dtype=torch.float64)), "dtype"),
        (dict(temperature=-1.0), "temperature"),
        (dict(chunk_size=0), "chunk_size"),
    ],
)
def test_bad_input_raises(change, match):
    args = dict(
        hidden=torch.randn(4, 8), weight=torch.randn(30, 8), targets=torch.tensor([0, 1, 2, 3]), temperature=1.0, chunk_size=16
    )
    args.update(change)
    with pytest.raises(ValueError, match=match):
        token_logprobs(args["hidden"], args["weight"], args["targets"], args["temperature"], chunk_size=args["chunk_size"])


@pytest.mark.gpu
@pytest.mark.parametrize("with_entropy", [False, True])
def test_triton_fp32_matches_reference(with_entropy):
    inputs = _inputs(300, 5000, 64, device="cuda")
    _assert_matches_reference(inputs, 0.7, with_entropy, atol=1e-4, chunk_size=1536)


@pytest.mark.gpu
def test_triton_bf16_matches_fp32_reference():
    """bf16 inputs: values within 1e-2 of the fp32 reference, gradients within 1e-2 relative norm."""
    hidden, weight, targets, grad_lp, grad_ent = _inputs(500, 20000, 256, dtype=torch.bfloat16, device="cuda")
    got = _values_and_grads(token_logprobs, hidden, weight, targets, grad_lp, grad_ent, 0.9, True, chunk_size=3000)
    want = _values_and_grads(reference_token_logprobs, hidden, weight, targets, grad_lp, grad_ent, 0.9, True)
    for name, g, w in zip(("logprobs", "entropy"), got[:2], want[:2]):
        assert g.dtype == torch.float32
        assert (g - w).abs().max().item() < 1e-2, name
    for name, g, w in zip(("grad_hidden", "grad_weight"), got[2:], want[2:]):
        assert g.dtype == torch.bfloat16
        assert ((g.float() - w.float()).norm() / w.float().norm()).item() < 1e-2, name


@pytest.mark.gpu
def test_peak_memory_stays_far_below_full_logits():
    num_tokens, vocab_size, hidden_size = 8192, 151936, 896
    hidden, weight, targets, grad_lp, grad_ent = _inputs(num_tokens, vocab_size, hidden_size, dtype=torch.bfloat16, device="cuda")
    hidden.requires_grad_()
    weight.requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp, ent = token_logprobs(hidden, weight, targets, 1.0, with_entropy=True)
    ((lp * grad_lp).sum() + (ent * grad_ent).sum()).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    full_logits = num_tokens * vocab_size * 4
    assert extra < full_logits / 4, f"peak extra {extra / 2**20:.0f} MiB"
    assert torch.isfinite(lp).all() and torch.isfinite(weight.grad.float()).all()
