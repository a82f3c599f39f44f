"""The SGLang rollout backend: SGLang 0.5.23's offline Engine living inside a torchrun rank.

SGLang runs its scheduler (the GPU work) and detokenizer in child processes and its tokenizer
manager in ours. The adapter keeps that engine to our protocol and to the memory contract of
the loop: one TP=1 engine per rank on the rank's GPU, distinct ports per rank, the process
state SGLang rewrites put back (see process.py), release/resume only when the scheduler
is provably idle (its release asserts idleness and a failed assert takes the rank down), weights
pushed as CUDA IPC buckets inside a begin/end session, and every answer checked against the
weight version we last recorded.

Call it from one thread: SGLang drives its asyncio loop in the calling thread.
"""

from __future__ import annotations

import atexit
import logging
import os
import random
import signal
import threading
import time
from typing import Iterable, Sequence

import torch

from colocate.rollout.protocol import Completion, SamplingParams, check_tags
from colocate.rollout.sglang.api import (
    completion_from_output,
    engine_kwargs,
    import_sglang,
    sampling_request,
)
from colocate.rollout.sglang.process import (
    DEFAULT_BASE_PORT,
    ProcessState,
    check_allocator_env,
    check_ports_free,
    child_env,
    engine_ports,
    engine_process_guard,
    kill_process_trees,
    visible_device_index,
)
from colocate.rollout.sglang.weights import (
    FLATTENED_BUCKET_FORMAT,
    TIED_HEAD,
    check_buffer,
    checkpoint_parameter_names,
    group_by_dtype,
    serialize_bucket,
    ties_word_embeddings,
)

logger = logging.getLogger(__name__)

TORCH_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
RESUME_ORDER = ("weights", "cuda_graph", "kv_cache")
"""Weights first (the sync writes into them), KV cache last (the largest; sync buffers are gone)."""
FLUSH_ATTEMPTS = 50
FLUSH_RETRY_S = 0.05
"""The scheduler may still hold its last finished batch for one loop turn after generate returns;
its flush fails until then, so a flush is retried for up to FLUSH_ATTEMPTS * FLUSH_RETRY_S."""


