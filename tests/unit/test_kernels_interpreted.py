"""The Triton kernels' logic on CPU, through Triton's interpreter (the `interpreted_triton` fixture;
skipped without triton and on GPU machines, where the `gpu`-marked tests run the compiled kernels):
each kernel against its plain-torch reference in fp32 at small shapes, and each path of the
batch-invariant ones against the others, so an indexing, masking or loop-bound slip shows up before
any GPU time. The interpreter multiplies tiles with numpy, whose BLAS rounds a row by its place in
the tile, so bitwise equality is left to the GPU tests: here the paths agree within 1e-6."""

import pytest
import torch

from colocate.kernels import (
    batch_invariant_cuda,
    invariant_attention,
    logprob,
    lora_merge,
    paged_attention,
    rotary,
    sampling,
)
from colocate.kernels.fp8 import E4M3, E4M3_MAX
from colocate.kernels.invariant_ops import reference_rms_norm
from colocate.kernels.paged_attention import DecodeConfig, reference_paged_decode_attention
from colocate.kernels.sampling import SampleConfig, reference_gumbel_sample
from tests.unit.test_kernel_paged_attention import _paged_inputs

pytestmark = pytest.mark.usefixtures("interpreted_triton")
SAME = dict(rtol=1e-6, atol=1e-6)
"""Two paths of one batch-invariant kernel: bitwise equal on the GPU, within numpy's rounding here."""


def _randn(*shape, seed=0, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def test_invariant_matmul_matches_torch_whatever_the_rows_beside():
    a, b, bias = _randn(70, 50), _randn(50, 90, seed=1), _randn(90, seed=2)
    full = batch_invariant_cuda.matmul(a, b, bias, alpha=0.5, beta=2.0)
    torch.testing.assert_close(full, 0.5 * (a @ b) + 2.0 * bias, rtol=1e-5, atol=1e-5)
    weight_t = _randn(90, 50, seed=3).T  # linear's transposed weight view, strides (1, K)
    plain = batch_invariant_cuda.matmul(a, weight_t)
    for start, m in ((0, 1), (5, 3), (33, 17), (0, 70)):
        torch.testing.assert_close(batch_invariant_cuda.matmul(a[start : start + m], weight_t), plain[start : start + m], **SAME)
        torch.testing.assert_close(
            batch_invariant_cuda.matmul(a[start : start + m], b, bias, alpha=0.5, beta=2.0), full[start : start + m], **SAME
        )
    assert batch_invariant_cuda.matmul(a[:0], b).shape == (0, 90)
    # K a multiple of BLOCK_K (the unmasked loads) and ten row tiles: two launch groups, the last partial.
    tall, square = _randn(300, 64, seed=4), _randn(64, 90, seed=5)
    torch.testing.assert_close(batch_invariant_cuda.matmul(tall, square), tall @ square, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [150, 128], ids=["masked", "even"])
def test_invariant_matmul_sums_k_chunks_alike_in_one_program_or_one_per_chunk(k, monkeypatch):
    """Chunks of 64 columns here: 150 is three (64, 64, 22), 128 two. The split launch (a program
    per chunk, then the in-order sum) and the one-program walk give the same values, those of torch."""
    monkeypatch.setattr(batch_invariant_cuda, "K_CHUNK", 64)
    a, b, bias = _randn(70, k), _randn(k, 90, seed=1), _randn(90, seed=2)
    walked = batch_invariant_cuda.matmul(a, b, bias, alpha=0.5, beta=2.0, split=False)
    torch.testing.assert_close(walked, 0.5 * (a @ b) + 2.0 * bias, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch_invariant_cuda.matmul(a, b, bias, alpha=0.5, beta=2.0, split=True), walked, **SAME)
    torch.testing.assert_close(batch_invariant_cuda.matmul(a[3:5], b, bias, alpha=0.5, beta=2.0, split=True), walked[3:5], **SAME)
    with pytest.raises(ValueError, match="does not divide K_CHUNK"):
        batch_invariant_cuda.matmul(a, b, config=(32, 64, 48, 4, 2))


@pytest.mark.parametrize("k", [200, 128], ids=["masked", "even"])
def test_invariant_matmul_in_half_precision_in_every_tile_config(k, monkeypatch):
    """fp16 (the interpreter has no bf16) through each of the half-precision tile configs, with K in
    chunks of 64 here: several chunks walked and split in the configs that take them, one chunk in
    the largest; each within half-precision rounding of torch, bias and alpha/beta included."""
    monkeypatch.setattr(batch_invariant_cuda, "K_CHUNK", 64)
    a, b, bias = _randn(300, k).half(), (_randn(k, 270, seed=1) * k**-0.5).half(), _randn(270, seed=2).half()
    block_k = batch_invariant_cuda.BLOCK_K[torch.float16]
    for block_m, block_n, warps, stages, wide_only in batch_invariant_cuda.TILES[torch.float16]:
        config = (block_m, block_n, block_k, warps, stages)
        x, w = (a[:, : k % 64 or 64], b[: k % 64 or 64]) if wide_only else (a, b)
        want = 0.5 * (x.float() @ w.float()) + 2.0 * bias.float()
        for split in (False,) if wide_only else (False, True):
            got = batch_invariant_cuda.matmul(x, w, bias, alpha=0.5, beta=2.0, config=config, split=split)
            assert got.dtype == torch.float16
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2, msg=f"{config} split={split}")


