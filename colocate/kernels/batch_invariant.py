"""Batch-invariant numerics: every token's result independent of the batch it is computed in.

With `algorithm.true_on_policy`, the log-prob the engine returns for a sampled token must equal,
bit for bit, the one the trainer computes for it. The engine computes a token in a prefill chunk
or a decode step beside whatever else is running; the trainer computes it inside a packed
sequence. Their results agree only if every operation gives a row the same result whatever the
other rows are, in the same order of floating-point operations:

- matrix products: BLAS picks its kernel by shape, and a product of 1-7 rows takes another path
  than one of many (the results differ in the last bits). `enable` replaces the CPU kernels of
  aten::mm and aten::addmm with one fixed-shape path: rows padded to a multiple of 16 (at least
  16) through one batched GEMM, whose result for a row depends on that row alone; on CUDA, with
  one Triton GEMM that sums K in fixed chunks, in order, each chunk in fixed steps of K, whatever
  tile the product's shape picks and however the chunks are spread over programs
  (kernels/batch_invariant_cuda.py). The
  lm_head's fp32 logits come from `logits`, one function for the engine and the trainer;
- attention: `attention` walks each query's keys in fixed chunks of CHUNK positions from position
  0, with an online softmax, whatever the query count or where the keys come from (a packed
  sequence, a prefill chunk, the paged cache). Chunks past a query's position are fully masked and
  change nothing (their update is an exact no-op: a factor of 1 and a sum of zeros). On CUDA one
  Triton kernel does the same in blocks of its own (kernels/invariant_attention.py);
- the log-prob itself: the scaled logit minus the row's logsumexp, one definition for the sampler
  and the trainer (`kernels.sampling.sampled_logprobs`); on CUDA the sampler draws the token and
  subtracts that logsumexp in one pass (`kernels.sampling.invariant_gumbel_sample`);
- SiLU: the CPU's vectorised sigmoid rounds a vector's tail elements otherwise than the others;
  `enable` computes it from exp (which rounds alike everywhere) instead. CUDA's elementwise kernels
  apply one scalar formula to every element;
- row-wise reductions: on the CPU, those of a fixed length (RMSNorm's mean, logsumexp) already give
  each row the same result in any batch. On CUDA torch's reduction kernels shape their thread
  blocks by the number of rows, so RMSNorm (and qk-norm) and the log-prob's logsumexp run as Triton
  kernels with a fixed reduction order (the logsumexp in a fixed number of slices per row);
- the rotary embedding: the engine rotates q/k with the trainer's op (`kernels.rotary.rotate`),
  whose CUDA kernel rounds once where the engine's plain ops round after each product.

The CPU path is fp32; CUDA takes bf16 (fp16, fp32) with fp32 accumulation. The model calls these
through opaque custom ops (kernels/invariant_ops.py), so the trainer's compiled blocks
(`model.compile`) run the same kernels as eager code. The engine's decode is not compiled in the
mode: it would compute the rotary tables with inductor's own cos/sin, which the trainer computes
eagerly.

The mode is chosen once at start: `kernels.ops.Ops.true_on_policy(device)` calls `enable` (the aten
overrides and inductor's precision-cast emulation, which are process-wide by nature) and returns the
table of the mode's implementations that the run hands to its models, trainer and engine. No code
path asks `enabled()`, which only reports whether the overrides are installed (`disable` removes
them, for tests).
"""

from __future__ import annotations

import warnings

import torch

CHUNK = 16
"""Keys per attention chunk, counted from position 0 of the sequence."""
ROWS = 16
"""Row multiple of every matrix product in the mode."""

_library: torch.library.Library | None = None
_casts_before: bool = False
"""inductor's emulate_precision_casts before `enable`, restored by `disable`."""


def enabled() -> bool:
    """Whether `enable` has switched aten's kernels (for tests: code takes its table, kernels.ops)."""
    return _library is not None


def enable(device: torch.device) -> None:
    """Switch this process's aten::mm, addmm and SiLU kernels (and inductor's precision-cast emulation)
    to the mode's (idempotent). Called by `kernels.ops.Ops.true_on_policy`, which builds the rest."""
    global _library, _casts_before
    if device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"algorithm.true_on_policy: bitwise-equal log-probs are implemented for the CPU and CUDA paths, not {device.type}"
        )
    if _library is not None:
        return
    library = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="(?s).*Overriding a previously registered kernel")
        library.impl("mm", _mm, "CPU")
        library.impl("addmm", _addmm, "CPU")
        library.impl("silu", _silu, "CPU")
        if device.type == "cuda":
            from colocate.kernels import batch_invariant_cuda

            library.impl("mm", batch_invariant_cuda.mm, "CUDA")
            library.impl("addmm", batch_invariant_cuda.addmm, "CUDA")
    import torch._inductor.config as inductor_config

    _casts_before = inductor_config.emulate_precision_casts
    inductor_config.emulate_precision_casts = True  # see kernels/invariant_ops.py
    _library = library


