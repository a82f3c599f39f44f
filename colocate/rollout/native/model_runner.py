"""The only part of the engine that touches tensors: KV cache, forward passes, sampling.

The model is the shared plain-torch definition; this runner hands it an attention callable per
forward (`CausalLM.hidden_states(..., attn=...)`) that stores each layer's new K/V into the paged
cache and attends over it, so the model never knows about paging:

- prefill: new tokens of several sequences packed flat. When a sequence continues a cached prefix
  (a chunked long prompt), its cached K/V is gathered from the cache and its queries attend
  bottom-right aligned over prefix + new keys. On CUDA (half precision) one varlen flash-attention
  call covers the batch; elsewhere one SDPA call per sequence (never a quadratic packed mask).
- decode: one token per sequence through `paged_decode_attention` (wrapped as a custom op, so that
  torch.compile can fuse the rest of the forward around it). A decode step — cache slots and
  context lengths from the positions, forward, fp32 logits, sampling, feeding the sampled ids and
  positions to the next step, recording the output — reads and writes only static buffers, so one
  CUDA graph per batch-size bucket (and sampler variant) captures all of it: the host replays
  `num_steps` graphs back to back and reads the whole window's ids and log-probs at once.

Logits are computed for the sampled positions only, in fp32 from the final hidden states (the
trainer's log-prob definition), outside the compiled forward: one cuBLAS GEMM with fp32 output.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from colocate.kernels.paged_attention import paged_decode_attention, store_kv
from colocate.models import CausalLM
from colocate.rollout.native.cuda_graphs import DecodeGraphs
from colocate.rollout.native.memory import DeviceMemory
from colocate.rollout.native.sampler import SamplingBatch, Variant
from colocate.rollout.native.scheduler import PrefillChunk, Sequence


@torch.library.custom_op("colocate_native::decode_attention", mutates_args=("kv",))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Store one layer's new K/V into the paged cache `kv` (2, L, num_blocks, block_size, Hk, D) and
    attend over it. An opaque op to torch.compile, which fuses everything around it."""
    k_cache, v_cache = kv[0, layer], kv[1, layer]
    store_kv(k, v, k_cache, v_cache, slot_mapping)
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


@decode_attention.register_fake
def _(q, k, v, kv, layer, slot_mapping, block_tables, context_lens, scale):
    return torch.empty_like(q)


@dataclass
class _PrefillContext:
    slot_mapping: torch.Tensor  # (N,) int64
    q_lens: list[int]  # new tokens per sequence
    k_lens: list[int]  # keys per sequence: cached prefix + new tokens
    cu_seq_q: torch.Tensor  # (S+1,) int32
    cu_seq_k: torch.Tensor  # (S+1,) int32
    gather_slots: torch.Tensor | None = None  # (M,) int64 slots of all keys, when some prefix is cached


