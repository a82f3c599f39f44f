"""The trainer and partial rollout's stale tokens (CPU, gloo ranks): with
rollout.partial_mask_stale_tokens, a step on samples whose first tokens came from an older weight
version updates the weights exactly as a step on the same samples with those tokens' loss mask
set to 0; without it, the stale tokens train (the update differs). Samples whose every token is
stale are left out of every pass (two ranks, one of them left with none to run), and the update
equals running them."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.distributed import run_ranks
from tests.helpers import write_hf_model
from tests.integration.test_trainer_fsdp import _config, _samples, _weights

VERSION = 3
"""The version of the weights being trained; tokens sampled by version 2 are stale."""


def _with_versions(samples, all_stale_groups=()):
    """Each sample's first half sampled by version 2 (carried from the last step), the rest by 3;
    every token by version 2 in `all_stale_groups` (samples that finished in the last step)."""
    out = []
    for s in samples:
        old = s.response_len if s.group_index in all_stale_groups else s.response_len // 2
        out.append(
            dataclasses.replace(
                s, token_versions=[VERSION - 1] * old + [VERSION] * (s.response_len - old), weight_version=VERSION
            )
        )
    return out


def _steps(rank, world_size, path, out_file):
    from colocate import dist
    from colocate.trainer import Trainer

    torch.set_num_threads(1)
    info = dist.get_info()
    samples = _with_versions(_samples(vocab=101))
    zeroed = [
        dataclasses.replace(s, token_versions=[], loss_mask=[m if v == VERSION else 0 for m, v in zip(s.loss_mask, s.versions)])
        for s in samples
    ]
    partial = {"rollout.partial_rollout": True, "rollout.over_sampling_batch_size": 4}
    out = {}
    for name, overrides, batch in (
        ("masked", partial, samples),
        ("zeroed", {}, zeroed),
        ("kept", {**partial, "rollout.partial_mask_stale_tokens": False}, samples),
    ):
        trainer = Trainer(_config(path, **overrides), info)
        out[name] = trainer.train(batch, rollout_id=0, weight_version=VERSION), _weights(trainer)
    torch.save(out, out_file)


def test_stale_tokens_are_masked_out_of_the_loss_only_when_asked(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_steps, 1, path, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    (masked, w_masked), (zeroed, w_zeroed), (kept, w_kept) = out["masked"], out["zeroed"], out["kept"]
    for metric in ("train/pg_loss", "train/grad_norm", "train/entropy_loss"):
        assert masked[metric] == zeroed[metric], metric
    for name in w_masked:
        assert torch.equal(w_masked[name], w_zeroed[name]), name
    assert kept["train/grad_norm"] != masked["train/grad_norm"]
    assert any((w_kept[n] - w_masked[n]).abs().max() > 1e-6 for n in w_masked)


def _skipping(rank, world_size, path, out_file):
    """Rank 0 holds the all-stale group, so it runs only dummy micro-batches; two optimizer steps
    (an old log-prob pass) and a KL loss (a reference pass); once more with every sample run (the
    skip undone), for reference."""
    from colocate import dist
    from colocate.trainer import Trainer, passes

    torch.set_num_threads(1)
    samples = _with_versions(_samples(vocab=101), all_stale_groups=(0,))
    local = [s for s in samples if s.group_index == rank]
    overrides = {
        "rollout.partial_rollout": True,
        "rollout.over_sampling_batch_size": 4,
        "algorithm.loss_agg_mode": "seq_mean_token_mean",
        "algorithm.use_kl_loss": True,
        "algorithm.kl_loss_coef": 0.5,
        "train.global_batch_size": 4,
    }
    out = {}
    for name, in_loss in (("skipped", passes.in_loss), ("run", lambda batch, indices: list(indices))):
        passes.in_loss = in_loss
        trainer = Trainer(_config(path, **overrides), dist.get_info())
        out[name] = trainer.train(local, rollout_id=0, weight_version=VERSION), _weights(trainer)
    if rank == 0:
        torch.save(out, out_file)


def test_samples_with_every_token_stale_are_not_run_and_the_update_is_unchanged(tmp_path):
    path, _ = write_hf_model(tmp_path, "qwen2")
    run_ranks(_skipping, 2, path, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt")
    (skipped, w_skipped), (run, w_run) = out["skipped"], out["run"]
    assert skipped["train/loss_free_samples"] == 4 and run["train/loss_free_samples"] == 0
    assert "perf/old_logprob_time" in skipped and "perf/ref_logprob_time" in skipped
    for metric in ("train/pg_loss", "train/grad_norm", "train/entropy_loss", "train/ppo_kl", "train/kl_loss"):
        assert skipped[metric] == pytest.approx(run[metric], rel=1e-5, abs=1e-7), metric
    assert skipped["train/grad_norm"] > 0 and skipped["train/kl_loss"] > 0
    for name in w_skipped:
        torch.testing.assert_close(w_skipped[name], w_run[name], rtol=1e-6, atol=1e-7, msg=name)
