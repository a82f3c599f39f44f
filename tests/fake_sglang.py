"""A CPU stand-in for the parts of SGLang 0.5.23 the adapter uses, with SGLang's behaviour.

`install(monkeypatch)` puts it into sys.modules under SGLang's module names. What it reproduces
(from SGLang's source): unknown Engine keywords are a TypeError; constructing the engine rewrites
the root logging config, SIGQUIT, the multiprocessing start method and NCCL_/CUDA_ variables,
registers Engine.shutdown with atexit and starts child processes (a scheduler with a child of its
own, and a detokenizer); the first request installs SIGTERM/SIGQUIT handlers on the engine loop (removable, as with
uvloop, only while the loop runs);
`sampling_seed` is ignored unless deterministic inference is on; eos from config.json stops
generation; outputs carry `output_ids` and `meta_info` with `finish_reason` dicts, logprob tuples
and the current `weight_version`; flush fails while the scheduler is not idle; release asserts
idleness; resuming a tag that is not released is a KeyError; weight updates outside
begin/end return (False, msg); a flattened bucket decodes through the serializer; weights are
garbage after a weights resume until the next load.

Differences, on purpose: tensors travel by value through pickle (no CUDA IPC on CPU), the
"model" emits token prompt[-1] + step (+ seed, + int(norm weight[0])) with log-prob
-0.5 - (token % 5) / 10, and Engine.shutdown fails the test (it would SIGKILL every child of the
test process). Knobs: `flush_failures`, `fail_next_update`, `on_generate`.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import types
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

SERVER_ARG_FIELDS = frozenset(
    {
        "model_path",
        "tokenizer_path",
        "dtype",
        "load_format",
        "skip_tokenizer_init",
        "tp_size",
        "dp_size",
        "base_gpu_id",
        "gpu_id_step",
        "host",
        "port",
        "nccl_port",
        "random_seed",
        "enable_memory_saver",
        "enable_weights_cpu_backup",
        "mem_fraction_static",
        "max_running_requests",
        "max_total_tokens",
        "chunked_prefill_size",
        "context_length",
        "cuda_graph_max_bs_decode",
        "cuda_graph_max_bs_prefill",
        "disable_cuda_graph",
        "log_level",
        "weight_version",
        "enable_deterministic_inference",
        "disable_radix_cache",
        "trust_remote_code",
    }
)
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "stop_regex",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "logit_bias",
        "sampling_seed",
    }
)
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
ABORT_TOKEN = 999
"""A prompt holding this token is aborted by the fake scheduler."""
VOCAB_SIZE = 1000


def fake_logprob(token: int) -> float:
    return -0.5 - (token % 5) / 10


@dataclass
class FlattenedTensorMetadata:
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


class FlattenedTensorBucket:
    """Same API as SGLang's: from named tensors, or from a flat uint8 tensor plus metadata."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None):
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("Cannot create empty tensor bucket")
            parts, self.metadata, offset = [], [], 0
            for name, tensor in named_tensors:
                raw = tensor.flatten().view(torch.uint8)
                self.metadata.append(
                    FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + raw.numel(), raw.numel())
                )
                parts.append(raw)
                offset += raw.numel()
            self.flattened_tensor = torch.cat(parts)
        else:
            self.flattened_tensor, self.metadata = flattened_tensor, metadata

    def get_flattened_tensor(self):
        return self.flattened_tensor

    def get_metadata(self):
        return self.metadata

    def reconstruct_tensors(self):
        return [(m.name, self.flattened_tensor[m.start_idx : m.end_idx].view(m.dtype).reshape(m.shape)) for m in self.metadata]


class MultiprocessingSerializer:
    """By-value pickle here; SGLang's pickles CUDA tensors as IPC handles."""

    @staticmethod
    def serialize(obj, output_str: bool = False):
        assert not output_str
        return pickle.dumps(obj)

    @staticmethod
    def deserialize(data):
        return pickle.loads(data)