def test_invariant_matmul_picks_the_largest_tile_that_fills_the_device(monkeypatch):
    """On an H100-sized device (132 SMs): a decode step's products take the one-warpgroup 64 x 64
    tile, split over their K chunks when they have too few tiles and K is at least SPLIT_GAIN chunks
    long; a training micro-batch's projections take 128 x 128, and its lm_head (wide, one chunk)
    128 x 256; every pick keeps BLOCK_K."""
    from colocate.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "_sm_count", lambda device: 132)
    monkeypatch.setattr(batch_invariant_cuda, "_shared_memory", lambda device: 227 * 1024)
    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    pick = batch_invariant_cuda.tile_config
    assert batch_invariant_cuda.K_CHUNK == 4096 and batch_invariant_cuda.SPLIT_GAIN == 1.5
    assert pick(256, 1152, 896, bf16, cuda) == ((64, 64, 64, 4, 4), False)  # 0.5B qkv at decode: 72 tiles
    assert pick(256, 896, 4864, bf16, cuda) == ((64, 64, 64, 4, 4), False)  # 0.5B down: two chunks, 1.19 long
    assert pick(256, 896, 6144, bf16, cuda) == ((64, 64, 64, 4, 4), True)  # 1.5 chunks long: split
    assert pick(256, 896, 6143, bf16, cuda) == ((64, 64, 64, 4, 4), False)
    assert pick(256, 1536, 8960, bf16, cuda) == ((64, 64, 64, 4, 4), True)  # 1.5B down: 96 tiles, 2.19 long
    assert pick(4096, 1536, 8960, bf16, cuda) == ((128, 128, 64, 8, 3), False)  # enough tiles: one walk each
    assert pick(256, 9728, 896, bf16, cuda) == ((64, 64, 64, 4, 4), False)  # 0.5B gate/up: 152 tiles of 128
    assert pick(512, 9728, 896, bf16, cuda) == ((128, 128, 64, 8, 3), False)  # a 512-token prefill: 304 tiles
    assert pick(16384, 896, 896, bf16, cuda) == ((128, 128, 64, 8, 3), False)  # training: a projection
    assert pick(16384, 151936, 896, bf16, cuda) == ((128, 256, 64, 8, 3), False)  # the lm_head: wide, one chunk
    assert pick(16384, 151936, 4097, bf16, cuda) == ((128, 128, 64, 8, 3), False)  # two chunks: two accumulators
    assert pick(3000, 151936, 896, torch.float32, cuda) == ((32, 64, 32, 4, 2), False)
    assert pick(1, 8, 16, bf16, torch.device("cpu")) == ((128, 128, 64, 8, 3), False)  # no SMs to fill
    assert pick(1, 40000, 16, bf16, torch.device("cpu")) == ((128, 256, 64, 8, 3), False)
    for tiles in batch_invariant_cuda.TILES.values():
        assert tiles[-1][4] is False  # the last config takes any product
    # An RTX 4090's 99 KiB: the 144 KiB pipeline of the 128 x 256 tile does not fit, the others do.
    monkeypatch.setattr(batch_invariant_cuda, "_shared_memory", lambda device: 101376)
    assert pick(16384, 151936, 896, bf16, cuda) == ((128, 128, 64, 8, 3), False)


