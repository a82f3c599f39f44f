"""FP8 (e4m3) paged KV cache: store_kv's quantization per (token, kv head) within e4m3's rounding;
decode attention over the fp8 cache equal to dense attention over its dequantized values, and
within a bound derived from those rounding errors of attention over the original K/V; gather_kv's
dequantized rows. On CUDA: the Triton store kernel writes the CPU path's bytes, the decode kernel
(unsplit and split) matches the reference, and a captured store + decode replays as it runs eagerly."""

import pytest
import torch

from colocate.kernels import paged_attention
from colocate.kernels.fp8 import E4M3, E4M3_MAX
from colocate.kernels.paged_attention import (
    DecodeConfig,
    gather_kv,
    kv_bytes_per_token,
    paged_decode_attention,
    reference_paged_decode_attention,
    store_kv,
)
from tests.helpers import cuda_graph_of
from tests.unit.test_kernel_paged_attention import _dense_attention, _paged_inputs

NORMAL_ERROR = 2**-4
"""e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself."""
SUBNORMAL_ERROR = 2**-10
"""Below 2^-6 the spacing is 2^-9: a quantized x / s moves by at most 2^-10, x by 2^-10 * s."""
FP32_SLACK = 1 + 2**-16
"""The division by s and the product with it round in fp32 (2^-24 each)."""


def _empty_fp8_cache(shape, device="cpu"):
    """Caches and scales holding sentinels (3.0 and -1) that no store writes."""
    caches = [torch.full(shape, 3.0, device=device).to(E4M3) for _ in range(2)]
    scales = [torch.full(shape[:3], -1.0, device=device) for _ in range(2)]
    return caches[0], caches[1], scales[0], scales[1]


def _quantize_caches(k_cache, v_cache):
    """Every slot of two dense caches through store_kv (the CPU path): (k8, v8, k_scale, v_scale)."""
    k8, v8, k_scale, v_scale = _empty_fp8_cache(k_cache.shape)
    slots = torch.arange(k_cache.shape[0] * k_cache.shape[1])
    store_kv(k_cache.cpu().flatten(0, 1), v_cache.cpu().flatten(0, 1), k8, v8, slots, k_scale, v_scale)
    return k8, v8, k_scale, v_scale


def _dequantize(x8, scale):
    return x8.float() * scale[..., None]


def _bits(t):
    """A tensor on the CPU, an fp8 one as its bytes (torch.equal then compares bit patterns)."""
    return t.cpu().view(torch.uint8) if t.dtype == E4M3 else t.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_quantizes_each_row_within_e4m3_rounding(dtype):
    """Rows of magnitudes from 1e-3 to 1e2, elements 1e-5 of their row's (x / s among e4m3's
    subnormals), an all-zero row and an outlier; the scale is the row's amax / 448, every element
    within its rounding bound, the amax element reproduced to fp32 rounding; skipped slots (-1) and
    the rest of the cache untouched."""
    num_blocks, block_size, num_kv_heads, head_dim = 6, 16, 3, 64
    gen = torch.Generator().manual_seed(0)
    magnitudes = torch.logspace(-3, 2, 12)[:, None, None]  # (N, 1, 1)
    k = (torch.randn(12, num_kv_heads, head_dim, generator=gen) * magnitudes).to(dtype)
    v = torch.randn(12, num_kv_heads, head_dim, generator=gen).to(dtype)
    k[3, 1] = 0
    k[7, :, :16] *= 1e-5
    assert (k[7, :, :16].abs() < 2**-6 * k[7].abs().amax(-1, keepdim=True) / E4M3_MAX).all()  # x / s subnormal
    v[5, 0, 7] = 200.0
    slots = torch.tensor([0, 17, -1, 33, 95, 5, -1, 40, 41, 42, 64, 2])
    k8, v8, k_scale, v_scale = _empty_fp8_cache((num_blocks, block_size, num_kv_heads, head_dim))
    store_kv(k, v, k8, v8, slots, k_scale, v_scale)

    keep = slots >= 0
    blocks, offsets = slots[keep] // block_size, slots[keep] % block_size
    for x, x8, scale in ((k, k8, k_scale), (v, v8, v_scale)):
        rows = x[keep].float()  # (n, Hk, D)
        amax = rows.abs().amax(-1)  # (n, Hk)
        s = scale[blocks, offsets]  # (n, Hk)
        assert torch.equal(s, amax.clamp(min=1e-12) / E4M3_MAX)
        got = _dequantize(x8[blocks, offsets], s)  # (n, Hk, D)
        bound = (NORMAL_ERROR * rows.abs() + SUBNORMAL_ERROR * s[..., None]) * FP32_SLACK
        assert ((got - rows).abs() <= bound).all()
        top = rows.abs().argmax(-1, keepdim=True)
        torch.testing.assert_close(got.gather(-1, top), rows.gather(-1, top), rtol=2**-22, atol=0)
        untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
        untouched[slots[keep]] = False
        assert (x8.flatten(0, 1)[untouched].float() == 3.0).all()
        assert (scale.flatten(0, 1)[untouched] == -1.0).all()
    assert (k8[2, 1, 1].float() == 0).all() and k_scale[2, 1, 1] == 1e-12 / E4M3_MAX  # the zero row (slot 33)
    assert v8[0, 5, 0, 7].float() == E4M3_MAX  # the outlier owns its row's scale (slot 5)


