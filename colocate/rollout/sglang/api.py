"""Every part of SGLang 0.5.23's API that the SGLang rollout adapter touches, in one place.

The names below are what `tests/unit/test_sglang_contract.py` checks against SGLang's source
(without importing it), so a rename upstream fails a CPU test instead of a GPU job. The pure
functions translate between our protocol and SGLang's request/response shapes.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
from typing import Sequence

from colocate.rollout.protocol import FINISH_REASONS, Completion, SamplingParams

SGLANG_VERSION = "0.5.23"
INSTALL_HINT = "pip install 'colocate[sglang]'"

SGLANG_IMPORTS = {
    "Engine": "sglang.srt.entrypoints.engine",
    "FlattenedTensorBucket": "sglang.srt.weight_sync.tensor_bucket",
    "MultiprocessingSerializer": "sglang.srt.utils.common",
    "monkey_patch_torch_reductions": "sglang.srt.utils.patch_torch",
    "UpdateWeightVersionReqInput": "sglang.srt.managers.io_struct",
}
"""name -> module it is imported from."""

ENGINE_METHODS = {
    "generate": ("input_ids", "sampling_params", "return_logprob"),
    "flush_cache": (),
    "release_memory_occupation": ("tags",),
    "resume_memory_occupation": ("tags",),
    "begin_weight_update": (),
    "end_weight_update": (),
    "update_weights_from_tensor": ("named_tensors", "load_format", "flush_cache"),
    "get_all_child_pids": (),
    "shutdown": (),
}
"""Engine method -> the keyword arguments we pass (`shutdown` only to take it off atexit)."""
ENGINE_ATTRIBUTES = ("loop", "tokenizer_manager", "send_to_rpc")
TOKENIZER_MANAGER_METHODS = {"update_weight_version": ("obj",)}
TOKENIZER_MANAGER_ATTRIBUTES = ("_subprocess_watchdog",)
"""Its watchdog SIGQUITs our process when an engine child dies, so shutdown stops it first."""
MEMORY_TAG_CONSTANTS = {
    "GPU_MEMORY_TYPE_WEIGHTS": "weights",
    "GPU_MEMORY_TYPE_KV_CACHE": "kv_cache",
    "GPU_MEMORY_TYPE_CUDA_GRAPH": "cuda_graph",
}
"""sglang.srt.constants: the same strings as protocol.MEMORY_TAGS, so tags pass through as-is."""
CUDA_GRAPH_ENV = "SGLANG_MEMORY_SAVER_CUDA_GRAPH"

SERVER_ARG_NAMES = (
    "model_path",
    "dtype",
    "load_format",
    "skip_tokenizer_init",
    "tp_size",
    "dp_size",
    "base_gpu_id",
    "port",
    "nccl_port",
    "random_seed",
    "enable_memory_saver",
    "mem_fraction_static",
    "max_running_requests",
    "cuda_graph_max_bs_decode",
    "log_level",
    "weight_version",
    "enable_deterministic_inference",
)
"""Exactly the keyword arguments `engine_kwargs` gives `Engine(...)`."""
REMOVED_SERVER_ARGS = ("cuda_graph_max_bs",)
"""Gone in 0.5.23 (an unknown keyword is a TypeError there)."""
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
LOAD_FORMATS = ("auto", "dummy")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

SAMPLING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_new_tokens",
    "min_new_tokens",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
)
"""Every key `sampling_request` can put in a request's sampling params."""
LOGPROB_KEY = "output_token_logprobs"


def import_sglang() -> SimpleNamespace:
    """The SGLang objects we use, imported lazily: the CPU install does not have sglang."""
    found = {}
    for name, module in SGLANG_IMPORTS.items():
        try:
            found[name] = getattr(importlib.import_module(module), name)
        except ImportError as e:
            raise ImportError(f"the SGLang rollout backend needs sglang=={SGLANG_VERSION} ({e}); {INSTALL_HINT}") from e
    return SimpleNamespace(**found)