def test_invariant_row_reductions_match_torch():
    x, w = _randn(40, 3, 72, scale=3), _randn(72, seed=1) + 1
    normed = batch_invariant_cuda.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(normed, reference_rms_norm(x, w, 1e-6), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(batch_invariant_cuda.rms_norm(x[7:9], w, 1e-6), normed[7:9], **SAME)
    delta = _randn(40, 72, seed=3)
    total, normed = batch_invariant_cuda.add_rms_norm(x[:, 0], delta, w, 1e-6)
    torch.testing.assert_close(total, x[:, 0] + delta, **SAME)
    torch.testing.assert_close(normed, reference_rms_norm(x[:, 0] + delta, w, 1e-6), rtol=1e-5, atol=1e-5)
    packed = _randn(7, 2 * 1500, seed=4, scale=3)  # the gate/up product's halves: row stride 3000
    gate, up = packed.chunk(2, dim=-1)
    torch.testing.assert_close(batch_invariant_cuda.silu_mul(gate, up), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    z = _randn(9, 3000, seed=2, scale=4)  # three column blocks of the log-sum-exp, the last one partial
    lse = sampling.invariant_logsumexp(z)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(sampling.invariant_logsumexp(z[4:5]), lse[4:5], **SAME)
    z[2, 7:2000] = float("-inf")  # masked columns carry no probability and no entropy
    lse, entropy = sampling.invariant_logsumexp_and_entropy(z)
    logp = torch.log_softmax(z, -1)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(entropy, -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), pytest.param(132, 2, marks=pytest.mark.slow)], ids=["group_2", "group_66"])
