"""Checkpoints never poison a run: every file is checksummed as it is written, resuming checks every
file and every tensor read and falls back past a damaged or non-finite checkpoint with one warning
line, and pruning never costs the run its last good checkpoint."""

from __future__ import annotations

import json
import random
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import colocate.checkpoint as ckpt_mod
import colocate.checkpoint_manifest as manifest_mod
from colocate import dist as cdist
from colocate.checkpoint import ModelOptimizerState, load_checkpoint, resume_newest, save_checkpoint
from tests.disk import snapshot

SHARD = "__0_0.distcp"


def _state(seed: int, nan: bool = False):
    """A layer after one SGD step with momentum (so the optimizer holds a tensor too)."""
    torch.manual_seed(seed)
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9)
    layer(torch.randn(4, 3)).sum().backward()
    opt.step()
    if nan:
        with torch.no_grad():
            layer.weight[1, 2] = float("nan")
    return {"model": ModelOptimizerState(layer, opt)}, layer, opt


def _values(layer, opt) -> list[torch.Tensor]:
    return [
        t.detach().clone() for t in (layer.weight, layer.bias, *(opt.state[p]["momentum_buffer"] for p in layer.parameters()))
    ]


def _save(root: Path, *ids: int, keep_last: int = 0, nan: bool = False) -> None:
    for i in ids:
        save_checkpoint(root, i, _state(i, nan)[0], extra={"id": i}, keep_last=keep_last)


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _as_format_v2(path: Path) -> None:
    """Rewrite a checkpoint's manifest as format v2 wrote it: CRC-32s of the small files only."""
    doc = _manifest(path)
    for name, entry in doc["files"].items():
        if name.endswith(".distcp"):
            del entry["crc32"]
    v2 = {"format": "colocate-checkpoint-v2", "files": doc["files"]}
    (path / "manifest.json").write_text(json.dumps(v2))


def _damage(path: Path, how: str) -> None:
    """Damage the newest checkpoint's shard in place: NaN over its saved weight (same size),
    garbage bytes (same size), or cut in half."""
    shard = path / SHARD
    data = bytearray(shard.read_bytes())
    if how == "nan":
        weight = _state(int(path.name[-6:]))[1].weight.detach().numpy().tobytes()
        at = data.find(weight)
        assert at > 0 and data.count(weight) == 1
        data[at : at + len(weight)] = torch.full((6,), float("nan")).numpy().tobytes()
    elif how == "garbage":
        middle = len(data) // 2
        data[middle - 512 : middle + 512] = random.Random(0).randbytes(1024)
    else:
        del data[len(data) // 2 :]
    shard.write_bytes(bytes(data))


def test_every_file_is_checksummed_as_written_and_never_read_back(tmp_path, monkeypatch):
    def no_reading(path):
        raise AssertionError(f"{path} read back to checksum it")

    monkeypatch.setattr(manifest_mod, "_crc32", no_reading)
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "tiny"}')
    path = save_checkpoint(tmp_path / "ckpt", 1, _state(1)[0], model_dir=model_dir)
    doc = _manifest(path)
    on_disk = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file())
    assert (
        sorted(doc["files"])
        == sorted(set(on_disk) - {"manifest.json"})
        == [".metadata", SHARD, "hf/config.json", "meta.json", "rng_rank0.pt"]
    )
    for name, entry in doc["files"].items():
        data = (path / name).read_bytes()
        assert entry == {"size": len(data), "crc32": zlib.crc32(data)}, name
    assert doc["format"] == "colocate-checkpoint-v3" and doc["finite"] is True and doc["non_finite"] is None


