"""The trainer's memory: which of its tensors leave the GPU between steps, and how they come back.

One object, `TrainerMemory`, with two entry points, `offload` and `onload`, over named groups:

    actor_params    the actor's parameters: the weight sync reads them, so they leave last
                    (with LoRA: the frozen base, and the adapters unless offload.keep_adapters)
    actor_optim     the actor's optimizer state and gradients (with LoRA: the adapters', which
                    stay on the device with offload.keep_adapters)
    critic_params   the critic's parameters            (PPO/GAE only)
    critic_optim    the critic's optimizer state and gradients
    reference       the frozen reference policy: on the host except during its log-prob pass

`STATE` names what the weight sync does not need, `PARAMS` what it reads. The colocation handoff
(colocate/colocation/handoff.py) decides when each moves; this module only moves them (through
`StateOffloader`, colocate/trainer/offload.py).

The return can overlap training (`onload(..., overlap=True)`, "pinned"):
- parameters are queued home one FSDP unit at a time in forward order, the root's (embeddings,
  final norm, heads) first and waited for at once; each block's forward first waits, on the host,
  for its own and the next block's (FSDP gathers the next block while this one computes), so the
  copies run under the first forward (`ParamArrival`);
- optimizer state stays on the host through the forward passes, and during a step's last backward
  each parameter's state is queued home as soon as FSDP has reduced that parameter's gradient,
  into memory the backward has just freed; the optimizer waits for it right before its update
  (`StateArrival`). The state never sits beside the forward's activations.
Under "tms" parameters come back at once and the state is resumed at once, and waited for at the
same place.
"""

from __future__ import annotations

import functools
import time
from typing import Iterator

import torch
from torch import nn

from colocate.trainer.offload import OffloadStats, StateOffloader
from colocate.trainer.optim import OptimizerStep

ACTOR_PARAMS, ACTOR_OPTIM = "actor_params", "actor_optim"
CRITIC_PARAMS, CRITIC_OPTIM = "critic_params", "critic_optim"
REFERENCE = "reference"
PARAMS = (ACTOR_PARAMS,)
"""What the weight sync reads."""
STATE = (ACTOR_OPTIM, CRITIC_PARAMS, CRITIC_OPTIM)
"""What the trainer keeps on the device between steps that the weight sync does not read."""


def _optimizer_tensors(opt: OptimizerStep, model: nn.Module) -> Iterator[torch.Tensor]:
    for state in opt.optimizer.state.values():
        yield from (v for v in state.values() if torch.is_tensor(v))
    yield from (p.grad for p in model.parameters() if p.grad is not None)


class StateArrival:
    """One optimizer's state on its way home from the host, for the step about to run.

    `gradient_step` calls `last_backward_begins` as the step's last backward starts and `wait`
    right before the update. Both do nothing when the state is already on the device."""

    def __init__(self, offloader: StateOffloader, tag: str, opt: OptimizerStep):
        self.offloader, self.tag, self.opt = offloader, tag, opt
        self.pending = False
        """The state is on the host, to come home in the next step's last backward."""
        self._stream: torch.cuda.Stream | None = None  # the backward's stream while it streams home
        for p in opt.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def last_backward_begins(self) -> None:
        if self.pending:
            self._stream = torch.cuda.current_stream(self.offloader.device)

    def _gradient_ready(self, param: torch.Tensor) -> None:
        """FSDP has reduced this parameter's gradient: its state is needed next, and the backward
        has freed memory to hold it."""
        if self._stream is not None:
            self.offloader.onload_part(self.tag, self.opt.optimizer.state[param].values(), self._stream)

    def wait(self) -> None:
        """Queue whatever is still away, then order the current stream after all of it."""
        if self.pending:
            self.pending, self._stream = False, None
            self.offloader.onload([self.tag], wait=False)
        self.offloader.wait([self.tag])


class ParamArrival:
    """One model's parameters on their way home from the host, one FSDP unit at a time in forward
    order (see the module docstring). `queue` starts the copies; a block's forward pre-hook,
    ahead of FSDP's own, waits for what that block gathers; `wait` orders the current stream after
    all of them, for whatever reads the parameters without a forward (the optimizer, the weight sync)."""

    def __init__(self, offloader: StateOffloader, tag: str, model: nn.Module):
        self.offloader, self.tag = offloader, tag
        self.blocks = list(model.model.layers)
        in_blocks = {id(p) for block in self.blocks for p in block.parameters()}
        self.root = [p for p in model.parameters() if id(p) not in in_blocks]
        self.pending: dict[int, torch.cuda.Event] = {}  # block position -> its gather's arrival
        for i, block in enumerate(self.blocks):
            block.register_forward_pre_hook(functools.partial(self._block_forward, i), prepend=True)

    def queue(self) -> OffloadStats:
        """Queue the whole model home and wait for the root's part; the blocks' parts arrive while
        the device computes. Returns the bytes queued and the seconds this took."""
        start = time.perf_counter()
        parts = [self.root, *(list(block.parameters()) for block in self.blocks)]
        events, num_bytes = self.offloader.onload_parts(self.tag, parts)
        if events:
            if events[0] is not None:
                events[0].synchronize()
            latest, through = None, []  # through[j]: the arrival of blocks 0..j (one stream, in order)
            for event in events[1:]:
                latest = event or latest
                through.append(latest)
            last = len(self.blocks) - 1
            self.pending = {i: through[min(i + 1, last)] for i in range(len(self.blocks))}
        return OffloadStats(num_bytes, time.perf_counter() - start)

    def _block_forward(self, i: int, module: nn.Module, args) -> None:
        event = self.pending.pop(i, None)
        if event is not None:
            event.synchronize()

    def wait(self) -> None:
        self.pending.clear()
        self.offloader.wait([self.tag])


