"""The peers of bench/trainer_throughput.py: transformers' Qwen2 (sdpa) + FSDP2 trained on padded batches of
random tokens, the same tokens a step as ours. The default peer is the plain recipe (eager
layers, every position's logits in fp32, 8 x 2048 micro-batches); the tuned peer is the same
model given a plan grid of its own, as ours is: activation checkpointing of every decoder layer
on or off, the micro-batch size, torch.compile of each decoder layer, and a loss that never forms
the full logits (liger-kernel's fused linear cross-entropy where it imports, else the chunked
one below). Parallelized in torchtitan's order: checkpointing, compile, fully_shard per layer,
then the root.

torchtitan itself is not a peer: TORCHTITAN says why.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import timed
from bench.train_plans import model_flops
from colocate.models import ArchConfig

TORCHTITAN = (
    "torchtitan 0.3.0 has no Qwen2 model: its only dense Qwen (qwen3) always adds q/k RMSNorm and "
    "has no q/k/v bias, so it cannot build the Qwen2.5 shapes trained here"
)
"""Why torchtitan (PyPI release 0.3.0) is not run beside the transformers peers."""
CHUNK_ROWS = 4096
"""Rows (tokens) of logits the chunked cross-entropy forms at once: 2.3 GiB in fp32 at 151,936 vocab."""


class PeerPlan(NamedTuple):
    """Every decoder layer recomputed in backward or none, the micro-batch (sequences x tokens),
    torch.compile of each decoder layer, and the loss from the final hidden states without full
    logits (False: every position's logits in fp32, then cross-entropy)."""

    recompute: bool
    num_sequences: int
    compile: bool
    fused_loss: bool = True
    sequence_length: int = 2048

    def fields(self) -> dict:
        return self._asdict()

    def label(self) -> str:
        return (
            f"{self.num_sequences} x {self.sequence_length}, "
            f"{'every layer recomputed' if self.recompute else 'no recompute'}, "
            f"{'compiled' if self.compile else 'eager'}, {'fused loss' if self.fused_loss else 'fp32 logits'}"
        )

    @staticmethod
    def of(run: dict) -> "PeerPlan":
        return PeerPlan(**{name: run[name] for name in PeerPlan._fields})


DEFAULT = PeerPlan(recompute=False, num_sequences=8, compile=False, fused_loss=False)
# Most informative first: the default's batch without the logits, compiled; twice the tokens per
# micro-batch, affordable only with recompute; half the tokens; the first one eager (compile's share).
GRID = {
    "1.5b": [PeerPlan(False, 8, True), PeerPlan(True, 16, True), PeerPlan(False, 4, True), PeerPlan(False, 8, False)],
    "0.5b": [PeerPlan(False, 8, True), PeerPlan(False, 16, True), PeerPlan(True, 16, True)],
}
SMOKE_SHAPE = ArchConfig(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=True,
    attention_bias=True,
)
"""`bench/trainer_throughput.py --cpu-smoke`: the peers on a tiny Qwen2 in fp32 on CPU, 512 tokens a step."""
SMOKE_DEFAULT = DEFAULT._replace(sequence_length=64)
SMOKE_GRID = [
    PeerPlan(False, 8, False, sequence_length=64),
    PeerPlan(True, 8, True, sequence_length=64),
    PeerPlan(True, 4, False, sequence_length=64),
]
SMOKE_CHUNK_ROWS = 100
"""Chunks of the smoke's 504 loss rows: five full ones and a ragged last one."""


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, `chunk_rows` rows at a time:
    both gradients are computed in forward, so no chunk's logits outlive its iteration."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows):  # hidden (N, H), weight (V, H), targets (N,)
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk_rows):
            h, t = hidden[start : start + chunk_rows], targets[start : start + chunk_rows]
            logits = (h @ weight.T).float()  # (C, V)
            lse = torch.logsumexp(logits, dim=-1)
            rows = torch.arange(len(t), device=t.device)
            loss += (lse - logits[rows, t]).sum()
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad[rows, t] -= 1.0
            grad = grad.div_(n).to(hidden.dtype)
            grad_hidden[start : start + chunk_rows] = grad @ weight
            grad_weight += grad.T @ h  # (V, H), in the compute dtype, summed in fp32
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype))
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_hidden, grad_weight = ctx.saved_tensors
        return grad_hidden * grad_loss, grad_weight * grad_loss, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, targets, chunk_rows)


def fused_loss_kind(device: torch.device) -> str:
    """Which fused linear cross-entropy the tuned peer runs here: liger's needs its Triton kernels."""
    if device.type != "cuda":
        return "chunked (plain torch)"
    try:
        import liger_kernel.transformers  # noqa: F401
    except ImportError:
        return "chunked (plain torch)"
    return "liger-kernel"


