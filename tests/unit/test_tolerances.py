"""The bf16 tolerance helpers of the GPU tests, on CPU: fp32 references against bf16 casts."""

import pytest
import torch

from colocate.models import from_pretrained
from tests import tolerances as tol
from tests.helpers import bf16_copy, hf_logprobs, write_hf_model


def _logprobs(x, w, targets, dtype, accumulate_fp32=False):
    """(T,) log-probs of `targets` under logits x @ w.T computed in `dtype` (or from `dtype`
    inputs with fp32 products and sums)."""
    if accumulate_fp32:
        logits = x.to(dtype).float() @ w.to(dtype).float().T
    else:
        logits = (x.to(dtype) @ w.to(dtype).T).float()
    return logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)


@pytest.fixture
def three_ways():
    """An fp32 reference, a bf16 baseline and a second bf16 variant of the same 4096 log-probs."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4096, 64, generator=g), torch.randn(512, 64, generator=g) * 0.3
    targets = torch.randint(0, 512, (4096,), generator=g)
    return (
        _logprobs(x, w, targets, torch.float32),
        _logprobs(x, w, targets, torch.bfloat16),
        _logprobs(x, w, targets, torch.bfloat16, accumulate_fp32=True),
    )


def test_error_stats_summarise_absolute_differences():
    err = torch.cat([torch.zeros(99), torch.tensor([2.0])])
    stats = tol.error_stats(err, torch.zeros(100))
    assert stats.num == 100 and stats.max == 2.0 and stats.mean == pytest.approx(0.02)
    assert 0 < stats.p99 < 2.0  # interpolates between the 99th and 100th values
    with pytest.raises(ValueError, match="equal"):
        tol.error_stats(torch.zeros(3), torch.zeros(4))


def test_a_bf16_variant_is_within_the_bf16_baseline(three_ways):
    ref, baseline, ours = three_ways
    base, mine = tol.error_stats(baseline, ref), tol.error_stats(ours, ref)
    assert 0 < base.mean < 0.1 and 0 < mine.mean
    tol.assert_within_noise(mine, base, "bf16 variant")
    tol.assert_within_noise(base, base, "the baseline itself")


def test_a_defect_on_a_few_percent_of_tokens_fails_the_p99(three_ways):
    ref, baseline, ours = three_ways
    broken = ours.clone()
    broken[::50] -= 0.1  # 2% of the tokens off by 0.1 nat: within the mean bound, far outside p99
    with pytest.raises(AssertionError, match="p99 error"):
        tol.assert_within_noise(tol.error_stats(broken, ref), tol.error_stats(baseline, ref), "broken")


def test_a_uniformly_worse_result_fails_the_mean(three_ways):
    ref, baseline, _ = three_ways
    noisy = ref + 3 * (baseline - ref)
    with pytest.raises(AssertionError, match="mean error"):
        tol.assert_within_noise(tol.error_stats(noisy, ref), tol.error_stats(baseline, ref), "noisy")


def test_vacuous_baselines_are_refused(three_ways):
    ref, baseline, ours = three_ways
    mine = tol.error_stats(ours, ref)
    with pytest.raises(AssertionError, match="equals the reference"):
        tol.assert_within_noise(mine, tol.error_stats(ref, ref), "exact")
    with pytest.raises(AssertionError, match="not finite"):
        tol.assert_within_noise(mine, tol.error_stats(torch.where(ref < -7, float("nan"), baseline), ref), "nan")
    with pytest.raises(AssertionError, match="cannot be the same model"):
        tol.assert_within_noise(mine, tol.error_stats(baseline + 3.0, ref), "shifted")
    few = tol.error_stats(ours[:100], ref[:100])
    with pytest.raises(AssertionError, match="too few"):
        tol.assert_within_noise(few, tol.error_stats(baseline[:100], ref[:100]), "few")


def test_mean_only_bound(three_ways):
    ref, baseline, ours = three_ways
    base = tol.error_stats(baseline, ref).mean
    tol.assert_mean_within_noise(tol.error_stats(ours, ref).mean, base, "metric")
    with pytest.raises(AssertionError, match="mean error"):
        tol.assert_mean_within_noise(2 * base, base, "metric")
    with pytest.raises(AssertionError, match="mean error"):
        tol.assert_mean_within_noise(float("nan"), base, "metric")
    with pytest.raises(AssertionError, match="equals the reference"):
        tol.assert_mean_within_noise(0.0, 0.0, "metric")


def _grads(dtype, fp32_compute=False, scale=None):
    """Gradients of a two-layer MLP's loss from weights cast to `dtype` and computed in it (or in
    fp32); the bias is subtracted again by the row mean, so its gradient is zero in exact
    arithmetic and rounding is all there is of it."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 32, generator=g)
    params = {
        "w1": torch.randn(64, 32, generator=g) * 0.2,
        "w2": torch.randn(8, 64, generator=g) * 0.2,
        "bias": torch.randn(64, generator=g) * 0.1,
    }
    leaves = {n: p.to(dtype).requires_grad_() for n, p in params.items()}
    w1, w2, b = (leaves[n].float() if fp32_compute else leaves[n] for n in ("w1", "w2", "bias"))
    h = torch.relu(x.to(w1.dtype) @ w1.T) + b  # (256, 64)
    s = h - h.mean(0, keepdim=True)
    (s @ w2.T).float().pow(2).mean().backward()
    grads = {n: p.grad.float() for n, p in leaves.items()}
    if scale is not None:
        grads[scale[0]] = grads[scale[0]] * scale[1]
    return grads