class TrainerMemory:
    """The trainer's groups of device tensors and the two moves between device and host.

    On CPU nothing moves; calls still return statistics (0 bytes), so callers need no special case.
    With offload on, `reserve` starts pinning a group's host buffers at start-up, on helper threads,
    as soon as its sizes are known: pinning many GiB takes seconds, which no step should pay, and
    the start-up goes on meanwhile. A group's first offload waits for none of it (zeros stay behind,
    the rest goes to pageable memory where a piece is not pinned yet: see offload.py); later ones
    wait for whatever is not pinned yet (`wait_seconds`)."""

    def __init__(self, method: str, device: torch.device):
        self.offloader = StateOffloader(method, device)
        self.arrivals: dict[str, StateArrival] = {}
        self.param_arrivals: dict[str, ParamArrival] = {}

    def region(self, tag: str):
        """Allocate a group's tensors inside this context (needed by "tms", a no-op otherwise)."""
        return self.offloader.region(tag)

    def add_model(self, tag: str, model: nn.Module, keep_trained: bool = False) -> None:
        """A model's parameters; those that train nothing (the frozen base under LoRA adapters, as
        the weight sync also assumes) are copied to the host once, then only freed. With
        `keep_trained` the trained ones (LoRA's adapters) never leave the device."""

        def frozen():
            return (p for p in model.parameters() if not p.requires_grad)

        self.offloader.register(tag, frozen if keep_trained else model.parameters, constant=lambda p: not p.requires_grad)
        self.param_arrivals[tag] = ParamArrival(self.offloader, tag, model)

    def add_optimizer(self, tag: str, opt: OptimizerStep, model: nn.Module, keep: bool = False) -> StateArrival:
        """An optimizer's state and its model's gradients; with `keep` they never leave the device
        (a group with no tensors)."""
        self.offloader.register(tag, (lambda: ()) if keep else (lambda: _optimizer_tensors(opt, model)))
        self.arrivals[tag] = StateArrival(self.offloader, tag, opt)
        return self.arrivals[tag]

    def reserve(self, *tags: str) -> float:
        """Start pinning the host buffers of these groups (default: every group), after those
        reserved before, parameters first: the start-up's offload leaves a fresh optimizer state
        behind as zeros, and its first weight sync offloads the parameters a second time, into
        their pinned buffers. Returns the seconds this took, not the pinning's."""
        chosen = set(tags or self.offloader.groups) & set(self.offloader.groups)
        order = dict.fromkeys([*PARAMS, *STATE, *self.offloader.groups])
        return self.offloader.reserve([tag for tag in order if tag in chosen])

    @property
    def wait_seconds(self) -> float:
        """Seconds offloads have spent on host buffers not pinned yet (an offload after a group's
        first one, while helper threads were still pinning, and any buffers a new layout needed)."""
        return self.offloader.wait_seconds

    def pinned_bytes(self) -> tuple[int, int]:
        """(bytes of host buffers pinned so far, bytes laid out)."""
        return self.offloader.pinned_bytes()

    def offload(self, *tags: str) -> OffloadStats:
        """Move these groups (those that exist) to the host and hand their memory back to the device."""
        stats = self.offloader.offload(self._existing(tags))
        if self.offloader.device.type == "cuda":
            torch.cuda.empty_cache()
        return stats

    def onload(self, *tags: str, overlap: bool = False) -> OffloadStats:
        """Bring these groups back. With `overlap`, parameters arrive during the next forward and
        optimizer states stay on the host to come home during the next step's last backward (see
        the module docstring); the statistics then count the bytes that came back or were queued
        now, and `pending_bytes` the state still to come."""
        tags = self._existing(tags)
        if not overlap:
            return self.offloader.onload(tags)
        states = [tag for tag in tags if tag in self.arrivals]
        models = [tag for tag in tags if tag in self.param_arrivals and self.offloader.method == "pinned"]
        stats = self.offloader.onload([tag for tag in tags if tag not in self.arrivals and tag not in models])
        for tag in models:
            stats += self.param_arrivals[tag].queue()
        if self.offloader.method != "pinned":
            self.offloader.onload(states, wait=False)
            return stats
        for tag in states:
            self.arrivals[tag].pending = self.offloader.is_offloaded(tag)
        return stats

    def pending_bytes(self) -> int:
        """Bytes of optimizer state left on the host to stream home in the next last backward."""
        return sum(self.offloader.away_bytes(tag) for tag, a in self.arrivals.items() if a.pending)

    def settle(self) -> None:
        """Bring home any optimizer state a step did not use (e.g. the actor's during critic-only
        warm-up steps), so that no group is left half on the host, and order the current stream
        after every parameter copy (a model whose forward did not run still has some in flight)."""
        for arrival in [*self.arrivals.values(), *self.param_arrivals.values()]:
            arrival.wait()

    def is_offloaded(self, tag: str) -> bool:
        return self.offloader.is_offloaded(tag)

    def _existing(self, tags) -> list[str]:
        return [tag for tag in tags if tag in self.offloader.groups]
