"""Log-probs of target tokens and the entropy, straight from final hidden states and the lm_head.

Why a kernel: an RL micro-batch of 8192 tokens over Qwen's 151936-token vocabulary has 5 GB of
fp32 logits, five times the bf16 weights of a 0.5B model, and autograd would keep several such
tensors alive (logits, log-softmax, probabilities). `token_logprobs` never holds
them: it walks the vocabulary in chunks (and the tokens too when there are many), keeps an online
logsumexp, the target logit and the entropy sum per token in fp32, and its backward recomputes each
chunk's logits instead of storing them. Peak extra memory is one (token chunk x vocab chunk) tile.

Definition, shared with the rollout engine: z = (hidden @ weight.T) / temperature with fp32
accumulation, logprob = z[target] - logsumexp(z), entropy = -sum softmax(z) * log_softmax(z).
Temperature 0 means greedy sampling, whose log-probs use the unscaled logits.

Gradient of one token's outputs w.r.t. its z (p = softmax(z), lp_j = log p_j, H = entropy):
    d logprob / dz_j = onehot_j - p_j
    d H / dz_j       = -p_j (lp_j + H)          (since z_j - E_p[z] = lp_j + H)
so grad_z = g_lp (onehot - p) - g_ent p (lp + H), and grad_logits = grad_z / temperature.

On CUDA the per-chunk elementwise work (online softmax statistics, grad_z) runs in Triton and the
matmuls in cuBLAS with fp32 output; elsewhere the same chunked algorithm runs in plain torch.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd.function import once_differentiable

from colocate.kernels import batch_invariant
from colocate.kernels.sampling import (
    invariant_logsumexp_and_entropy,
    invariant_row_logsumexp,
    sampled_logprobs,
    scale_logits,
)

MAX_CHUNK_ELEMENTS = 1 << 26
"""Elements of one (token chunk x vocab chunk) fp32 logits tile: 256 MiB, which with the tile's
half-precision gradient is the peak extra memory. Smaller tiles launch more kernels per token: a
profile of 0.5B-shape training (16k-token micro-batches, 64 MiB tiles) found this backward
host-bound, its launches taking twice its device time."""
INVARIANT_CHUNK_ELEMENTS = 1 << 29
"""Logits per chunk (2 GiB in fp32) in algorithm.true_on_policy's log-prob, whose matrix product
wants many rows at a time."""

_INIT_MAX = -1e30
"""Running-max start value: finite, so merging an empty accumulator never forms inf - inf."""

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def reference_token_logprobs(
    hidden: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (V, H)
    targets: torch.Tensor,  # (T,)
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The definition written out with full fp32 (or fp64) logits: the oracle for the tests."""
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    logits = hidden.to(dtype) @ weight.to(dtype).T  # (T, V)
    if temperature > 0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # (T, V)
    logprobs = logp.gather(1, targets.long()[:, None]).squeeze(1)  # (T,)
    entropy = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return logprobs, entropy


