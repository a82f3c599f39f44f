"""The colocated RL loop: `torchrun --nproc-per-node N -m colocate.train --config X.yaml`.

Per rollout step, in this order (docs/architecture.md): generate -> to_train (the engine gives its
memory back, the trainer's comes back) -> train -> save -> to_rollout (the trainer's memory goes,
the weights reach the engine, the engine's memory comes back) -> eval. What moves in each switch,
and when, is colocate/colocation/handoff.py's to decide; this file only says when to switch.
"""

from __future__ import annotations

import copy
import os
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from colocate import dist
from colocate.cli import entry_point
from colocate.config import Config, use_compile_cache
from colocate.config_loading import load_config
from colocate.stopping import StopSignals, exit_code
from colocate.timing import process_age_s, timed


def seed_everything(seed: int) -> None:
    """torch's, Python's and numpy's generators: user code (rewards, custom generation) may draw
    from any of them, and a fresh run must repeat. A resumed run restores them from the checkpoint."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Phases:
    """Per-phase wall seconds (perf/<phase>_time) and a ledger row at every phase's end; a phase that
    runs out of GPU memory ends the run with an error that names the settings to change."""

    def __init__(self, ledger, device: torch.device, cfg: Config):
        self.ledger, self.device, self.cfg, self.times, self.step = ledger, device, cfg, {}, 0

    @contextmanager
    def __call__(self, name: str):
        try:
            with timed(self.times, f"perf/{name}_time", self.device):
                yield
        except torch.OutOfMemoryError as e:
            from colocate.colocation.ledger import out_of_memory

            raise out_of_memory(self.cfg, name, self.step, self.device, e) from e
        self.ledger.record(self.step, name)

    def take(self) -> dict[str, float]:
        out, self.times = self.times, {}
        return out


def _add_parts(startup: dict[str, float], part: str, seconds: dict[str, float]) -> None:
    """Sub-parts of a start-up part (`perf/startup/engine_cuda_graphs_s` under `engine`)."""
    for name, value in seconds.items():
        startup[f"perf/startup/{part}_{name}_s"] = value


class Loop:
    def __init__(
        self, cfg: Config, info: dist.DistInfo, startup: dict[str, float] | None = None, stop: StopSignals | None = None
    ):
        from colocate.colocation.ledger import MemoryLedger
        from colocate.inputs import RunInputs
        from colocate.metrics import MetricsLogger

        self.cfg, self.info = cfg, info
        self.out = Path(cfg.output_dir)
        self.startup: dict[str, float] = dict(startup or {})
        """perf/startup/<part>_s: where the time before step 0 went, logged with the first step
        (`startup`: the parts before the loop, in order), with the start-up's moves of the trainer's
        state (handoff/trainer_offload_*, handoff/first_sync/*) and its host buffers pinned by then."""
        # Everything that can be wrong with the user's input is checked before any model is built.
        with timed(self.startup, "perf/startup/inputs_s", info.device):
            self.inputs = RunInputs.load(cfg, info)
        _add_parts(self.startup, "inputs", self.inputs.startup_seconds)
        self.log = MetricsLogger(
            self.out,
            enabled=info.is_main,
            use_wandb=cfg.logging.wandb,
            wandb_project=cfg.logging.wandb_project,
            run_name=cfg.logging.run_name,
            config=cfg.to_dict(),
            console=cfg.logging.console,
        )
        self.ledger = MemoryLedger(info.device, strict=cfg.train.strict)
        self.phase = Phases(self.ledger, info.device, cfg)
        self.weight_version = 0
        self.start_rollout_id = 0
        self.resumed_rollouts: list | None = None
        """Partial rollout: the groups in flight that the checkpoint resumed from carries."""
        self.stop = stop or StopSignals(info.is_main)
        self.saved: set[int] = set()
        """Rollout ids this run has checkpointed."""
        self.stopped_after: int | None = None
        """The last step a requested stop let run (-1: none), or None when the run was not stopped."""

    def build(self):
        from colocate.colocation.handoff import GIB, Colocation
        from colocate.kernels.ops import Ops
        from colocate.metrics import startup_line, startup_phases
        from colocate.models import resolve_dtype
        from colocate.rollout.factory import build_engine, reachable_batch_size
        from colocate.rollout.orchestrator import RolloutManager
        from colocate.trainer import Trainer

        cfg, info, startup = self.cfg, self.info, self.startup
        # The run's operations, chosen once, before any model runs: the trainer's models and the
        # engine compute with this table.
        ops = Ops.standard()
        if cfg.algorithm.true_on_policy:
            ops = Ops.true_on_policy(info.device)
            if cfg.rollout.compile_decode and info.device.type == "cuda":
                self.log.info(
                    "algorithm.true_on_policy: the engine's decode runs uncompiled "
                    "(rollout.compile_decode is ignored in the mode)"
                )
        with timed(startup, "perf/startup/trainer_s", info.device):  # load, shard, reserve pinned buffers
            self.trainer = Trainer(cfg, info, ops=ops)
        _add_parts(startup, "trainer", self.trainer.startup_seconds)
        if self.trainer.memory_plan.summary():
            self.log.info(self.trainer.memory_plan.summary())
        startup.update(self.trainer.memory_plan.forecast)
        with timed(startup, "perf/startup/resume_s", info.device):
            self._maybe_resume()
        self.colocation = Colocation(
            self.trainer,
            cfg.offload,
            dtype=resolve_dtype(cfg.model.dtype, info.device),
            bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20,
        )
        if cfg.offload.offload_train:
            with timed(startup, "perf/startup/offload_s", info.device):
                room = self.colocation.make_room()
            _add_parts(startup, "offload", {"pinned_wait": self.trainer.memory.wait_seconds})
            startup.update(room.transfer_metrics())
        eval_prompts = max((len(prompts) for _, prompts, _ in self.inputs.eval_sets), default=0)
        with timed(startup, "perf/startup/engine_s", info.device):
            self.engine = build_engine(
                cfg,
                info,
                self.inputs.eos_token_ids,
                reachable_batch_size(cfg, info.world_size, eval_prompts),
                self.trainer.memory_plan,
                ops=ops,
            )
        _add_parts(startup, "engine", getattr(self.engine, "startup_seconds", {}))
        self.rollout = RolloutManager(
            self.engine,
            self.inputs.tokenizer,
            cfg.rollout,
            reward_fn=self.inputs.reward_fn,
            strict=cfg.train.strict,
            overlong=self.inputs.overlong,
            custom_generate=self.inputs.custom_generate,
            episodes=self.inputs.episodes,
            seed=cfg.rollout.seed,
        )
        if self.resumed_rollouts is not None:
            self.rollout.load_state_dict(self.resumed_rollouts, self.inputs.data.dataset)
        # The engine always starts from the trainer's weights (they differ from disk after resume).
        self.weight_version += 1
        with timed(startup, "perf/startup/first_sync_s", info.device):
            first = self.colocation.start(self.engine, self.weight_version)
        startup.update(first.transfer_metrics("handoff/first_sync/"))
        pinned, laid_out = self.trainer.memory.pinned_bytes()
        if laid_out:  # what the helper threads have still to pin once the loop starts
            startup.update({"handoff/host_pinned_gib": pinned / GIB, "handoff/host_buffers_gib": laid_out / GIB})
        self.ledger.record(self.start_rollout_id, "start")
        self.log.info(startup_line(startup_phases(startup)))

    def _maybe_resume(self):
        """Resume from the newest checkpoint that loads cleanly: every file matches its checksum and
        every tensor is finite; a damaged one is skipped with a warning for the next older one."""
        if not self.cfg.checkpoint.resume:
            return
        root = self.cfg.checkpoint_dir
        found = None
        # Checkpoints, or leftovers of a save to remove; rank 0's view, which resume_newest changes.
        if dist.broadcast_from_main(root.is_dir() and any(root.glob("*rollout_*"))):
            from colocate.checkpoint import resume_newest  # torch.distributed.checkpoint: seconds to import

            found = resume_newest(root, self.trainer.checkpoint_states())
        if found is None:
            self.log.info(f"no checkpoint under {root}: starting from step 0")
            return
        path, extra = found
        self.inputs.data.load_state_dict(extra["data"])
        self.start_rollout_id = extra["rollout_id"] + 1
        self.weight_version = extra["weight_version"]
        self._log_lost_record(extra)
        if self.cfg.rollout.partial_rollout:
            self.resumed_rollouts = extra.get("partial_rollout")
        elif any(extra.get("partial_rollout") or []):
            self.log.info("rollout.partial_rollout is off: the checkpoint's groups in flight are dropped")
        self.log.info(f"resumed from {path} at rollout {self.start_rollout_id}")

    def _log_lost_record(self, extra: dict) -> None:
        """The checkpointed step's record, from the checkpoint, if the run died before writing it
        (marked resume/record_from_checkpoint; it lacks what came after the save)."""
        from colocate.metrics import logged_steps

        step, saved = extra["rollout_id"], extra.get("metrics")
        if saved is not None and self.info.is_main and step not in logged_steps(self.out):
            self.log.log(step, {**saved, "resume/record_from_checkpoint": 1})
            self.log.info(f"step {step}'s metrics record was lost with the run: written from the checkpoint")

    def evaluate(self, rollout_id: int) -> dict[str, float]:
        with self.phase("eval"):
            return self.rollout.evaluate(self.inputs.eval_sets, rollout_id, self.cfg.eval)

    def save(self, rollout_id: int, step_metrics: dict, weight_version: int | None = None):
        """A checkpoint after the step's training, of the weights of `weight_version` (default: the
        current one). It also holds the step's metrics so far: the record is written after
        to_rollout and eval, and a run that dies in between gets it back on resume (`_maybe_resume`)."""
        from colocate.checkpoint import save_checkpoint
        from colocate.metrics import plain_metrics

        version = self.weight_version if weight_version is None else weight_version
        extra = {
            "rollout_id": rollout_id,
            "weight_version": version,
            "data": self.inputs.data.state_dict(),
            "metrics": plain_metrics(step_metrics),
        }
        if self.cfg.rollout.partial_rollout:  # the groups in flight, carried into the next step
            extra["partial_rollout"] = self.rollout.state_dict()
        save_checkpoint(
            self.cfg.checkpoint_dir,
            rollout_id,
            self.trainer.checkpoint_states(),
            extra=extra,
            model_dir=Path(self.cfg.model.path),
            keep_last=self.cfg.checkpoint.keep_last,
        )
        self.saved.add(rollout_id)

    def run(self):
        cfg = self.cfg
        eval_on = cfg.eval.interval is not None and bool(self.inputs.eval_sets)
        if cfg.train.num_rollout == 0:
            if eval_on:
                self.log.log(0, self.evaluate(0))
            return
        for rollout_id in range(self.start_rollout_id, cfg.train.num_rollout):
            if self.stop.requested(self.info.device):
                self._stop_between_steps(rollout_id)
                return
            step_start = time.perf_counter()
            self.phase.step = rollout_id
            metrics = {}
            if eval_on and rollout_id == 0:
                metrics.update(self.evaluate(rollout_id))
            epoch = self.inputs.data.epoch
            groups = cfg.rollout.rollout_batch_size // self.info.world_size
            with self.phase("generate"), self.log.progress(groups, f"rollout {rollout_id}") as bar:
                samples, rollout_metrics = self.rollout.generate(self.inputs.data, rollout_id, bar.advance)
            epoch_end = self.inputs.data.epoch != epoch
            last = rollout_id + 1 == cfg.train.num_rollout
            with self.phase("to_train"):
                to_train = self.colocation.to_train()
            with self.phase("train"):
                train_metrics = self.trainer.train(samples, rollout_id, self.weight_version)
            stopping = self.stop.requested(self.info.device)
            if self._save_due(rollout_id, epoch_end, last, stopping):
                with self.phase("save"):
                    self.save(rollout_id, {**metrics, **rollout_metrics, **train_metrics, **to_train.metrics()})
            if stopping:  # the engine is not woken again: the step's record goes out as it is
                self._log_step(rollout_id, step_start, metrics, rollout_metrics, train_metrics, to_train)
                self.stopped_after = rollout_id
                return
            self.weight_version += 1
            with self.phase("to_rollout"):
                to_rollout = self.colocation.to_rollout(self.weight_version)
            if eval_on and ((rollout_id + 1) % cfg.eval.interval == 0 or epoch_end or last):
                metrics.update(self.evaluate(rollout_id))
            metrics.update(to_rollout.metrics())
            self._log_step(rollout_id, step_start, metrics, rollout_metrics, train_metrics, to_train)

    def _save_due(self, rollout_id: int, epoch_end: bool, last: bool, stopping: bool) -> bool:
        """Every save_interval steps and at epoch ends (with an interval), at the run's end and
        on a requested stop (with checkpoint.save_on_exit)."""
        c = self.cfg.checkpoint
        if c.save_interval is not None and ((rollout_id + 1) % c.save_interval == 0 or epoch_end or last):
            return True
        return c.save_on_exit and (last or stopping)

    def _stop_between_steps(self, rollout_id: int) -> None:
        """A stop asked for after the previous step's save point (during its weight sync or eval, or
        during start-up): the previous step is saved if it trained in this run and is not saved yet."""
        previous = rollout_id - 1
        if self.cfg.checkpoint.save_on_exit and previous >= self.start_rollout_id and previous not in self.saved:
            self.colocation.to_train()  # the trainer's state back on the device, where the save reads it
            with self.phase("save"):  # as the step's own save would have: before the version it pushed
                self.save(previous, {}, weight_version=self.weight_version - 1)
        self.stopped_after = previous

    def _log_step(self, rollout_id, step_start, metrics, rollout_metrics, train_metrics, to_train) -> None:
        """The step's record: its phases' metrics, times and memory, once per step."""
        for part in (
            rollout_metrics,
            train_metrics,
            to_train.metrics(),
            self.phase.take(),
            self.startup,
            self.ledger.step_metrics(rollout_id),
        ):
            metrics.update(part)
        self.startup = {}  # the first step's record only
        self.ledger.append_to(self.out / f"memory_rank{self.info.rank}.jsonl", rollout_id)
        metrics["perf/step_time"] = time.perf_counter() - step_start
        metrics["rollout/weight_version"] = self.weight_version
        metrics["rollout/dropped_long_prompts"] = self.inputs.num_dropped_prompts
        metrics["rollout/epoch"] = self.inputs.data.epoch
        self.log.log(rollout_id, metrics)

    def close(self):
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
        if self.inputs.episodes is not None:
            self.inputs.episodes.close()
        self.log.close()


@entry_point
def main(argv: list[str]) -> int:
    """User errors (bad config, data, rewards, checkpoints, an unwritable disk) end as one line,
    `error: ...`, and exit status 2 (with the traceback under --debug)."""
    from colocate.metrics import run_summary
    from colocate.run_dir import RunDir

    age = process_age_s()  # the interpreter's start and the imports so far
    start = time.perf_counter()
    stop = StopSignals(is_main=os.environ.get("RANK", "0") == "0").install()  # Ctrl-C: a clean stop
    use_compile_cache()
    cfg = load_config(argv)
    given = copy.deepcopy(cfg)  # as the user gave it: loading resolves Hub ids to local snapshots
    config_s = time.perf_counter() - start
    info = dist.init()
    seed_everything(cfg.train.seed)
    loop = run_dir = None
    finished = False
    try:
        run_dir = RunDir.claim(cfg, info)  # one run per output_dir
        startup = {"perf/startup/process_s": age} if age is not None else {}
        startup["perf/startup/config_s"] = config_s
        startup["perf/startup/dist_s"] = time.perf_counter() - start - config_s  # process group, output dir
        loop = Loop(cfg, info, startup, stop)  # data, rewards, hooks and the model config are checked here
        loop.build()
        run_dir.save_config(given)  # once the inputs and the models have loaded
        loop.run()
        signum = None if loop.stopped_after is None else stop.agreed_signum(info.device)
        code = 0 if signum is None else exit_code(signum)
        if info.is_main:
            loop.log.info(run_summary(cfg.output_dir, time.perf_counter() - start))
            if signum is not None:
                loop.log.info(stop_line(loop, signal.Signals(signum).name))
        finished = True
    finally:
        if loop is not None:
            loop.close()
        if run_dir is not None:
            run_dir.release()
        dist.destroy(synchronize=finished)
        stop.uninstall()
    return code


def stop_line(loop: Loop, signal_name: str) -> str:
    """One line after a requested stop: what was saved and how to go on."""
    from colocate.checkpoint_manifest import checkpoint_dir

    step = loop.stopped_after
    if step in loop.saved:
        path = checkpoint_dir(loop.cfg.checkpoint_dir, step)
        return f"stopped by {signal_name} after step {step}: checkpoint {path}; run the same command to resume from it"
    if step < loop.start_rollout_id:
        when, why = f"before step {loop.start_rollout_id}", "no step trained in this run"
    else:
        when, why = f"after step {step}", "checkpoint.save_on_exit is off"
    return (
        f"stopped by {signal_name} {when}, nothing saved ({why}); the same command resumes from "
        f"the newest checkpoint under {loop.cfg.checkpoint_dir}, if any"
    )


if __name__ == "__main__":
    dist.exit_process(main())