def engine_kwargs(
    *,
    model_path: str,
    dtype: str,
    seed: int,
    rank: int,
    device_index: int,
    port: int,
    nccl_port: int,
    mem_fraction_static: float,
    max_running_requests: int,
    cuda_graph_max_bs: int,
    load_dummy: bool,
    log_level: str,
    deterministic: bool,
) -> dict:
    """Keyword arguments for `sglang.Engine`: one TP=1 engine per rank on this rank's GPU."""
    checks = [
        ("dtype", dtype, dtype in DTYPES, f"must be one of {DTYPES}"),
        ("log_level", log_level, log_level in LOG_LEVELS, f"must be one of {LOG_LEVELS}"),
        ("device_index", device_index, device_index >= 0, "must be >= 0"),
        ("mem_fraction_static", mem_fraction_static, 0 < mem_fraction_static < 1, "must be in (0, 1)"),
        ("max_running_requests", max_running_requests, max_running_requests >= 1, "must be >= 1"),
        ("cuda_graph_max_bs", cuda_graph_max_bs, cuda_graph_max_bs >= 1, "must be >= 1"),
    ]
    for name, value, ok, why in checks:
        if not ok:
            raise ValueError(f"SGLangEngine {name}={value!r} {why}")
    return dict(
        model_path=str(model_path),
        dtype=dtype,
        load_format="dummy" if load_dummy else "auto",
        skip_tokenizer_init=True,  # we send token ids and read token ids
        tp_size=1,
        dp_size=1,
        base_gpu_id=device_index,
        port=port,
        nccl_port=nccl_port,
        random_seed=seed + rank,
        enable_memory_saver=True,
        mem_fraction_static=mem_fraction_static,
        max_running_requests=max_running_requests,
        cuda_graph_max_bs_decode=cuda_graph_max_bs,
        log_level=log_level,
        weight_version="0",  # our versions are ints; the engine echoes str(version) per request
        enable_deterministic_inference=deterministic,
    )


def sampling_request(sp: SamplingParams, eos_token_ids: Sequence[int], sampling_seed: int | None) -> dict:
    """SGLang sampling params for one sample (`n` is expanded by the caller, never sent).

    Our eos ids go in as stop ids so they hold whatever the engine read from the checkpoint.
    SGLang's ignore_eos also disables stop_token_ids, so asking for both cannot be honoured.
    """
    if sp.ignore_eos and sp.stop_token_ids:
        raise ValueError(
            f"SamplingParams.stop_token_ids={sp.stop_token_ids} with ignore_eos=True: SGLang's "
            "ignore_eos disables every stop token"
        )
    request = {
        "temperature": sp.temperature,  # SGLang turns < 1e-6 into greedy with unscaled log-probs
        "top_p": sp.top_p,
        "top_k": sp.top_k if sp.top_k > 0 else -1,
        "min_p": sp.min_p,
        "max_new_tokens": sp.max_new_tokens,
        "min_new_tokens": sp.min_new_tokens,
        "stop_token_ids": [] if sp.ignore_eos else sorted({*eos_token_ids, *sp.stop_token_ids}),
        "ignore_eos": sp.ignore_eos,
    }
    if sampling_seed is not None:
        request["sampling_seed"] = sampling_seed
    return request


def completion_from_output(out: dict, prompt_index: int, sample_index: int, weight_version: int) -> Completion:
    """Our Completion from one SGLang output dict; refuses output made with other weights."""
    meta = out["meta_info"]
    if meta["weight_version"] != str(weight_version):
        raise RuntimeError(
            f"SGLang answered with weight_version {meta['weight_version']!r} but the adapter "
            f"recorded {weight_version}: the engine's weights are not the ones last pushed"
        )
    output_ids = list(out["output_ids"])
    triples = meta[LOGPROB_KEY]  # [(logprob, token_id, text or None)] per generated token
    if [t[1] for t in triples] != output_ids:
        raise RuntimeError(f"SGLang log-probs cover tokens {[t[1] for t in triples]} but output_ids are {output_ids}")
    reason = meta["finish_reason"] or {}
    kind = reason.get("type")
    if kind not in FINISH_REASONS:
        raise RuntimeError(f"SGLang finish_reason {meta['finish_reason']!r} is not one of {FINISH_REASONS}")
    extra = {"abort_message": reason.get("message")} if kind == "abort" else {}
    return Completion(
        prompt_index=prompt_index,
        sample_index=sample_index,
        output_ids=output_ids,
        logprobs=[float(t[0]) for t in triples],
        finish_reason=kind,
        weight_version=weight_version,
        extra=extra,
    )
