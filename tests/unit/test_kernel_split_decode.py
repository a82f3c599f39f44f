"""Split-KV decode (flash-decoding) against the unsplit kernel, in fp32: splitting the context over
programs and merging their partial softmaxes must not move the output by more than 1e-5, launched
eagerly or replayed from a CUDA graph, at Qwen3-4B's heads (32 query, 8 kv, head_dim 128) and long
contexts, where the engine splits. The CPU path is the plain-torch reference, which never splits:
these tests need the Triton kernel."""

import pytest
import torch

from colocate.kernels import paged_attention
from colocate.kernels.paged_attention import DecodeConfig, paged_decode_attention, reference_paged_decode_attention
from tests.helpers import cuda_graph_of
from tests.unit.test_kernel_paged_attention import _paged_inputs

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
SCALE = 128**-0.5
TOL = dict(atol=1e-5, rtol=1e-5)


def _inputs(context_lens, seed, **sizes):
    return _paged_inputs(context_lens, dtype=torch.float32, device="cuda", seed=seed, **HEADS, **sizes)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 4, 8, 16])
@pytest.mark.parametrize("block_n", [16, 64])
def test_split_equals_unsplit_in_fp32(num_splits, block_n):
    """Contexts shorter than one tile per split, on tile edges and up to 8k; a padded row (0)."""
    inputs = _inputs([1, 15, 16, 700, 0, 2049, 4096, 8191], seed=0)
    unsplit = paged_attention._paged_decode_triton(*inputs, SCALE, DecodeConfig(block_n=block_n))
    split = paged_attention._paged_decode_triton(*inputs, SCALE, DecodeConfig(block_n=block_n, num_splits=num_splits))
    torch.testing.assert_close(split, unsplit, **TOL)
    assert split[4].abs().max() == 0


@pytest.mark.gpu
def test_split_replayed_from_a_cuda_graph_equals_unsplit_eager():
    """The public call as the engine's decode graph makes it: captured once at batch 8 with room for
    8k tokens (decode_config splits there), replayed with other lengths, tables, queries and K/V."""
    sizes = dict(num_blocks=8 * 520, max_blocks=520)
    static = [t.clone() for t in _inputs([8000, 1, 300, 4096, 0, 17, 8191, 2048], seed=1, **sizes)]
    q, k_cache, v_cache, tables, lens = static
    assert paged_attention.decode_config(8, 8, 128, tables.shape[1] * 16, q.device).num_splits > 1

    graph, out = cuda_graph_of(lambda: paged_decode_attention(*static, SCALE))

    for seed, lengths in ((2, [5, 8190, 0, 1024, 4097, 256, 3, 6000]), (3, [8192] * 8)):
        for buffer, fresh in zip(static, _inputs(lengths, seed=seed, **sizes)):
            buffer.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        unsplit = paged_attention._paged_decode_triton(*static, SCALE, DecodeConfig())
        torch.testing.assert_close(out, unsplit, **TOL)
        want = reference_paged_decode_attention(*static, SCALE)  # the fp32 tolerance of the kernel's own tests
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