def test_grads_within_noise_pass_for_another_rounding_and_name_a_broken_parameter():
    fp32, eager = _grads(torch.float32), _grads(torch.bfloat16)
    other = _grads(torch.bfloat16, fp32_compute=True)
    assert fp32["bias"].norm() < 1e-4 * fp32["w1"].norm() < eager["bias"].norm()  # zero but for rounding
    ratios = tol.assert_grads_within_noise(other, eager, fp32, "fp32 sums")
    assert set(ratios) == {"w1", "w2", "bias"} and max(ratios.values()) <= 1
    with pytest.raises(AssertionError, match="w2 differs from eager"):
        tol.assert_grads_within_noise(_grads(torch.bfloat16, scale=("w2", 1.1)), eager, fp32, "scaled")
    with pytest.raises(AssertionError, match="not a measure of rounding"):
        tol.assert_grads_within_noise(other, fp32, fp32, "no noise")


def test_release_expectations_count_graphs_where_they_move():
    stats = {"weights_bytes": 10, "kv_cache_bytes": 100, "cuda_graph_bytes": 1000, "cuda_graph_releasable": True}
    assert tol.release_expectations(stats, graphs_resume=False) == (1110, 110)
    assert tol.release_expectations(stats, graphs_resume=True) == (1110, 1110)
    kept = {**stats, "cuda_graph_releasable": False}
    assert tol.release_expectations(kept, graphs_resume=False) == (110, 110)


def test_hf_logprobs_align_with_our_model(tmp_path):
    """The reference the GPU tests build: transformers' response-token log-probs equal ours in fp32,
    and bf16-rounded weights load into a bf16 model unchanged."""
    path, hf = write_hf_model(tmp_path, "qwen3", bf16_weights=True)
    assert all(torch.equal(p, p.bfloat16().float()) for p in hf.parameters())
    ours = from_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(5)
    seqs = [
        (torch.randint(2, 101, (n,), generator=g).tolist(), torch.randint(2, 101, (m,), generator=g).tolist())
        for n, m in ((5, 9), (1, 4), (12, 20))
    ]
    got = hf_logprobs(hf, seqs, temperature=0.7)
    want = []
    with torch.no_grad():
        for prompt, response in seqs:
            logits = ours(torch.tensor(prompt + response))[len(prompt) - 1 : -1] / 0.7  # (T, V)
            want.append(logits.log_softmax(-1).gather(1, torch.tensor(response)[:, None]).squeeze(1))
    assert got.shape == (33,)
    torch.testing.assert_close(got, torch.cat(want), rtol=0, atol=1e-5)
    bf16 = from_pretrained(path, dtype="bfloat16")
    assert all(torch.equal(p.float(), q) for p, q in zip(bf16.parameters(), ours.parameters()))


def test_our_bf16_forward_is_within_transformers_bf16_error(tmp_path):
    """The GPU log-prob tests' comparison, run here on CPU kernels: our bf16 model's log-probs of
    2100 tokens against transformers fp32, bounded by transformers bf16 on the same tokens."""
    path, hf = write_hf_model(tmp_path, "qwen3", bf16_weights=True, initializer_range=0.08)
    hf16 = bf16_copy(hf)
    assert {b.dtype for b in hf16.buffers()} == {torch.float32}  # the rotary frequencies
    assert {p.dtype for p in hf16.parameters()} == {torch.bfloat16}
    ours = from_pretrained(path, dtype="bfloat16")
    g = torch.Generator().manual_seed(0)
    seqs = [
        (torch.randint(2, 101, (10,), generator=g).tolist(), torch.randint(2, 101, (50,), generator=g).tolist())
        for _ in range(42)
    ]
    mine = []
    with torch.no_grad():
        for prompt, response in seqs:
            hidden = ours.hidden_states(torch.tensor(prompt + response))[len(prompt) - 1 : -1]  # (T, H)
            logp = (hidden.float() @ ours.lm_head.weight.float().T / 0.7).log_softmax(-1)  # (T, V)
            mine.append(logp.gather(1, torch.tensor(response)[:, None]).squeeze(1))
    reference = hf_logprobs(hf, seqs, 0.7)
    tol.assert_within_noise(
        tol.error_stats(torch.cat(mine), reference), tol.error_stats(hf_logprobs(hf16, seqs, 0.7), reference), "ours bf16 on CPU"
    )
