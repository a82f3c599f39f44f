"""The only part of the engine that touches tensors: KV cache, forward passes, sampling.

The model is the shared plain-torch definition; this runner hands it an attention callable per
forward (`CausalLM.hidden_states(..., attn=...)`) that stores each layer's new K/V into the paged
cache and attends over it, so the model never knows about paging:

- prefill: new tokens of several sequences packed flat. When a sequence continues a cached prefix
  (a chunked long prompt), its cached K/V is gathered from the cache and its queries attend
  bottom-right aligned over prefix + new keys. On CUDA (half precision) one varlen flash-attention
  call covers the batch; elsewhere one SDPA call per sequence (never a quadratic packed mask).
  Both sit in the op `prefill_attention` (attention_ops.py). Prefills of at least
  `COMPILED_PREFILL_MIN_TOKENS` tokens run compiled when the decode does: one graph of a decoder
  layer that every layer runs, around that op, the token, sequence and key counts its varying
  sizes (and one more graph for prefills that continue a cached prefix).
- decode: one token per sequence through `paged_decode_attention` (wrapped as a custom op, so that
  torch.compile can fuse the rest of the forward around it), from static buffers that CUDA graphs
  replay; several decode steps run back to back on the device, each step feeding its sampled ids
  to the next, and the host reads all of them at once. Compiled, the decode forward is three
  graphs (embedding, one decoder layer that every layer runs, head), so the compile costs about
  one layer's, whatever the depth.

Logits are computed for the sampled positions only, in fp32 (the trainer's log-prob definition).

The runner computes with its model's table of operations (`model.ops`, colocate/kernels/ops.py):
the lm_head's logits, the rotary embedding and the layers' operations come from it. With the true
on-policy mode's table (algorithm.true_on_policy) the decode forward is not compiled and runs the
trainer's layer, its attention is the table's (`Ops.decode_attention`), and prefill attends with the
mode's fixed-order attention: on CUDA through `kernels.invariant_attention`, reading every key from
the paged cache. The opaque ops of attention_ops.py (`decode_attention`, `prefill_attention`) are
the default path's, which the compiled decode and prefill fuse around; the mode's path calls its
kernels eagerly.
"""

from __future__ import annotations

import array
from dataclasses import dataclass

import torch
from torch import nn

from colocate.kernels import batch_invariant, invariant_attention
from colocate.kernels.fp8 import E4M3
from colocate.kernels.ops import Ops
from colocate.kernels.paged_attention import kv_bytes_per_token, store_kv
from colocate.models import CausalLM
from colocate.rollout.native.attention_ops import decode_attention, prefill_attention
from colocate.rollout.native.cuda_graphs import DecodeGraphs
from colocate.rollout.native.memory import DeviceMemory
from colocate.rollout.native.sampler import SamplingBatch
from colocate.rollout.native.scheduler import PrefillChunk, Sequence

COMPILED_PREFILL_MIN_TOKENS = 4096
"""Prefills of at least this many tokens run compiled (when the decode is). Eager, a prefill's
norm, rotary and residual work between the GEMMs took about half of a 4B model's prefill time;
below this size the saving is small, and a run whose prefills are all small never pays the compile."""


