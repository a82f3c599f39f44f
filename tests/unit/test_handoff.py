"""The colocation handoff moves memory in the order of the memory contract, and records each move."""

from __future__ import annotations

import pytest
import torch

from colocate.colocation.handoff import Colocation
from colocate.config import OffloadConfig
from colocate.trainer.memory import ACTOR_OPTIM, ACTOR_PARAMS, CRITIC_OPTIM, CRITIC_PARAMS
from colocate.trainer.offload import OffloadStats


class Events(list):
    def add(self, *event):
        self.append(event)


class FakeMemory:
    """Records the trainer memory's moves; each moves 1 GiB in 0.5 s."""

    def __init__(self, events: Events):
        self.events = events

    def offload(self, *tags):
        self.events.add("trainer.offload", tags)
        return OffloadStats(1 << 30, 0.5)

    def onload(self, *tags, overlap=False):
        self.events.add("trainer.onload", tags, overlap)
        return OffloadStats(1 << 30, 0.5)

    def pending_bytes(self):
        return 3 << 30


class FakeTrainer:
    def __init__(self, events: Events, lora: bool = False):
        self.memory, self.device = FakeMemory(events), torch.device("cpu")
        self.actor_module = torch.nn.Linear(3, 2)
        self.lora = object() if lora else None


class FakeEngine:
    casts_on_update = False

    def __init__(self, events: Events):
        self.events, self.weight_version = events, 0

    def flush_cache(self):
        self.events.add("engine.flush")

    def release_memory(self, tags=None):
        self.events.add("engine.release", tags)

    def resume_memory(self, tags=None):
        self.events.add("engine.resume", tuple(tags))

    def begin_weight_update(self, partial=False):
        self.events.add("engine.begin", partial)

    def update_weights(self, named):
        self.events.add("engine.update", tuple(name for name, _ in named))

    def end_weight_update(self, version):
        self.weight_version = version
        self.events.add("engine.end", version)


STATE = (ACTOR_OPTIM, CRITIC_PARAMS, CRITIC_OPTIM)
PUSH = [("engine.begin", False), ("engine.update", ("weight", "bias")), ("engine.end", 2)]


def _colocation(offload_train: bool, offload_rollout: bool, lora: bool = False):
    events = Events()
    colocation = Colocation(
        FakeTrainer(events, lora),
        OffloadConfig(offload_rollout=offload_rollout, offload_train=offload_train),
        dtype=torch.float32,
        bucket_bytes=1 << 20,
    )
    return colocation, FakeEngine(events), events


def test_both_offloads_follow_the_memory_contract():
    colocation, engine, events = _colocation(True, True)
    colocation.make_room()
    assert events == [("trainer.offload", STATE + (ACTOR_PARAMS,))]
    events.clear()
    colocation.start(engine, version=1)
    assert events[0] == ("engine.release", None)  # the first push resumes as every later one does
    events.clear()

    moved = colocation.to_train()
    assert events == [("engine.flush",), ("engine.release", None), ("trainer.onload", (ACTOR_PARAMS,) + STATE, True)]
    assert [t.name for t in moved.transfers] == ["engine_release", "trainer_onload"]
    metrics = moved.metrics()
    assert metrics["handoff/trainer_onload_gib"] == 1.0 and metrics["handoff/trainer_onload_s"] == 0.5
    assert metrics["handoff/trainer_state_streamed_gib"] == 3.0
    assert metrics["handoff/engine_release_gib"] == 0.0  # the CPU has no device memory to read

    events.clear()
    moved = colocation.to_rollout(version=2)
    assert events == [
        ("trainer.offload", STATE),
        ("trainer.onload", (ACTOR_PARAMS,), False),
        ("engine.resume", ("weights",)),
        *PUSH,
        ("trainer.offload", (ACTOR_PARAMS,)),
        ("engine.resume", ("cuda_graph", "kv_cache")),
    ]
    assert [t.name for t in moved.transfers] == [
        "trainer_state_offload",
        "trainer_params_onload",
        "engine_resume_weights",
        "trainer_params_offload",
        "engine_resume_cache",
    ]
    assert moved.sync.version == 2 and moved.sync.num_tensors == 2 and engine.weight_version == 2
    assert moved.metrics()["perf/sync_gib"] == pytest.approx(8 * 4 / (1 << 30))