class ModelRunner:
    def __init__(self, model: CausalLM, *, memory: DeviceMemory, block_size: int, num_blocks: int,
                 max_num_seqs: int, max_model_len: int, max_decode_steps: int, cuda_graph_max_bs: int | None,
                 compile_decode: bool):
        cfg = model.config
        self.model = model
        self.memory = memory
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = cfg.vocab_size
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv_shape = (2, cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.scale = cfg.head_dim ** -0.5
        self.kv: torch.Tensor | None = None
        self.allocate_kv()
        # Static decode state (outside any releasable region: small, and graphs read it). A row
        # with position -1 is inert: no K/V write, empty context.
        max_blocks_per_seq = -(-max_model_len // block_size)
        dev = dict(device=self.device)
        self.tokens = torch.zeros((2, max_num_seqs), dtype=torch.int64, **dev)  # input ids; positions
        self.input_ids, self.positions = self.tokens[0], self.tokens[1]
        self.positions.fill_(-1)
        self.block_tables = torch.full((max_num_seqs, max_blocks_per_seq), -1, dtype=torch.int32, **dev)
        self.out_ids = torch.zeros((max_decode_steps, max_num_seqs), dtype=torch.int64, **dev)
        self.out_logprobs = torch.zeros((max_decode_steps, max_num_seqs), dtype=torch.float32, **dev)
        self.step = torch.zeros((), dtype=torch.int64, **dev)
        """Index of the current step in the window (out_ids row), advanced on the device."""
        self._step_rows = torch.arange(max_decode_steps, **dev)[:, None]  # (k, 1)
        self._sampling: dict[Variant, SamplingBatch] = {}
        self._prefill: _PrefillContext | None = None
        # Eager, a decode step is ~40 small kernels per layer; compiled, the elementwise work
        # between the GEMMs and the attention op fuses (the graphs then replay fewer launches).
        self._decode_fn = self._decode_hidden
        if compile_decode:
            self._decode_fn = torch.compile(self._decode_hidden, dynamic=True, fullgraph=True)
        self.graphs = None
        if cuda_graph_max_bs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(self, min(cuda_graph_max_bs, max_num_seqs))

    @property
    def kv_bytes(self) -> int:
        return math.prod(self.kv_shape) * self.dtype.itemsize

    def allocate_kv(self) -> None:
        with self.memory.region("kv_cache"):
            self.kv = torch.zeros(self.kv_shape, dtype=self.dtype, device=self.device)

    def free_kv(self) -> None:
        self.kv = None

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (every layer, K and V): copy on write of shared prompt blocks."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64).to(self.device, non_blocking=True)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64).to(self.device, non_blocking=True)
        self.kv[:, :, dst] = self.kv[:, :, src]

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, V) fp32, accumulated in fp32 as the trainer computes them."""
        weight = self.model.lm_head.weight
        if hidden.is_cuda and hidden.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(hidden, weight.T, out_dtype=torch.float32)
        return F.linear(hidden.float(), weight.float())

    # ---------------------------------------------------------------- prefill

    @torch.no_grad()
    def prefill(self, chunks: list[PrefillChunk], sampling: SamplingBatch | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
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
        ctx = _PrefillContext(slot_mapping=torch.tensor(slots, dtype=torch.int64, **to), q_lens=q_lens,
                              k_lens=k_lens, cu_seq_q=_cumsum(q_lens, **to), cu_seq_k=_cumsum(k_lens, **to))
        if k_lens != q_lens:
            gather = [s for c in chunks for s in _slots(c.seq.block_table, 0, c.end, bs)]
            ctx.gather_slots = torch.tensor(gather, dtype=torch.int64, **to)
        self._prefill = ctx
        try:
            hidden = self.model.hidden_states(
                torch.tensor(ids, dtype=torch.int64, **to), positions=torch.tensor(positions, **to),
                attn=self._prefill_attention)  # (N, H)
        finally:
            self._prefill = None
        if sampling is None:
            return torch.empty(0, dtype=torch.int64, **to), torch.empty(0, **to)
        logits = self._logits(hidden[torch.tensor(last_rows, **to)])  # (R, V)
        return sampling.sample(logits, torch.tensor(counters, dtype=torch.int64, **to))

    def _prefill_attention(self, layer: int, q, k, v):
        ctx = self._prefill
        k_cache, v_cache = self.kv[0, layer], self.kv[1, layer]
        store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        if ctx.gather_slots is not None:
            k = k_cache.flatten(0, 1)[ctx.gather_slots]  # (M, Hk, D): cached prefix + new keys
            v = v_cache.flatten(0, 1)[ctx.gather_slots]
        if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
            from torch.nn.attention.varlen import varlen_attn

            # Causal with fewer queries than keys aligns the last query with the last key.
            return varlen_attn(q, k, v, ctx.cu_seq_q, ctx.cu_seq_k, max(ctx.q_lens), max(ctx.k_lens),
                               scale=self.scale, window_size=(-1, 0))
        return _attention_per_sequence(q, k, v, ctx.q_lens, ctx.k_lens, self.scale)

    # ---------------------------------------------------------------- decode

    def reset_rows(self) -> None:
        """Make every decode row inert (before warming up or capturing a graph)."""
        self.positions.fill_(-1)

    def static_sampling(self, variant: Variant) -> SamplingBatch:
        """The static sampling buffers of one sampler variant (all rows)."""
        if variant not in self._sampling:
            self._sampling[variant] = SamplingBatch.static(self.input_ids.shape[0], self.vocab_size, self.device,
                                                           variant)
        return self._sampling[variant]

    def _decode_hidden(self, input_ids, positions, kv, block_tables):
        """Final hidden states (B, H) of one decode token per row; rows at position -1 are inert."""
        live = positions >= 0
        pos = positions.clamp(min=0)
        block = block_tables.gather(1, (pos // self.block_size)[:, None]).squeeze(1)  # (B,)
        slots = torch.where(live, block.long() * self.block_size + pos % self.block_size, -1)
        context_lens = torch.where(live, pos + 1, 0).to(torch.int32)

        def attn(layer, q, k, v):
            return decode_attention(q, k, v, kv, layer, slots, block_tables, context_lens, self.scale)

        return self.model.hidden_states(input_ids, positions=pos, attn=attn)

    def decode_step(self, batch_size: int, variant: Variant) -> None:
        """One decode step of the first `batch_size` static rows, on the device only (what a graph
        captures): sample from each row's last token, record the sample at row `step` of the
        output buffers, feed it back, advance live positions."""
        b = batch_size
        input_ids, positions = self.input_ids[:b], self.positions[:b]
        hidden = self._decode_fn(input_ids, positions, self.kv, self.block_tables[:b])  # (b, H)
        ids, logprobs = self.static_sampling(variant).head(b).sample(self._logits(hidden), positions)
        now = self._step_rows == self.step  # (k, 1)
        self.out_ids[:, :b].copy_(torch.where(now, ids, self.out_ids[:, :b]))
        self.out_logprobs[:, :b].copy_(torch.where(now, logprobs, self.out_logprobs[:, :b]))
        self.step.add_(1)
        input_ids.copy_(ids)
        positions.add_(positions >= 0)

    @torch.no_grad()
    def decode(self, seqs: list[Sequence], num_steps: int, sampling: SamplingBatch
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `num_steps` decode steps for `seqs`; ids and log-probs (num_steps, B) on the device,
        views of static buffers that the next call overwrites."""
        b = len(seqs)
        assert 1 <= num_steps <= self.out_ids.shape[0] and 1 <= b <= self.input_ids.shape[0]
        variant = sampling.variant
        rows, graph = b, None
        if self.graphs is not None and self.graphs.bucket(b) is not None:
            rows = self.graphs.bucket(b)
            graph = self.graphs.get(rows, variant)  # captured on first use (leaves every row inert)
        with record_function("decode.prepare"):
            self.static_sampling(variant).copy_(sampling)
            width = max(len(s.block_table) for s in seqs)
            flat = array.array("i")  # ~4x faster than torch.tensor on nested lists, per decode window
            for s in seqs:
                flat.extend(s.block_table)
                flat.extend([-1] * (width - len(s.block_table)))
            self.block_tables[:b, :width].copy_(torch.frombuffer(flat, dtype=torch.int32).view(b, width))
            pad = rows - b
            tokens = array.array("q", [s.token_ids[-1] for s in seqs])
            tokens.extend([0] * pad)
            tokens.extend([s.num_tokens - 1 for s in seqs])
            tokens.extend([-1] * pad)  # padding rows of the bucket stay inert
            self.tokens[:, :rows].copy_(torch.frombuffer(tokens, dtype=torch.int64).view(2, rows))
            self.step.zero_()
        with record_function("decode.steps"):
            for _ in range(num_steps):
                if graph is not None:
                    graph.replay()
                else:
                    self.decode_step(rows, variant)
        return self.out_ids[:num_steps, :b], self.out_logprobs[:num_steps, :b]


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


def _attention_per_sequence(q, k, v, q_lens: list[int], k_lens: list[int], scale: float) -> torch.Tensor:
    """Causal attention of each sequence's queries (its last q_len positions) over its keys, one
    SDPA call per sequence: cost sum(q_len * k_len), where one packed mask would cost N * M."""
    out = torch.empty_like(q)  # (N, Hq, D)
    q0 = k0 = 0
    for nq, nk in zip(q_lens, k_lens):
        qs, ks, vs = (t.transpose(0, 1) for t in (q[q0:q0 + nq], k[k0:k0 + nk], v[k0:k0 + nk]))
        mask = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(diagonal=nk - nq)
        out[q0:q0 + nq] = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=True).transpose(0, 1)
        q0, k0 = q0 + nq, k0 + nk
    return out