def disable() -> None:
    global _library
    if _library is not None:
        _library._destroy()
        _library = None
        import torch._inductor.config as inductor_config

        inductor_config.emulate_precision_casts = _casts_before


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The lm_head's logits (T, V) fp32 from hidden (T, H) and weight (V, H), as the engine and the
    trainer both compute them in the mode: accumulated in fp32 and never rounded to half precision
    on CUDA."""
    if hidden.is_cuda:
        from colocate.kernels import batch_invariant_cuda

        return batch_invariant_cuda.logits(hidden, weight)
    return torch.nn.functional.linear(hidden, weight).float()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The engine's decode attention in the mode: one query per sequence, q (B, Hq, D), at position
    context_lens - 1 over its keys in the paged cache (num_blocks, block_size, Hk, D). On CUDA the
    mode's Triton kernel (kernels/invariant_attention.py); elsewhere the fixed chunk order of
    `attention`, a row at a time (rows with no context stay zero)."""
    if q.is_cuda:
        from colocate.kernels import invariant_attention

        return invariant_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    out = torch.zeros_like(q)  # (B, Hq, D)
    block_size = k_cache.shape[1]
    for row, ctx in enumerate(context_lens.tolist()):
        if ctx == 0:
            continue
        blocks = block_tables[row, : -(-ctx // block_size)].long()
        keys, values = (c[blocks].flatten(0, 1)[:ctx] for c in (k_cache, v_cache))  # (ctx, Hk, D)
        out[row] = attention(q[row : row + 1], keys, values, torch.tensor([ctx - 1], device=q.device), scale)[0]
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    rows = a.shape[0]
    pad = max(ROWS, -(-rows // ROWS) * ROWS) - rows
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    return torch.bmm(a.unsqueeze(0), b.unsqueeze(0))[0, :rows]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = _mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


def _silu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x) from exp and a division: the CPU's vectorised sigmoid rounds the elements of a
    vector's tail otherwise than the rest, so a token's result would depend on its place in the batch."""
    return x / (1 + torch.exp(-x))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence's queries over its keys, in the fixed chunk order.

    q (Nq, Hq, D) at sequence positions `positions` (Nq,); k, v (Nk, Hk, D) for positions
    0..Nk-1 (Nk > every query position) -> (Nq, Hq, D)."""
    num_q, heads, dim = q.shape
    group = heads // k.shape[1]
    if group > 1:  # one key head per query head (an exact copy)
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    last = int(positions.max()) + 1 if num_q else 0
    f32 = dict(dtype=torch.float32, device=q.device)
    run_max = torch.full((num_q, heads), float("-inf"), **f32)
    run_sum = torch.zeros((num_q, heads), **f32)
    acc = torch.zeros((num_q, heads, dim), **f32)
    qf = q.float()[:, :, None, :]  # (Nq, H, 1, D)
    for start in range(0, last, CHUNK):
        keys = torch.zeros((CHUNK, heads, dim), **f32)
        values = torch.zeros((CHUNK, heads, dim), **f32)
        stop = min(start + CHUNK, k.shape[0])
        keys[: stop - start], values[: stop - start] = k[start:stop].float(), v[start:stop].float()
        scores = (qf * keys.transpose(0, 1)[None]).sum(-1) * scale  # (Nq, H, CHUNK)
        key_pos = torch.arange(start, start + CHUNK, device=q.device)
        scores = scores.masked_fill(key_pos[None, None, :] > positions[:, None, None], float("-inf"))
        new_max = torch.maximum(run_max, scores.amax(-1))  # (Nq, H)
        alpha = torch.exp(run_max - new_max)
        p = torch.exp(scores - new_max[..., None])  # (Nq, H, CHUNK)
        run_sum = run_sum * alpha + p.sum(-1)
        weighted = (p[..., None, :] * values.permute(1, 2, 0)[None]).sum(-1)  # (Nq, H, D)
        acc = acc * alpha[..., None] + weighted
        run_max = new_max
    return (acc / run_sum[..., None]).to(q.dtype)