@dataclass(kw_only=True)
class UpdateWeightVersionReqInput:
    new_version: str
    abort_all_requests: bool = True


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class FakeState:
    """Everything the fake records across engines, reset by install()."""

    def __init__(self):
        self.engines: list[Engine] = []
        self.patched_reductions = 0


STATE = FakeState()


def monkey_patch_torch_reductions():
    STATE.patched_reductions += 1


class UvLikeLoop(asyncio.SelectorEventLoop):
    """An asyncio loop with uvloop's rules for signal handlers: removal works only while the loop
    runs (otherwise it returns False and keeps the handler) and only in the main thread."""

    def __init__(self):
        super().__init__()
        self.signal_handlers_left: set[int] = set()

    def add_signal_handler(self, sig, callback, *args):
        super().add_signal_handler(sig, callback, *args)
        self.signal_handlers_left.add(sig)

    def remove_signal_handler(self, sig):
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("remove_signal_handler() can only be called from the main thread")
        if not self.is_running():
            return False
        self.signal_handlers_left.discard(sig)
        return super().remove_signal_handler(sig)


class Watchdog:
    """Stands for SGLang's SubprocessWatchdog, which SIGQUITs the parent when a child dies."""

    def __init__(self, procs):
        self.procs, self.stopped, self.children_alive_at_stop = procs, False, None

    def stop(self):
        self.stopped = True
        self.children_alive_at_stop = all(p.poll() is None for p in self.procs)


class RpcSocket:
    def __init__(self):
        self.closed = False

    def close(self, linger=None):
        self.closed = True


class TokenizerManager:
    def __init__(self, engine, weight_version: str):
        self.engine, self.weight_version, self.event_loop = engine, weight_version, None
        self._subprocess_watchdog = Watchdog(engine.procs)

    def auto_create_handle_loop(self):
        if self.event_loop is not None:
            return
        self.event_loop = self.engine.loop
        if threading.current_thread() is threading.main_thread():
            self.event_loop.add_signal_handler(signal.SIGTERM, lambda: None)
            self.event_loop.add_signal_handler(signal.SIGQUIT, lambda: None)

    async def flush_cache(self):
        self.auto_create_handle_loop()
        return self.engine.scheduler_flush()

    async def update_weight_version(self, obj: UpdateWeightVersionReqInput) -> None:
        self.auto_create_handle_loop()
        assert isinstance(obj.new_version, str), obj.new_version
        self.weight_version = obj.new_version


