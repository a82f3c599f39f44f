"""The colocated RL loop: `torchrun --nproc-per-node N -m colocate.train --config X.yaml`.

Per rollout step, in this order (docs/architecture.md): generate -> to_train (the engine gives its
memory back, the trainer's comes back) -> train -> save -> to_rollout (the trainer's memory goes,
the weights reach the engine, the engine's memory comes back) -> eval. What moves in each switch,
and when, is colocate/colocation/handoff.py's to decide; this file only says when to switch.
"""

from __future__ import annotations

import copy
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from colocate import dist
from colocate.cli import entry_point
from colocate.config import Config, load_config, use_compile_cache
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
    def __init__(self, cfg: Config, info: dist.DistInfo, startup: dict[str, float] | None = None):
        from colocate.colocation.ledger import MemoryLedger
        from colocate.inputs import RunInputs
        from colocate.metrics import MetricsLogger

        self.cfg, self.info = cfg, info
        self.out = Path(cfg.output_dir)
        self.startup: dict[str, float] = dict(startup or {})
        """perf/startup/<part>_s: where the time before step 0 went, logged with the first step
        (`startup`: the parts before the loop, in order)."""
        # Everything that can be wrong with the user's input is checked before any model is built.
        with timed(self.startup, "perf/startup/inputs_s", info.device):
            self.inputs = RunInputs.load(cfg, info)
        self.log = MetricsLogger(self.out, enabled=info.is_main, use_wandb=cfg.logging.wandb,
                                 wandb_project=cfg.logging.wandb_project, run_name=cfg.logging.run_name,
                                 config=cfg.to_dict(), console=cfg.logging.console)
        self.ledger = MemoryLedger(info.device, strict=cfg.train.strict)
        self.phase = Phases(self.ledger, info.device, cfg)
        self.weight_version = 0
        self.start_rollout_id = 0
        self.resumed_rollouts: list | None = None
        """Partial rollout: the groups in flight that the checkpoint resumed from carries."""

    def build(self):
        from colocate.colocation.handoff import Colocation
        from colocate.metrics import startup_line, startup_phases
        from colocate.models import resolve_dtype
        from colocate.rollout.factory import build_engine, reachable_batch_size
        from colocate.rollout.orchestrator import RolloutManager
        from colocate.trainer import Trainer

        cfg, info, startup = self.cfg, self.info, self.startup
        if cfg.algorithm.true_on_policy:  # before any model runs: engine and trainer alike
            from colocate.kernels import batch_invariant

            batch_invariant.enable(info.device)
            if cfg.rollout.compile_decode and info.device.type == "cuda":
                self.log.info("algorithm.true_on_policy: the engine's decode runs uncompiled "
                              "(rollout.compile_decode is ignored in the mode)")
        with timed(startup, "perf/startup/trainer_s", info.device):  # load, shard, reserve pinned buffers
            self.trainer = Trainer(cfg, info)
        _add_parts(startup, "trainer", self.trainer.startup_seconds)
        with timed(startup, "perf/startup/resume_s", info.device):
            self._maybe_resume()
        self.colocation = Colocation(self.trainer, cfg.offload, dtype=resolve_dtype(cfg.model.dtype, info.device),
                                     bucket_bytes=cfg.rollout.weight_sync_bucket_mb << 20)
        if cfg.offload.offload_train:
            with timed(startup, "perf/startup/offload_s", info.device):
                self.colocation.make_room()
        eval_prompts = max((len(prompts) for _, prompts, _ in self.inputs.eval_sets), default=0)
        with timed(startup, "perf/startup/engine_s", info.device):
            self.engine = build_engine(cfg, info, self.inputs.eos_token_ids,
                                       reachable_batch_size(cfg, info.world_size, eval_prompts))
        _add_parts(startup, "engine", getattr(self.engine, "startup_seconds", {}))
        self.rollout = RolloutManager(
            self.engine, self.inputs.tokenizer, cfg.rollout, reward_fn=self.inputs.reward_fn,
            strict=cfg.train.strict, overlong=self.inputs.overlong,
            custom_generate=self.inputs.custom_generate, seed=cfg.rollout.seed)
        if self.resumed_rollouts is not None:
            self.rollout.load_state_dict(self.resumed_rollouts, self.inputs.data.dataset)
        # The engine always starts from the trainer's weights (they differ from disk after resume).
        self.weight_version += 1
        with timed(startup, "perf/startup/first_sync_s", info.device):
            self.colocation.start(self.engine, self.weight_version)
        self.ledger.record(self.start_rollout_id, "start")
        self.log.info(startup_line(startup_phases(startup)))

    def _maybe_resume(self):
        from colocate.checkpoint_manifest import latest_checkpoint

        if not self.cfg.checkpoint.resume:
            return
        path = latest_checkpoint(self.cfg.checkpoint_dir)
        if path is None:
            self.log.info(f"no checkpoint under {self.cfg.checkpoint_dir}: starting from step 0")
            return
        from colocate.checkpoint import load_checkpoint  # torch.distributed.checkpoint: only when resuming

        extra = load_checkpoint(path, self.trainer.checkpoint_states())
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

    def save(self, rollout_id: int, step_metrics: dict):
        """A checkpoint after the step's training. It also holds the step's metrics so far: the
        record is written after to_rollout and eval, and a run that dies in between gets it back
        on resume (`_maybe_resume`)."""
        from colocate.checkpoint import save_checkpoint
        from colocate.metrics import plain_metrics

        extra = {"rollout_id": rollout_id, "weight_version": self.weight_version,
                 "data": self.inputs.data.state_dict(), "metrics": plain_metrics(step_metrics)}
        if self.cfg.rollout.partial_rollout:  # the groups in flight, carried into the next step
            extra["partial_rollout"] = self.rollout.state_dict()
        save_checkpoint(self.cfg.checkpoint_dir, rollout_id, self.trainer.checkpoint_states(), extra=extra,
                        model_dir=Path(self.cfg.model.path), keep_last=self.cfg.checkpoint.keep_last)

    def run(self):
        cfg = self.cfg
        eval_on = cfg.eval.interval is not None and bool(self.inputs.eval_sets)
        if cfg.train.num_rollout == 0:
            if eval_on:
                self.log.log(0, self.evaluate(0))
            return
        for rollout_id in range(self.start_rollout_id, cfg.train.num_rollout):
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
            interval = cfg.checkpoint.save_interval
            if interval is not None and ((rollout_id + 1) % interval == 0 or epoch_end or last):
                with self.phase("save"):
                    self.save(rollout_id, {**metrics, **rollout_metrics, **train_metrics, **to_train.metrics()})
            self.weight_version += 1
            with self.phase("to_rollout"):
                to_rollout = self.colocation.to_rollout(self.weight_version)
            if eval_on and ((rollout_id + 1) % cfg.eval.interval == 0 or epoch_end or last):
                metrics.update(self.evaluate(rollout_id))
            metrics.update(rollout_metrics)
            metrics.update(train_metrics)
            metrics.update(to_train.metrics())
            metrics.update(to_rollout.metrics())
            metrics.update(self.phase.take())
            metrics.update(self.startup)  # the first step's record only
            self.startup = {}
            metrics.update(self.ledger.step_metrics(rollout_id))
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
        self.log.close()


@entry_point
def main(argv: list[str]) -> int:
    """User errors (bad config, data, rewards, checkpoints, an unwritable disk) end as one line,
    `error: ...`, and exit status 2 (with the traceback under --debug)."""
    from colocate.metrics import run_summary
    from colocate.run_dir import RunDir

    age = process_age_s()  # the interpreter's start and the imports so far
    start = time.perf_counter()
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
        loop = Loop(cfg, info, startup)  # data, rewards, hooks and the model config are checked here
        loop.build()
        run_dir.save_config(given)  # once the inputs and the models have loaded
        loop.run()
        if info.is_main:
            loop.log.info(run_summary(cfg.output_dir, time.perf_counter() - start))
        finished = True
    finally:
        if loop is not None:
            loop.close()
        if run_dir is not None:
            run_dir.release()
        dist.destroy(synchronize=finished)
    return 0


if __name__ == "__main__":
    dist.exit_process(main())
