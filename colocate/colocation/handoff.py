"""When GPU memory moves between the trainer and the rollout engine: the loop's two switches.

    to_train     release the engine: flush its cache, then release its KV cache, weights and
                 CUDA graphs (with LoRA, its weights stay) -> bring the trainer's parameters (and
                 the critic) back, one FSDP unit at a time under the first forward ("pinned"); the
                 optimizer states come home during the step's last backward ("pinned"), or now
                 ("tms")
    to_rollout   offload what the weight sync does not read (optimizer states, gradients, the
                 critic) -> resume the engine's weights -> push the weights, one FSDP unit at a
                 time -> offload the trainer's parameters -> resume the engine's CUDA graphs and
                 KV cache

The order is a memory contract. The engine's weights come back first because the sync writes into
its own mapped pages; the KV cache comes back last because it is the largest region and the sync's
temporary buffers must be gone by then. With `offload.offload_rollout` off the engine keeps its
memory; with `offload.offload_train` off the trainer keeps its; with both off only the weight push
remains. An engine that kept its weights since the last push is sent only what can have changed
(with LoRA: the adapted modules' merged weights); one that released them gets every weight again,
since released pages come back without their content. With LoRA the engine therefore keeps its
weights through training even with `offload.offload_rollout`: the modules without adapters never
move again after the first push, the KV cache (sized while the weights are there) is the same, and
training has the weights' size less to use.

Where each kind of memory moves:
    engine weights, KV cache, CUDA graphs   `to_train` (release), `to_rollout` (resume)
    trainer parameters                      `to_train` (onload), `to_rollout` (offload, after the push)
    optimizer states and gradients          `to_rollout` (offload, before the push); back in the
                                            step's last backward, armed by `to_train`
    the reference policy                    on the host; visits the device for its own pass
                                            (colocate/trainer/reference.py)

Each switch returns a `Handoff` record: one `Transfer` per move (bytes and seconds), and the weight
sync's statistics, which the loop logs under handoff/*.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from colocate.colocation.ledger import read_memory
from colocate.colocation.weight_sync import SyncStats, sync_weights
from colocate.config import OffloadConfig
from colocate.rollout.protocol import RolloutEngine
from colocate.trainer import Trainer
from colocate.trainer.memory import PARAMS, STATE
from colocate.trainer.offload import OffloadStats

GIB = 1 << 30


@dataclass
class Transfer:
    """One move of a handoff: `num_bytes` that changed sides in `seconds`. For the engine the bytes
    are what the device gained or lost (its used memory before and after). A move of the trainer's
    also says what of it went to pageable host memory, what it left behind as zeros, and how long
    it waited for host buffers still pinning (colocate/trainer/offload.py)."""

    name: str
    num_bytes: int
    seconds: float
    pageable_bytes: int = 0
    zero_bytes: int = 0
    pinned_wait_s: float = 0.0


@dataclass
class Handoff:
    """What one switch moved."""

    transfers: list[Transfer] = field(default_factory=list)
    sync: SyncStats | None = None
    pending_bytes: int = 0
    """Optimizer state left on the host to stream home in the next step's last backward."""

    def metrics(self) -> dict[str, float]:
        out = self.transfer_metrics()
        if self.pending_bytes:
            out["handoff/trainer_state_streamed_gib"] = self.pending_bytes / GIB
        if self.sync is not None:
            out.update(self.sync.metrics())
        return out

    def transfer_metrics(self, prefix: str = "handoff/") -> dict[str, float]:
        """<prefix><move>_gib and _s of each move; _pageable_gib, _zeros_gib and _pinned_wait_s
        where not zero."""
        out = {}
        for t in self.transfers:
            out[f"{prefix}{t.name}_gib"] = t.num_bytes / GIB
            out[f"{prefix}{t.name}_s"] = t.seconds
            for suffix, value in (
                ("pageable_gib", t.pageable_bytes / GIB),
                ("zeros_gib", t.zero_bytes / GIB),
                ("pinned_wait_s", t.pinned_wait_s),
            ):
                if value:
                    out[f"{prefix}{t.name}_{suffix}"] = value
        return out


