"""Gumbel-max sampling: the reference against a direct computation, the Triton kernel against the
reference (GPU), and the input checks."""

import math

import pytest
import torch

from colocate.kernels import sampling
from colocate.kernels.sampling import gumbel_noise, gumbel_sample, reference_gumbel_sample


def _inputs(batch=6, vocab=5000, device="cpu"):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, vocab, generator=g) * 3
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.5])[:batch]
    seed = torch.tensor([1, 2, (1 << 61) + 12345, 99, 7, 0], dtype=torch.int64)[:batch]
    counter = torch.tensor([0, 5, 1 << 33, 17, 3, 1000], dtype=torch.int64)[:batch]
    return [t.to(device) for t in (logits, temperature, seed, counter)]


def _mix32(x: int) -> int:
    """The hash written out on Python ints."""
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_noise_is_the_documented_hash():
    seed, counter = (1 << 40) + 77, 12
    noise = gumbel_noise(torch.tensor([seed]), torch.tensor([counter]), 50)[0]
    key = _mix32((seed & 0xFFFFFFFF) ^ _mix32((seed >> 32) ^ _mix32(counter)))
    for v in (0, 1, 31, 49):
        bits = _mix32(key ^ _mix32(v ^ 0x9E3779B9)) >> 9
        u = (bits + 0.5) / (1 << 23)
        assert noise[v].item() == pytest.approx(-math.log(-math.log(u)), rel=1e-6)


def test_reference_samples_the_argmax_and_reports_full_log_softmax():
    logits, temperature, seed, counter = _inputs()
    ids, logprobs = reference_gumbel_sample(logits, temperature, seed, counter)
    scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
    noise = gumbel_noise(seed, counter, logits.shape[1])
    noise[1] = 0  # the greedy row
    assert torch.equal(ids, (scaled + noise).argmax(-1))
    assert ids[1] == logits[1].argmax()
    want = torch.log_softmax(scaled, -1).gather(1, ids[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs, want, atol=1e-5, rtol=0)


def test_suppressed_ids_lose_the_argmax_but_keep_their_log_softmax_mass():
    logits, temperature, seed, counter = _inputs()
    free, free_lp = reference_gumbel_sample(logits, temperature, seed, counter)
    suppress_ids = torch.stack([free, free], 1)
    left = torch.tensor([1, 0, 2, 1, 0, 5])
    ids, lp = reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, left)
    assert bool((ids != free)[left > 0].all()) and bool((ids == free)[left == 0].all())
    scaled = logits / torch.where(temperature == 0, 1.0, temperature)[:, None]
    torch.testing.assert_close(lp, torch.log_softmax(scaled, -1).gather(1, ids[:, None]).squeeze(1), atol=1e-5, rtol=0)


def test_bad_inputs_name_the_argument():
    logits, temperature, seed, counter = _inputs()
    with pytest.raises(ValueError, match="logits"):
        gumbel_sample(logits.double(), temperature, seed, counter)
    with pytest.raises(ValueError, match="seed"):
        gumbel_sample(logits, temperature, seed.int(), counter)
    with pytest.raises(ValueError, match="together"):
        gumbel_sample(logits, temperature, seed, counter, torch.zeros(6, 1, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "config",
    [sampling.SampleConfig(1), sampling.SampleConfig(3, 1024, 4), sampling.SampleConfig(4), sampling.SampleConfig(64, 512, 4)],
)
@pytest.mark.parametrize("vocab", [5000, 151936])
def test_triton_matches_reference(config, vocab):
    logits, temperature, seed, counter = _inputs(vocab=vocab, device="cuda")
    ref_free, _ = reference_gumbel_sample(logits, temperature, seed, counter)
    for suppress_ids, left in (
        (None, None),
        (torch.stack([ref_free, (ref_free + 1) % vocab], 1), torch.tensor([1, 0, 2, 1, 0, 5], device="cuda")),
    ):
        want = reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, left)
        got = sampling._gumbel_sample_triton(logits, temperature, seed, counter, suppress_ids, left, config)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=2e-5, rtol=0)


@pytest.mark.gpu
def test_public_path_on_a_decode_batch():
    """256 rows of a real vocabulary: the launcher's split choice, ids equal the reference."""
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(256, 151936, device="cuda", generator=g) * 4
    temperature = torch.ones(256, device="cuda")
    seed = torch.arange(256, device="cuda") * 7919
    counter = torch.arange(256, device="cuda") + 100
    got = gumbel_sample(logits, temperature, seed, counter)
    want = reference_gumbel_sample(logits, temperature, seed, counter)
    assert (got[0] == want[0]).float().mean().item() >= 0.99  # tl.log and torch.log may differ by an ulp
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [sampling.SampleConfig(1), sampling.SampleConfig(5, 512, 4)])
def test_triton_greedy_ties_take_the_first_column(config):
    """Equal logits everywhere: a greedy row picks column 0 (or the first one not suppressed)."""
    logits = torch.zeros(3, 6000, device="cuda")
    logits[2, 4000:] = 1.0
    zeros = torch.zeros(3, device="cuda")
    index = torch.zeros(3, dtype=torch.int64, device="cuda")
    suppress_ids = torch.tensor([[0, 0], [0, 1], [4000, 4000]], device="cuda")
    left = torch.tensor([0, 1, 1], device="cuda")
    ids, _ = sampling._gumbel_sample_triton(logits, zeros, index, index, suppress_ids, left, config)
    assert ids.tolist() == [0, 2, 4001]
