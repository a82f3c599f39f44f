"""What the config accepts, the trainer runs: every numeric field of algorithm.* and train.* at
each finite edge of its documented range (the `_ranged` metadata) validates and trains one CPU step
with finite metrics, or is refused by validation naming the field. Also the trainer's side of
non-finite weights (refused at load) and of repeated skipped steps (stopped)."""

from __future__ import annotations

import dataclasses
import math
import typing

import pytest
import torch
from safetensors.torch import load_file, save_file

from colocate.config import AlgorithmConfig, Config, EvalDataset, TrainConfig
from colocate.config_checks import validate
from colocate.rollout.sample import Sample
from tests.distributed import run_ranks
from tests.helpers import write_hf_model

GROUP = 4
GAE = {"algorithm.advantage_estimator": "gae"}
# Settings under which a field is read at all (a coefficient of a feature that is off is not).
READ_WITH = {
    "algorithm.kl_loss_coef": {"algorithm.use_kl_loss": True},
    "algorithm.kl_reward_coef": {"algorithm.kl_in_reward": True},
    "algorithm.tis_clip": {"algorithm.use_tis": True},
    "algorithm.mis_low": {"algorithm.use_mis": True},
    "algorithm.mis_high": {"algorithm.use_mis": True},
    "algorithm.overlong_penalty_factor": {"algorithm.overlong_buffer_len": 4},
    "algorithm.gamma": GAE,
    "algorithm.lam": GAE,
    "algorithm.value_clip": GAE,
    "algorithm.num_critic_only_steps": GAE,
    "train.critic_lr": GAE,
    "train.num_rollout": {"eval.interval": 1, "eval.datasets": [EvalDataset(path="eval.jsonl")]},
    # Several optimizer steps per rollout, so that ratios move away from 1 and clipping matters.
    "algorithm.eps_clip": {"train.global_batch_size": 4},
    "algorithm.dual_clip_c": {"train.global_batch_size": 4},
}
# Edges that a rule tying fields together refuses, with the start of its message.
REFUSED = {("train.max_tokens_per_gpu", 1): "config: train.max_tokens_per_gpu must hold one full sample"}
WIDE_CLIP = {"algorithm.eps_clip": 1.0, "algorithm.eps_clip_high": 4.0, "train.global_batch_size": 4}


def _edges(spec: str, integer: bool) -> list[float]:
    """The finite edges of a range spec; an open edge is replaced by the nearest value inside."""
    step = 1 if integer else 1e-6
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return [lo if spec[0] == "[" else lo + step, hi if spec[-1] == "]" else hi - step]
    op, bound = spec.split()
    return [float(bound) if op == ">=" else float(bound) + step]


def edge_cases() -> list[tuple[str, float | int]]:
    cases = []
    for section, cls in (("algorithm", AlgorithmConfig), ("train", TrainConfig)):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if "range" not in f.metadata:
                continue
            integer = int in (typing.get_args(hints[f.name]) or (hints[f.name],))
            for edge in _edges(f.metadata["range"], integer):
                cases.append((f"{section}.{f.name}", int(edge) if integer else edge))
    return cases


def _config(path, overrides: dict) -> Config:
    cfg = Config()
    cfg.model.path, cfg.model.dtype = str(path), "float32"
    r, t = cfg.rollout, cfg.train
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_prompt_len, r.max_response_len = 2, GROUP, 16, 16
    t.lr, t.max_tokens_per_gpu = 1e-3, 64
    for dotted, value in overrides.items():
        section, name = dotted.split(".")
        setattr(getattr(cfg, section), name, value)
    return cfg


def _samples(vocab: int, reward: float | None = None) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for group in range(2):
        prompt = torch.randint(2, vocab, (5,), generator=g).tolist()
        for j in range(GROUP):
            n = int(torch.randint(2, 10, (1,), generator=g))
            r = float(torch.rand(1, generator=g)) if reward is None else reward
            out.append(
                Sample(prompt, torch.randint(2, vocab, (n,), generator=g).tolist(), [-3.0] * n, [1] * n, group, j, reward=r)
            )
    return out


def _walk(rank, world_size, path, nan_path, out_file):
    from colocate import dist
    from colocate.trainer import Trainer

    torch.set_num_threads(1)
    info = dist.get_info()
    results = {}
    for name, value in edge_cases() + [("wide_clip_cispo", None), ("wide_clip_ppo", None)]:
        if value is None:
            overrides = {**WIDE_CLIP, "algorithm.policy_loss": name.rsplit("_", 1)[1]}
        else:
            overrides = {**READ_WITH.get(name, {}), name: value}
        cfg = _config(path, overrides)
        try:
            validate(cfg)
        except ValueError as e:
            results[name, value] = str(e)
            continue
        results[name, value] = Trainer(cfg, info).train(_samples(101), rollout_id=0)
    try:
        Trainer(_config(nan_path, {}), info)
    except ValueError as e:
        results["nan_weights"] = str(e)
    trainer = Trainer(_config(path, {"train.max_skipped_steps": 2}), info)
    results["skips"] = [trainer.train(_samples(101, float("nan")), rollout_id=0)["train/skipped_steps"]]
    try:
        trainer.train(_samples(101, float("nan")), rollout_id=1)
    except ValueError as e:
        results["skips"].append(str(e))
    torch.save(results, out_file)


@pytest.fixture(scope="module")
def walked(tmp_path_factory):
    root = tmp_path_factory.mktemp("edges")
    path, _ = write_hf_model(root, "qwen2")
    nan_path, _ = write_hf_model(root / "nan", "qwen2")
    file = nan_path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(file), metadata={"format": "pt"})
    run_ranks(_walk, 1, path, nan_path, root / "results.pt")
    return torch.load(root / "results.pt"), file


@pytest.mark.slow
def test_every_documented_edge_validates_and_trains_or_is_refused_by_name(walked):
    results, _ = walked
    cases = edge_cases()
    assert len(cases) == 32 and ("train.max_skipped_steps", 1) in cases and ("algorithm.mis_low", 1.0) in cases
    for case in cases:
        outcome = results[case]
        if case in REFUSED:
            assert outcome.startswith(REFUSED[case]), (case, outcome)
            continue
        assert isinstance(outcome, dict), (case, outcome)
        assert all(math.isfinite(v) for v in outcome.values()), case
        assert outcome["train/skipped_steps"] == 0.0, case


@pytest.mark.slow
def test_a_wide_clip_without_lower_bound_trains_with_cispo_and_ppo(walked):
    results, _ = walked
    for name in ("wide_clip_cispo", "wide_clip_ppo"):
        metrics = results[name, None]
        assert metrics["train/skipped_steps"] == 0.0 and metrics["train/grad_norm"] > 0, name
        assert all(math.isfinite(v) for v in metrics.values()), name


@pytest.mark.slow
def test_the_trainer_refuses_non_finite_weights_and_stops_after_repeated_skips(walked):
    results, file = walked
    assert results["nan_weights"] == f"{file}: tensor model.norm.weight holds non-finite values (1 NaN, 0 inf of 56)"
    skipped, error = results["skips"]
    assert skipped == 1.0  # one optimizer step per rollout: the first skip is only logged
    assert error == (
        "2 optimizer steps in a row (train.max_skipped_steps) were skipped for a non-finite loss (nan) "
        "or grad norm (nan): training diverged; lower train.lr (now 0.001)"
    )
