"""An output directory belongs to one run: locked, never mixed with another run, config written last."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from colocate.config import Config
from colocate.dist import DistInfo
from colocate.run_dir import RunDir, drop_torn_line

INFO = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))


def _cfg(out, **fields) -> Config:
    cfg = Config(output_dir=str(out))
    for name, value in fields.items():
        section, _, field = name.rpartition(".")
        setattr(getattr(cfg, section) if section else cfg, field, value)
    return cfg


def _tree(path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _checkpoint(out):
    ckpt = out / "checkpoints" / "rollout_000003"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"format": "colocate-checkpoint-v1"}))
    (ckpt / ".metadata").write_bytes(b"x")
    return ckpt


def test_a_second_run_on_a_locked_directory_is_refused(tmp_path):
    first = RunDir.claim(_cfg(tmp_path), INFO)
    with pytest.raises(ValueError, match=rf"output_dir {tmp_path} is in use by another run \(process \d+\)"):
        RunDir.claim(_cfg(tmp_path), INFO)
    first.release()
    RunDir.claim(_cfg(tmp_path), INFO).release()  # free again once the first run ends


def test_a_fresh_run_over_another_runs_metrics_is_refused_unless_overwrite(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "config.yaml").write_text("output_dir: old\n")
    before = _tree(tmp_path)
    with pytest.raises(ValueError, match="holds another run's metrics.jsonl and no checkpoint"):
        RunDir.claim(_cfg(tmp_path), INFO)
    assert {k: v for k, v in _tree(tmp_path).items() if k != ".lock"} == before  # nothing changed
    RunDir.claim(_cfg(tmp_path, overwrite=True), INFO).release()
    assert not (tmp_path / "metrics.jsonl").exists() and (tmp_path / "config.yaml").exists()


def test_checkpoints_of_another_run_are_never_mixed_with_a_fresh_one(tmp_path):
    ckpt = _checkpoint(tmp_path)
    before = _tree(ckpt)
    with pytest.raises(ValueError, match="holds another run's checkpoints and checkpoint.resume is off"):
        RunDir.claim(_cfg(tmp_path, **{"checkpoint.resume": False}), INFO)
    assert _tree(ckpt) == before


@pytest.mark.parametrize("own_dir", [False, True])
def test_overwrite_with_checkpoints_is_refused_and_deletes_nothing(tmp_path, own_dir):
    """--overwrite promises a fresh run; with checkpoints present that run would resume instead."""
    out = tmp_path / "run"
    ckpt_dir = _checkpoint(tmp_path / "elsewhere" if own_dir else out).parent
    out.mkdir(exist_ok=True)
    (out / "metrics.jsonl").write_text('{"step": 3}\n')
    (out / "log.txt").write_text("earlier\n")
    before = _tree(tmp_path)
    fields = {"checkpoint.dir": str(ckpt_dir)} if own_dir else {}
    for resume in (True, False):
        with pytest.raises(ValueError) as info:
            RunDir.claim(_cfg(out, overwrite=True, **fields, **{"checkpoint.resume": resume}), INFO)
        assert str(info.value) == (
            f"--overwrite starts a fresh run, but {ckpt_dir} holds checkpoints: drop "
            "--overwrite to resume from them, or choose another output_dir or checkpoint.dir"
        )
    assert {k: v for k, v in _tree(tmp_path).items() if not k.endswith(".lock")} == before
    RunDir.claim(_cfg(out, **fields), INFO).release()  # without --overwrite: resumes, keeps the metrics
    assert (out / "metrics.jsonl").read_text() == '{"step": 3}\n'


def test_a_resumed_run_drops_the_torn_last_metrics_line(tmp_path):
    _checkpoint(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": 1}\n{"step": 2, "rollout/rew')
    RunDir.claim(_cfg(tmp_path), INFO).release()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert not drop_torn_line(tmp_path / "metrics.jsonl")


def test_config_is_written_atomically_and_only_when_asked(tmp_path):
    run = RunDir.claim(_cfg(tmp_path), INFO)
    assert not (tmp_path / "config.yaml").exists()
    run.save_config(_cfg(tmp_path, **{"train.lr": 0.25}))
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["lr"] == 0.25
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "config.yaml"]
    run.release()


def test_a_launch_with_bad_data_keeps_the_previous_config(tmp_path, capsys):
    from colocate.train import main

    (tmp_path / "config.yaml").write_text("output_dir: earlier run\n")
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a", "label": "b"}\nnot json\n')
    assert main(["--output-dir", str(tmp_path), "--rollout.prompt-data", str(data)]) == 2
    assert f"{data}:2" in capsys.readouterr().err
    assert (tmp_path / "config.yaml").read_text() == "output_dir: earlier run\n"