def _rounding_bound(q, k_cache, v_cache, k_deq, v_deq, tables, context_lens, scale):
    """How far attention over the dequantized K/V may be from attention over K/V, per (b, h, d).

    With score errors |s'_n - s_n| <= delta, every probability moves by a factor within
    exp(+-2 delta), so sum |p' - p| <= expm1(2 delta); then
    |sum p' v' - sum p v| <= max_n |v'_n - v_n| + expm1(2 delta) * max_n |v_n - c| for any c (the
    probabilities' change sums to 0), c the midrange here. delta is measured on the data."""
    batch, num_q_heads, head_dim = q.shape
    block_size, group = k_cache.shape[1], num_q_heads // k_cache.shape[2]
    bound = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        positions = torch.arange(int(context_lens[b]))
        if not len(positions):
            continue
        blocks, offsets = tables[b, positions // block_size].long(), positions % block_size
        k, v = k_cache[blocks, offsets].double(), v_cache[blocks, offsets].double()  # (L, Hk, D)
        dk, dv = k_deq[blocks, offsets].double() - k, v_deq[blocks, offsets].double() - v
        for h in range(num_q_heads):
            delta = (dk[:, h // group] @ q[b, h].double() * scale).abs().max()
            vh = v[:, h // group]  # (L, D)
            spread = (vh.amax(0) - vh.amin(0)) / 2
            bound[b, h] = dv[:, h // group].abs().amax(0) + torch.expm1(2 * delta) * spread
    return bound


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_over_an_fp8_cache(group, block_size, dtype):
    """Equal to fp64 attention over the dequantized cache (to fp32 rounding, or to the bf16 output's),
    within the derived rounding bound of attention over the original K/V (exactly reached at a
    context of one token, whose output is its value: errors up to 0.09 here; 0.01 to 0.07 at longer
    contexts, against bounds of 0.4 to 0.7); a padded row (context 0) gives zeros; contexts of one
    token, one block, and not a multiple of the block."""
    num_kv_heads, head_dim = 2, 64
    context_lens = [0, 1, block_size, 45, 3 * block_size + 5]
    q, k_cache, v_cache, tables, lens = _paged_inputs(
        context_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, dtype
    )
    k8, v8, k_scale, v_scale = _quantize_caches(k_cache, v_cache)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k8, v8, tables, lens, scale, k_scale, v_scale)
    assert got.shape == q.shape and got.dtype == dtype
    assert got[0].abs().max() == 0
    k_deq, v_deq = _dequantize(k8, k_scale), _dequantize(v8, v_scale)
    exact = _dense_attention(q, k_deq, v_deq, tables, lens, scale)
    output_rounding = 2**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.double(), exact, rtol=output_rounding, atol=1e-6)
    original = _dense_attention(q, k_cache, v_cache, tables, lens, scale)
    bound = _rounding_bound(q, k_cache, v_cache, k_deq, v_deq, tables, lens, scale)
    assert ((got.double() - original).abs() <= bound + output_rounding * original.abs() + 1e-6).all()


def test_gather_kv_returns_dequantized_rows_and_plain_rows():
    _, k_cache, v_cache, _, _ = _paged_inputs([40], 4, 2, 64, 16)
    k8, v8, k_scale, v_scale = _quantize_caches(k_cache, v_cache)
    slots = torch.tensor([5, 0, 77, 5, 31])
    k, v = gather_kv(k8, v8, slots, torch.bfloat16, k_scale, v_scale)
    assert k.shape == v.shape == (5, 2, 64) and k.dtype == v.dtype == torch.bfloat16
    for i, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, 16)
        assert torch.equal(k[i], (k8[block, offset].float() * k_scale[block, offset, :, None]).bfloat16())
        assert torch.equal(v[i], (v8[block, offset].float() * v_scale[block, offset, :, None]).bfloat16())
    k, v = gather_kv(k_cache, v_cache, slots, torch.float32)
    assert torch.equal(k, k_cache.flatten(0, 1)[slots]) and torch.equal(v, v_cache.flatten(0, 1)[slots])


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(8, 128, E4M3) == 2 * 8 * (128 + 4)
    assert kv_bytes_per_token(8, 128, torch.bfloat16) == 2 * 8 * 128 * 2
    assert kv_bytes_per_token(2, 64, torch.float32) == 2 * 2 * 64 * 4
    with pytest.raises(ValueError, match="KV cache dtype"):
        kv_bytes_per_token(8, 128, torch.int8)


def test_bad_scales_raise():
    shape = (4, 16, 2, 64)
    k8, v8, k_scale, v_scale = _empty_fp8_cache(shape)
    k, slots = torch.randn(3, 2, 64), torch.zeros(3, dtype=torch.int64)
    q, tables, lens = torch.randn(1, 4, 64), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        store_kv(k, k, k8, v8, slots)
    with pytest.raises(ValueError, match="needs k_scale and v_scale"):
        paged_decode_attention(q, k8, v8, tables, lens, 1.0, k_scale)
    with pytest.raises(ValueError, match="belong with"):
        store_kv(k, k, torch.zeros(shape), torch.zeros(shape), slots, k_scale, v_scale)
    with pytest.raises(ValueError, match="v_scale must be"):
        store_kv(k, k, k8, v8, slots, k_scale, v_scale[:, :8])
    with pytest.raises(ValueError, match="k_scale must be"):
        gather_kv(k8, v8, slots, torch.float32, k_scale.bfloat16(), v_scale)
    with pytest.raises(ValueError, match="share strides"):
        store_kv(k, k, k8, v8, slots, k_scale, v_scale.transpose(0, 1).contiguous().transpose(0, 1))
    with pytest.raises(ValueError, match="q dtype"):
        paged_decode_attention(q.double(), k8, v8, tables, lens, 1.0, k_scale, v_scale)
    with pytest.raises(ValueError, match="k and v must share"):
        store_kv(k.half(), k, k8, v8, slots, k_scale, v_scale)


def _fp8_inputs(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, seed=0, **sizes):
    """_paged_inputs quantized on the CPU, then moved to CUDA with q in bf16."""
    q, k_cache, v_cache, tables, lens = _paged_inputs(
        context_lens, num_q_heads, num_kv_heads, head_dim, block_size, seed=seed, **sizes
    )
    k8, v8, k_scale, v_scale = _quantize_caches(k_cache, v_cache)
    cuda = [t.cuda() for t in (q.bfloat16(), k8, v8, tables, lens, k_scale, v_scale)]
    return cuda[:5], cuda[5:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_triton_store_writes_the_cpu_bytes(dtype, head_dim):
    """The kernel's IEEE divisions and round-to-nearest cast give the CPU path's bytes and scales."""
    shape = (6, 16, 2, head_dim)
    gen = torch.Generator().manual_seed(0)
    k = (torch.randn(9, 2, head_dim, generator=gen) * torch.logspace(-3, 2, 9)[:, None, None]).to(dtype)
    v = torch.randn(9, 2, head_dim, generator=gen).to(dtype)
    k[4, 1] = 0
    slots = torch.tensor([3, -1, 22, 0, 95, -1, 50, 51, 70])
    want = _empty_fp8_cache(shape)
    store_kv(k, v, *want[:2], slots, *want[2:])
    got = _empty_fp8_cache(shape, "cuda")
    store_kv(k.cuda(), v.cuda(), *got[:2], slots.cuda(), *got[2:])
    for g, w in zip(got, want):
        assert torch.equal(_bits(g), _bits(w))


@pytest.mark.gpu
@pytest.mark.parametrize("block_n, num_splits", [(16, 1), (64, 1), (64, 4), (128, 2)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [(8, 2, 64, 16), (8, 8, 128, 32), (32, 8, 128, 16)])
def test_triton_decode_over_an_fp8_cache_matches_the_reference(
    block_n, num_splits, num_q_heads, num_kv_heads, head_dim, block_size
):
    """bf16 queries over fp8 tiles, tiles inside one cache block and over several, with and without
    splits; the bf16 kernel's tolerance (its p is rounded to bf16 alike)."""
    inputs, scales = _fp8_inputs([1, block_size, 700, 129, 0, 64 * 5], num_q_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    config = DecodeConfig(block_n=block_n, num_splits=num_splits)
    got = paged_attention._paged_decode_triton(*inputs, scale, config, *scales)
    want = reference_paged_decode_attention(*inputs, scale, *scales)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=1.5e-2, rtol=1.5e-2)
    assert got[4].abs().max() == 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_decode_over_an_fp8_cache_in_fp32_and_fp16(dtype):
    """fp32 queries (IEEE products) agree to fp32 rounding; fp16 queries over values of size 1e-3,
    whose scales (~2e-6) times p would be fp16 subnormals, keep fp16's precision."""
    _, k_cache, v_cache, tables, lens = _paged_inputs([1, 16, 700, 129, 0, 320], 16, 2, 128, 16)
    q = torch.randn(6, 16, 128, generator=torch.Generator().manual_seed(5))
    k8, v8, k_scale, v_scale = (t.cuda() for t in _quantize_caches(k_cache, v_cache * 1e-3))
    inputs = (q.to(dtype).cuda(), k8, v8, tables.cuda(), lens.cuda())
    for config in (DecodeConfig(), DecodeConfig(num_splits=4)):
        got = paged_attention._paged_decode_triton(*inputs, 128**-0.5, config, k_scale, v_scale)
        want = reference_paged_decode_attention(*inputs, 128**-0.5, k_scale, v_scale)
        tol = 1e-4 if dtype == torch.float32 else 2e-3
        torch.testing.assert_close(got.float() * 1e3, want.float() * 1e3, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_fp8_public_path_splits():
    """Two long sequences over two kv heads: decode_config splits, and the public call matches."""
    inputs, scales = _fp8_inputs([3000, 2500], 16, 2, 128, 16)
    assert paged_attention.decode_config(2, 2, 128, inputs[3].shape[1] * 16, inputs[0].device).num_splits > 1
    got = paged_decode_attention(*inputs, 128**-0.5, *scales)
    want = reference_paged_decode_attention(*inputs, 128**-0.5, *scales)
    torch.testing.assert_close(got.float(), want.float(), atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_fp8_store_and_decode_replay_from_a_cuda_graph_as_eager(num_splits):
    """Capture store + decode once on static buffers, replay with new lengths, tables, queries and
    K/V: the same output as the same step run eagerly, the stored rows those of the CPU path."""
    batch, num_q_heads, num_kv_heads, head_dim, block_size = 4, 14, 2, 64, 16
    sizes = dict(num_blocks=20, max_blocks=12)
    first, first_scales = _fp8_inputs([40, 1, 100, 16], num_q_heads, num_kv_heads, head_dim, block_size, seed=1, **sizes)
    q, k8, v8, tables, lens = (t.clone() for t in first)
    k_scale, v_scale = (t.clone() for t in first_scales)
    new_k = torch.zeros(batch, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    new_v = torch.zeros_like(new_k)
    slots = torch.full((batch,), -1, device="cuda", dtype=torch.int64)
    config = DecodeConfig(num_splits=num_splits)

    def step():
        store_kv(new_k, new_v, k8, v8, slots, k_scale, v_scale)
        return paged_attention._paged_decode_triton(q, k8, v8, tables, lens, 0.125, config, k_scale, v_scale)

    graph, out = cuda_graph_of(step)

    second, second_scales = _fp8_inputs([7, 150, 33, 0], num_q_heads, num_kv_heads, head_dim, block_size, seed=2, **sizes)
    for static, fresh in zip((q, k8, v8, tables, lens, k_scale, v_scale), (*second, *second_scales)):
        static.copy_(fresh)
    gen = torch.Generator().manual_seed(3)
    new_k.copy_(torch.randn(new_k.shape, generator=gen))
    new_v.copy_(torch.randn(new_v.shape, generator=gen) * 5)
    slots.copy_(torch.tensor([0, -1, -1, 5], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    eager = step()  # storing the same rows again leaves the cache as the replay left it
    assert torch.equal(out, eager)
    want = reference_paged_decode_attention(q, k8, v8, tables, lens, 0.125, k_scale, v_scale)
    torch.testing.assert_close(out.float(), want.float(), atol=1.5e-2, rtol=1.5e-2)
    cpu = _empty_fp8_cache((1, 1, num_kv_heads, head_dim))
    store_kv(new_k[3:].cpu(), new_v[3:].cpu(), *cpu[:2], torch.zeros(1, dtype=torch.int64), *cpu[2:])
    for cache, row in zip((k8, v8, k_scale, v_scale), cpu):
        assert torch.equal(_bits(cache.flatten(0, 1)[5]), _bits(row[0, 0]))