class Engine:
    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - SERVER_ARG_FIELDS)
        if unknown:
            raise TypeError(f"Unexpected keyword argument {unknown[0]!r}")
        assert kwargs.get("tp_size", 1) == 1 and kwargs.get("dp_size", 1) == 1
        self.kwargs = kwargs
        path = Path(kwargs["model_path"])
        self.config = json.loads((path / "config.json").read_text())
        files = sorted(path.glob("*.safetensors"))
        checkpoint = {k: v for f in files for k, v in load_file(str(f)).items()}
        self.param_shapes = {k: v.shape for k, v in checkpoint.items()} if files else None
        self.weights = {} if kwargs.get("load_format") == "dummy" else checkpoint
        self.weights_valid = True
        self._set_envs_and_config(kwargs.get("log_level", "error"))
        atexit.register(self.shutdown)
        self.spawn_env = dict(os.environ)
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
            raise RuntimeError("scheduler died: torch_memory_saver refuses expandable_segments")
        if "torch_memory_saver" in os.environ.get("LD_PRELOAD", ""):
            raise RuntimeError("scheduler died: the memory saver hook is in LD_PRELOAD twice")
        child_env = {"PATH": os.environ.get("PATH", "")}
        scheduler = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!; wait"], stdout=subprocess.PIPE, env=child_env)
        self.scheduler_child_pid = int(scheduler.stdout.readline())
        scheduler.stdout.close()
        self.procs = [scheduler, subprocess.Popen(["sleep", "300"], env=child_env)]
        self.loop = UvLikeLoop()
        self.tokenizer_manager = TokenizerManager(self, kwargs.get("weight_version", "default"))
        self.send_to_rpc = RpcSocket()
        self.offloaded: set[str] = set()
        self.session_open = self.loaded_in_session = False
        self.dirty = self.in_generate = False
        self.flush_failures, self.fail_next_update, self.on_generate = 0, None, None
        self.flush_calls = 0
        self.requests, self.release_calls, self.resume_calls, self.update_calls = [], [], [], []
        STATE.engines.append(self)

    @staticmethod
    def _set_envs_and_config(log_level: str):
        logging.basicConfig(level=getattr(logging, log_level.upper()), format="[fake] %(message)s", force=True)
        os.environ.setdefault("NCCL_CUMEM_ENABLE", "0")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = "8"
        os.environ["SGLANG_RUN_ID"] = f"sglang-run-{uuid.uuid4().hex}"
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGQUIT, lambda signum, frame: None)
        multiprocessing.set_start_method("spawn", force=True)

    def get_all_child_pids(self):
        return [p.pid for p in self.procs]

    def shutdown(self):
        raise AssertionError("Engine.shutdown SIGKILLs every child of the calling process")

    # -- scheduler side --

    def scheduler_flush(self) -> FlushCacheReqOutput:
        self.flush_calls += 1
        if self.in_generate or self.flush_failures > 0:
            self.flush_failures = max(0, self.flush_failures - 1)
            return FlushCacheReqOutput(success=False, message="Cache not flushed because there are pending requests.")
        self.dirty = False
        return FlushCacheReqOutput(success=True)

    def flush_cache(self):
        return self.loop.run_until_complete(self.tokenizer_manager.flush_cache())

    def release_memory_occupation(self, tags=None):
        self.tokenizer_manager.auto_create_handle_loop()
        assert not (self.in_generate or self.dirty), "release_memory_occupation should be called only when server is idle."
        tags = list(tags) if tags else list(MEMORY_TAGS)
        for tag in tags:
            assert tag in MEMORY_TAGS and tag not in self.offloaded, tag
        self.offloaded.update(tags)
        self.release_calls.append(tags)

    def resume_memory_occupation(self, tags=None):
        self.tokenizer_manager.auto_create_handle_loop()
        tags = list(tags) if tags else list(MEMORY_TAGS)
        for tag in tags:
            self.offloaded.remove(tag)
        if "weights" in tags:
            self.weights_valid = False
        self.resume_calls.append(tags)

    def begin_weight_update(self, selector: str = "all"):
        self.tokenizer_manager.auto_create_handle_loop()
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open, self.loaded_in_session = True, False
        return True, "Success"

    def end_weight_update(self):
        self.tokenizer_manager.auto_create_handle_loop()
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        self.weights_valid = self.weights_valid or self.loaded_in_session
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.tokenizer_manager.auto_create_handle_loop()
        if not self.session_open:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        assert "weights" not in self.offloaded, "writing into paused weight memory"
        assert load_format == "flattened_bucket" and isinstance(named_tensors, list) and len(named_tensors) == 1
        data = MultiprocessingSerializer.deserialize(named_tensors[0])
        tensors = FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        ).reconstruct_tensors()
        self.update_calls.append(
            dict(keys=tuple(data), names=[n for n, _ in tensors], flush_cache=flush_cache, load_format=load_format)
        )
        if self.fail_next_update is not None:
            message, self.fail_next_update = self.fail_next_update, None
            return False, message
        for name, tensor in tensors:
            if self.param_shapes is not None and self.param_shapes.get(name) != tensor.shape:
                return False, f"Failed to update parameter online: no parameter {name} of shape {tuple(tensor.shape)}"
            self.weights[name] = tensor.clone()
        self.loaded_in_session = True
        if flush_cache and not self.scheduler_flush().success:
            return False, "Weights were updated, but the cache was not flushed"
        return True, "Success"

    def generate(self, input_ids=None, sampling_params=None, return_logprob=False, **unused):
        self.tokenizer_manager.auto_create_handle_loop()
        assert not self.offloaded, f"generating with released memory {self.offloaded}"
        assert self.weights_valid, "generating with garbage weights"
        single = isinstance(input_ids[0], int)
        batch = [input_ids] if single else input_ids
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or {}] * len(batch)
        for p in params:
            unknown = set(p) - SAMPLING_FIELDS
            if unknown:
                raise TypeError(f"Unexpected keyword argument {sorted(unknown)[0]!r}")
        self.requests.extend(zip(batch, params))
        self.in_generate = True
        try:
            if self.on_generate is not None:
                self.on_generate()
            outputs = [self._run(ids, p, return_logprob) for ids, p in zip(batch, params)]
        finally:
            self.in_generate = False
        self.dirty = True
        return outputs[0] if single else outputs

    def _run(self, ids, p, return_logprob):
        seed = p.get("sampling_seed") if self.kwargs.get("enable_deterministic_inference") else None
        norm = self.weights.get("model.norm.weight")
        shift = (seed or 0) + (int(norm.flatten()[0].item()) if norm is not None else 0)
        eos = self.config.get("eos_token_id")
        stops = set(p.get("stop_token_ids") or ()) | ({eos} if isinstance(eos, int) else set(eos or ()))
        out, reason = [], None
        if ABORT_TOKEN in ids:
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
        for step in range(p.get("max_new_tokens", 128) if reason is None else 0):
            token = (ids[-1] + step + shift) % VOCAB_SIZE
            out.append(token)
            if not p.get("ignore_eos") and step + 1 > p.get("min_new_tokens", 0) and token in stops:
                reason = {"type": "stop", "matched": token}
                break
        reason = reason or {"type": "length", "length": len(out)}
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": reason,
            "prompt_tokens": len(ids),
            "weight_version": self.tokenizer_manager.weight_version,
            "completion_tokens": len(out),
            "cached_tokens": 0,
        }
        if return_logprob:
            meta["output_token_logprobs"] = [(fake_logprob(t), t, None) for t in out]
            meta["output_token_logprobs_length"] = len(out)
        return {"output_ids": out, "meta_info": meta}

    def close(self):
        """Test teardown: end what a test left running."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        try:
            os.kill(self.scheduler_child_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for sig in list(self.loop.signal_handlers_left):
            asyncio.SelectorEventLoop.remove_signal_handler(self.loop, sig)
        self.loop.close()


MODULES = {
    "sglang.srt.entrypoints.engine": {"Engine": Engine},
    "sglang.srt.weight_sync.tensor_bucket": {
        "FlattenedTensorBucket": FlattenedTensorBucket,
        "FlattenedTensorMetadata": FlattenedTensorMetadata,
    },
    "sglang.srt.utils.common": {"MultiprocessingSerializer": MultiprocessingSerializer},
    "sglang.srt.utils.patch_torch": {"monkey_patch_torch_reductions": monkey_patch_torch_reductions},
    "sglang.srt.managers.io_struct": {
        "UpdateWeightVersionReqInput": UpdateWeightVersionReqInput,
        "FlushCacheReqOutput": FlushCacheReqOutput,
    },
}


def install(monkeypatch) -> FakeState:
    """Make `import sglang...` find the fake for the rest of the test; returns the record."""
    global STATE
    STATE = FakeState()
    names = set()
    for dotted in MODULES:
        parts = dotted.split(".")
        names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    for name in sorted(names):
        module = types.ModuleType(name)
        module.__dict__.update(MODULES.get(name, {}))
        monkeypatch.setitem(sys.modules, name, module)
    return STATE