def token_logprobs(
    hidden: torch.Tensor,  # (T, H)
    weight: torch.Tensor,  # (V, H)
    targets: torch.Tensor,  # (T,) long
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
    chunk_size: int = 8192,
    invariant: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of `targets` (and the entropy) under softmax((hidden @ weight.T) / temperature).

    Returns fp32 (T,) log-probs and fp32 (T,) entropy (None unless `with_entropy`); both are
    differentiable w.r.t. `hidden` and `weight`. `chunk_size` is the vocabulary chunk; the token
    chunk follows from MAX_CHUNK_ELEMENTS. Targets are range-checked, which reads one flag back
    from the device. `invariant`: the true on-policy mode's forward, the engine's computation
    (the mode's table, kernels/ops.py, binds it).
    """
    _check_inputs(hidden, weight, targets, temperature, chunk_size)
    vocab_chunk = min(chunk_size, weight.shape[0])
    token_chunk = max(1, MAX_CHUNK_ELEMENTS // vocab_chunk)
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    if invariant:
        logprobs, entropy = _InvariantTokenLogprobs.apply(
            hidden, weight, targets.contiguous(), inv_temp, with_entropy, vocab_chunk, token_chunk, temperature
        )
    else:
        logprobs, entropy = _TokenLogprobs.apply(
            hidden, weight, targets.contiguous(), inv_temp, with_entropy, vocab_chunk, token_chunk
        )
    return logprobs, (entropy if with_entropy else None)


def _batch_invariant_logprobs(hidden, weight, targets, temperature, with_entropy):
    """The engine's computation of the same quantity, op for op (colocate/kernels/batch_invariant.py):
    fp32 logits from the lm_head's matrix product, scaled and read by the sampler's function. A
    token's result depends on its row alone, so the rows go through in chunks of about
    INVARIANT_CHUNK_ELEMENTS logits: one chunk's (rows, V) logits are alive at a time, not the
    whole (T, V). Returns log-probs, entropy (None unless with_entropy) and each row's logsumexp of
    the scaled logits."""
    rows = max(1, INVARIANT_CHUNK_ELEMENTS // weight.shape[0])
    parts = [_invariant_chunk(h, weight, t, temperature, with_entropy) for h, t in zip(hidden.split(rows), targets.split(rows))]
    logprobs, lse = torch.cat([p[0] for p in parts]), torch.cat([p[2] for p in parts])
    return logprobs, (torch.cat([p[1] for p in parts]) if with_entropy else None), lse


def _invariant_chunk(hidden, weight, targets, temperature, with_entropy):
    scaled = batch_invariant.logits(hidden, weight)  # (rows, V)
    # At temperature 0 or 1 the sampler's division leaves every logit as it is, so no copy is made;
    # others divide as the sampler does, by a tensor (torch multiplies by the inverse of a scalar).
    if temperature not in (0.0, 1.0):
        scaled = scale_logits(scaled, torch.full((hidden.shape[0],), float(temperature), device=hidden.device))
    entropy = None
    if with_entropy and scaled.is_cuda:  # the sampler's log-sum-exp, the entropy in the same pass
        lse, entropy = invariant_logsumexp_and_entropy(scaled)
    else:
        lse = invariant_row_logsumexp(scaled)
        if with_entropy:
            logp = scaled - lse[:, None]
            entropy = -(logp.exp() * logp).sum(-1)
    return sampled_logprobs(scaled, targets, lse), entropy, lse


def _check_inputs(hidden, weight, targets, temperature, chunk_size) -> None:
    if hidden.ndim != 2:
        raise ValueError(f"hidden must be (tokens, hidden_size), got shape {tuple(hidden.shape)}")
    if weight.ndim != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be (vocab_size, {hidden.shape[1]}) to match hidden, got {tuple(weight.shape)}")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must have shape ({hidden.shape[0]},), got {tuple(targets.shape)}")
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be torch.long, got {targets.dtype}")
    if hidden.dtype not in _DTYPES or weight.dtype != hidden.dtype:
        raise ValueError(f"hidden and weight must share one dtype of {_DTYPES}, got {hidden.dtype} and {weight.dtype}")
    if not (hidden.device == weight.device == targets.device):
        raise ValueError(
            f"hidden, weight and targets must be on one device, got {hidden.device}, {weight.device}, {targets.device}"
        )
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if targets.numel():
        message = f"targets must lie in [0, {weight.shape[0]})"
        bad = ((targets < 0) | (targets >= weight.shape[0])).any()
        if targets.is_cuda:  # checked on the device: reading the flag back would make the host wait
            torch._assert_async(~bad, message)
        elif bool(bad):
            raise ValueError(message)


class _TokenLogprobs(torch.autograd.Function):
    """Chunked forward that saves only per-token statistics; backward recomputes the logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, vocab_chunk, token_chunk):
        num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
        f32 = dict(dtype=torch.float32, device=hidden.device)
        run_max = torch.full((num_tokens,), _INIT_MAX, **f32)
        sum_exp = torch.zeros(num_tokens, **f32)  # sum_j exp(z_j - run_max)
        sum_exp_z = torch.zeros(num_tokens, **f32)  # sum_j exp(z_j - run_max) (z_j - run_max)
        target_z = torch.zeros(num_tokens, **f32)
        stats = _chunk_stats_triton if hidden.is_cuda else _chunk_stats_torch
        with torch.autocast(hidden.device.type, enabled=False):  # the matmuls pick their own dtypes
            for t0 in range(0, num_tokens, token_chunk):
                rows = slice(t0, t0 + token_chunk)
                for v0 in range(0, vocab_size, vocab_chunk):
                    logits = _matmul_f32(hidden[rows], weight[v0 : v0 + vocab_chunk].T)  # (tc, vc)
                    stats(
                        logits,
                        targets[rows],
                        v0,
                        inv_temp,
                        with_entropy,
                        run_max[rows],
                        sum_exp[rows],
                        sum_exp_z[rows],
                        target_z[rows],
                    )
        log_sum = sum_exp.log()
        lse = run_max + log_sum
        logprobs = target_z - lse
        entropy = log_sum - sum_exp_z / sum_exp if with_entropy else lse.new_empty(0)
        _keep_for_backward(ctx, hidden, weight, targets, lse, entropy, inv_temp, with_entropy, vocab_chunk, token_chunk)
        return logprobs, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprobs, grad_entropy):  # grads arrive as None for unused outputs
        hidden, weight, targets, lse, entropy = ctx.saved_tensors
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        if not ctx.with_entropy or grad_entropy is None:
            entropy = grad_entropy = None
        with torch.autocast(hidden.device.type, enabled=False):
            grad_hidden, grad_weight = _backward_chunks(
                ctx,
                hidden,
                weight,
                targets,
                lse,
                grad_logprobs.float().contiguous(),
                entropy,
                None if grad_entropy is None else grad_entropy.float().contiguous(),
            )
        return grad_hidden, grad_weight, None, None, None, None, None


