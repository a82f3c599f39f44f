"""The SGLang adapter's orchestration on CPU, against tests/fake_sglang.py."""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from colocate.rollout.protocol import SamplingParams
from colocate.rollout.sglang import engine as sglang_engine
from colocate.rollout.sglang import weights as sglang_weights
from colocate.rollout.sglang.api import SAMPLING_KEYS, SERVER_ARG_NAMES, engine_kwargs
from colocate.rollout.sglang.engine import SGLangEngine
from colocate.rollout.sglang.process import (
    check_allocator_env,
    check_ports_free,
    child_env,
    engine_ports,
    visible_device_index,
)
from colocate.rollout.sglang.weights import BUCKET_KEYS
from tests import fake_sglang

PARAMS = {  # name: (shape, dtype) of the fake checkpoint
    "model.embed_tokens.weight": ((8, 4), torch.bfloat16),
    "model.layers.0.mlp.down_proj.weight": ((4, 6), torch.bfloat16),
    "model.norm.weight": ((4,), torch.float32),
    "lm_head.weight": ((8, 4), torch.bfloat16),
}


def write_model(root: Path, tied: bool = False, weights: bool = True, eos: int = 0) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "tie_word_embeddings": tied, "eos_token_id": eos}
    (root / "config.json").write_text(json.dumps(config))
    if weights:
        save_file(
            {n: torch.zeros(s, dtype=d) for n, (s, d) in PARAMS.items() if not (tied and n == "lm_head.weight")},
            str(root / "model.safetensors"),
        )
    return root


