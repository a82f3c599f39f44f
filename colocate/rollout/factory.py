"""Build the configured rollout engine for this rank."""

from __future__ import annotations

from colocate.config import Config
from colocate.dist import DistInfo
from colocate.kernels.ops import Ops
from colocate.models import resolve_dtype
from colocate.rollout.protocol import RolloutEngine
from colocate.sizing import AUTO, MemoryPlan

DEFAULT_KV_FRACTION = 0.5
"""The KV cache's share of free memory with rollout.gpu_memory_fraction auto and no plan (an engine
built outside the training loop)."""


def reachable_batch_size(cfg: Config, world_size: int, eval_prompts: int = 0) -> int:
    """The most sequences one rank's engine decodes at once in this run: a sampling round's groups
    (rollout or over-sampling batch) or an eval set's, capped by rollout.max_running_requests.
    CUDA graphs of larger batches would never replay, and each costs start-up time."""
    r = cfg.rollout
    prompts = max(r.rollout_batch_size, r.over_sampling_batch_size or 0) // world_size
    most = max(prompts * r.n_samples_per_prompt, eval_prompts * cfg.eval.n_samples_per_eval_prompt)
    return max(1, min(r.max_running_requests, most))


def build_engine(
    cfg: Config,
    info: DistInfo,
    eos_token_ids: list[int],
    max_batch_size: int | None = None,
    memory_plan: MemoryPlan | None = None,
    ops: Ops | None = None,
) -> RolloutEngine:
    """The native engine (default) or SGLang's, sized for whatever the trainer left free; with
    `max_batch_size` (see `reachable_batch_size`), no decode graph is captured beyond it. With
    rollout.gpu_memory_fraction auto, the KV cache is `memory_plan`'s (colocate/sizing.py), or
    DEFAULT_KV_FRACTION of free memory without one. `ops`: the run's table of operations
    (colocate/kernels/ops.py), which the native engine computes with; default `Ops.standard()`."""
    r = cfg.rollout
    fraction, kv_tokens, static = r.gpu_memory_fraction, None, r.gpu_memory_fraction
    if fraction == AUTO:
        fraction = static = DEFAULT_KV_FRACTION
        if memory_plan is not None and memory_plan.kv_cache_tokens is not None:
            kv_tokens, static = memory_plan.kv_cache_tokens, memory_plan.static_fraction
    dtype = resolve_dtype(cfg.model.dtype, info.device)
    graph_max_bs = min(r.cuda_graph_max_bs, max_batch_size or r.cuda_graph_max_bs)
    if r.engine == "sglang":
        from colocate.rollout.sglang.engine import SGLangEngine

        return SGLangEngine(
            model_path=cfg.model.path,
            dtype=dtype,
            seed=r.seed,
            rank=info.rank,
            local_rank=info.local_rank,
            mem_fraction_static=static,
            max_running_requests=r.max_running_requests,
            cuda_graph_max_bs=graph_max_bs,
            release_cuda_graph=cfg.offload.offload_rollout,
            eos_token_ids=eos_token_ids,
            load_dummy=True,
            log_level=r.sglang_log_level,
        )
    from colocate.rollout.native import NativeEngine

    return NativeEngine(
        cfg.model.path,
        dtype=dtype,
        device=info.device,
        eos_token_ids=eos_token_ids,
        max_num_seqs=r.max_running_requests,
        kv_cache_fraction=fraction,
        max_kv_tokens=r.max_kv_tokens if info.device.type == "cpu" else kv_tokens,
        cuda_graph=r.cuda_graph,
        cuda_graph_max_bs=graph_max_bs,
        seed=r.seed + info.rank,
        compile_decode=r.compile_decode and info.device.type == "cuda",
        ops=Ops.standard() if ops is None else ops,
        weight_dtype="fp8" if r.weight_dtype == "fp8" else "auto",
        kv_cache_dtype=r.kv_cache_dtype,
    )