@pytest.mark.parametrize("shard_checksum", [True, False], ids=["v3", "v2_manifest"])
@pytest.mark.parametrize("how", ["nan", "garbage", "truncated"])
def test_a_damaged_shard_falls_back_to_the_older_checkpoint(tmp_path, how, shard_checksum):
    _save(tmp_path, 1, 2)
    newest = tmp_path / "rollout_000002"
    if not shard_checksum:  # the damage is then found by loading: bytes that do not load, NaN
        for path in (newest, tmp_path / "rollout_000001"):  # and format v2 still loads
            _as_format_v2(path)
    size = (newest / SHARD).stat().st_size
    _damage(newest, how)
    before = snapshot(tmp_path)
    states, layer, opt = _state(7)
    with pytest.warns(UserWarning) as warned:
        path, extra = resume_newest(tmp_path, states)
    assert (path, extra) == (tmp_path / "rollout_000001", {"id": 1})
    (line,) = [str(w.message) for w in warned]
    reason = {
        "truncated": f"{SHARD} has {size // 2} bytes, {size} when saved",
        "nan": f"{SHARD} differs from the saved file (CRC-32)" if shard_checksum else "model.model.weight holds NaN or inf",
    }.get(how, f"{SHARD} differs from the saved file (CRC-32)")
    if how == "garbage" and not shard_checksum:
        assert line.startswith(f"{newest}: skipped, damaged: unreadable (") and "\n" not in line
    else:
        assert line == f"{newest}: skipped, damaged: {reason}"
    # Whatever the damaged load wrote into the states, the older checkpoint's load replaced it all.
    for got, want in zip(_values(layer, opt), _values(*_state(1)[1:]), strict=True):
        assert torch.equal(got, want)
    assert snapshot(tmp_path) == before
    with pytest.raises(ValueError, match=f"checkpoint {newest} is damaged: "):
        load_checkpoint(newest, states)


def test_none_loading_is_one_error_naming_each_and_nothing_is_deleted(tmp_path):
    _save(tmp_path, 1, 2, 3)
    _damage(tmp_path / "rollout_000003", "garbage")
    (tmp_path / "rollout_000002" / "rng_rank0.pt").unlink()
    _damage(tmp_path / "rollout_000001", "nan")
    before = snapshot(tmp_path)
    with pytest.warns(UserWarning) as warned, pytest.raises(ValueError) as info:
        resume_newest(tmp_path, _state(7)[0])
    reasons = [
        f"{tmp_path / 'rollout_000003'} ({SHARD} differs from the saved file (CRC-32))",
        f"{tmp_path / 'rollout_000002'} (rng_rank0.pt is missing)",
        f"{tmp_path / 'rollout_000001'} ({SHARD} differs from the saved file (CRC-32))",
    ]
    assert str(info.value) == f"no usable checkpoint under {tmp_path}: {'; '.join(reasons)}"
    assert len(warned) == 3
    assert snapshot(tmp_path) == before