class _InvariantTokenLogprobs(_TokenLogprobs):
    """algorithm.true_on_policy's log-probs: the forward is the engine's computation
    (`_batch_invariant_logprobs`, nothing kept but per-row statistics), the backward the default
    path's chunked one. Gradients need no invariance, and this spares the backward a second pass of
    the mode's lm_head product and autograd's full-vocabulary fp32 tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, inv_temp, with_entropy, vocab_chunk, token_chunk, temperature):
        logprobs, entropy, lse = _batch_invariant_logprobs(hidden, weight, targets, temperature, with_entropy)
        entropy = entropy if with_entropy else lse.new_empty(0)
        _keep_for_backward(ctx, hidden, weight, targets, lse, entropy, inv_temp, with_entropy, vocab_chunk, token_chunk)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        return *_TokenLogprobs.backward(ctx, grad_logprobs, grad_entropy), None


def _keep_for_backward(ctx, hidden, weight, targets, lse, entropy, inv_temp, with_entropy, vocab_chunk, token_chunk) -> None:
    """What `_TokenLogprobs.backward` reads; `entropy` is empty without with_entropy."""
    ctx.save_for_backward(hidden, weight, targets, lse, entropy)
    ctx.inv_temp, ctx.with_entropy = inv_temp, with_entropy
    ctx.vocab_chunk, ctx.token_chunk = vocab_chunk, token_chunk
    ctx.set_materialize_grads(False)
    if not with_entropy:
        ctx.mark_non_differentiable(entropy)


def _backward_chunks(ctx, hidden, weight, targets, lse, grad_lp, entropy, grad_ent):
    """Recompute each logits tile, turn it into grad_logits and fold it into both gradients.

    Vocab chunks are the outer loop so that each (vc, H) slice of grad_weight is summed over the
    token chunks in fp32 and written once; grad_hidden is summed over vocab chunks in fp32.
    """
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    num_tokens, vocab_size = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.zeros(hidden.shape, **f32) if need_hidden else None  # (T, H)
    grad_weight = torch.zeros_like(weight) if need_weight else None
    grad_chunk = _chunk_grad_triton if hidden.is_cuda else _chunk_grad_torch
    vc, tc = ctx.vocab_chunk, ctx.token_chunk
    for v0 in range(0, vocab_size, vc):
        w_chunk = weight[v0 : v0 + vc]  # (vc, H)
        grad_w_chunk = None
        for t0 in range(0, num_tokens, tc):
            rows = slice(t0, t0 + tc)
            grad_logits = grad_chunk(
                _matmul_f32(hidden[rows], w_chunk.T),
                targets[rows],
                v0,
                ctx.inv_temp,
                lse[rows],
                grad_lp[rows],
                None if entropy is None else entropy[rows],
                None if grad_ent is None else grad_ent[rows],
                hidden.dtype,
            )  # (tc, vc)
            if need_hidden:
                grad_hidden[rows] += _matmul_f32(grad_logits, w_chunk)  # (tc, H)
            if need_weight:
                part = _matmul_f32(grad_logits.T, hidden[rows])  # (vc, H)
                grad_w_chunk = part if grad_w_chunk is None else grad_w_chunk.add_(part)
        if grad_w_chunk is not None:
            grad_weight[v0 : v0 + vc].copy_(grad_w_chunk)
    return (grad_hidden.to(hidden.dtype) if need_hidden else None), grad_weight


def _matmul_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b with fp32 output: cuBLAS's half-precision GEMM writing fp32 on CUDA, upcast elsewhere."""
    if a.is_cuda and a.dtype in (torch.bfloat16, torch.float16) and a.dtype == b.dtype:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def _chunk_stats_torch(logits, targets, v0, inv_temp, with_entropy, run_max, sum_exp, sum_exp_z, target_z):
    """Fold one logits tile into the running statistics (in place on the (tc,) views)."""
    z = logits.mul_(inv_temp)  # (tc, vc)
    new_max = torch.maximum(run_max, z.amax(dim=1))  # (tc,)
    shifted = z.sub_(new_max[:, None])  # (tc, vc), z - new_max
    exp = shifted.exp()  # (tc, vc)
    shift = run_max - new_max  # (tc,), <= 0
    alpha = shift.exp()
    if with_entropy:
        sum_exp_z.copy_(alpha * (sum_exp_z + sum_exp * shift) + (exp * shifted).sum(1))
    sum_exp.copy_(alpha * sum_exp + exp.sum(1))
    local = targets - v0
    hit = (local >= 0) & (local < z.shape[1])
    picked = shifted.gather(1, local.clamp(0, z.shape[1] - 1)[:, None]).squeeze(1) + new_max
    target_z.add_(torch.where(hit, picked, 0.0))
    run_max.copy_(new_max)


