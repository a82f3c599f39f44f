"""The batch-invariant CUDA kernels in bf16: each row's bits independent of the rows beside it,
and the values within rounding of an fp32 reference."""

import pytest
import torch
import torch.nn.functional as F

from colocate.kernels import batch_invariant, batch_invariant_cuda, invariant_attention, invariant_ops
from colocate.kernels.ops import Ops
from colocate.kernels.sampling import (
    invariant_logsumexp,
    invariant_logsumexp_and_entropy,
    sampled_logprobs,
    scale_logits,
)
from colocate.rollout.native.sampler import SamplingBatch
from colocate.rollout.protocol import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture
def invariant():
    """The mode's table; building it switches aten's products to the mode's."""
    yield Ops.true_on_policy(torch.device("cuda"))
    batch_invariant.disable()


def _bf16(*shape, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).bfloat16()


def test_linear_rows_do_not_depend_on_the_batch(invariant):
    torch.manual_seed(0)
    x, weight, bias = _bf16(64, 1536), _bf16(8960, 1536, scale=0.02), _bf16(8960)
    full = F.linear(x, weight, bias)  # aten::addmm with the transposed weight view
    ref = x.float() @ weight.float().T + bias.float()
    torch.testing.assert_close(full.float(), ref, rtol=1e-2, atol=1e-2)
    for m in (1, 3, 16, 17, 64):
        for start in sorted({0, 5, 64 - m}):
            assert torch.equal(F.linear(x[start : start + m], weight, bias), full[start : start + m]), (m, start)
            assert torch.equal(F.linear(x[start : start + m], weight), F.linear(x, weight)[start : start + m])
    # A column does not depend on the other columns either (packed gate/up vs separate projections).
    assert torch.equal(F.linear(x, weight[:4480]), F.linear(x, weight)[:, :4480])
    logits = batch_invariant.logits(x, weight)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, x.float() @ weight.float().T, rtol=1e-4, atol=1e-4)
    assert torch.equal(batch_invariant.logits(x[7:8], weight), logits[7:8])


def test_split_k_chunks_give_the_bits_of_one_program_walking_them():
    """A decode step's product (fewer tiles than SMs) computes each K chunk in a program of its own;
    a tall one walks them in one program. A row comes out the same either way (1.5B's down
    projection: K = 8960, three chunks)."""
    torch.manual_seed(0)
    x, weight, bias = _bf16(4096, 8960), _bf16(1536, 8960, scale=0.02), _bf16(1536)
    tall = batch_invariant_cuda.matmul(x, weight.T, bias)
    torch.testing.assert_close(tall.float(), x.float() @ weight.float().T + bias.float(), rtol=1e-2, atol=1e-2)
    for m in (1, 7, 256):
        rows = x[100 : 100 + m]
        assert torch.equal(batch_invariant_cuda.matmul(rows, weight.T, bias), tall[100 : 100 + m]), m
        assert torch.equal(
            batch_invariant_cuda.matmul(rows, weight.T, bias, split=True),
            batch_invariant_cuda.matmul(rows, weight.T, bias, split=False),
        ), m
    assert torch.equal(batch_invariant_cuda.matmul(x, weight.T, bias, split=True), tall)


@pytest.mark.parametrize(
    "n, k, out_dtype",
    [(2048, 1536, None), (17920, 1536, None), (1536, 8960, None), (1152, 896, None), (151936, 896, torch.float32)],
    ids=["qkv_1.5b", "gate_up_1.5b", "down_1.5b", "qkv_0.5b", "lm_head_0.5b"],
)
def test_every_tile_config_gives_a_row_the_same_bits(n, k, out_dtype):
    """The product's shape picks its tile (TILES: 128 x 256 on two warpgroups down to 64 x 64 on
    one), and a token's row must not change with it: each config, the pick at every M from a decode
    step to a training micro-batch, and the split launch give one set of bits."""
    torch.manual_seed(0)
    x, weight = _bf16(4096, k), _bf16(n, k, scale=k**-0.5)
    want = batch_invariant_cuda.matmul(x, weight.T, out_dtype=out_dtype)
    torch.testing.assert_close(want.float(), x.float() @ weight.float().T, rtol=2e-2, atol=2e-2)
    chunks = -(-k // batch_invariant_cuda.K_CHUNK)
    block_k = batch_invariant_cuda.BLOCK_K[torch.bfloat16]
    for block_m, block_n, warps, stages, wide_only in batch_invariant_cuda.TILES[torch.bfloat16]:
        if wide_only and chunks > 1:
            continue
        config = (block_m, block_n, block_k, warps, stages)
        for split in (False, True) if chunks > 1 else (False,):
            got = batch_invariant_cuda.matmul(x, weight.T, out_dtype=out_dtype, config=config, split=split)
            assert torch.equal(got, want), (config, split)
    for m in (1, 7, 64, 256, 1000, 3000):
        picked = batch_invariant_cuda.tile_config(m, n, k, torch.bfloat16, x.device)
        got = batch_invariant_cuda.matmul(x[:m], weight.T, out_dtype=out_dtype)
        assert torch.equal(got, want[:m]), (m, picked)


def test_row_reductions_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    x, w = _bf16(300, 12, 128, scale=3), _bf16(128) + 1
    full = batch_invariant_cuda.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(full.float(), invariant_ops.reference_rms_norm(x, w, 1e-6).float(), rtol=2e-2, atol=2e-2)
    for m in (1, 3, 16, 17, 64):
        assert torch.equal(batch_invariant_cuda.rms_norm(x[100 : 100 + m], w, 1e-6), full[100 : 100 + m])
    z = torch.randn(256, 151936, device="cuda") * 4
    lse = invariant_logsumexp(z)
    torch.testing.assert_close(lse, torch.logsumexp(z, -1), rtol=1e-5, atol=1e-5)
    for m in (1, 3, 17, 64):
        assert torch.equal(invariant_logsumexp(z[9 : 9 + m]), lse[9 : 9 + m])
    same_lse, entropy = invariant_logsumexp_and_entropy(z)  # the trainer's: the entropy beside
    assert torch.equal(same_lse, lse)
    logp = torch.log_softmax(z, -1)
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), rtol=1e-4, atol=1e-4)