def test_invariant_attention_packed_prefill_and_decode_agree(heads, kv_heads, monkeypatch):
    """The trainer's packed sequences, the engine's chunked prefill from the paged cache and its decode
    steps (a kv head's query heads as a tile's rows: a group of 66 takes two tiles), padded rows
    among them: one kernel, the same values per query, those of dense attention. A sequence of 140
    takes three packed tiles of 64 queries, and a prefill chunk of 100 two. Its output starts as
    NaN here, so a row it does not store shows."""
    monkeypatch.setattr(invariant_attention.torch, "empty_like", lambda t: torch.full_like(t, float("nan")))
    lens, dim, block_size = [5, 140, 1, 17], 16, 32
    n, scale = sum(lens), dim**-0.5
    q, k, v = _randn(n, heads, dim), _randn(n, kv_heads, dim, seed=1), _randn(n, kv_heads, dim, seed=2)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = invariant_attention.packed_attention(q, k, v, cu, scale)
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = invariant_attention.reference_attention(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
        torch.testing.assert_close(packed[a:b], ref, rtol=1e-5, atol=1e-5)
    k_cache = torch.full((24, block_size, kv_heads, dim), float("nan"))  # unwritten slots are never read
    v_cache = k_cache.clone()
    free = torch.randperm(24, generator=torch.Generator().manual_seed(3)).tolist()
    tables = torch.full((len(lens), 8), -1, dtype=torch.int32)
    for s, length in enumerate(lens):
        for j in range(0, length, block_size):
            tables[s, j // block_size] = block = free.pop()
            rows = slice(cu[s].item() + j, cu[s].item() + min(j + block_size, length))
            k_cache[block, : rows.stop - rows.start], v_cache[block, : rows.stop - rows.start] = k[rows], v[rows]
    starts = [0, 0, 0, 0]
    chunks = [[2, 3], [100, 40], [1], [17]]
    prefilled = torch.zeros_like(q)
    for step in range(2):
        live = [s for s in range(len(lens)) if step < len(chunks[s])]
        q_lens = [chunks[s][step] for s in live]
        rows = torch.cat([torch.arange(cu[s].item() + starts[s], cu[s].item() + starts[s] + m) for s, m in zip(live, q_lens)])
        k_lens = [starts[s] + m for s, m in zip(live, q_lens)]
        prefilled[rows] = invariant_attention.paged_prefill_attention(
            q[rows], k_cache, v_cache, tables[live], q_lens, k_lens, scale
        )
        for s, m in zip(live, q_lens):
            starts[s] += m
    torch.testing.assert_close(prefilled, packed, **SAME)
    for j in (0, 4, 16, 39, 139):  # decode steps at several positions, with a padded row of no context
        live = [s for s in range(len(lens)) if j < lens[s]]
        batch_q = torch.cat([q[[cu[s].item() + j for s in live]], torch.zeros(1, heads, dim)])
        context = torch.tensor([j + 1] * len(live) + [0], dtype=torch.int32)
        out = invariant_attention.paged_decode_attention(
            batch_q, k_cache, v_cache, torch.cat([tables[live], tables[:1]]), context, scale
        )
        torch.testing.assert_close(out[:-1], packed[[cu[s].item() + j for s in live]], **SAME)
        assert not out[-1].any()


def test_invariant_attention_in_half_precision_matches_dense_attention():
    """fp16 inputs (the interpreter has no bf16): the probabilities are rounded to v's dtype for both
    the numerator's and the denominator's MMA, and the result stays within half-precision rounding."""
    lens, heads, kv_heads, dim = [5, 140, 17], 6, 2, 16
    n, scale = sum(lens), dim**-0.5
    q, k, v = (_randn(n, h, dim, seed=seed).half() for seed, h in enumerate((heads, kv_heads, kv_heads)))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    out = invariant_attention.packed_attention(q, k, v, cu, scale)
    assert out.dtype == torch.float16
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref = invariant_attention.reference_attention(q[a:b], k[a:b], v[a:b], torch.arange(b - a), scale)
        torch.testing.assert_close(out[a:b].float(), ref, rtol=5e-3, atol=5e-3)


def test_invariant_attention_tiles_of_any_size_give_the_same_values(monkeypatch):
    """The denominator is summed by the MMA, so packed tiles of 16 and 128 queries and decode tiles
    of 16 query heads compute what the 64-row tiles do (bit for bit on the GPU, as the sweep checks)."""
    lens, heads, kv_heads, dim = [3, 150, 70], 6, 2, 16
    n, scale = sum(lens), dim**-0.5
    q, k, v = _randn(n, heads, dim), _randn(n, kv_heads, dim, seed=1), _randn(n, kv_heads, dim, seed=2)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    packed = invariant_attention.packed_attention(q, k, v, cu, scale)
    for block_m in (16, 128):
        monkeypatch.setattr(invariant_attention, "BLOCK_M", block_m)
        torch.testing.assert_close(invariant_attention.packed_attention(q, k, v, cu, scale), packed, **SAME)
    block_size, width = 16, -(-max(lens) // 16)
    k_cache, v_cache = (torch.zeros(len(lens) * width, block_size, kv_heads, dim) for _ in range(2))
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)  # blocks in order
    for s, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for cache, x in ((k_cache, k), (v_cache, v)):
            cache[s * width : (s + 1) * width].view(-1, kv_heads, dim)[: b - a] = x[a:b]
    last = (cu[1:] - 1).long()
    monkeypatch.setattr(invariant_attention, "DECODE_BLOCK_M", 16)
    decoded = invariant_attention.paged_decode_attention(
        q[last], k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), scale
    )
    torch.testing.assert_close(decoded, packed[last], **SAME)


def test_rotary_kernel_matches_the_reference_and_inverts():
    """Queries and keys (other head counts, a strided view among them) in one launch."""
    n, dim = 13, 16
    q, k = _randn(n, 3, dim), _randn(n, 2 * 5, dim, seed=2)[:, ::2]
    angles = _randn(n, dim // 2, seed=1)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_out, k_out = rotary._launch(q, k, cos, sin, False)
    for got, x in ((q_out, q), (k_out, k)):
        torch.testing.assert_close(got, rotary.reference_rotate(x, cos, sin), rtol=1e-6, atol=1e-6)
    for back, x in zip(rotary._launch(q_out, k_out, cos, sin, True), (q, k)):
        torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config", [DecodeConfig(block_n=16), DecodeConfig(block_n=16, num_splits=4)], ids=["unsplit", "split"])
def test_paged_decode_kernel_matches_the_reference(config):
    """Contexts of one token, on block and tile edges, spread over several splits; a padded row."""
    inputs = _paged_inputs([1, 15, 16, 70, 0, 33], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    out = paged_attention._paged_decode_triton(*inputs, 0.25, config)
    torch.testing.assert_close(out, reference_paged_decode_attention(*inputs, 0.25), rtol=1e-5, atol=1e-5)
    assert not out[4].any()


@pytest.mark.parametrize("config", [DecodeConfig(block_n=16), DecodeConfig(block_n=32, num_splits=4)], ids=["unsplit", "split"])
def test_paged_decode_kernel_reads_an_fp8_cache(config):
    """fp8 tiles with their scales: fp32 queries agree with the reference over the dequantized cache
    to fp32 rounding; fp16 queries over values of size 1e-3 (scales ~2e-6, so p * v_scale would be an
    fp16 subnormal) keep fp16's precision. Tiles of 32 span two cache blocks."""
    q, k_cache, v_cache, tables, lens = _paged_inputs(
        [1, 15, 16, 70, 0, 33], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=16
    )
    slots = torch.arange(k_cache.shape[0] * k_cache.shape[1])
    for x_q, v_size, tol in ((q, 1.0, 1e-5), (q.half(), 1e-3, 2e-3)):
        k8, v8 = torch.empty(k_cache.shape, dtype=E4M3), torch.empty(k_cache.shape, dtype=E4M3)
        k_scale, v_scale = torch.empty(k_cache.shape[:3]), torch.empty(k_cache.shape[:3])
        paged_attention.store_kv(k_cache.flatten(0, 1), v_cache.flatten(0, 1) * v_size, k8, v8, slots, k_scale, v_scale)
        out = paged_attention._paged_decode_triton(x_q, k8, v8, tables, lens, 0.25, config, k_scale, v_scale)
        want = reference_paged_decode_attention(x_q, k8, v8, tables, lens, 0.25, k_scale, v_scale)
        assert out.dtype == x_q.dtype and not out[4].any()
        torch.testing.assert_close(out.float() / v_size, want.float() / v_size, rtol=tol, atol=tol)


def test_store_kernel_writes_fp8_rows_and_scales():
    """The Triton store into an fp8 cache writes the CPU path's bytes and scales and skips -1. The
    values lie on e4m3's grid times a power of two (each row's amax 448 * 2^e), so no rounding
    happens: the interpreter's fp32 -> e4m3 cast drops the carry when it rounds up to a power of two
    (124.7 -> 64, not 128); rounding is the GPU test's (test_fp8_kv_cache.py)."""
    gen = torch.Generator().manual_seed(0)
    grid = (torch.randn(2, 7, 2, 40, generator=gen) * 100).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).float()
    grid[..., 3] = E4M3_MAX
    powers = 2.0 ** torch.randint(-12, 4, (2, 7, 2, 1), generator=gen)
    k, v = (grid * powers).unbind(0)  # (N, Hk, D)
    slots = torch.tensor([3, -1, 22, 0, 63, -1, 40])
    caches = []
    for store in (paged_attention.store_kv, paged_attention._store_kv_triton):
        cache = [torch.full((4, 16, 2, 40), 3.0).to(E4M3) for _ in range(2)] + [torch.full((4, 16, 2), -1.0) for _ in range(2)]
        store(k, v, cache[0], cache[1], slots, cache[2], cache[3])
        caches.append(cache)
    for got, want in zip(*caches):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if got.dtype == E4M3 else torch.equal(got, want)
    assert (caches[1][2].flatten(0, 1)[[3, 22, 0, 63, 40]] == powers[0, [0, 2, 3, 4, 6]].squeeze(-1)).all()


@pytest.mark.parametrize("config", [SampleConfig(1), SampleConfig(3, 256, 4)], ids=["one_split", "three_splits"])
def test_sampling_kernel_matches_the_reference(config):
    """Ids equal the reference's (greedy and sampled rows, with and without suppressed ids), log-probs
    within rounding; the vocabulary does not fill the last block."""
    vocab = 1500
    logits = _randn(6, vocab, scale=3)
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0])
    seed, counter = torch.arange(6) * 7919 + 3, torch.arange(6) + 11
    free, _ = reference_gumbel_sample(logits, temperature, seed, counter)
    for suppress_ids, left in ((None, None), (torch.stack([free, (free + 1) % vocab], 1), torch.tensor([1, 0, 2, 1, 0, 5]))):
        want = reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, left)
        got = sampling._gumbel_sample_triton(logits, temperature, seed, counter, suppress_ids, left, config)
        assert torch.equal(got[0], want[0])
        torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=0)


