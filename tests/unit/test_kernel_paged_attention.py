"""Paged decode attention and store_kv against dense per-sequence attention written out here."""

import pytest
import torch

from colocate.kernels import paged_attention
from colocate.kernels.paged_attention import (
    paged_decode_attention,
    reference_paged_decode_attention,
    store_kv,
)
from tests.helpers import cuda_graph_of


def _paged_inputs(
    context_lens,
    num_q_heads,
    num_kv_heads,
    head_dim,
    block_size,
    dtype=torch.float32,
    device="cpu",
    num_blocks=None,
    max_blocks=None,
    seed=0,
):
    """Random cache whose sequences own shuffled blocks; table rows padded with -1."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(context_lens)
    used = [-(-n // block_size) for n in context_lens]
    max_blocks = max_blocks or max(used) + 2
    num_blocks = num_blocks or sum(used) + 3
    assert max(used) <= max_blocks and sum(used) <= num_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(used):
        tables[b, :n] = order[taken : taken + n].int()
        taken += n
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen)
    to = dict(device=device)
    return (
        q.to(dtype=dtype, **to),
        k_cache.to(dtype=dtype, **to),
        v_cache.to(dtype=dtype, **to),
        tables.to(**to),
        torch.tensor(context_lens, dtype=torch.int32, **to),
    )


def _dense_attention(q, k_cache, v_cache, tables, context_lens, scale):
    """Per sequence and query head: collect its tokens one by one and attend in fp64."""
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        positions = range(int(context_lens[b]))
        if not positions:
            continue
        slots = [(int(tables[b, j // block_size]), j % block_size) for j in positions]
        k = torch.stack([k_cache[blk, off] for blk, off in slots]).double().cpu()  # (L, Hk, D)
        v = torch.stack([v_cache[blk, off] for blk, off in slots]).double().cpu()  # (L, Hk, D)
        for h in range(num_q_heads):
            scores = k[:, h // group] @ q[b, h].double().cpu() * scale  # (L,)
            out[b, h] = torch.softmax(scores, dim=0) @ v[:, h // group]
    return out


@pytest.mark.parametrize("num_q_heads, num_kv_heads", [(4, 4), (8, 4), (14, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [16, 32])
def test_reference_matches_dense(num_q_heads, num_kv_heads, head_dim, block_size):
    context_lens = [1, block_size, 3 * block_size, 45, 2 * block_size + 1]
    inputs = _paged_inputs(context_lens, num_q_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5
    got = paged_decode_attention(*inputs, scale)
    assert got.shape == inputs[0].shape and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _dense_attention(*inputs, scale), atol=1e-5, rtol=1e-5)


def test_context_of_one_returns_its_value_and_zero_context_returns_zero():
    q, k_cache, v_cache, tables, _ = _paged_inputs([1, 1], 4, 2, 64, 16)
    out = paged_decode_attention(q, k_cache, v_cache, tables, torch.tensor([1, 0], dtype=torch.int32), 0.125)
    first = v_cache[tables[0, 0], 0]  # (Hk, D)
    torch.testing.assert_close(out[0], first.repeat_interleave(2, dim=0))
    assert out[1].abs().max() == 0


def test_empty_batch():
    _, k_cache, v_cache, _, _ = _paged_inputs([5], 4, 2, 64, 16)
    out = paged_decode_attention(
        torch.zeros(0, 4, 64), k_cache, v_cache, torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32), 1.0
    )
    assert out.shape == (0, 4, 64)


def test_store_kv_round_trip_skips_minus_one():
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 64
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    k = torch.randn(6, num_kv_heads, head_dim)
    v = torch.randn(6, num_kv_heads, head_dim)
    slots = torch.tensor([0, 7, -1, 21, -1, 5])
    store_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(k_cache[slot // block_size, slot % block_size], k[i])
            assert torch.equal(v_cache[slot // block_size, slot % block_size], v[i])
    written = (k_cache.abs().sum((2, 3)) > 0).sum().item()
    assert written == 4 and (v_cache.abs().sum((2, 3)) > 0).sum().item() == 4


def test_store_then_attend_matches_dense():
    """A sequence written token by token through store_kv attends over exactly those tokens."""
    block_size, num_kv_heads, group, head_dim, length = 16, 2, 3, 64, 37
    k_cache = torch.zeros(8, block_size, num_kv_heads, head_dim)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[5, 2, 7, -1]], dtype=torch.int32)
    positions = torch.arange(length)
    slots = table[0, positions // block_size].long() * block_size + positions % block_size
    k = torch.randn(length, num_kv_heads, head_dim)
    v = torch.randn(length, num_kv_heads, head_dim)
    store_kv(k, v, k_cache, v_cache, slots)
    q = torch.randn(1, num_kv_heads * group, head_dim)
    got = paged_decode_attention(q, k_cache, v_cache, table, torch.tensor([length], dtype=torch.int32), 0.1)
    for h in range(num_kv_heads * group):
        probs = torch.softmax(k[:, h // group] @ q[0, h] * 0.1, dim=0)  # (L,)
        torch.testing.assert_close(got[0, h], probs @ v[:, h // group])


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("q", torch.randn(2, 4, 32), "head_dim"),
        ("q", torch.randn(2, 3, 64), "multiple"),
        ("q", torch.randn(2, 4, 64, dtype=torch.float64), "dtype"),
        ("tables", torch.zeros(2, 3, dtype=torch.int64), "block_tables"),
        ("tables", torch.zeros(3, 3, dtype=torch.int32), "block_tables"),
        ("lens", torch.ones(2, dtype=torch.int64), "context_lens"),
        ("v_cache", torch.zeros(5, 16, 2, 32), "v_cache"),
    ],
)
def test_attention_bad_input_raises(field, value, match):
    args = dict(
        q=torch.randn(2, 4, 64),
        k_cache=torch.zeros(5, 16, 2, 64),
        v_cache=torch.zeros(5, 16, 2, 64),
        tables=torch.zeros(2, 3, dtype=torch.int32),
        lens=torch.ones(2, dtype=torch.int32),
    )
    args[field] = value
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(args["q"], args["k_cache"], args["v_cache"], args["tables"], args["lens"], 1.0)


def test_store_bad_input_raises():
    cache = torch.zeros(4, 16, 2, 64)
    k = torch.randn(3, 2, 64)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(k, k, cache, cache.clone(), torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        store_kv(k.half(), k.half(), cache, cache.clone(), torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="k and v"):
        store_kv(k, k[:2], cache, cache.clone(), torch.zeros(3, dtype=torch.int64))


_GPU_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.5e-2}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block_n, num_splits, num_warps", [(16, 1, 4), (32, 2, 2), (64, 8, 4), (128, 1, 8)])
@pytest.mark.parametrize("num_q_heads, num_kv_heads, head_dim, block_size", [(14, 2, 64, 16), (8, 8, 128, 32), (16, 8, 128, 128)])
def test_triton_matches_reference(dtype, block_n, num_splits, num_warps, num_q_heads, num_kv_heads, head_dim, block_size):
    """Tiles inside one cache block and tiles over several, with and without context splits."""
    context_lens = [1, block_size, 700, 129, 0, 64 * 5]
    inputs = _paged_inputs(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    scale = head_dim**-0.5
    config = paged_attention.DecodeConfig(block_n=block_n, num_splits=num_splits, num_warps=num_warps)
    got = paged_attention._paged_decode_triton(*inputs, scale, config)
    want = reference_paged_decode_attention(*inputs, scale)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), atol=_GPU_TOL[dtype], rtol=_GPU_TOL[dtype])
    assert got[4].abs().max() == 0


@pytest.mark.gpu
def test_split_heuristic_and_public_path():
    """Two long sequences over two kv heads cannot fill the GPU alone: the public call splits."""
    inputs = _paged_inputs([3000, 2500], 16, 2, 128, 16, torch.bfloat16, "cuda")
    assert paged_attention.decode_config(2, 2, 128, inputs[3].shape[1] * 16, inputs[0].device).num_splits > 1
    assert paged_attention.decode_config(1024, 8, 128, 4096, inputs[0].device).num_splits == 1
    got = paged_decode_attention(*inputs, 128**-0.5)
    want = reference_paged_decode_attention(*inputs, 128**-0.5)
    torch.testing.assert_close(got.float(), want.float(), atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.gpu
def test_cuda_kernel_rejects_odd_block_size():
    inputs = _paged_inputs([10], 4, 2, 64, 24, torch.float16, "cuda")
    with pytest.raises(ValueError, match="block_size"):
        paged_decode_attention(*inputs, 0.125)


@pytest.mark.gpu
def test_store_kv_triton_skips_minus_one():
    cache = torch.zeros(6, 4, 2, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(5, 2, 64, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([3, -1, 22, 0, -1], device="cuda")
    k_cache, v_cache = cache.clone(), cache.clone()
    store_kv(k, -k, k_cache, v_cache, slots)
    expected_k, expected_v = cache.clone(), cache.clone()
    keep = slots >= 0
    expected_k.view(24, 2, 64)[slots[keep]] = k[keep]
    expected_v.view(24, 2, 64)[slots[keep]] = -k[keep]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_cuda_graph_capture_and_replay(num_splits):
    """Capture once with static buffers, then replay with new lengths, tables, queries and K/V."""
    batch, num_q_heads, num_kv_heads, head_dim, block_size = 4, 14, 2, 64, 16
    sizes = dict(num_blocks=20, max_blocks=12)
    first = _paged_inputs(
        [40, 1, 100, 16], num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda", seed=1, **sizes
    )
    q, k_cache, v_cache, tables, lens = (t.clone() for t in first)
    new_k = torch.zeros(batch, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    slots = torch.full((batch,), -1, device="cuda", dtype=torch.int64)

    def step():
        store_kv(new_k, new_k, k_cache, v_cache, slots)
        config = paged_attention.DecodeConfig(num_splits=num_splits)
        return paged_attention._paged_decode_triton(q, k_cache, v_cache, tables, lens, 0.125, config)

    graph, out = cuda_graph_of(step)

    second = _paged_inputs(
        [7, 150, 33, 0], num_q_heads, num_kv_heads, head_dim, block_size, torch.bfloat16, "cuda", seed=2, **sizes
    )
    for static, fresh in zip((q, k_cache, v_cache, tables, lens), second):
        static.copy_(fresh)
    new_k.copy_(torch.randn_like(new_k))
    slots.copy_(torch.tensor([0, -1, -1, 5], device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = reference_paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    torch.testing.assert_close(out.float(), want.float(), atol=1.5e-2, rtol=1.5e-2)
    assert torch.equal(k_cache.view(-1, num_kv_heads, head_dim)[5], new_k[3])
