"""Damaged checkpoints, failed saves and exports that must not destroy anything: resume falls back
to the newest usable checkpoint and says why, pruning keeps usable ones, a failed save leaves no
temporary directory, and export never replaces a directory it did not write."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import filesystem

import colocate.checkpoint as ckpt_mod
from colocate.checkpoint import ModelOptimizerState, load_checkpoint, save_checkpoint
from colocate.checkpoint_manifest import latest_checkpoint
from colocate.export import export
from colocate.export import main as export_main
from colocate.models import from_pretrained
from colocate.output_dir import MARKER
from tests.disk import snapshot
from tests.helpers import write_hf_model


def _tiny_state(seed: int):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    return {"model": ModelOptimizerState(layer, torch.optim.SGD(layer.parameters(), lr=0.1))}, layer


def _save(root: Path, *ids: int, keep_last: int = 0) -> None:
    for i in ids:
        save_checkpoint(root, i, _tiny_state(i)[0], extra={"id": i}, keep_last=keep_last)


def _truncate(file: Path) -> tuple[int, int]:
    size = file.stat().st_size
    file.write_bytes(file.read_bytes()[: size // 2])
    return size // 2, size


@pytest.mark.parametrize("name", ["__0_0.distcp", "meta.json", ".metadata", "rng_rank0.pt"])
def test_a_truncated_file_in_the_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, name):
    _save(tmp_path, 1, 2)
    newest = tmp_path / "rollout_000002"
    now, saved = _truncate(newest / name)
    before = snapshot(tmp_path)
    with pytest.warns(UserWarning) as warned:
        path = latest_checkpoint(tmp_path)
    assert path == tmp_path / "rollout_000001"
    assert [str(w.message) for w in warned] == [f"{newest}: skipped, damaged: {name} has {now} bytes, {saved} when saved"]
    states, layer = _tiny_state(7)
    assert load_checkpoint(path, states) == {"id": 1}
    assert torch.equal(layer.weight, _tiny_state(1)[1].weight)
    with pytest.raises(ValueError) as info:  # named, when asked for by path
        load_checkpoint(newest, states)
    assert str(info.value) == f"checkpoint {newest} is damaged: {name} has {now} bytes, {saved} when saved"
    assert snapshot(tmp_path) == before


def test_an_edited_or_missing_small_file_is_caught_and_none_usable_is_an_error(tmp_path):
    _save(tmp_path, 1, 2)
    meta = tmp_path / "rollout_000002" / "meta.json"
    meta.write_text(meta.read_text().replace('"id": 2', '"id": 9'))  # same size, other bytes
    (tmp_path / "rollout_000001" / "rng_rank0.pt").unlink()
    before = snapshot(tmp_path)
    with pytest.warns(UserWarning), pytest.raises(ValueError) as info:
        latest_checkpoint(tmp_path)
    assert str(info.value) == (
        f"no usable checkpoint under {tmp_path}: {tmp_path / 'rollout_000002'} (meta.json differs from the "
        f"saved file (CRC-32)); {tmp_path / 'rollout_000001'} (rng_rank0.pt is missing)"
    )
    assert snapshot(tmp_path) == before


def test_a_checkpoint_from_before_the_manifest_still_loads(tmp_path):
    _save(tmp_path, 1, 2)
    newest = tmp_path / "rollout_000002"
    (newest / "manifest.json").unlink()
    with pytest.warns(UserWarning, match="rollout_000002: skipped, damaged: manifest.json is missing"):
        assert latest_checkpoint(tmp_path) == tmp_path / "rollout_000001"
    meta = json.loads((newest / "meta.json").read_text())
    (newest / "meta.json").write_text(json.dumps({**meta, "format": "colocate-checkpoint-v1"}))
    assert latest_checkpoint(tmp_path) == newest
    states, layer = _tiny_state(7)
    assert load_checkpoint(newest, states) == {"id": 2}
    assert torch.equal(layer.weight, _tiny_state(2)[1].weight)


def test_pruning_does_not_count_a_damaged_checkpoint_among_those_kept(tmp_path):
    _save(tmp_path, 1, 2, 5)  # 5: a later save of an earlier run, damaged since
    _truncate(tmp_path / "rollout_000005" / "__0_0.distcp")
    _save(tmp_path, 3, keep_last=2)
    # By rollout id alone the two kept would be 3 and 5, leaving one usable checkpoint.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000002", "rollout_000003", "rollout_000005"]
    _save(tmp_path, 4, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000004", "rollout_000005"]


def _no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _read_only(self, *args, exist_ok=False, **kwargs):
    """Path.mkdir on a read-only file system: only an existing directory with exist_ok passes."""
    if not (exist_ok and self.is_dir()):
        raise PermissionError(errno.EROFS, "Read-only file system", str(self))


@pytest.mark.parametrize("fault", ["full_disk_in_dcp", "full_disk_in_rng_file", "read_only"])
def test_a_failed_save_is_one_line_naming_the_checkpoint_and_leaves_nothing(tmp_path, monkeypatch, fault):
    _save(tmp_path, 1)
    before = snapshot(tmp_path)
    if fault == "full_disk_in_dcp":
        monkeypatch.setattr(filesystem, "_write_item", _no_space)
        reason = "[Errno 28] No space left on device"
    elif fault == "full_disk_in_rng_file":
        monkeypatch.setattr(ckpt_mod, "_rng_bytes", _no_space)
        reason = "[Errno 28] No space left on device"
    else:
        monkeypatch.setattr(Path, "mkdir", _read_only)
        reason = f"[Errno 30] Read-only file system: '{tmp_path / '.tmp-rollout_000002'}'"
    with pytest.raises(OSError) as info:
        save_checkpoint(tmp_path, 2, _tiny_state(2)[0], keep_last=1)
    assert str(info.value) == (
        f"cannot save checkpoint {tmp_path / 'rollout_000002'}: {reason} (its temporary "
        "directory was removed; earlier checkpoints are intact)"
    )
    assert snapshot(tmp_path) == before
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == tmp_path / "rollout_000001"


@pytest.fixture(scope="module")
def actor_checkpoint(tmp_path_factory):
    """A run directory (metrics + checkpoints) whose one checkpoint holds a tiny Qwen2 actor."""
    model_dir, _ = write_hf_model(tmp_path_factory.mktemp("model"), "qwen2")
    run = tmp_path_factory.mktemp("run")
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    model = from_pretrained(model_dir, dtype="float32")
    return save_checkpoint(run / "checkpoints", 0, {"model": ModelOptimizerState(model)}, model_dir=model_dir)


def _refused(ckpt: Path, out: Path | str, message: str, capsys, *flags: str) -> None:
    """export CKPT OUT ends with `message` and status 2; nothing under the run or OUT changed."""
    watched = [ckpt.parents[1], Path(out).resolve()]
    before = [snapshot(d) for d in watched]
    assert export_main([str(ckpt), str(out), *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    assert [snapshot(d) for d in watched] == before


def test_export_never_replaces_what_it_did_not_write(actor_checkpoint, tmp_path, monkeypatch, capsys):
    ckpt, run = actor_checkpoint, actor_checkpoint.parents[1]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me\n")
    _refused(
        ckpt,
        mine,
        f"output {mine} is not empty and was not written by colocate: choose a new directory, or replace it with --overwrite",
        capsys,
    )
    monkeypatch.chdir(mine)
    _refused(ckpt, ".", "output . is or contains the working directory: choose a new directory", capsys)
    monkeypatch.chdir(tmp_path)
    for out in (run, run / "checkpoints", ckpt, ckpt / "hf_export"):
        _refused(
            ckpt, out, f"output {out} must not be, contain or lie inside {ckpt}, which it is read from", capsys, "--overwrite"
        )
    first = export(ckpt, tmp_path / "exported", dtype="float32")
    assert (first / MARKER).is_file() and (first / "model.safetensors").is_file()
    export(ckpt, first)  # an earlier export is replaced
    assert json.loads((first / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert export_main([str(ckpt), str(mine), "--overwrite"]) == 0
    assert not (mine / "notes.txt").exists() and (mine / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "mine"]


def test_a_failed_export_leaves_the_earlier_one(actor_checkpoint, tmp_path, monkeypatch, capsys):
    out = export(actor_checkpoint, tmp_path / "exported")
    before = snapshot(tmp_path)
    monkeypatch.setattr("colocate.models.loading.save_file", _no_space)
    assert export_main([str(actor_checkpoint), str(out)]) == 2
    assert capsys.readouterr().err == "error: [Errno 28] No space left on device\n"
    assert snapshot(tmp_path) == before


def test_export_of_a_damaged_checkpoint_names_the_file(actor_checkpoint, tmp_path, capsys):
    ckpt = Path(shutil.copytree(actor_checkpoint, tmp_path / "rollout_000000"))
    now, saved = _truncate(ckpt / ".metadata")
    _refused(ckpt, tmp_path / "out", f"checkpoint {ckpt} is damaged: .metadata has {now} bytes, {saved} when saved", capsys)
    assert not (tmp_path / "out").exists() and os.listdir(tmp_path) == ["rollout_000000"]