def _chunk_grad_torch(logits, targets, v0, inv_temp, lse, grad_lp, entropy, grad_ent, dtype):
    """grad of the loss w.r.t. one logits tile; kept in fp32 whatever `dtype` (the CPU matmuls
    upcast anyway), which only the CUDA version uses for its output."""
    logp = logits.mul_(inv_temp).sub_(lse[:, None])  # (tc, vc), log_softmax
    p = logp.exp()  # (tc, vc)
    grad = p * -grad_lp[:, None]  # (tc, vc)
    if grad_ent is not None:
        grad -= grad_ent[:, None] * p * (logp + entropy[:, None])
    local = targets - v0
    hit = (local >= 0) & (local < logits.shape[1])
    rows = torch.arange(logits.shape[0], device=logits.device)[hit]
    grad[rows, local[hit]] += grad_lp[hit]
    return grad.mul_(inv_temp)


def _chunk_stats_triton(logits, targets, v0, inv_temp, with_entropy, run_max, sum_exp, sum_exp_z, target_z):
    """Triton version of `_chunk_stats_torch`: one program per token row of the tile."""
    stats_kernel, _ = _triton_kernels()
    rows, cols = logits.shape
    assert logits.stride(1) == 1 and targets.is_contiguous()
    assert all(t.is_contiguous() and t.shape == (rows,) for t in (run_max, sum_exp, sum_exp_z, target_z))
    stats_kernel[(rows,)](
        logits,
        logits.stride(0),
        targets,
        run_max,
        sum_exp,
        sum_exp_z,
        target_z,
        cols,
        v0,
        inv_temp,
        HAS_ENTROPY=with_entropy,
        BLOCK_V=1024,
        num_warps=4,
    )