class Colocation:
    """The trainer and the engine of one rank, and the switches between them."""

    def __init__(self, trainer: Trainer, offload: OffloadConfig, *, dtype: torch.dtype, bucket_bytes: int):
        self.trainer, self.memory = trainer, trainer.memory
        self.offload_train, self.offload_rollout = offload.offload_train, offload.offload_rollout
        self.dtype, self.bucket_bytes = dtype, bucket_bytes
        self.engine: RolloutEngine | None = None
        self.engine_keeps_weights = trainer.lora is not None
        """Released with the rest, the weights would have to be pushed whole again; under LoRA
        only the adapted modules change, so the engine keeps them."""
        self.engine_holds_last_push = False
        """The engine's weights are those of the last push (none released since): a push may then
        send only what can have changed (with LoRA, the adapted modules' merged weights)."""

    def make_room(self) -> Handoff:
        """Before the engine is built: the trainer's whole state to the host, so that the engine
        sizes its KV cache from the memory the trainer leaves it during generation. Nothing waits
        for host buffers still pinning: a fresh optimizer's state stays behind as zeros, and what
        is not pinned yet goes to pageable memory (colocate/trainer/offload.py)."""
        out = Handoff()
        if self.offload_train:
            self._trainer(out, "trainer_offload", self.memory.offload(*STATE, *PARAMS))
        return out

    def start(self, engine: RolloutEngine, version: int) -> Handoff:
        """The first weight push, in the order every later one follows."""
        self.engine = engine
        if self.offload_rollout:
            engine.release_memory(self._released())
        self.engine_holds_last_push = False
        return self.to_rollout(version)

    def to_train(self) -> Handoff:
        out = Handoff()
        if self.offload_rollout:
            self._engine(out, "engine_release", lambda: (self.engine.flush_cache(), self.engine.release_memory(self._released())))
            if not self.engine_keeps_weights:
                self.engine_holds_last_push = False
        if self.offload_train:
            self._trainer(out, "trainer_onload", self.memory.onload(*PARAMS, *STATE, overlap=True))
            out.pending_bytes = self.memory.pending_bytes()
        return out

    def to_rollout(self, version: int) -> Handoff:
        """Push the trainer's weights into the engine as weight `version`, moving memory around it."""
        out = Handoff()
        if self.offload_train:
            self._trainer(out, "trainer_state_offload", self.memory.offload(*STATE))
            self._trainer(out, "trainer_params_onload", self.memory.onload(*PARAMS))
        elif self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()  # the step's cached activations, for the engine to use
        if self.offload_rollout and not self.engine_keeps_weights:
            self._engine(out, "engine_resume_weights", lambda: self.engine.resume_memory(["weights"]))
        out.sync = sync_weights(
            self.trainer.actor_module,
            self.engine,
            version=version,
            dtype=self.dtype,
            bucket_bytes=self.bucket_bytes,
            since_last=self.engine_holds_last_push,
        )
        self.engine_holds_last_push = True
        if self.offload_train:
            self._trainer(out, "trainer_params_offload", self.memory.offload(*PARAMS))
        if self.offload_rollout:
            self._engine(out, "engine_resume_cache", lambda: self.engine.resume_memory(["cuda_graph", "kv_cache"]))
        return out

    def _released(self) -> list[str] | None:
        """The engine's memory tags that `to_train` releases (None: all of them)."""
        return ["kv_cache", "cuda_graph"] if self.engine_keeps_weights else None

    def _engine(self, out: Handoff, name: str, move: Callable[[], object]) -> None:
        device = self.trainer.device
        before = read_memory(device)[2]
        start = time.perf_counter()
        move()
        after = read_memory(device)[2]  # synchronises: the move's kernels are counted
        seconds = time.perf_counter() - start
        out.transfers.append(Transfer(name, abs(after - before) if device.type == "cuda" else 0, seconds))

    @staticmethod
    def _trainer(out: Handoff, name: str, stats: OffloadStats) -> None:
        if stats.num_bytes:
            out.transfers.append(
                Transfer(name, stats.num_bytes, stats.seconds, stats.pageable_bytes, stats.zero_bytes, stats.pinned_wait_s)
            )