def free_base_port() -> int:
    """A port p with p and p + 1 both free (the engine's port and its NCCL port)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("", port))
                b.bind(("", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two consecutive free ports")


def new_weights(norm_value: float, skip=()):
    return [
        (n, torch.full(s, norm_value if n == "model.norm.weight" else 0.25, dtype=d))
        for n, (s, d) in PARAMS.items()
        if n not in skip
    ]


class AtexitRecord(list):
    """What is registered with atexit during a test (nothing reaches the real atexit)."""

    def register(self, func, *args, **kwargs):
        self.append(func)
        return func

    def unregister(self, func):
        self[:] = [f for f in self if f != func]

    def owned_by(self, *objects):
        return [f for f in self if getattr(f, "__self__", None) in objects]


@pytest.fixture
def fake(monkeypatch):
    state = fake_sglang.install(monkeypatch)
    monkeypatch.setattr(sglang_weights, "BUFFER_DEVICE_TYPE", "cpu")
    monkeypatch.setattr(sglang_engine, "FLUSH_RETRY_S", 0.0)
    state.atexit = AtexitRecord()
    monkeypatch.setattr(atexit, "register", state.atexit.register)
    monkeypatch.setattr(atexit, "unregister", state.atexit.unregister)
    yield state
    for engine in state.engines:
        engine.close()


def process_state():
    """What the engine may change in our process, in comparable form."""
    return (
        dict(os.environ),
        list(logging.getLogger().handlers),
        logging.getLogger().level,
        {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT)},
        multiprocessing.get_start_method(allow_none=True),
    )


def make_engine(model_dir, **overrides) -> SGLangEngine:
    args = dict(
        model_path=str(model_dir),
        dtype=torch.bfloat16,
        seed=7,
        rank=0,
        local_rank=0,
        mem_fraction_static=0.5,
        max_running_requests=8,
        cuda_graph_max_bs=4,
        release_cuda_graph=True,
        eos_token_ids=[500],
        load_dummy=False,
        log_level="warning",
        base_port=free_base_port(),
    )
    args.update(overrides)
    return SGLangEngine(**args)


def test_engine_kwargs_per_rank():
    ports = []
    for rank in range(8):
        port, nccl_port = engine_ports(rank)
        kw = engine_kwargs(
            model_path="m",
            dtype="bfloat16",
            seed=11,
            rank=rank,
            device_index=rank,
            port=port,
            nccl_port=nccl_port,
            mem_fraction_static=0.4,
            max_running_requests=16,
            cuda_graph_max_bs=32,
            load_dummy=rank % 2 == 0,
            log_level="info",
            deterministic=False,
        )
        assert tuple(kw) == SERVER_ARG_NAMES and "cuda_graph_max_bs" not in kw
        assert (kw["random_seed"], kw["base_gpu_id"], kw["cuda_graph_max_bs_decode"]) == (11 + rank, rank, 32)
        assert kw["load_format"] == ("dummy" if rank % 2 == 0 else "auto")
        assert (kw["tp_size"], kw["dp_size"]) == (1, 1)
        assert kw["enable_memory_saver"] and kw["skip_tokenizer_init"]
        ports += [kw["port"], kw["nccl_port"]]
    assert len(set(ports)) == 16 and all(1024 <= p < 32768 for p in ports)
    with pytest.raises(ValueError, match="mem_fraction_static"):
        engine_kwargs(
            model_path="m",
            dtype="bfloat16",
            seed=0,
            rank=0,
            device_index=0,
            port=1,
            nccl_port=2,
            mem_fraction_static=1.0,
            max_running_requests=1,
            cuda_graph_max_bs=1,
            load_dummy=False,
            log_level="info",
            deterministic=False,
        )


def test_visible_device_index_and_ports():
    assert visible_device_index(3, {}) == 3
    assert visible_device_index(2, {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 2
    assert visible_device_index(5, {"CUDA_VISIBLE_DEVICES": "5"}) == 0
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        visible_device_index(3, {"CUDA_VISIBLE_DEVICES": "0,1"})
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        taken = s.getsockname()[1]
        with pytest.raises(RuntimeError, match=str(taken)):
            check_ports_free([taken])


def test_allocator_and_child_env():
    check_allocator_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"})
    for var in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        with pytest.raises(ValueError, match=var):
            check_allocator_env({var: "max_split_size_mb:64, expandable_segments:True"})
    env = {"LD_PRELOAD": "/a/libx.so:/b/torch_memory_saver_hook_mode_preload.abi3.so"}
    expected = {"LD_PRELOAD": "/a/libx.so", "SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}
    assert child_env(env, release_cuda_graph=True) == expected
    assert child_env({"LD_PRELOAD": "/a/libx.so"}, release_cuda_graph=False) == {}


def test_expandable_segments_refused_before_engine(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(ValueError, match="expandable_segments"):
        make_engine(write_model(tmp_path))
    assert fake.engines == []


def test_missing_sglang_is_a_clear_import_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    before = process_state()
    with pytest.raises(ImportError, match=r"pip install 'colocate\[sglang\]'"):
        make_engine(write_model(tmp_path))
    assert process_state() == before


def test_process_state_restored_after_construction_and_shutdown(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    monkeypatch.setenv("LD_PRELOAD", "/opt/libx.so:/opt/torch_memory_saver_hook_mode_preload.so")
    monkeypatch.delenv("NCCL_CUMEM_ENABLE", raising=False)
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGQUIT, signal.SIGINT)}
    mine = {signal.SIGTERM: lambda *a: None, signal.SIGQUIT: lambda *a: None}
    root, log_file = logging.getLogger(), tmp_path / "run.log"
    handler, level = logging.FileHandler(log_file, mode="w"), root.level  # stops for good once closed
    try:
        for sig, h in mine.items():
            signal.signal(sig, h)
        root.addHandler(handler)
        root.setLevel(logging.INFO)
        state = process_state()
        engine = make_engine(write_model(tmp_path / "model"), release_cuda_graph=True)
        spawned = fake.engines[0].spawn_env
        assert spawned["LD_PRELOAD"] == "/opt/libx.so" and spawned["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
        assert spawned["NCCL_DEBUG"] == "WARN"
        for phase in ("constructed", "shut down"):
            assert process_state() == state, phase
            assert root.level == logging.INFO
            assert {s: signal.getsignal(s) for s in mine} == mine
            assert fake.engines[0].loop.signal_handlers_left == set()
            logging.getLogger("colocate.test").info("still logging when %s", phase)
            handler.flush()
            assert f"still logging when {phase}" in log_file.read_text()
            if phase == "constructed":
                assert fake.atexit.owned_by(engine, fake.engines[0]) == [engine.shutdown]
                assert fake.patched_reductions == 1
                engine.shutdown()
        assert fake.atexit.owned_by(engine, fake.engines[0]) == []
    finally:
        root.removeHandler(handler)
        handler.close()
        root.setLevel(level)
        for sig, h in saved.items():
            signal.signal(sig, h)


def test_generate_expands_n_prompt_major(fake, tmp_path, caplog):
    engine = make_engine(write_model(tmp_path))
    assert fake.engines[0].kwargs["dtype"] == "bfloat16" and fake.engines[0].kwargs["base_gpu_id"] == 0
    sp = SamplingParams(n=3, temperature=0.7, top_k=0, max_new_tokens=4, min_p=0.05)
    out = engine.generate([[5, 6, 10], [20]], sp)
    assert [(c.prompt_index, c.sample_index) for c in out] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]
    for c in out:
        last = [10, 20][c.prompt_index]
        assert c.output_ids == [last, last + 1, last + 2, last + 3]
        assert c.logprobs == pytest.approx([-0.5 - (t % 5) / 10 for t in c.output_ids])
        assert (c.finish_reason, c.weight_version) == ("length", 0)
    requests = fake.engines[0].requests
    assert [ids for ids, _ in requests] == [[5, 6, 10]] * 3 + [[20]] * 3
    for _, params in requests:
        assert "n" not in params and set(params) <= set(SAMPLING_KEYS) and "sampling_seed" not in params
        assert (params["top_k"], params["temperature"], params["min_p"]) == (-1, 0.7, 0.05)
        assert params["stop_token_ids"] == [500]
    with caplog.at_level(logging.WARNING, logger="colocate.rollout.sglang.engine"):
        for _ in range(2):
            engine.generate([[1]], SamplingParams(seed=3, max_new_tokens=1))
    assert "sampling_seed" not in requests[-1][1]
    assert sum("ignores SamplingParams.seed" in r.getMessage() for r in caplog.records) == 1
    with pytest.raises(ValueError, match="2 entries for 1 prompts"):
        engine.generate([[1]], [sp, sp])
    engine.shutdown()


def test_deterministic_seeds(fake, tmp_path):
    engine = make_engine(write_model(tmp_path), deterministic=True)
    out = engine.generate([[10], [40]], [SamplingParams(n=3, seed=100, max_new_tokens=1), SamplingParams(n=2, max_new_tokens=1)])
    seeds = [params["sampling_seed"] for _, params in fake.engines[0].requests]
    assert seeds[:3] == [100, 101, 102] and len(set(seeds[3:])) == 2
    firsts = [10] * 3 + [40] * 2
    assert [c.output_ids[0] for c in out] == [(b + s) % fake_sglang.VOCAB_SIZE for b, s in zip(firsts, seeds)]
    with pytest.raises(ValueError, match="min_p"):
        engine.generate([[1]], SamplingParams(min_p=0.1))
    engine.shutdown()


def test_finish_reasons(fake, tmp_path):
    engine = make_engine(write_model(tmp_path), eos_token_ids=[12])
    stop, length, ignore, abort = engine.generate(
        [[10], [10], [10], [fake_sglang.ABORT_TOKEN]],
        [
            SamplingParams(max_new_tokens=8),
            SamplingParams(max_new_tokens=2),
            SamplingParams(max_new_tokens=5, ignore_eos=True),
            SamplingParams(),
        ],
    )
    assert (stop.output_ids, stop.finish_reason) == ([10, 11, 12], "stop")
    assert (length.output_ids, length.finish_reason) == ([10, 11], "length")
    assert (ignore.output_ids, ignore.finish_reason) == ([10, 11, 12, 13, 14], "length")
    assert (abort.output_ids, abort.finish_reason, abort.extra) == ([], "abort", {"abort_message": "Aborted"})
    with pytest.raises(ValueError, match="ignore_eos"):
        engine.generate([[1]], SamplingParams(ignore_eos=True, stop_token_ids=(3,)))
    engine.shutdown()


def test_generate_checks_weight_version(fake, tmp_path):
    engine = make_engine(write_model(tmp_path))
    fake.engines[0].tokenizer_manager.weight_version = "3"
    with pytest.raises(RuntimeError, match="weight_version '3'"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))
    engine.shutdown()


def test_release_resume_order_and_refusals(fake, tmp_path):
    engine = make_engine(write_model(tmp_path))
    sglang = fake.engines[0]
    engine.generate([[1]], SamplingParams(max_new_tokens=2))
    assert sglang.dirty  # the fake asserts idleness on release: the adapter must flush first
    engine.release_memory()
    assert sglang.release_calls == [["weights", "kv_cache", "cuda_graph"]]
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([[1]], SamplingParams())
    with pytest.raises(ValueError, match="already released"):
        engine.release_memory(["kv_cache"])
    with pytest.raises(ValueError, match="unknown memory tags"):
        engine.resume_memory(["activations"])
    engine.resume_memory(["kv_cache", "cuda_graph", "weights"])
    assert sglang.resume_calls == [["weights"], ["cuda_graph"], ["kv_cache"]]
    with pytest.raises(ValueError, match="not released"):
        engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="stale"):  # weights came back without content
        engine.generate([[1]], SamplingParams())
    engine.begin_weight_update()
    engine.update_weights(new_weights(2.0))
    engine.end_weight_update(1)
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0].output_ids == [3]
    engine.shutdown()


def test_release_retries_flush_then_gives_up(fake, tmp_path):
    engine = make_engine(write_model(tmp_path))
    sglang = fake.engines[0]
    calls = sglang.flush_calls
    sglang.flush_failures = 3
    engine.release_memory(["kv_cache"])
    assert sglang.flush_calls - calls == 4 and sglang.release_calls == [["kv_cache"]]
    sglang.flush_failures = 10**6
    with pytest.raises(RuntimeError, match="refused to flush"):
        engine.release_memory(["weights"])
    assert sglang.release_calls == [["kv_cache"]]
    engine.shutdown()


def test_release_refused_while_generate_in_flight(fake, tmp_path):
    engine = make_engine(write_model(tmp_path))
    fake.engines[0].on_generate = engine.release_memory
    with pytest.raises(RuntimeError, match="in flight"):
        engine.generate([[1]], SamplingParams(max_new_tokens=1))
    fake.engines[0].on_generate = None
    engine.release_memory()
    assert fake.engines[0].release_calls == [["weights", "kv_cache", "cuda_graph"]]
    engine.shutdown()


def test_weight_update_round_trip(fake, tmp_path):
    engine = make_engine(write_model(tmp_path), load_dummy=True)
    sglang = fake.engines[0]
    with pytest.raises(RuntimeError, match="stale"):
        engine.generate([[1]], SamplingParams())
    sent = new_weights(5.0)
    sent = [(n, t + torch.arange(t.numel()).reshape(t.shape).to(t.dtype)) for n, t in sent]
    engine.begin_weight_update()
    engine.update_weights(sent[:2])  # one dtype: one bucket
    engine.update_weights(sent[2:])  # fp32 norm + bf16 head: one bucket per dtype
    assert [c["names"] for c in sglang.update_calls] == [
        ["model.embed_tokens.weight", "model.layers.0.mlp.down_proj.weight"],
        ["model.norm.weight"],
        ["lm_head.weight"],
    ]
    assert all(c["keys"] == BUCKET_KEYS and c["flush_cache"] is False for c in sglang.update_calls)
    for name, tensor in sent:
        assert sglang.weights[name].dtype == tensor.dtype and torch.equal(sglang.weights[name], tensor)
    engine.end_weight_update(5)
    assert sglang.tokenizer_manager.weight_version == "5" and engine.weight_version == 5
    (c,) = engine.generate([[1]], SamplingParams(max_new_tokens=1))
    assert (c.output_ids, c.weight_version) == ([6], 5)
    engine.shutdown()


def test_weight_update_failures(fake, tmp_path):
    engine = make_engine(write_model(tmp_path))
    sglang = fake.engines[0]
    assert sglang.update_weights_from_tensor([b""], "flattened_bucket")[0] is False  # the fake enforces sessions
    with pytest.raises(RuntimeError, match="outside begin_weight_update"):
        engine.update_weights(new_weights(1.0))
    engine.begin_weight_update()
    with pytest.raises(RuntimeError, match="already open"):
        engine.begin_weight_update()
    with pytest.raises(ValueError, match="not a parameter"):
        engine.update_weights([("model.layers.9.foo", torch.zeros(2))])
    with pytest.raises(AssertionError, match="contiguous"):
        engine.update_weights([("lm_head.weight", torch.zeros(4, 8, dtype=torch.bfloat16).t())])
    sglang.fail_next_update = "Failed to update parameter online: shape mismatch"
    with pytest.raises(RuntimeError, match="shape mismatch"):
        engine.update_weights(new_weights(1.0)[:1])
    engine.update_weights(new_weights(1.0, skip=("lm_head.weight",)))
    with pytest.raises(RuntimeError, match=r"1 parameters were not sent \(e.g. \['lm_head.weight'\]\)"):
        engine.end_weight_update(1)
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="stale"):
        engine.generate([[1]], SamplingParams())
    engine.shutdown()


def test_tied_head_skipped_and_first_sync_defines_names(fake, tmp_path):
    engine = make_engine(write_model(tmp_path / "tied", tied=True))
    engine.begin_weight_update()
    engine.update_weights(new_weights(1.0))  # the fake rejects lm_head.weight: the tied model has none
    engine.end_weight_update(1)
    assert "lm_head.weight" not in fake.engines[0].weights
    engine.shutdown()
    engine = make_engine(write_model(tmp_path / "bare", weights=False), load_dummy=True)
    for version, skip in ((1, ()), (2, ("model.norm.weight",))):
        engine.begin_weight_update()
        engine.update_weights(new_weights(1.0, skip=skip))
        if skip:
            with pytest.raises(RuntimeError, match="model.norm.weight"):
                engine.end_weight_update(version)
        else:
            engine.end_weight_update(version)
    engine.shutdown()


def test_partial_weight_update_needs_current_weights(fake, tmp_path):
    engine = make_engine(write_model(tmp_path), load_dummy=True)
    sglang = fake.engines[0]
    with pytest.raises(RuntimeError, match="partial=True.*stale"):
        engine.begin_weight_update(partial=True)
    engine.begin_weight_update()
    engine.update_weights(new_weights(1.0))
    engine.end_weight_update(1)
    engine.begin_weight_update(partial=True)
    engine.update_weights([(n, t) for n, t in new_weights(2.0) if n == "model.norm.weight"])
    engine.end_weight_update(2)  # the other parameters keep the first update's values
    assert engine.weight_version == 2 and sglang.tokenizer_manager.weight_version == "2"
    assert torch.equal(sglang.weights["model.norm.weight"], torch.full((4,), 2.0))
    assert torch.equal(sglang.weights["lm_head.weight"], torch.full((8, 4), 0.25, dtype=torch.bfloat16))
    assert engine.generate([[1]], SamplingParams(max_new_tokens=1))[0].weight_version == 2
    engine.release_memory(["weights"])
    engine.resume_memory(["weights"])
    with pytest.raises(RuntimeError, match="partial=True.*stale"):
        engine.begin_weight_update(partial=True)
    engine.shutdown()


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX"
    except FileNotFoundError:
        return True


def test_shutdown_kills_only_the_engine_processes(fake, tmp_path):
    worker = subprocess.Popen(["sleep", "300"])  # e.g. a DataLoader worker of the rank
    try:
        engine = make_engine(write_model(tmp_path))
        sglang = fake.engines[0]
        pids = sglang.get_all_child_pids() + [sglang.scheduler_child_pid]
        assert not any(_gone(p) for p in pids)
        engine.shutdown()
        assert all(_gone(p) for p in pids) and worker.poll() is None
        watchdog = sglang.tokenizer_manager._subprocess_watchdog
        assert watchdog.stopped and watchdog.children_alive_at_stop and sglang.send_to_rpc.closed
        engine.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            engine.generate([[1]], SamplingParams())
    finally:
        worker.kill()
        worker.wait()


def test_failed_start_leaves_nothing_behind(fake, tmp_path, monkeypatch):
    monkeypatch.setattr(
        fake_sglang.Engine, "scheduler_flush", lambda self: fake_sglang.FlushCacheReqOutput(success=False, message="busy")
    )
    before = process_state()
    with pytest.raises(RuntimeError, match="refused to flush"):
        make_engine(write_model(tmp_path))
    sglang = fake.engines[0]
    assert all(_gone(p) for p in sglang.get_all_child_pids() + [sglang.scheduler_child_pid])
    assert process_state() == before
