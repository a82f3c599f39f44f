"""The embedded rollout engine: paged KV cache, continuous batching, CUDA-graph decode.

`NativeEngine` implements the rollout protocol (colocate/rollout/protocol.py) in-process. It owns
its own copy of the weights (never a trainer's parameters), the KV cache and the decode graphs,
each in its own releasable memory region. Dependencies run one way: engine -> scheduler -> block
manager (pure integers), and engine -> model runner (the only part touching tensors).
"""

from __future__ import annotations

import random
import time
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Callable, Iterable
from typing import Sequence as SequenceType

import torch

from colocate.kernels.fp8 import E4M3, quantize_rowwise_into
from colocate.kernels.ops import Ops
from colocate.kernels.paged_attention import kv_bytes_per_token
from colocate.models import CausalLM, from_config, from_pretrained, load_weights, resolve_dtype
from colocate.models.layers import rope_inv_freq
from colocate.rollout.native.block_manager import BlockManager
from colocate.rollout.native.memory import DeviceMemory
from colocate.rollout.native.model_runner import ModelRunner
from colocate.rollout.native.sampler import SamplingBatch
from colocate.rollout.native.scheduler import Scheduler, Sequence
from colocate.rollout.protocol import Completion, Continue, Request, SamplingParams, TurnEnd, check_tags

_SEED_MASK = (1 << 62) - 1
WEIGHT_DTYPES = ("auto", "fp8")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")