def test_with_lora_the_engine_keeps_its_weights_through_training():
    colocation, engine, events = _colocation(True, True, lora=True)
    colocation.start(engine, version=1)
    assert events[0] == ("engine.release", ["kv_cache", "cuda_graph"])
    assert [e for e in events if e[0] == "engine.resume"] == [("engine.resume", ("cuda_graph", "kv_cache"))]
    assert colocation.engine_holds_last_push
    for version in (2, 3):
        events.clear()
        moved = colocation.to_train()
        assert ("engine.release", ["kv_cache", "cuda_graph"]) in events
        assert colocation.engine_holds_last_push  # the next push may leave the frozen modules out
        assert [t.name for t in moved.transfers] == ["engine_release", "trainer_onload"]
        events.clear()
        moved = colocation.to_rollout(version)
        assert [e for e in events if e[0] == "engine.resume"] == [("engine.resume", ("cuda_graph", "kv_cache"))]
        assert "engine_resume_weights" not in [t.name for t in moved.transfers]
        assert engine.weight_version == version


@pytest.mark.parametrize("offload_train,offload_rollout", [(False, False), (True, False), (False, True)])
def test_each_offload_switch_moves_only_its_half(offload_train, offload_rollout):
    colocation, engine, events = _colocation(offload_train, offload_rollout)
    colocation.make_room()
    colocation.start(engine, version=1)
    events.clear()
    colocation.to_train()
    colocation.to_rollout(version=2)
    trainer_moves = [e for e in events if e[0].startswith("trainer.")]
    engine_moves = [e for e in events if e[0] in ("engine.flush", "engine.release", "engine.resume")]
    assert bool(trainer_moves) == offload_train and bool(engine_moves) == offload_rollout
    push = events.index(("engine.begin", False))
    assert events[push : push + 3] == PUSH  # the weight push happens in every mode


def _lora_trainer(events: Events) -> FakeTrainer:
    """A trainer whose model is a frozen base: one adapted projection and one frozen one."""
    from colocate.lora.identity import LoRASpec
    from colocate.trainer.lora import LoRALinear

    trainer = FakeTrainer(events, lora=True)
    model = torch.nn.Module()
    model.proj = LoRALinear(torch.nn.Linear(3, 2).requires_grad_(False), LoRASpec(1, 2.0, 0.0, ("proj",)))
    model.head = torch.nn.Linear(2, 2, bias=False).requires_grad_(False)
    with torch.no_grad():
        model.proj.lora_A.weight.fill_(1.0)
        model.proj.lora_B.weight.fill_(0.5)
    trainer.actor_module = model
    return trainer


@pytest.mark.parametrize("offload_rollout", [False, True])
def test_lora_pushes_only_merged_weights_while_the_engine_keeps_its_own(offload_rollout):
    """The first push sends every weight (adapted ones merged, adapters never); later ones only
    the merged weights, in a partial session: the engine keeps its weights under LoRA, offload or not."""
    events = Events()
    colocation = Colocation(
        _lora_trainer(events), OffloadConfig(offload_rollout=offload_rollout), dtype=torch.float32, bucket_bytes=1 << 20
    )
    engine = FakeEngine(events)
    full = [("engine.begin", False), ("engine.update", ("proj.weight", "proj.bias", "head.weight"))]
    for version in (1, 2, 3):
        events.clear()
        moved = colocation.start(engine, version) if version == 1 else colocation.to_rollout(version)
        if version > 1:
            assert [e for e in events if e[0] in ("engine.begin", "engine.update", "engine.end")] == [
                ("engine.begin", True),
                ("engine.update", ("proj.weight",)),
                ("engine.end", version),
            ]
            assert moved.sync.partial and moved.sync.num_tensors == 1
        else:
            assert [e for e in events if e[0] in ("engine.begin", "engine.update")] == full
            assert not moved.sync.partial and moved.sync.num_tensors == 3
        colocation.to_train()
