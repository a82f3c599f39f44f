import warnings

import pytest
import torch

from colocate.colocation import ledger as ledger_module
from colocate.colocation.ledger import MemoryGrowthError, MemoryLedger

GIB = 1 << 30


def _ledger(monkeypatch, used_by_step, **kw):
    """A ledger whose device reads follow used_by_step[(step, phase)] (bytes)."""
    current = {}
    monkeypatch.setattr(ledger_module, "read_memory", lambda device: (current["v"], current["v"], current["v"]))
    ledger = MemoryLedger(torch.device("cpu"), warmup_steps=1, **kw)

    def record(step, phase):
        current["v"] = used_by_step[(step, phase)]
        return ledger.record(step, phase)

    return ledger, record


def test_growth_after_warmup_is_reported_once_past_tolerance(monkeypatch):
    used = {(s, "train"): 10 * GIB + s * (200 << 20) for s in range(5)}  # +200 MiB per step
    ledger, record = _ledger(monkeypatch, used, tolerance=0.01, min_bytes=0)
    with pytest.warns(UserWarning, match="phase 'train' grew by 0.195 GiB since step 1"):
        for s in range(3):
            record(s, "train")
    assert len(ledger.reports) == 1


def test_steady_memory_and_small_noise_pass(monkeypatch):
    used = {(s, p): 8 * GIB + (s % 2) * (50 << 20) for s in range(6) for p in ("generate", "train")}
    ledger, record = _ledger(monkeypatch, used, tolerance=0.01, min_bytes=0)  # 50 MiB < 1% of 8 GiB
    for s in range(6):
        record(s, "generate")
        record(s, "train")
    assert ledger.reports == []
    m = ledger.step_metrics(3)
    assert m["memory/train/device_used_gib"] == pytest.approx(8 + 50 / 1024)
    assert set(m) == {f"memory/{p}/{k}_gib" for p in ("generate", "train") for k in ("allocated", "reserved", "device_used")}


def test_strict_mode_raises(monkeypatch):
    used = {(0, "sync"): GIB, (1, "sync"): GIB, (2, "sync"): 2 * GIB}
    _, record = _ledger(monkeypatch, used, strict=True)
    record(0, "sync")
    record(1, "sync")
    with pytest.raises(MemoryGrowthError, match="sync"):
        record(2, "sync")


def test_reads_real_process_memory_on_cpu():
    allocated, reserved, used = ledger_module.read_memory(torch.device("cpu"))
    assert allocated == reserved == used > 10 << 20  # a Python process with torch is > 10 MiB


def test_allocator_retries_are_counted_per_step_and_warned_of_once(monkeypatch):
    """On CUDA each step's metrics count the caching allocator's new retries (a free-cache-and-retry,
    which synchronises the device); the first step that has any warns, later ones only count."""
    assert ledger_module.alloc_retries(torch.device("cpu")) is None
    total = iter([0, 0, 3, 3, 7])
    monkeypatch.setattr(ledger_module, "alloc_retries", lambda device: next(total))
    ledger = MemoryLedger(torch.device("cpu"))
    assert [ledger.step_metrics(s)["memory/alloc_retries"] for s in range(2)] == [0, 0]
    with pytest.warns(UserWarning, match="step 2: the CUDA caching allocator freed its cache and retried 3"):
        assert ledger.step_metrics(2)["memory/alloc_retries"] == 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert [ledger.step_metrics(s)["memory/alloc_retries"] for s in (3, 4)] == [0, 4]
    assert ledger.reports == []  # not memory growth: never fatal under train.strict


@pytest.mark.gpu
def test_allocator_retries_are_read_on_cuda():
    device = torch.device("cuda")
    torch.ones(1, device=device)  # the allocator's statistics start with its first allocation
    assert "num_alloc_retries" in torch.cuda.memory_stats(device)
    assert ledger_module.alloc_retries(device) == torch.cuda.memory_stats(device)["num_alloc_retries"]


def _oom(phase, step=3, **fields):
    from colocate.colocation.ledger import out_of_memory
    from colocate.config import Config

    cfg = Config()
    for name, value in fields.items():
        section, field = name.split(".")
        setattr(getattr(cfg, section), field, value)
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 378.00 MiB.\nIf reserved but unallocated...")
    return str(out_of_memory(cfg, phase, step, torch.device("cpu"), error))


def test_out_of_memory_in_training_names_the_settings_that_give_it_room():
    # The loop reports the budget the start-up chose (colocate/sizing.py), which replaced `auto`.
    msg = _oom(
        "train", **{"model.gradient_checkpointing": False, "offload.offload_rollout": False, "train.max_tokens_per_gpu": 16384}
    )
    assert msg.startswith("step 3: the train phase ran out of GPU memory. For more room: ")
    assert "train.max_tokens_per_gpu (now 16384" in msg and "model.gradient_checkpointing" in msg
    assert "offload.offload_rollout" in msg and "rollout.gpu_memory_fraction" not in msg
    assert msg.endswith("(CUDA out of memory. Tried to allocate 378.00 MiB.)")
    settled = _oom("train", **{"model.gradient_checkpointing": True, "offload.offload_rollout": True})
    assert "gradient_checkpointing" not in settled and "offload" not in settled  # nothing to turn on
    assert "model.recompute_fraction (now 0.5)" in _oom("train", **{"model.recompute_fraction": 0.5})


def test_out_of_memory_in_generation_or_a_switch_names_the_kv_cache_and_offload():
    msg = _oom("generate", **{"rollout.gpu_memory_fraction": 0.8, "offload.offload_train": False})
    assert "rollout.gpu_memory_fraction (now 0.8" in msg and "rollout.max_running_requests (now 256)" in msg
    assert "offload.offload_train" in msg and "max_tokens_per_gpu" not in msg
    switch = _oom("to_rollout", **{"offload.offload_train": True, "offload.offload_rollout": False})
    assert "rollout.gpu_memory_fraction" in switch and "offload.offload_rollout" in switch
    assert "offload.offload_train" not in switch


def test_a_phase_out_of_memory_ends_as_a_user_error_and_records_no_row(monkeypatch):
    from colocate.colocation.ledger import DeviceMemoryError
    from colocate.config import Config
    from colocate.train import Phases

    ledger, _ = _ledger(monkeypatch, {})
    phase = Phases(ledger, torch.device("cpu"), Config())
    phase.step = 5
    oom = torch.OutOfMemoryError("CUDA out of memory.")
    with pytest.raises(DeviceMemoryError, match="step 5: the train phase") as raised:
        with phase("train"):
            raise oom
    assert isinstance(raised.value, ValueError) and raised.value.__cause__ is oom
    with pytest.raises(KeyError):  # any other error goes through as it is
        with phase("train"):
            raise KeyError("x")
    assert ledger.rows == []


def test_the_run_ends_with_one_error_line_naming_the_phase_and_settings(tmp_path, monkeypatch, capsys):
    from colocate.train import main
    from colocate.trainer import Trainer

    def out_of_memory(self, *args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")

    monkeypatch.setattr(Trainer, "train", out_of_memory)
    assert (
        main(
            [
                "--config",
                "configs/default.yaml",
                "--output-dir",
                str(tmp_path),
                "--train.max-tokens-per-gpu",
                "512",
                "--logging.console",
                "False",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(
        "error: step 0: the train phase ran out of GPU memory. For more room: a lower train.max_tokens_per_gpu (now 512"
    )
    assert err[-1].endswith("(CUDA out of memory. Tried to allocate 2.00 GiB.)")