def _decode_layer(
    layer: nn.Module,
    x: torch.Tensor,
    delta: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer of a decode step, as `DecoderLayer.forward` computes it but with the
    residual sum moved to the start: takes the stream `x` and the previous layer's MLP output
    `delta`, returns this layer's stream and MLP output. The sum then fuses with the norm that
    reads it, as it would in a compile of the whole forward, while one compiled graph serves every
    layer (the layer's cache `kv` (2, num_blocks, block_size, Hk, D) is an input, not an index)."""

    def attn(_module, q, k, v):
        return decode_attention(q, k, v, kv, kv_scale, slot_mapping, block_tables, context_lens, scale)

    x, normed = layer.input_layernorm.add_forward(x, delta)
    attended = layer.self_attn(normed, cos, sin, None, None, attn)
    x, normed = layer.post_attention_layernorm.add_forward(x, attended)
    return x, layer.mlp(normed)


def _prefill_layer(
    layer: nn.Module,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: torch.Tensor,
    kv_scale: torch.Tensor,
    slot_mapping: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_lens: torch.Tensor,
    gather_slots: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """One decoder layer of a prefill of N packed tokens (x (N, H)); compiled, one graph serves
    every layer, as in `_decode_layer`."""

    def attn(_module, q, k, v):
        return prefill_attention(q, k, v, kv, kv_scale, slot_mapping, cu_seq_q, cu_seq_k, max_lens, gather_slots, scale)

    return layer(x, cos, sin, None, None, attn)


@dataclass
class _PrefillContext:
    slot_mapping: torch.Tensor  # (N,) int64
    q_lens: list[int]  # new tokens per sequence
    k_lens: list[int]  # keys per sequence: cached prefix + new tokens
    cu_seq_q: torch.Tensor  # (S+1,) int32
    cu_seq_k: torch.Tensor  # (S+1,) int32
    max_lens: torch.Tensor  # (2,) int64 on the host: max(q_lens), max(k_lens)
    gather_slots: torch.Tensor | None = None  # (M,) int64 slots of all keys, when some prefix is cached
    block_tables: torch.Tensor | None = None  # (S, max_blocks) int32, for the batch-invariant CUDA kernel


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        memory: DeviceMemory,
        block_size: int,
        num_blocks: int,
        max_num_seqs: int,
        max_model_len: int,
        cuda_graph_max_bs: int | None,
        compile_decode: bool,
        kv_dtype: torch.dtype | None = None,
    ):
        """kv_dtype: the cache's dtype, default the model's compute dtype; float8_e4m3fn caches
        K/V in e4m3 with an fp32 scale per token and head (`kv_scale`)."""
        cfg = model.config
        self.model = model
        self.ops: Ops = model.ops
        """The model's table of operations, read once: the mode's (`ops.invariant`) changes whole paths."""
        self.memory = memory
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.kv_dtype = kv_dtype or self.dtype
        if self.kv_dtype == E4M3 and self.ops.invariant:
            raise ValueError("an FP8 KV cache breaks the true on-policy mode's bitwise match")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_shape = (2, cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.scale = cfg.head_dim**-0.5
        self.kv: torch.Tensor | None = None
        self.kv_scale: torch.Tensor | None = None
        """An FP8 cache's scales (2, layers, num_blocks, block_size, Hk) fp32; else empty."""
        self.allocate_kv()
        # Static decode inputs (outside any releasable region: small, and graphs read them).
        max_blocks_per_seq = -(-max_model_len // block_size)
        dev = dict(device=self.device)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.int64, **dev)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.int64, **dev)
        self.slot_mapping = torch.full((max_num_seqs,), -1, dtype=torch.int64, **dev)
        self.block_tables = torch.full((max_num_seqs, max_blocks_per_seq), -1, dtype=torch.int32, **dev)
        self.context_lens = torch.zeros(max_num_seqs, dtype=torch.int32, **dev)
        self._prefill: _PrefillContext | None = None
        # Eager, a decode step is ~40 small kernels per layer; compiled, the elementwise work
        # between the GEMMs and the attention op fuses (the graphs then replay fewer launches).
        # Compiled a layer at a time: the layers share one graph, so the compile costs one layer's
        # trace and code generation rather than the whole model's. Never in the batch-invariant
        # mode: inductor would bypass the mode's kernels.
        self.compiled_decode = bool(compile_decode) and not self.ops.invariant
        self._prefill_attention = self._invariant_prefill_attention if self.ops.invariant else self._default_prefill_attention

        def compiled(fn):
            return torch.compile(fn, fullgraph=True) if self.compiled_decode else fn

        self._embed, self._layer, self._head = (
            compiled(self._decode_embed),
            compiled(_decode_layer),
            compiled(self._decode_head),
        )
        self._prefill_layer = compiled(_prefill_layer)
        self.compiled_prefill_min_tokens = COMPILED_PREFILL_MIN_TOKENS
        self.graphs = None
        if cuda_graph_max_bs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, min(cuda_graph_max_bs, max_num_seqs))

    @property
    def kv_bytes(self) -> int:
        _, layers, blocks, block_size, heads, head_dim = self.kv_shape
        return layers * blocks * block_size * kv_bytes_per_token(heads, head_dim, self.kv_dtype)

    def allocate_kv(self) -> None:
        with self.memory.region("kv_cache"):
            self.kv = torch.zeros(self.kv_shape, dtype=self.kv_dtype, device=self.device)
            scale_shape = self.kv_shape[:-1] if self.kv_dtype == E4M3 else (2, self.kv_shape[1], 0)
            self.kv_scale = torch.zeros(scale_shape, dtype=torch.float32, device=self.device)

    def free_kv(self) -> None:
        self.kv = self.kv_scale = None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): copy on write of shared prompt blocks."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64).to(self.device, non_blocking=True)
        self.kv[:, :, dst] = self.kv[:, :, src]
        if self.kv_dtype == E4M3:
            self.kv_scale[:, :, dst] = self.kv_scale[:, :, src]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, V) fp32, accumulated in fp32 as the trainer computes them (the table's `logits`)."""
        return self.ops.logits(hidden, self.model.lm_head.weight)

    # ---------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute the chunks' tokens; sample one token per sampler of completed chunks (`sampling`
        has one row per sampler, None when no chunk completes). Returns ids (R,) and log-probs (R,)
        on the device."""
        bs = self.block_size
        ids, positions, slots, q_lens, k_lens = [], [], [], [], []
        last_rows, counters = [], []
        for chunk in chunks:
            seq, start, end = chunk.seq, chunk.start, chunk.end
            ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += _slots(seq.block_table, start, end, bs)
            q_lens.append(end - start)
            k_lens.append(end)
            last_rows += [len(ids) - 1] * len(chunk.samplers)
            counters += [end - 1] * len(chunk.samplers)
        to = dict(device=self.device)
        ctx = _PrefillContext(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, **to),
            q_lens=q_lens,
            k_lens=k_lens,
            cu_seq_q=_cumsum(q_lens, **to),
            cu_seq_k=_cumsum(k_lens, **to),
            max_lens=torch.tensor([max(q_lens), max(k_lens)]),
        )
        if self.ops.invariant and self.device.type == "cuda":
            width = max(len(c.seq.block_table) for c in chunks)
            ctx.block_tables = torch.tensor(
                [c.seq.block_table + [-1] * (width - len(c.seq.block_table)) for c in chunks], dtype=torch.int32, **to
            )
        elif k_lens != q_lens:
            gather = [s for c in chunks for s in _slots(c.seq.block_table, 0, c.end, bs)]
            ctx.gather_slots = torch.tensor(gather, dtype=torch.int64, **to)
        input_ids, positions = torch.tensor(ids, dtype=torch.int64, **to), torch.tensor(positions, **to)
        if self.compiled_decode and len(ids) >= self.compiled_prefill_min_tokens:
            hidden = self._compiled_prefill(input_ids, positions, ctx)  # (N, H)
        else:
            self._prefill = ctx
            try:
                hidden = self.model.hidden_states(input_ids, positions=positions, attn=self._prefill_attention)
            finally:
                self._prefill = None
        if sampling is None:
            return torch.empty(0, dtype=torch.int64, **to), torch.empty(0, **to)
        logits = self._logits(hidden[torch.tensor(last_rows, **to)])  # (R, V)
        return sampling.sample(logits, torch.tensor(counters, dtype=torch.int64, **to))

    def _compiled_prefill(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: _PrefillContext) -> torch.Tensor:
        """`CausalLM.hidden_states` of a prefill, its layers through the compiled `_prefill_layer`."""
        inner = self.model.model
        x = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary(positions, x.dtype)
        slots = () if ctx.gather_slots is None else (ctx.gather_slots,)
        self._batch_dim(x, cos, sin, ctx.slot_mapping, ctx.cu_seq_q, ctx.cu_seq_k, *slots)
        for i, layer in enumerate(inner.layers):
            x = self._prefill_layer(
                layer,
                x,
                cos,
                sin,
                *self._layer_kv(i),
                ctx.slot_mapping,
                ctx.cu_seq_q,
                ctx.cu_seq_k,
                ctx.max_lens,
                ctx.gather_slots,
                self.scale,
            )
        return inner.norm(x)

    def _default_prefill_attention(self, module: nn.Module, q, k, v):
        ctx = self._prefill
        i = module.layer_idx
        return prefill_attention(
            q,
            k,
            v,
            self.kv[:, i],
            self.kv_scale[:, i],
            ctx.slot_mapping,
            ctx.cu_seq_q,
            ctx.cu_seq_k,
            ctx.max_lens,
            ctx.gather_slots,
            self.scale,
        )

    def _invariant_prefill_attention(self, module: nn.Module, q, k, v):
        """The true on-policy mode's prefill attention, eager: on CUDA the mode's kernel over the
        paged cache (every key read from it, the new ones included); elsewhere the fixed-chunk
        attention per sequence, over the cached prefix and the new keys."""
        ctx = self._prefill
        kv = self.kv[:, module.layer_idx]
        store_kv(k, v, kv[0], kv[1], ctx.slot_mapping)
        if ctx.block_tables is not None:
            return invariant_attention.paged_prefill_attention(
                q, kv[0], kv[1], ctx.block_tables, ctx.q_lens, ctx.k_lens, self.scale
            )
        if ctx.gather_slots is not None:
            k = kv[0].flatten(0, 1)[ctx.gather_slots]  # (M, Hk, D): cached prefix + new keys
            v = kv[1].flatten(0, 1)[ctx.gather_slots]
        return _invariant_attention_per_sequence(q, k, v, ctx.q_lens, ctx.k_lens, self.scale)

    # ---------------------------------------------------------------- decode

    def reset_padding(self, batch_size: int) -> None:
        """Make rows batch_size.. inert: no K/V write, empty context."""
        self.slot_mapping[batch_size:].fill_(-1)
        self.context_lens[batch_size:].zero_()

    def decode_forward(self, batch_size: int) -> torch.Tensor:
        """Logits (B, V) fp32 for the first `batch_size` rows of the static decode buffers."""
        b = batch_size
        slot_mapping, block_tables, context_lens = self.slot_mapping[:b], self.block_tables[:b], self.context_lens[:b]
        if self.ops.invariant:  # the trainer's layer, as the mode's bits are checked against it
            attend = self.ops.decode_attention

            def attn(module, q, k, v):
                kv = self.kv[:, module.layer_idx]
                store_kv(k, v, kv[0], kv[1], slot_mapping)
                return attend(q, kv[0], kv[1], block_tables, context_lens, self.scale)

            return self._logits(self.model.hidden_states(self.input_ids[:b], positions=self.positions[:b], attn=attn))
        batch = self._batch_dim
        x, delta, cos, sin = batch(*self._embed(*batch(self.input_ids[:b], self.positions[:b])))
        batch(slot_mapping, block_tables, context_lens)
        for i, layer in enumerate(self.model.model.layers):
            x, delta = batch(
                *self._layer(layer, x, delta, cos, sin, *self._layer_kv(i), slot_mapping, block_tables, context_lens, self.scale)
            )
        return self._head(x, delta)

    def _batch_dim(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Mark dim 0 as varying: the batch, a compiled decode's one varying size, or a compiled
        prefill's token, sequence and key counts; every other size is traced as a constant. Were all
        sizes symbolic, a batch equal to another size (a hidden size or a block-table width of 256,
        say) would share its symbol, the first trace would fix both, and every other batch would
        compile again."""
        if self.compiled_decode:
            for t in tensors:
                torch._dynamo.maybe_mark_dynamic(t, 0)
        return tensors

    def _layer_kv(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's cache (2, num_blocks, block_size, Hk, D) and its scales for a compiled layer, the
        block count traced as a size that varies. On CUDA the engine sizes its cache from the free
        memory, which moves between runs by more than a block; as a constant, the block count would
        key the compile caches (inductor's graphs, AOTAutograd's) anew, and a warm restart would
        compile the layer again. Only the opaque attention op reads the cache, so no kernel depends on it."""
        kv, kv_scale = self.kv[:, i], self.kv_scale[:, i]
        if self.compiled_decode:
            torch._dynamo.maybe_mark_dynamic(kv, 1)
            if self.kv_dtype == E4M3:
                torch._dynamo.maybe_mark_dynamic(kv_scale, 1)
        return kv, kv_scale

    def _decode_embed(self, input_ids, positions):
        """The stream (B, H), a zero first delta, and the rotary tables of a decode step."""
        x = self.model.model.embed_tokens(input_ids)
        cos, sin = self.model.model.rotary(positions, x.dtype)
        return x, torch.zeros_like(x), cos, sin

    def _decode_head(self, x, delta):
        """The last layer's residual sum, the final norm and the fp32 logits (B, V)."""
        return self._logits(self.model.model.norm(x + delta))

    @torch.no_grad()
    def decode(self, seqs: list[Sequence], num_steps: int, sampling: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `num_steps` decode steps for `seqs`; ids and log-probs (num_steps, B) on the device."""
        b = len(seqs)
        to = dict(device=self.device)
        use_graph = self.graphs is not None and self.graphs.bucket(b) is not None
        if use_graph and not self.graphs.captured:
            self.graphs.capture()  # again, after the tensors it read were reallocated
        width = max(len(s.block_table) for s in seqs)
        flat = array.array("i")  # ~4x faster than torch.tensor on nested lists, per decode window
        for s in seqs:
            flat.extend(s.block_table)
            flat.extend([-1] * (width - len(s.block_table)))
        tables = torch.frombuffer(flat, dtype=torch.int32).view(b, width)
        self.block_tables[:b, :width].copy_(tables)
        self.input_ids[:b].copy_(torch.tensor([s.token_ids[-1] for s in seqs]), non_blocking=True)
        self.positions[:b].copy_(torch.tensor([s.num_tokens - 1 for s in seqs]), non_blocking=True)
        self.context_lens[:b].copy_(torch.tensor([s.num_tokens for s in seqs], dtype=torch.int32), non_blocking=True)
        self.reset_padding(b)
        out_ids = torch.empty((num_steps, b), dtype=torch.int64, **to)
        out_logprobs = torch.empty((num_steps, b), dtype=torch.float32, **to)
        rows = torch.arange(b, **to)
        for step in range(num_steps):
            if step:
                self.positions[:b] += 1
                self.context_lens[:b] += 1
            pos = self.positions[:b]
            blocks = self.block_tables[rows, pos // self.block_size].long()  # (B,)
            self.slot_mapping[:b] = blocks * self.block_size + pos % self.block_size
            logits = self.graphs.replay(b) if use_graph else self.decode_forward(b)  # (B, V)
            ids, logprobs = sampling.sample(logits, pos)
            out_ids[step], out_logprobs[step] = ids, logprobs
            self.input_ids[:b] = ids
            sampling.advance()
        return out_ids, out_logprobs


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Flat cache slots of token positions [start, end) of a sequence with this block table."""
    out = []
    pos = start
    while pos < end:
        block, offset = divmod(pos, block_size)
        stop = min(end, (block + 1) * block_size)
        base = table[block] * block_size
        out += range(base + offset, base + offset + stop - pos)
        pos = stop
    return out


def _cumsum(lengths: list[int], device) -> torch.Tensor:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=device)


def _invariant_attention_per_sequence(q, k, v, q_lens: list[int], k_lens: list[int], scale: float) -> torch.Tensor:
    """`attention_per_sequence` (attention_ops.py) in batch-invariant mode: the fixed-chunk attention the trainer
    computes too (`batch_invariant.attention`), a sequence at a time."""
    out = torch.empty_like(q)  # (N, Hq, D)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        positions = torch.arange(nk - nq, nk, device=q.device)
        out[q0 : q0 + nq] = batch_invariant.attention(q[q0 : q0 + nq], k[k0 : k0 + nk], v[k0 : k0 + nk], positions, scale)
        q0, k0 = q0 + nq, k0 + nk
    return out