def test_the_modes_sampler_subtracts_the_trainers_log_sum_exp_bit_for_bit(monkeypatch):
    """The mode's sampler (a fixed launch, logits scaled beforehand) draws the reference's ids, and
    each log-prob is exactly the scaled logit minus the trainer's log-sum-exp of that row
    (`invariant_logsumexp`, `invariant_logsumexp_and_entropy`, whose entropy matches torch's), with
    three rows or one beside it; the slices walk two blocks each, the last block part-filled and one slice empty."""
    monkeypatch.setattr(sampling, "INVARIANT_CONFIG", SampleConfig(5, 128, 4))
    vocab = 1000  # 5 slices of 256 columns: the last one holds none
    logits = _randn(6, vocab, scale=3)
    logits[4, 100:900] = float("-inf")
    temperature = torch.tensor([1.0, 0.0, 0.7, 1.3, 0.0, 1.0])
    seed, counter = torch.arange(6) * 7919 + 3, torch.arange(6) + 11
    scaled = sampling.scale_logits(logits, temperature)
    stop, left = torch.tensor([[3, 7]] * 6), torch.tensor([1, 0, 2, 1, 0, 5])
    for suppress_ids, suppress_left in ((None, None), (stop, left)):
        ids, logprobs = sampling.invariant_gumbel_sample(scaled, temperature, seed, counter, suppress_ids, suppress_left)
        want = reference_gumbel_sample(logits, temperature, seed, counter, suppress_ids, suppress_left)
        assert torch.equal(ids, want[0])
        torch.testing.assert_close(logprobs, want[1], atol=1e-5, rtol=0)
        lse = sampling.invariant_logsumexp(scaled)
        assert torch.equal(logprobs, scaled.gather(1, ids[:, None]).squeeze(1) - lse)
        same_lse, entropy = sampling.invariant_logsumexp_and_entropy(scaled)
        assert torch.equal(same_lse, lse)
        logp = torch.log_softmax(scaled, -1)
        torch.testing.assert_close(entropy, -(logp.exp() * logp.nan_to_num(neginf=0.0)).sum(-1), rtol=1e-5, atol=1e-5)
        for rows in (slice(2, 5), slice(4, 5)):
            part = sampling.invariant_gumbel_sample(
                scaled[rows],
                temperature[rows],
                seed[rows],
                counter[rows],
                *(t[rows] if t is not None else None for t in (suppress_ids, suppress_left)),
            )
            assert torch.equal(part[0], ids[rows]) and torch.equal(part[1], logprobs[rows])
            assert torch.equal(sampling.invariant_logsumexp(scaled[rows]), lse[rows])