class NativeEngine:
    """In-process rollout engine. See the protocol for the meaning of every public method."""

    casts_on_update = True
    """update_weights takes tensors of any floating dtype and casts while copying them in."""

    def __init__(
        self,
        model: CausalLM | str | Path,
        *,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        eos_token_ids: SequenceType[int] | None = None,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 16384,
        kv_cache_fraction: float = 0.5,
        max_kv_tokens: int | None = None,
        cuda_graph: bool = True,
        cuda_graph_max_bs: int = 256,
        max_decode_steps: int = 16,
        compile_decode: bool | None = None,
        memory_saver: bool | str = "auto",
        seed: int = 0,
        ops: Ops | None = None,
        weight_dtype: str = "auto",
        kv_cache_dtype: str = "auto",
    ):
        """
        model: an HF model directory, or a CausalLM whose weights are copied (never shared).
        eos_token_ids: default from the model config.
        kv_cache_fraction: on CUDA without max_kv_tokens, the share of free device memory (after
            the weights) that the KV cache takes.
        max_kv_tokens: KV-cache capacity in tokens; None means 65536 on CPU, kv_cache_fraction on CUDA.
        max_decode_steps: decode steps run on the device per host round trip.
        compile_decode: torch.compile the decode forward (fusing its elementwise kernels); None
            means on CUDA only (on CPU the compile costs more than it saves).
        memory_saver: 'auto' uses torch_memory_saver on CUDA when it is importable.
        seed: draws the seeds of requests that give none.
        ops: the table of operations the engine computes and samples with (colocate/kernels/ops.py;
            the true on-policy mode's in that mode); default: that of `model` when it is a CausalLM,
            else `Ops.standard()`.
        weight_dtype: 'auto' keeps the weights in `dtype`; 'fp8' holds every decoder projection in
            e4m3 with per-row scales and runs it as an FP8 GEMM (kernels/fp8.py; updates are
            quantized as they are copied in). Not with the true on-policy table.
        kv_cache_dtype: 'auto' caches K/V in `dtype`; 'fp8_e4m3' in e4m3 with a scale per token and
            head (kernels/paged_attention.py): about half the bytes per cached token.
        """
        checks = [
            ("block_size", block_size, block_size >= 1),
            ("max_num_seqs", max_num_seqs, max_num_seqs >= 1),
            ("max_num_batched_tokens", max_num_batched_tokens, max_num_batched_tokens >= 1),
            ("kv_cache_fraction", kv_cache_fraction, 0 < kv_cache_fraction < 1),
            ("max_kv_tokens", max_kv_tokens, max_kv_tokens is None or max_kv_tokens >= block_size),
            ("cuda_graph_max_bs", cuda_graph_max_bs, cuda_graph_max_bs >= 1),
            ("max_decode_steps", max_decode_steps, max_decode_steps >= 1),
        ]
        for name, value, ok in checks:
            if not ok:
                raise ValueError(f"NativeEngine: invalid {name}={value!r}")
        if weight_dtype not in WEIGHT_DTYPES or kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"NativeEngine: weight_dtype must be one of {WEIGHT_DTYPES} and kv_cache_dtype one of "
                f"{KV_CACHE_DTYPES}, got {weight_dtype!r} and {kv_cache_dtype!r}"
            )
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.memory = DeviceMemory(self.device, memory_saver)
        self.ops = ops if ops is not None else (model.ops if isinstance(model, CausalLM) else Ops.standard())
        if self.ops.invariant and (weight_dtype == "fp8" or kv_cache_dtype == "fp8_e4m3"):
            raise ValueError("NativeEngine: FP8 weights or KV cache break the true on-policy mode's bitwise match")
        self.fp8_weights = weight_dtype == "fp8"
        start = time.perf_counter()
        self.model = self._load(model, resolve_dtype(dtype, self.device))
        self.startup_seconds = {"weights": time.perf_counter() - start}
        """Seconds of construction: weights (load and pack), runner (KV cache and static buffers),
        with CUDA graphs first_decode (the first warm-up forward, which compiles the decode forward)
        and cuda_graphs (the other warm-ups and the capture of every bucket)."""
        cfg = self.model.config
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        compute_dtype = self.model.model.embed_tokens.weight.dtype  # the embeddings are never FP8
        kv_dtype = E4M3 if kv_cache_dtype == "fp8_e4m3" else compute_dtype
        num_blocks = self._num_kv_blocks(block_size, kv_cache_fraction, max_kv_tokens, kv_dtype)
        self.max_model_len = min(cfg.max_position_embeddings, num_blocks * block_size)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.block_manager, max_num_seqs, max_num_batched_tokens, max_decode_steps)
        self.runner = ModelRunner(
            self.model,
            memory=self.memory,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            kv_dtype=kv_dtype,
            cuda_graph_max_bs=cuda_graph_max_bs if cuda_graph else None,
            compile_decode=self.device.type == "cuda" if compile_decode is None else compile_decode,
        )
        self.startup_seconds["runner"] = time.perf_counter() - start - self.startup_seconds["weights"]
        if self.runner.graphs is not None:
            self.startup_seconds.update(self.runner.graphs.capture())
        self.weight_version = 0
        self._weights_valid = True
        self._released: set[str] = set()
        self._written: set[str] | None = None
        self._partial = False  # the open session may leave parameters as they are
        self._params = dict(self.model.named_parameters())  # the same objects across release/resume
        self._param_shapes = {n: p.shape for n, p in self._params.items()}
        self._weights_bytes = sum(p.numel() * p.element_size() for p in self._params.values())
        self._scales = {n: self._params[n + "_scale"] for n in self._params if n + "_scale" in self._params}
        """An FP8 weight's name -> its row scales (written by update_weights, never pushed)."""
        self._rng = random.Random(seed)
        self._next_seq_id = 0
        self._next_prompt_index = 0
        self._decode_sampling: tuple[list[int], SamplingBatch] | None = None
        self.stats = dict(
            prefill_steps=0,
            prefill_tokens=0,
            prefill_seconds=0.0,
            decode_steps=0,
            decode_tokens=0,
            decode_seconds=0.0,
            preemptions=0,
            env_wait_seconds=0.0,
            history_tokens=0,
            reused_history_tokens=0,
            evictions=0,
        )
        """Cumulative counters: tokens computed and wall time (synchronised) per phase, sequences
        preempted for want of KV-cache blocks (each recomputes its context later); multi-turn:
        seconds waited for environments with nothing to decode, history tokens cached at the ends
        of turns and those still cached when their sequence came back, and parked sequences whose
        blocks were taken."""

    def _load(self, model: CausalLM | str | Path, dtype: torch.dtype) -> CausalLM:
        with self.memory.region("weights"):
            if isinstance(model, CausalLM):
                ours = from_config(model.config, dtype, self.device)
                load_weights(ours, model.state_dict().items(), source="model")
            else:
                ours = from_pretrained(model, dtype, self.device)
            if self.fp8_weights:
                _check_fp8_shapes(ours, dtype, self.device)
                ours.quantize_projections()
            ours.pack_projections()  # one GEMM for q/k/v and one for gate/up
            ours.set_ops(self.ops)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # loading goes through an fp32 copy; hand its cached memory back
        cfg = ours.config
        # Outside the region: released weights lose their contents, and nothing rewrites this table.
        ours.model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(self.device)
        return ours.eval().requires_grad_(False)

    def _num_kv_blocks(self, block_size: int, fraction: float, max_kv_tokens: int | None, kv_dtype: torch.dtype) -> int:
        cfg = self.model.config
        token_bytes = kv_bytes_per_token(cfg.num_key_value_heads, cfg.head_dim, kv_dtype)
        block_bytes = cfg.num_hidden_layers * block_size * token_bytes
        if max_kv_tokens is None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            free = torch.cuda.mem_get_info(self.device)[0]
            num_blocks = int(free * fraction) // block_bytes
            if num_blocks < 1:
                raise ValueError(f"kv_cache_fraction={fraction} of {free} free bytes holds no KV block")
            return num_blocks
        return -(-(max_kv_tokens or 65536) // block_size)

    # ---------------------------------------------------------------- generation

    def generate(
        self, prompt_ids: SequenceType[SequenceType[int]], sampling: SamplingParams | SequenceType[SamplingParams]
    ) -> list[Completion]:
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(prompt_ids)
        if len(sampling) != len(prompt_ids):
            raise ValueError(f"sampling has {len(sampling)} entries for {len(prompt_ids)} prompts")
        for i, params in enumerate(sampling):
            if not isinstance(params, SamplingParams):
                raise ValueError(f"prompt {i}: sampling must be a SamplingParams, got {type(params).__name__}")
        return self.generate_requests([Request(ids, params) for ids, params in zip(prompt_ids, sampling)])

    def generate_requests(
        self, requests: SequenceType[Request], stop: Callable[[list[Completion]], bool] | None = None
    ) -> list[Completion]:
        """See the protocol (PartialRolloutEngine): requests run in order; once `stop` says so, the
        unfinished samples come back aborted with their tokens so far."""
        self._admit(requests, "generate()")
        out = []
        try:
            while self.has_unfinished_requests():
                finished = self.step()
                out += finished
                if stop is not None and finished and stop(finished):
                    out += self.abort()
        except BaseException:
            self.abort()  # leave the engine usable (and releasable) after a failed or interrupted call
            raise
        return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))

    def add_request(
        self,
        prompt_ids: SequenceType[int],
        sampling: SamplingParams,
        prompt_index: int | None = None,
        *,
        output_ids: SequenceType[int] = (),
        logprobs: SequenceType[float] = (),
        sample_index: int = 0,
    ) -> int:
        """Queue the `sampling.n` samples of one prompt (numbered from `sample_index`), or continue
        one sample after its kept `output_ids` (see Request); returns the prompt index."""
        if prompt_index is None:
            prompt_index = self._next_prompt_index
        self._check_prompt(prompt_index, prompt_ids, sampling, output_ids)
        self._add(Request(prompt_ids, sampling, output_ids, logprobs, sample_index), prompt_index)
        return prompt_index

    def generate_turns(self, requests: SequenceType[Request], next_turn: Callable[[TurnEnd], Future]) -> list[Completion]:
        """See the protocol (MultiTurnEngine). A sample that ends its turn is parked with its KV
        cache while its future runs (an environment step in a worker); finished futures are taken
        between engine steps, and when nothing else can run the engine waits for the first one
        (counted in stats['env_wait_seconds'])."""
        self._admit(requests, "generate_turns()", hold=True)
        pending: dict[Future, Sequence] = {}
        answered: SimpleQueue[Future] = SimpleQueue()  # futures put here by their done callbacks
        out = []
        try:
            while self.has_unfinished_requests() or pending:
                ready = []
                if not self.has_unfinished_requests():  # nothing to decode: wait for an answer
                    start = time.perf_counter()
                    ready.append(answered.get())
                    self.stats["env_wait_seconds"] += time.perf_counter() - start
                while not answered.empty():
                    ready.append(answered.get())
                for future in ready:
                    out += self._next_turn(pending.pop(future), future.result())
                if self.has_unfinished_requests():
                    for seq in self._step():
                        future = next_turn(
                            TurnEnd(seq.prompt_index, seq.sample_index, seq.output_ids, seq.turn_ids, seq.finish_reason)
                        )
                        pending[future] = seq
                        future.add_done_callback(answered.put)
        except BaseException:
            for future in pending:
                future.cancel()
            self.abort()
            raise
        return sorted(out, key=lambda c: (c.prompt_index, c.sample_index))

    def _admit(self, requests: SequenceType[Request], caller: str, hold: bool = False) -> None:
        """Check every request, then queue them all (request i as prompt index i)."""
        if self.has_unfinished_requests():
            raise RuntimeError(f"{caller} called while requests added with add_request are unfinished")
        self._check_ready()
        for i, r in enumerate(requests):
            self._check_prompt(i, r.prompt_ids, r.sampling, r.output_ids)
        for i, r in enumerate(requests):
            self._add(r, i, hold=hold)

    def _next_turn(self, seq: Sequence, cont: Continue | None) -> list[Completion]:
        """Resume a parked sequence with `cont`, or end it (returning its completion)."""
        if cont is None:
            self.scheduler.release(seq)
            return [self._completion(seq)]
        ids = [int(t) for t in cont.observation_ids]
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {seq.prompt_index}: observation token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        if cont.max_new_tokens < 1 or seq.num_tokens + len(ids) + cont.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"prompt {seq.prompt_index}: {seq.num_tokens} tokens + a {len(ids)}-token observation + "
                f"max_new_tokens={cont.max_new_tokens} exceed the engine's max length "
                f"{self.max_model_len} (or max_new_tokens < 1)"
            )
        self.scheduler.resume(seq, ids, cont.max_new_tokens)
        return []

    def _add(self, request: Request, prompt_index: int, hold: bool = False) -> None:
        self._next_prompt_index = max(self._next_prompt_index, prompt_index + 1)
        sampling = request.sampling
        base = sampling.seed if sampling.seed is not None else self._rng.getrandbits(62)
        stop = frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids)
        tokens = [int(t) for t in (*request.prompt_ids, *request.output_ids)]
        first = request.sample_index
        group = []
        for j in range(first, first + sampling.n):
            group.append(
                Sequence(
                    seq_id=self._next_seq_id,
                    prompt_index=prompt_index,
                    sample_index=j,
                    token_ids=list(tokens),
                    num_prompt_tokens=len(request.prompt_ids),
                    params=sampling,
                    seed=(base + j) & _SEED_MASK,
                    stop_ids=stop,
                    logprobs=[float(x) for x in request.logprobs],
                    hold=hold,
                )
            )
            self._next_seq_id += 1
        self.scheduler.add(group)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self) -> list[Completion]:
        """Drop every unfinished request, freeing its blocks; returns them with finish reason 'abort'."""
        return [self._completion(s) for s in self.scheduler.abort_all()]

    def step(self) -> list[Completion]:
        """Run one scheduled batch (a prefill step, or a few decode steps); return what finished."""
        self._check_ready()
        return [self._completion(s) for s in self._step()]

    def _step(self) -> list[Sequence]:
        """One scheduled batch; the sequences that finished (or, holding, ended their turn)."""
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        self.stats["preemptions"] = self.scheduler.num_preemptions
        self.runner.copy_blocks(batch.copies)
        vocab = self.model.config.vocab_size
        if batch.is_prefill:
            samplers = [s for chunk in batch.chunks for s in chunk.samplers]
            sampling = SamplingBatch.build(_rows(samplers), vocab, self.device, self.ops) if samplers else None
            ids, logprobs = self.runner.prefill(batch.chunks, sampling)
            token_ids = [[t] for t in ids.tolist()]
            token_logprobs = [[lp] for lp in logprobs.tolist()]
            self.stats["prefill_steps"] += 1
            self.stats["prefill_tokens"] += sum(c.end - c.start for c in batch.chunks)
            self.stats["prefill_seconds"] += time.perf_counter() - start
        else:
            key = [s.seq_id for s in batch.seqs]
            if self._decode_sampling is None or self._decode_sampling[0] != key:
                self._decode_sampling = (key, SamplingBatch.build(_rows(batch.seqs), vocab, self.device, self.ops))
            sampling = self._decode_sampling[1]  # same rows as the last window: its tensors still hold
            ids, logprobs = self.runner.decode(batch.seqs, batch.num_steps, sampling)  # (k, B)
            token_ids, token_logprobs = ids.T.tolist(), logprobs.T.tolist()
            self.stats["decode_steps"] += batch.num_steps
            self.stats["decode_tokens"] += batch.num_steps * len(batch.seqs)
            self.stats["decode_seconds"] += time.perf_counter() - start
        finished = self.scheduler.postprocess(batch, token_ids, token_logprobs)
        sched = self.scheduler
        self.stats.update(
            history_tokens=sched.history_tokens, reused_history_tokens=sched.reused_tokens, evictions=sched.num_evictions
        )
        return finished

    def _completion(self, seq: Sequence) -> Completion:
        extra = {"loss_mask": seq.loss_mask} if seq.hold else {}
        return Completion(
            seq.prompt_index,
            seq.sample_index,
            seq.output_ids,
            seq.logprobs,
            seq.finish_reason,
            weight_version=self.weight_version,
            extra=extra,
        )

    def _check_prompt(
        self, index: int, ids: SequenceType[int], params: SamplingParams, output_ids: SequenceType[int] = ()
    ) -> None:
        if not isinstance(params, SamplingParams):
            raise ValueError(f"prompt {index}: sampling must be a SamplingParams, got {type(params).__name__}")
        if len(ids) == 0:
            raise ValueError(f"prompt {index}: empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in (*ids, *output_ids) if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        total = len(ids) + params.max_new_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt {index}: {len(ids)} prompt + {params.max_new_tokens} new tokens exceed the "
                f"engine's max length {self.max_model_len} (position limit or KV-cache capacity)"
            )

    def _check_ready(self) -> None:
        if self._released:
            raise RuntimeError(f"memory {sorted(self._released)} is released; call resume_memory first")
        if not self._weights_valid:
            raise RuntimeError("weights were released; update them (begin/update/end_weight_update) first")
        if self._written is not None:
            raise RuntimeError("a weight update is in progress; call end_weight_update first")

    # ---------------------------------------------------------------- memory

    def release_memory(self, tags: SequenceType[str] | None = None) -> None:
        tags = check_tags(tags)
        if self.has_unfinished_requests():
            raise RuntimeError("cannot release memory while requests are running")
        if self._written is not None:
            raise RuntimeError("cannot release memory during a weight update")
        graphs = self.runner.graphs
        for tag in tags:
            if tag in self._released:
                continue
            if self.memory.keeps_addresses:
                if tag != "cuda_graph" or self.memory.graphs_pausable:
                    self.memory.pause(tag)
            elif tag == "weights":
                for p in self.model.parameters():
                    p.data = torch.empty(0, dtype=p.dtype, device=self.device)
                self.model.unpack_projections()
            elif tag == "kv_cache":
                self.runner.free_kv()
            if tag == "weights":
                self._weights_valid = False
            if graphs is not None and not self.memory.keeps_addresses:
                graphs.drop()  # they point at tensors that are freed now; captured again when needed
            self._released.add(tag)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def resume_memory(self, tags: SequenceType[str] | None = None) -> None:
        for tag in check_tags(tags):
            if tag not in self._released:
                continue
            if self.memory.keeps_addresses:
                if tag != "cuda_graph" or self.memory.graphs_pausable:
                    self.memory.resume(tag)
            elif tag == "weights":
                for name, p in self.model.named_parameters():
                    p.data = torch.empty(self._param_shapes[name], dtype=p.dtype, device=self.device)
                self.model.pack_projections(keep_values=False)
            elif tag == "kv_cache":
                self.runner.allocate_kv()
            self._released.discard(tag)

    def memory_stats(self) -> dict:
        """Bytes per tag, how release works here, and which tags are released now."""
        graphs = self.runner.graphs
        return {
            "mode": self.memory.mode,
            "weights_bytes": self._weights_bytes,
            "kv_cache_bytes": self.runner.kv_bytes,
            "cuda_graph_bytes": graphs.num_bytes if graphs is not None else 0,
            # Pausable in preload mode; dropped and captured again without the memory saver; kept
            # allocated by the memory saver's torch-hook mode.
            "cuda_graph_releasable": graphs is not None and (self.memory.graphs_pausable or not self.memory.keeps_addresses),
            "num_kv_blocks": self.block_manager.num_blocks,
            "block_size": self.block_manager.block_size,
            "released": sorted(self._released),
        }

    # ---------------------------------------------------------------- weights

    def begin_weight_update(self, partial: bool = False) -> None:
        if self._written is not None:
            raise RuntimeError("begin_weight_update called twice without end_weight_update")
        if self.has_unfinished_requests():
            raise RuntimeError("cannot update weights while requests are running")
        if "weights" in self._released:
            raise RuntimeError("weights are released; resume_memory(['weights']) before updating them")
        if partial and not self._weights_valid:
            raise RuntimeError(
                "a partial weight update needs complete weights, but they were released "
                "since the last full update: update every parameter"
            )
        self._written, self._partial = set(), partial

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self._written is None:
            raise RuntimeError("update_weights called outside begin_weight_update/end_weight_update")
        params = self._params
        tied = self.model.config.tie_word_embeddings
        names, dsts, srcs = [], [], []
        scales = self._scales
        for name, tensor in named_tensors:
            if tied and name == "lm_head.weight":
                continue  # the same tensor as model.embed_tokens.weight
            if name not in params:
                raise ValueError(f"update_weights: unknown parameter {name!r}")
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
            names.append(name)
            if name in scales:  # an FP8 weight: quantized on the tensor's device as it is written
                quantize_rowwise_into(tensor.detach(), p.data, scales[name].data)
                names.append(name + "_scale")
                continue
            dsts.append(p.data)
            srcs.append(tensor.detach())
        # One multi-tensor launch (casting on the fly) instead of a copy kernel per tensor.
        if dsts:
            torch._foreach_copy_(dsts, srcs)
        self._written.update(names)

    def end_weight_update(self, version: int) -> None:
        if self._written is None:
            raise RuntimeError("end_weight_update called without begin_weight_update")
        missing = [] if self._partial else sorted(set(self._param_shapes) - self._written)
        if missing:
            raise RuntimeError(f"weight update left {len(missing)} parameters unwritten, e.g. {missing[:3]}")
        self._written = None
        self._weights_valid = True
        self.weight_version = version

    # ---------------------------------------------------------------- lifecycle

    def flush_cache(self) -> None:
        """No prefix outlives a generate call here, so this only checks that nothing is cached."""
        if self.has_unfinished_requests():
            raise RuntimeError("cannot flush the cache while requests are running")
        assert self.block_manager.num_free_blocks == self.block_manager.num_blocks

    def shutdown(self) -> None:
        if self.runner.graphs is not None:
            self.runner.graphs.drop()
        self.runner.free_kv()
        self.runner = self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _check_fp8_shapes(model: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """FP8 GEMMs on CUDA (torch._scaled_mm with row scales) take bf16 activations and widths that
    are multiples of 16."""
    if device.type != "cuda":
        return
    if dtype != torch.bfloat16:
        raise ValueError(f"FP8 weights compute in bf16 on CUDA; the model dtype is {dtype}")
    layer = model.model.layers[0]
    for name, m in [*layer.self_attn.named_children(), *layer.mlp.named_children()]:
        if name.endswith("_proj") and (m.in_features % 16 or m.out_features % 16):
            raise ValueError(f"FP8 weights need widths that are multiples of 16; {name} is {m.out_features} x {m.in_features}")


def _rows(seqs: list[Sequence]) -> list[tuple[SamplingParams, int, frozenset[int], int]]:
    return [(s.params, s.seed, s.stop_ids, s.num_output_tokens) for s in seqs]