class _CausalLoss(nn.Module):
    """A transformers causal LM with its next-token loss in forward: the FSDP2 root, so that the
    tied embedding it gathers also serves the loss's projection."""

    def __init__(self, lm: nn.Module, loss_kind: str | None, chunk_rows: int):
        super().__init__()
        self.lm, self.loss_kind, self.chunk_rows = lm, loss_kind, chunk_rows
        if loss_kind == "liger-kernel":
            from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

            self.liger = LigerFusedLinearCrossEntropyLoss()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids (B, T)
        targets = ids[:, 1:].reshape(-1)
        if self.loss_kind is None:
            logits = self.lm(input_ids=ids, use_cache=False).logits.float()  # (B, T, V) fp32
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets)
        hidden = self.lm.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]  # (B, T-1, H)
        hidden = hidden.reshape(-1, hidden.shape[-1])
        weight = self.lm.lm_head.weight
        if self.loss_kind == "liger-kernel":
            return self.liger(weight, hidden, targets)
        return chunked_linear_cross_entropy(hidden, weight, targets, self.chunk_rows)


def hf_model(mcfg: ArchConfig, device: torch.device) -> nn.Module:
    """transformers' Qwen2 of this shape, sdpa attention, fp32 weights, seeded random init."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=mcfg.vocab_size,
        hidden_size=mcfg.hidden_size,
        intermediate_size=mcfg.intermediate_size,
        num_hidden_layers=mcfg.num_hidden_layers,
        num_attention_heads=mcfg.num_attention_heads,
        num_key_value_heads=mcfg.num_key_value_heads,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
    )
    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


def parallelize(
    lm: nn.Module, plan: PeerPlan, compute_dtype: torch.dtype, device: torch.device, chunk_rows: int = CHUNK_ROWS
) -> nn.Module:
    """Checkpointing, compile, fully_shard per decoder layer, then the root: the loss module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    layers = lm.model.layers
    for i, layer in enumerate(layers):
        if plan.recompute:
            layer = checkpoint_wrapper(layer, preserve_rng_state=False)
        if plan.compile:
            layer.compile()
        layers[i] = layer
    mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    loss = _CausalLoss(lm, fused_loss_kind(device) if plan.fused_loss else None, chunk_rows)
    return fully_shard(loss, mp_policy=mp)


def bench_peer(
    mcfg: ArchConfig,
    plan: PeerPlan,
    steps: int,
    step_tokens: int,
    peak_tflops: float,
    device: torch.device,
    compute_dtype: torch.dtype = torch.bfloat16,
    chunk_rows: int = CHUNK_ROWS,
) -> dict:
    """Steps of step_tokens / (num_sequences x sequence_length) accumulated micro-batches of
    random tokens, after 2 untimed ones; the first micro-batch's loss and the first step's
    gradient norm (before any update: every plan starts from the same weights)."""
    from colocate.trainer.optim import clip_grad_norm

    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated() if cuda else 0
    model = parallelize(hf_model(mcfg, device), plan, compute_dtype, device, chunk_rows)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(0, mcfg.vocab_size, (plan.num_sequences, plan.sequence_length), device=device, generator=gen)
    accumulate = max(1, step_tokens // ids.numel())
    losses, grad_norms = [], []

    def step():
        for _ in range(accumulate):
            loss = model(ids)
            losses.append(loss.detach())
            (loss / accumulate).backward()
        grad_norms.append(clip_grad_norm(list(model.parameters()), 1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)

    warmup_s = sum(timed(step, device) for _ in range(2))
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    seconds = sum(timed(step, device) for _ in range(steps))
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else None
    # Logits are formed at every position for the fp32 loss, at all but the last for the fused one.
    num_logits = ids.numel() - (plan.num_sequences if plan.fused_loss else 0)
    palm, causal = model_flops(mcfg, [plan.sequence_length] * plan.num_sequences, num_logits)
    micro_batches = accumulate * steps
    return dict(
        loss_kind=fused_loss_kind(device) if plan.fused_loss else "fp32 logits",
        micro_batches_per_step=accumulate,
        tokens_per_s=ids.numel() * micro_batches / seconds,
        mfu=palm * micro_batches / seconds / (peak_tflops * 1e12),
        mfu_causal=causal * micro_batches / seconds / (peak_tflops * 1e12),
        peak_gib=peak,
        warmup_s=warmup_s,
        first_loss=losses[0].item(),
        first_grad_norm=grad_norms[0].item(),
    )


def best(peers: list[dict]) -> dict | None:
    """The fastest peer configuration that ran."""
    return max((p for p in peers if "tokens_per_s" in p), key=lambda p: p["tokens_per_s"], default=None)
