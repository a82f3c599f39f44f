"""Resume covers every piece of state: a run stopped right after a checkpoint and resumed in a
fresh loop matches the uninterrupted run over the three rollouts that follow.

The run is the whole loop (colocate.train.Loop) on the toy task, configured so that each piece of
state changes what comes next: PPO with a critic and a KL loss (actor and critic, their AdamW
moments, their warm-up + cosine schedules, the frozen reference), two optimizer steps per rollout,
shuffled prompts (the data sampler's position) and a reward with a random term drawn from Python's
and torch's generators (the RNG state). The comparison is exact: every logged training and rollout
metric of the three steps, then the actor's and the critic's weights, optimizer moments and
schedulers, and the sampler's position at the end.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from colocate.config import Config
from colocate.metrics import read_metrics
from colocate.rollout.rewards import toy_reward
from tests.distributed import run_ranks

NUM_ROLLOUT, STOP_AFTER = 5, 1
"""Checkpoints at rollouts 1, 3 and 4 (save_interval 2 and the last); the stopped run ends after the first."""


def noisy_toy_reward(prompts, responses, labels, metadata):
    """The toy reward plus a small random term: the rewards depend on the restored RNG state."""
    rewards = toy_reward(prompts, responses, labels, metadata)
    return [r + 0.1 * random.random() + 0.1 * float(torch.rand(())) for r in rewards]


def _config(toy, out) -> Config:
    cfg = Config()
    cfg.output_dir = str(out)
    cfg.model.path = str(toy / "model")
    r, a, t = cfg.rollout, cfg.algorithm, cfg.train
    r.prompt_data, r.reward, r.shuffle = str(toy / "train.jsonl"), f"{__name__}:noisy_toy_reward", True
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_response_len, r.max_kv_tokens = 4, 4, 8, 4096
    a.advantage_estimator, a.use_kl_loss, a.kl_loss_coef, a.kl_estimator = "gae", True, 0.1, "k3"
    t.num_rollout, t.global_batch_size, t.max_tokens_per_gpu, t.seed = NUM_ROLLOUT, 8, 256, 3
    t.lr, t.critic_lr, t.lr_schedule, t.lr_warmup_steps, t.min_lr_ratio = 3e-3, 2e-3, "cosine", 3, 0.1
    cfg.checkpoint.save_interval, cfg.checkpoint.keep_last = 2, 3
    cfg.logging.console = False
    return cfg


class _Stopped(Exception):
    """Ends a run right after its first checkpoint, as a kill would."""


def _state(loop) -> dict:
    """Everything that must carry over, as plain tensors and numbers: the checkpointed parts
    (weights, optimizer moments and steps, scheduler) of actor and critic, and the sampler."""

    def plain(value):
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        if hasattr(value, "full_tensor"):
            return value.full_tensor().clone()
        return value.clone() if torch.is_tensor(value) else value

    states = loop.trainer.checkpoint_states()
    assert set(states) == {"model", "critic"}
    return {**{name: plain(s.state_dict()) for name, s in states.items()}, "data": loop.inputs.data.state_dict()}


@contextlib.contextmanager
def run_loop(cfg, stop: bool, prepare=None):
    """Build and run the loop as `colocate.train.main` does, from the same generator states each
    time, as two processes seeded alike would; with `stop`, the run ends right after its first save.
    `prepare(loop)` runs before the loop does. Yields the loop after its run; closes it after."""
    from colocate import dist
    from colocate.train import Loop, seed_everything

    seed_everything(cfg.train.seed)
    loop = Loop(cfg, dist.get_info())
    try:
        loop.build()
        if stop:
            save = loop.save

            def save_and_stop(rollout_id, step_metrics):
                save(rollout_id, step_metrics)
                raise _Stopped

            loop.save = save_and_stop
        if prepare is not None:
            prepare(loop)
        try:
            loop.run()
        except _Stopped:
            pass
        yield loop
    finally:
        loop.close()


def _run(cfg, stop: bool):
    with run_loop(cfg, stop) as loop:
        return loop.start_rollout_id, _state(loop)


def _runs(rank, world_size, toy, root, out_file):
    torch.set_num_threads(1)  # a tiny model: a second thread only waits on the first
    _, full = _run(_config(toy, root / "full"), stop=False)
    stopped = _config(toy, root / "stopped")
    _run(stopped, stop=True)
    start, resumed = _run(stopped, stop=False)
    torch.save({"full": full, "resumed": resumed, "start": start}, out_file)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from colocate.toy import ensure_toy

    root = tmp_path_factory.mktemp("resume")
    toy = ensure_toy(root / "toy")
    run_ranks(_runs, 1, toy, root, root / "result.pt")
    return root, torch.load(root / "result.pt")


def assert_record_from_checkpoint(row: dict, full: dict) -> None:
    """A record resume wrote from the checkpoint: marked, and what it holds (the step's rollout
    and training, not what came after the save) as the uninterrupted run logged it."""
    assert row["resume/record_from_checkpoint"] == 1
    got = _compared(row)
    assert {"train/pg_loss", "train/grad_norm", "rollout/raw_reward"} <= set(got)
    assert got == {k: v for k, v in _compared(full).items() if k in got}


def _compared(row: dict) -> dict:
    """A step's logged values that do not depend on timing or memory."""
    return {
        k: v for k, v in row.items() if k.split("/")[0] in ("train", "critic", "rollout") and not k.endswith(("_time", "_per_s"))
    }


def _assert_equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert set(a) == set(b), where
        for key in a:
            _assert_equal(a[key], b[key], f"{where}.{key}")
    elif torch.is_tensor(a):
        assert torch.equal(a, b), where
    else:
        assert a == b, where


def test_resumed_run_matches_the_uninterrupted_one(runs):
    root, result = runs
    assert result["start"] == STOP_AFTER + 1
    full = {r["step"]: r for r in read_metrics(root / "full")}
    stopped = read_metrics(root / "stopped")
    # Stopped between its save and its log: resume writes step 1's record from the checkpoint.
    assert [r["step"] for r in stopped] == list(range(NUM_ROLLOUT))
    assert_record_from_checkpoint(stopped[STOP_AFTER], full[STOP_AFTER])
    for row in stopped[STOP_AFTER + 1 :]:
        expected, got = _compared(full[row["step"]]), _compared(row)
        assert {"train/lr", "critic/lr", "train/kl_loss", "critic/value_loss", "rollout/raw_reward"} <= set(got)
        assert got == expected, row["step"]
    _assert_equal(result["resumed"], result["full"], "state")
    # The schedules are still warming up or decaying at the end: a lost scheduler would show.
    assert 0 < full[NUM_ROLLOUT - 1]["train/lr"] < 3e-3
