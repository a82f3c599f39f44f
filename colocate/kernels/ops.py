"""The table of operations a run computes with, built once at start and handed down.

The true on-policy mode (`algorithm.true_on_policy`, colocate/kernels/batch_invariant.py) swaps a
few implementations: the projections, SiLU's product, RMSNorm, packed attention, the engine's rotary
embedding, the lm_head's fp32 logits, the engine's decode attention, the sampler and its
log-sum-exp, and the trainer's log-prob. `Ops` holds one choice of each. The run builds it once
(`Ops.standard()`, or `Ops.true_on_policy(device)`) and hands it to the models (`CausalLM(cfg, ops)`
or `model.set_ops(ops)`, which reach every layer), the trainer and the engine; they call what they
were given, and nothing reads a process-wide switch. The default everywhere is `Ops.standard()`.

`invariant` tells the few places where a whole code path differs in the mode: the engine neither
compiles its decode nor uses its own decode layer (it runs the trainer's), and reads every key
from its paged cache; the LoRA merge keeps the mode's product; LoRA dropout is never applied.

Torch custom ops cannot take this object: a caller picks the op once from the table instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from colocate.kernels import batch_invariant, flash, invariant_ops, logprob, sampling
from colocate.kernels.paged_attention import paged_decode_attention
from colocate.kernels.rotary import reference_rotate, rotate


@dataclass(frozen=True)
class Ops:
    """One implementation of each operation the true on-policy mode swaps (signatures below)."""

    invariant: bool
    """The true on-policy mode's table: whole code paths that differ in the mode check it."""
    linear: Callable
    """(x, weight, bias=None) -> x @ weight.T + bias, as F.linear."""
    silu_mul: Callable
    """(gate, up) -> SiLU(gate) * up."""
    rms_norm: Callable
    """(x, weight, eps) -> RMSNorm of x over its last dimension."""
    add_rms_norm: Callable
    """(x, delta, weight, eps) -> (x + delta, RMSNorm(x + delta))."""
    packed_attention: Callable
    """(q, k, v, cu_seqlens, max_seqlen, scale) -> causal attention within each packed sequence."""
    engine_rotate: Callable
    """(q, k, cos, sin) -> rotated (q, k), as the engine rotates them (the trainer always takes the
    rotary op, kernels.rotary.rotate)."""
    logits: Callable
    """(hidden (R, H), weight (V, H)) -> the lm_head's logits (R, V) fp32, accumulated in fp32."""
    decode_attention: Callable
    """(q, k_cache, v_cache, block_tables, context_lens, scale) -> one query per sequence over its
    paged keys (the engine's decode in the mode; outside it, the compiled decode's opaque op runs the
    same kernel)."""
    sample: Callable
    """kernels.sampling.gumbel_sample's signature: ids and their log-probs."""
    row_logsumexp: Callable
    """(scaled (B, V)) -> each row's log-sum-exp: the sampler's log-prob (and the trainer's, in the mode)."""
    token_logprobs: Callable
    """kernels.logprob.token_logprobs's signature: the trainer's log-probs (and entropy)."""

    @staticmethod
    def standard() -> Ops:
        """The default table: the fastest kernels, no invariance across batches."""
        return _STANDARD

    @staticmethod
    def true_on_policy(device: torch.device) -> Ops:
        """The true on-policy mode's table. Building it also switches the process's aten::mm, addmm
        and SiLU kernels (and inductor's precision-cast emulation) to the mode's
        (`batch_invariant.enable`, idempotent; tests undo it with `batch_invariant.disable`): those
        ops are reached from everywhere (autograd, F.linear's decomposition), not only through the
        table. Raises ValueError off the CPU and CUDA."""
        batch_invariant.enable(device)
        return _TRUE_ON_POLICY


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + delta
    return total, invariant_ops.reference_rms_norm(total, weight, eps)


def _reference_rotate_pair(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain ops, which the engine's compiled decode step fuses with the cos/sin math."""
    return reference_rotate(q, cos, sin), reference_rotate(k, cos, sin)


def _fp32_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(hidden, weight.T, out_dtype=torch.float32)
    return F.linear(hidden, weight).float()


_STANDARD = Ops(
    invariant=False,
    linear=F.linear,
    silu_mul=_silu_mul,
    rms_norm=invariant_ops.reference_rms_norm,
    add_rms_norm=_add_rms_norm,
    packed_attention=flash.fast_packed_attention,
    engine_rotate=_reference_rotate_pair,
    logits=_fp32_logits,
    decode_attention=paged_decode_attention,
    sample=sampling.gumbel_sample,
    row_logsumexp=sampling.row_logsumexp,
    token_logprobs=logprob.token_logprobs,
)

_TRUE_ON_POLICY = Ops(
    invariant=True,
    linear=invariant_ops.linear,
    silu_mul=invariant_ops.silu_mul,
    rms_norm=invariant_ops.rms_norm,  # torch's CUDA mean picks its reduction order by shape
    add_rms_norm=invariant_ops.add_rms_norm,
    packed_attention=invariant_ops.attention,
    engine_rotate=rotate,  # the trainer's rounding (one per output, not per product)
    logits=batch_invariant.logits,
    decode_attention=batch_invariant.paged_decode_attention,
    sample=sampling.invariant_sample,
    row_logsumexp=sampling.invariant_row_logsumexp,
    token_logprobs=functools.partial(logprob.token_logprobs, invariant=True),
)
"""Private: the mode's kernels are only right once `Ops.true_on_policy` has switched aten's."""