class SGLangEngine:
    """A RolloutEngine backed by one SGLang engine on this rank's GPU.

    Construct it after the trainer's model is built and offloaded (SGLang sizes its KV cache from
    the memory free at that moment) and after logging and signal handlers are set up: shutdown()
    returns those to their state from before construction.
    """

    casts_on_update = False
    """Buckets travel to SGLang's scheduler process as they are: the sync casts them first."""

    def __init__(
        self,
        *,
        model_path: str,
        dtype: str | torch.dtype,
        seed: int,
        rank: int,
        local_rank: int,
        mem_fraction_static: float,
        max_running_requests: int,
        cuda_graph_max_bs: int,
        release_cuda_graph: bool,
        eos_token_ids: Sequence[int],
        load_dummy: bool,
        log_level: str,
        device_index: int | None = None,
        deterministic: bool = False,
        base_port: int = DEFAULT_BASE_PORT,
    ):
        """
        dtype: an SGLang dtype name or torch.bfloat16 / float16 / float32.
        device_index: this rank's GPU among its visible devices; default: LOCAL_RANK when all GPUs
            are visible, 0 when the rank sees one (process.visible_device_index).
        release_cuda_graph: make CUDA-graph memory releasable (costs host RAM for a backup).
        load_dummy: start from random weights; generate is refused until the first weight push.
        deterministic: SGLang's batch-invariant mode (slower), the only one in which per-request
            seeds (SamplingParams.seed) are honoured; otherwise seeds are dropped with a warning.
        base_port: local rank r uses ports base_port + 8r (unused HTTP port) and the next (NCCL).
        """
        self.port, self.nccl_port = engine_ports(local_rank, base_port)
        if device_index is None:
            device_index = visible_device_index(local_rank)
        kwargs = engine_kwargs(
            model_path=model_path,
            dtype=TORCH_DTYPE_NAMES.get(dtype, dtype),
            seed=seed,
            rank=rank,
            device_index=device_index,
            port=self.port,
            nccl_port=self.nccl_port,
            mem_fraction_static=mem_fraction_static,
            max_running_requests=max_running_requests,
            cuda_graph_max_bs=cuda_graph_max_bs,
            load_dummy=load_dummy,
            log_level=log_level,
            deterministic=deterministic,
        )
        check_allocator_env()
        check_ports_free((self.port, self.nccl_port))
        self.model_path = str(model_path)
        self.weight_version = 0
        self._eos_token_ids = tuple(eos_token_ids)
        self._deterministic = deterministic
        self._rank = rank
        self._warned_seed = False
        self._seed_rng = random.Random(seed + rank)
        self._tied = ties_word_embeddings(model_path)
        self._expected = checkpoint_parameter_names(model_path, self._tied)
        self._weights_current = not load_dummy
        self._released: set[str] = set()
        self._session: set[str] | None = None
        self._partial = False  # the open session may leave parameters as they are
        self._busy = False
        self._engine = None
        self._state = ProcessState.capture()
        with engine_process_guard(self._state, child_env(os.environ, release_cuda_graph)):
            self._sgl = import_sglang()
            self._sgl.monkey_patch_torch_reductions()  # IPC handles name GPUs by UUID, not index
            engine = self._sgl.Engine(**kwargs)
            atexit.unregister(engine.shutdown)  # it would SIGKILL every child of this process
            self._engine = engine
            try:
                # The first request starts the engine's handle loop, which installs SIGTERM and
                # SIGQUIT handlers that tear down our whole process tree: take them off again.
                self._flush()
                if threading.current_thread() is threading.main_thread():
                    engine.loop.run_until_complete(_remove_signal_handlers(engine.loop))
            except BaseException:
                self._engine = None
                _stop_engine(engine)
                raise
        logging.getLogger("sglang").setLevel(log_level.upper())
        atexit.register(self.shutdown)

    # -- generation ------------------------------------------------------------------------

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """One SGLang request per sample, all in one batch; completions prompt-major."""
        prompts = [list(p) for p in prompt_ids]
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        if len(params) != len(prompts):
            raise ValueError(f"sampling has {len(params)} entries for {len(prompts)} prompts")
        empty = [i for i, p in enumerate(prompts) if not p]
        if empty:
            raise ValueError(f"prompt_ids[{empty[0]}] is empty")
        engine = self._ready("generate")
        if self._session is not None:
            raise RuntimeError("generate refused: a weight update is open; call end_weight_update first")
        if self._released:
            raise RuntimeError(f"generate refused: memory {sorted(self._released)} is released; resume it first")
        if not self._weights_current:
            raise RuntimeError(
                "generate refused: the engine's weights are stale (random after load_dummy, or "
                "released and resumed); push weights with begin/update/end_weight_update first"
            )
        input_ids, requests, index = [], [], []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            for j in range(sp.n):
                input_ids.append(prompt)
                requests.append(sampling_request(sp, self._eos_token_ids, self._sampling_seed(sp, j)))
                index.append((i, j))
        if not index:
            return []
        self._busy = True
        try:
            outputs = engine.generate(input_ids=input_ids, sampling_params=requests, return_logprob=True)
        finally:
            self._busy = False
        if len(outputs) != len(index):
            raise RuntimeError(f"SGLang returned {len(outputs)} outputs for {len(index)} requests")
        return [completion_from_output(out, i, j, self.weight_version) for out, (i, j) in zip(outputs, index)]

    def _sampling_seed(self, sp: SamplingParams, sample_index: int) -> int | None:
        """SGLang reads sampling_seed only in deterministic mode, where an unseeded request gets
        the fixed seed 42 (all samples of a prompt alike); we draw those from our own RNG.
        Outside that mode seeds cannot be honoured: they are dropped, with one warning."""
        if not self._deterministic:
            if sp.seed is not None and not self._warned_seed:
                self._warned_seed = True
                if self._rank == 0:
                    logger.warning(
                        "SGLang ignores SamplingParams.seed unless SGLangEngine(deterministic=True): "
                        "rollouts are not reproducible"
                    )
            return None
        if sp.min_p > 0:
            raise ValueError(f"SamplingParams.min_p={sp.min_p}: SGLang's seeded sampler does not support min_p")
        return self._seed_rng.getrandbits(63) if sp.seed is None else sp.seed + sample_index

    # -- memory ----------------------------------------------------------------------------

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = check_tags(tags)
        engine = self._ready("release_memory")
        if self._session is not None:
            raise RuntimeError("release_memory refused: a weight update is open")
        again = sorted(set(tags) & self._released)
        if again:
            raise ValueError(f"memory tags {again} are already released")
        # A successful flush proves the scheduler idle; its release asserts that, and a failed
        # assert kills the scheduler and then, through SIGQUIT, this rank.
        self._flush()
        engine.release_memory_occupation(tags=list(tags))
        self._released.update(tags)
        if "weights" in tags:
            self._weights_current = False  # resumed pages come back without their content

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        tags = check_tags(tags)
        engine = self._ready("resume_memory")
        missing = sorted(set(tags) - self._released)
        if missing:
            raise ValueError(f"memory tags {missing} are not released")
        for tag in RESUME_ORDER:
            if tag in tags:
                engine.resume_memory_occupation(tags=[tag])
                self._released.discard(tag)

    def flush_cache(self) -> None:
        self._ready("flush_cache")
        self._flush()

    def _flush(self) -> None:
        for _ in range(FLUSH_ATTEMPTS):
            result = self._engine.flush_cache()
            if result.success:
                return
            time.sleep(FLUSH_RETRY_S)
        raise RuntimeError(
            f"SGLang refused to flush its cache {FLUSH_ATTEMPTS} times ({result.message!r}): requests are still queued or running"
        )

    # -- weights ---------------------------------------------------------------------------

    def begin_weight_update(self, partial: bool = False) -> None:
        engine = self._ready("begin_weight_update")
        if self._session is not None:
            raise RuntimeError("begin_weight_update: a weight update is already open")
        if "weights" in self._released:
            raise RuntimeError("begin_weight_update: resume_memory(['weights']) first; the weight pages are unmapped")
        if partial and not self._weights_current:
            raise RuntimeError(
                "begin_weight_update(partial=True): the engine's weights are stale (random after "
                "load_dummy, or released and resumed); a full update must come first"
            )
        _check(engine.begin_weight_update(), "begin_weight_update")
        self._session, self._partial = set(), partial
        self._weights_current = False

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Send HF-named full tensors (one CUDA IPC bucket per dtype). A tied lm_head is skipped."""
        engine = self._ready("update_weights")
        if self._session is None:
            raise RuntimeError("update_weights outside begin_weight_update() ... end_weight_update()")
        named = []
        for name, tensor in named_tensors:
            if self._tied and name == TIED_HEAD:
                continue
            if self._expected is not None and name not in self._expected:
                raise ValueError(f"update_weights: {name!r} is not a parameter of {self.model_path}")
            check_buffer(name, tensor)
            named.append((name, tensor))
        for group in group_by_dtype(named):
            flat, payload = serialize_bucket(self._sgl, group)
            result = engine.update_weights_from_tensor(
                named_tensors=[payload],  # one payload per TP rank
                load_format=FLATTENED_BUCKET_FORMAT,
                flush_cache=False,  # flushed once in end_weight_update
            )
            del flat, payload  # the scheduler has copied and closed the handle
            if torch.cuda.is_initialized():
                torch.cuda.ipc_collect()
            _check(result, "update_weights_from_tensor")
            self._session.update(name for name, _ in group)

    def end_weight_update(self, version: int) -> None:
        """Flush, close the session, record `version`; raise if a parameter was not sent.

        The names a sync must cover come from the checkpoint's safetensors (less a tied lm_head);
        for a directory without weights, the first completed sync defines them. A partial session
        covers what it sent; the other parameters keep the values of the sessions before it.
        """
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"end_weight_update version={version!r} must be an int")
        engine = self._ready("end_weight_update")
        if self._session is None:
            raise RuntimeError("end_weight_update without begin_weight_update")
        sent, self._session = self._session, None
        self._flush()
        _check(engine.end_weight_update(), "end_weight_update")
        if self._expected is None:
            self._expected = frozenset(sent)
        missing = [] if self._partial else sorted(self._expected - sent)
        if missing:
            raise RuntimeError(
                f"end_weight_update: {len(missing)} parameters were not sent (e.g. {missing[:5]}); "
                "the engine holds stale weights for them"
            )
        request = self._sgl.UpdateWeightVersionReqInput(new_version=str(version))
        engine.loop.run_until_complete(engine.tokenizer_manager.update_weight_version(request))
        self.weight_version = version
        self._weights_current = True

    # -- lifetime --------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Kill the engine's processes (and only those), then put back our process state."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        atexit.unregister(self.shutdown)
        try:
            _stop_engine(engine)
        finally:
            self._state.restore()

    def _ready(self, what: str):
        if self._engine is None:
            raise RuntimeError(f"{what}: the SGLang engine is shut down")
        if self._busy:
            raise RuntimeError(f"{what} refused: a generate call is in flight")
        return self._engine


async def _remove_signal_handlers(loop) -> None:
    """From inside the running loop: uvloop removes a handler only while it is running."""
    for sig in (signal.SIGTERM, signal.SIGQUIT):
        loop.remove_signal_handler(sig)


def _check(result, what: str) -> None:
    ok, message = result
    if not ok:
        raise RuntimeError(f"SGLang {what} failed: {message}")


def _stop_engine(engine) -> None:
    """SIGKILL the engine's own process trees. Its watchdog goes first: it SIGQUITs this process
    when a child it watches dies. SGLang's Engine.shutdown is not used: it kills every child of
    this process, DataLoader workers included."""
    watchdog = engine.tokenizer_manager._subprocess_watchdog
    if watchdog is not None:
        watchdog.stop()
    try:
        kill_process_trees(engine.get_all_child_pids())
    finally:
        if engine.send_to_rpc is not None:
            engine.send_to_rpc.close(linger=0)