def test_the_samplers_log_prob_at_unit_temperatures_skips_the_quotient_not_its_bits(invariant):
    """The mode's one-pass sampler gives the trainer's log-prob function's bits (the scaled logit
    minus `logsumexp`), at unit temperatures from the logits themselves (no (B, V) quotient made),
    at others from logits / T; and a row's draw and log-prob are the same in a batch of 5 rows."""
    b, v = 64, 151936
    logits = torch.randn(b, v, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 4
    counter = torch.arange(b, device="cuda") + 100

    def batch(temps):
        rows = [(SamplingParams(temperature=t), 7919 * i, frozenset(), 0) for i, t in enumerate(temps)]
        return SamplingBatch.build(rows, v, torch.device("cuda"), invariant)

    unit, mixed = batch([float(i % 2) for i in range(b)]), batch([0.7] + [1.0] * (b - 1))
    assert unit.unit_temperature and not mixed.unit_temperature
    for sampling in (unit, mixed):
        ids, logprobs = sampling.sample(logits, counter)
        scaled = scale_logits(logits, sampling.temperature)
        assert torch.equal(logprobs, sampled_logprobs(scaled, ids, invariant.row_logsumexp(scaled)))
    assert not torch.equal(mixed.sample(logits, counter)[1][:1], unit.sample(logits, counter)[1][:1])
    ids, logprobs = unit.sample(logits, counter)
    few = batch([float(i % 2) for i in range(3, 8)])
    few.seed = unit.seed[3:8]
    part = few.sample(logits[3:8], counter[3:8])
    assert torch.equal(part[0], ids[3:8]) and torch.equal(part[1], logprobs[3:8])


def test_fused_residual_norm_and_gate_product_do_not_depend_on_the_batch():
    """The residual add before RMSNorm and SiLU(gate) * up, each one kernel: the sum is torch's bf16
    sum bit for bit, the rest within bf16 rounding of torch, and every row the same in any batch."""
    torch.manual_seed(0)
    x, delta, w = _bf16(300, 1536, scale=3), _bf16(300, 1536), _bf16(1536) + 1
    total, normed = batch_invariant_cuda.add_rms_norm(x, delta, w, 1e-6)
    assert torch.equal(total, x + delta)
    assert torch.equal(normed, batch_invariant_cuda.rms_norm(x + delta, w, 1e-6))
    gate, up = _bf16(300, 2 * 8960, scale=3).chunk(2, dim=-1)
    product = batch_invariant_cuda.silu_mul(gate, up)
    torch.testing.assert_close(product.float(), (F.silu(gate.float()) * up.float()), rtol=2e-2, atol=2e-2)
    for m in (1, 3, 17, 64):
        rows = slice(100, 100 + m)
        got = batch_invariant_cuda.add_rms_norm(x[rows], delta[rows], w, 1e-6)
        assert torch.equal(got[0], total[rows]) and torch.equal(got[1], normed[rows])
        assert torch.equal(batch_invariant_cuda.silu_mul(gate[rows], up[rows]), product[rows])


def test_packed_prefill_and_decode_attention_agree_bitwise():
    torch.manual_seed(0)
    lens, heads, kv_heads, dim, block_size = [7, 300, 1, 129, 64], 12, 2, 128, 16
    n, scale = sum(lens), dim**-0.5
    q, k, v = _bf16(n, heads, dim), _bf16(n, kv_heads, dim), _bf16(n, kv_heads, dim)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    packed = invariant_attention.packed_attention(q, k, v, cu, scale)
    for s in range(len(lens)):
        a, b = cu[s].item(), cu[s + 1].item()
        ref = invariant_attention.reference_attention(q[a:b], k[a:b], v[a:b], torch.arange(b - a, device="cuda"), scale)
        torch.testing.assert_close(packed[a:b].float(), ref, rtol=2e-2, atol=2e-2)
    # The cache: every sequence in shuffled blocks, unwritten slots NaN.
    k_cache = torch.full((64, block_size, kv_heads, dim), float("nan"), device="cuda").bfloat16()
    v_cache = k_cache.clone()
    free = torch.randperm(64).tolist()
    tables = torch.full((len(lens), 32), -1, dtype=torch.int32, device="cuda")
    for s, length in enumerate(lens):
        for j in range(0, length, block_size):
            tables[s, j // block_size] = block = free.pop()
            rows = slice(cu[s].item() + j, cu[s].item() + min(j + block_size, length))
            k_cache[block, : rows.stop - rows.start], v_cache[block, : rows.stop - rows.start] = k[rows], v[rows]
    chunks = {0: [3, 4], 1: [100, 1, 199], 2: [1], 3: [64, 65], 4: [10, 20, 34]}
    prefilled = torch.zeros_like(q)
    for step in range(3):
        live = [s for s in chunks if step < len(chunks[s])]
        starts = [sum(chunks[s][:step]) for s in live]
        q_lens = [chunks[s][step] for s in live]
        rows = [torch.arange(cu[s].item() + a, cu[s].item() + a + m) for s, a, m in zip(live, starts, q_lens)]
        out = invariant_attention.paged_prefill_attention(
            q[torch.cat(rows)], k_cache, v_cache, tables[live], q_lens, [a + m for a, m in zip(starts, q_lens)], scale
        )
        prefilled[torch.cat(rows)] = out
    assert torch.equal(prefilled, packed)
    decoded = torch.zeros_like(q)
    batch = len(lens) + 3  # three padded rows of no context, as in a captured graph's bucket
    q_static = torch.zeros(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    lens_static = torch.zeros(batch, dtype=torch.int32, device="cuda")
    tables_static = torch.cat([tables, torch.full((3, 32), -1, dtype=torch.int32, device="cuda")])
    invariant_attention.paged_decode_attention(q_static, k_cache, v_cache, tables_static, lens_static, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_static = invariant_attention.paged_decode_attention(q_static, k_cache, v_cache, tables_static, lens_static, scale)
    for j in range(max(lens)):
        live = [s for s in range(len(lens)) if j < lens[s]]
        rows = torch.tensor([cu[s].item() + j for s in live])
        q_static.zero_()
        lens_static.zero_()
        q_static[torch.tensor(live)] = q[rows]
        lens_static[torch.tensor(live)] = j + 1
        graph.replay()
        decoded[rows] = out_static[torch.tensor(live)]
        assert not out_static[len(lens) :].any()
    assert torch.equal(decoded, packed)


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def test_gradients_in_the_mode_leave_its_kernels_and_match_plain_torch(invariant):
    """Backward matrix products run on cuBLAS and the packed attention's backward through the
    default varlen kernel: the gradients match plain torch (fp32 reference) to bf16 rounding."""
    torch.manual_seed(0)
    x = _bf16(300, 1536).requires_grad_()
    weight, bias = _bf16(896, 1536, scale=0.02).requires_grad_(), _bf16(896).requires_grad_()
    g = _bf16(300, 896)
    F.linear(x, weight, bias).backward(g)
    xf, wf, bf = (t.detach().float().requires_grad_() for t in (x, weight, bias))
    F.linear(xf, wf, bf).backward(g.float())
    for got, want in ((x.grad, xf.grad), (weight.grad, wf.grad), (bias.grad, bf.grad)):
        assert _relative_error(got, want) < 1e-2

    lens, heads, kv_heads, dim = [37, 300, 5, 129], 12, 2, 128
    n, scale = sum(lens), dim**-0.5
    q, k, v = (_bf16(n, h, dim).requires_grad_() for h in (heads, kv_heads, kv_heads))
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    g = _bf16(n, heads, dim)
    invariant_ops.attention(q, k, v, cu, max(lens), scale).backward(g)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = torch.cat(
        [
            invariant_attention.reference_attention(qf[a:b], kf[a:b], vf[a:b], torch.arange(b - a, device="cuda"), scale)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())
        ]
    )
    ref.backward(g.float())
    for got, want in ((q.grad, qf.grad), (k.grad, kf.grad), (v.grad, vf.grad)):
        assert _relative_error(got, want) < 2e-2