def test_nothing_to_resume_is_none_and_stale_temporary_directories_go(tmp_path):
    assert resume_newest(tmp_path / "absent", _state(0)[0]) is None
    for name in (".tmp-rollout_000003", ".tmp-rollout_000002.replaced"):
        (tmp_path / name).mkdir()
        (tmp_path / name / SHARD).write_bytes(b"half")
    (tmp_path / "notes").mkdir()
    assert resume_newest(tmp_path, _state(0)[0]) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]
    _save(tmp_path, 1)
    (tmp_path / ".tmp-rollout_000002").mkdir()
    assert resume_newest(tmp_path, _state(0)[0]) == (tmp_path / "rollout_000001", {"id": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes", "rollout_000001"]


def test_states_that_do_not_fit_raise_at_once_rather_than_falling_back(tmp_path):
    _save(tmp_path, 1, 2)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=r"rollout_000002 is incompatible .* shapes differ"):
        resume_newest(tmp_path, {"model": ModelOptimizerState(torch.nn.Linear(4, 2))})
    assert snapshot(tmp_path) == before


def test_a_non_finite_save_is_marked_skipped_and_never_prunes_the_last_good_one(tmp_path):
    _save(tmp_path, 1, keep_last=1)
    with pytest.warns(UserWarning) as warned:
        _save(tmp_path, 2, 3, keep_last=1, nan=True)
    assert [str(w.message) for w in warned] == [
        f"checkpoint {tmp_path / f'rollout_00000{i}'}: model.model.weight holds NaN or inf; it is kept, but "
        "resuming skips it and pruning does not count it"
        for i in (2, 3)
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000001", "rollout_000002", "rollout_000003"]
    doc = _manifest(tmp_path / "rollout_000003")
    assert doc["finite"] is False and doc["non_finite"] == "model.model.weight"
    states, layer, opt = _state(7)
    with pytest.warns(UserWarning) as warned:
        assert resume_newest(tmp_path, states) == (tmp_path / "rollout_000001", {"id": 1})
    assert [str(w.message) for w in warned] == [
        f"{tmp_path / f'rollout_00000{i}'}: skipped, damaged: model.model.weight held NaN or inf when saved" for i in (3, 2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(_values(layer, opt), _values(*_state(1)[1:])))
    _save(tmp_path, 4, keep_last=1)  # a usable checkpoint: the others may go
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000004"]


def test_pruning_keeps_the_checkpoint_resumed_from_until_a_usable_one_is_saved(tmp_path):
    _save(tmp_path, 1, 2)
    _damage(tmp_path / "rollout_000002", "garbage")  # same size: only a full check finds it
    with pytest.warns(UserWarning, match="rollout_000002: skipped, damaged"):
        assert resume_newest(tmp_path, _state(7)[0])[0] == tmp_path / "rollout_000001"
    with pytest.warns(UserWarning, match="holds NaN or inf"):
        _save(tmp_path, 3, keep_last=1, nan=True)
    # By the cheap check rollout 2 is the one usable checkpoint, which would have cost rollout 1.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000001", "rollout_000002", "rollout_000003"]
    _save(tmp_path, 4, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rollout_000004"]
    assert ckpt_mod._resumed is None


def _two_rank_worker(rank, store_file, root, out):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=2)

    def build(seed):
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
        return model, opt

    model, opt = build(0)
    full = lambda m: [p.full_tensor().clone() for p in m.parameters()]  # noqa: E731
    at_save = full(model)
    for i in (1, 2):
        save_checkpoint(root, i, {"model": ModelOptimizerState(model, opt)})
    if rank == 1:  # a NaN in this rank's shard only: both ranks must mark the checkpoint
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as saved_warnings:
        warnings.simplefilter("always")
        save_checkpoint(root, 3, {"model": ModelOptimizerState(model, opt)})
    cdist.barrier()
    if rank == 0:  # rank 1's file of checkpoint 2, same size, other bytes
        shard = root / "rollout_000002" / "__1_0.distcp"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    cdist.barrier()
    fresh, fresh_opt = build(5)
    with warnings.catch_warnings(record=True) as resume_warnings:
        warnings.simplefilter("always")
        path, _ = resume_newest(root, {"model": ModelOptimizerState(fresh, fresh_opt)})
    equal = all(torch.equal(a, b) for a, b in zip(full(fresh), at_save))
    torch.save(
        dict(
            path=str(path),
            equal=equal,
            saved=[str(w.message) for w in saved_warnings],
            resumed=[str(w.message) for w in resume_warnings if "skipped" in str(w.message)],
        ),
        out / f"rank{rank}.pt",
    )
    cdist.destroy()
    cdist.exit_process(0)


def test_two_ranks_agree_on_a_nan_in_one_shard_and_on_a_file_damaged_on_one_rank(tmp_path):
    import torch.multiprocessing as mp

    root = tmp_path / "ckpt"
    mp.spawn(_two_rank_worker, args=(str(tmp_path / "store"), root, tmp_path), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert [r["path"] for r in ranks] == [str(root / "rollout_000001")] * 2 and all(r["equal"] for r in ranks)
    assert _manifest(root / "rollout_000003")["non_finite"] == "model.model.0.weight"
    assert [len(r["saved"]) for r in ranks] == [1, 0]  # only rank 0 warns
    assert ranks[0]["resumed"] == [
        f"{root / 'rollout_000003'}: skipped, damaged: model.model.0.weight held NaN or inf when saved",
        f"{root / 'rollout_000002'}: skipped, damaged: __1_0.distcp differs from the saved file (CRC-32)",
    ]
    assert ranks[1]["resumed"] == []
    assert sorted(p.name for p in root.iterdir()) == ["rollout_000001", "rollout_000002", "rollout_000003"]