@pytest.mark.parametrize("with_entropy", [False, True])
def test_logprob_chunk_kernels_match_their_torch_versions(with_entropy):
    """One vocabulary chunk's online statistics and its logits gradient: targets inside and outside
    the chunk, a chunk wider than one kernel block and not a multiple of it."""
    rows, cols, v0 = 5, 2500, 1000
    logits = _randn(rows, cols, scale=3)
    targets = torch.tensor([1000, 3499, 999, 2000, 5000])
    state = [_randn(rows, seed=s) for s in (1, 2, 3, 4)]
    state[1], state[2] = state[1].abs(), state[2].abs()
    got, want = [t.clone() for t in state], [t.clone() for t in state]
    logprob._chunk_stats_triton(logits.clone(), targets, v0, 0.8, with_entropy, *got)
    logprob._chunk_stats_torch(logits.clone(), targets, v0, 0.8, with_entropy, *want)
    for g, w in zip(got if with_entropy else got[:2] + got[3:], want if with_entropy else want[:2] + want[3:]):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    lse, grad_lp = torch.logsumexp(logits * 0.8, 1), _randn(rows, seed=5)
    entropy, grad_ent = (_randn(rows, seed=6).abs(), _randn(rows, seed=7)) if with_entropy else (None, None)
    args = (targets, v0, 0.8, lse, grad_lp, entropy, grad_ent, torch.float32)
    torch.testing.assert_close(
        logprob._chunk_grad_triton(logits.clone(), *args), logprob._chunk_grad_torch(logits.clone(), *args), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("rank", [8, 64, 96], ids=["padded", "one-chunk", "two-chunks"])
def test_lora_merge_kernel_matches_the_torch_merge(rank):
    """W + scale * B A: a rank below tl.dot's 16 (masked up), one chunk, and two chunks, the last
    partial; row and column tiles partial too; fp32 and bf16 results. (The interpreter truncates
    where the GPU rounds to nearest, so A and B are rounded to W's dtype before the kernel here.)"""
    rows, cols = 200, 150
    weight = _randn(rows, cols, scale=0.02).bfloat16()
    a, b = _randn(rank, cols, seed=1, scale=0.1), _randn(rows, rank, seed=2, scale=0.1)
    exact = (b.bfloat16().float() @ a.bfloat16().float()) * 0.5 + weight.float()
    got = lora_merge._launch(weight, a, b, 0.5, torch.float32)
    torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
    rounded = lora_merge._launch(weight, a, b, 0.5, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16  # within one bf16 step: the interpreter truncates, the GPU rounds
    assert ((rounded.float() - exact).abs() <= exact.abs() * 2**-7).all()
    with pytest.raises(AssertionError):
        lora_merge._launch(weight, a[:, :-1], b, 0.5, torch.bfloat16)