def _chunk_grad_triton(logits, targets, v0, inv_temp, lse, grad_lp, entropy, grad_ent, dtype):
    """Triton version of `_chunk_grad_torch`, writing grad_logits in the GEMM input dtype."""
    _, grad_kernel = _triton_kernels()
    rows, cols = logits.shape
    assert logits.stride(1) == 1 and targets.is_contiguous() and lse.is_contiguous()
    grad = logits if dtype == torch.float32 else torch.empty_like(logits, dtype=dtype)  # (tc, vc)
    has_entropy = grad_ent is not None
    block = 1024
    grad_kernel[(rows, -(-cols // block))](
        logits,
        logits.stride(0),
        grad,
        grad.stride(0),
        targets,
        lse,
        grad_lp,
        entropy if has_entropy else lse,
        grad_ent if has_entropy else grad_lp,
        cols,
        v0,
        inv_temp,
        HAS_ENTROPY=has_entropy,
        BLOCK_V=block,
        num_warps=4,
    )
    return grad


@functools.cache
def _triton_kernels():
    """Define the Triton kernels on first CUDA use, so CPU installs never import triton."""
    global triton, tl  # the kernels resolve `tl` as a module global, as Triton expects
    import triton
    import triton.language as tl

    @triton.jit
    def stats(
        logits_ptr,
        stride_l,
        targets_ptr,
        max_ptr,
        sum_ptr,
        sum_z_ptr,
        target_z_ptr,
        num_cols,
        v0,
        inv_temp,
        HAS_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_l
        local_target = tl.load(targets_ptr + row) - v0
        m = tl.load(max_ptr + row)
        s = tl.load(sum_ptr + row)
        sz = tl.load(sum_z_ptr + row)
        tz = tl.load(target_z_ptr + row)
        for start in range(0, num_cols, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            valid = cols < num_cols
            z = tl.load(row_ptr + cols, mask=valid, other=float("-inf")) * inv_temp
            new_m = tl.maximum(m, tl.max(z, axis=0))
            shift = m - new_m
            alpha = tl.exp(shift)
            shifted = z - new_m
            e = tl.exp(shifted)
            if HAS_ENTROPY:
                sz = alpha * (sz + s * shift) + tl.sum(e * tl.where(valid, shifted, 0.0), axis=0)
            s = alpha * s + tl.sum(e, axis=0)
            tz += tl.sum(tl.where(valid & (cols == local_target), z, 0.0), axis=0)
            m = new_m
        tl.store(max_ptr + row, m)
        tl.store(sum_ptr + row, s)
        if HAS_ENTROPY:
            tl.store(sum_z_ptr + row, sz)
        tl.store(target_z_ptr + row, tz)

    @triton.jit
    def grad(
        logits_ptr,
        stride_l,
        grad_ptr,
        stride_g,
        targets_ptr,
        lse_ptr,
        grad_lp_ptr,
        entropy_ptr,
        grad_ent_ptr,
        num_cols,
        v0,
        inv_temp,
        HAS_ENTROPY: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        valid = cols < num_cols
        z = tl.load(logits_ptr + row.to(tl.int64) * stride_l + cols, mask=valid, other=0.0) * inv_temp
        logp = z - tl.load(lse_ptr + row)
        p = tl.exp(logp)
        g_lp = tl.load(grad_lp_ptr + row)
        onehot = tl.where(cols == tl.load(targets_ptr + row) - v0, 1.0, 0.0)
        g = g_lp * (onehot - p)
        if HAS_ENTROPY:
            g -= tl.load(grad_ent_ptr + row) * p * (logp + tl.load(entropy_ptr + row))
        g = g * inv_temp
        tl.store(grad_ptr + row.to(tl.int64) * stride_g + cols, g.to(grad_ptr.dtype.element_ty), mask=valid)

    return stats, grad
