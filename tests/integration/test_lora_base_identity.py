"""Which base LoRA adapters belong to, by its weights: the fingerprint reads a few kilobytes per
file yet sees a changed header or a changed byte where it samples, and not where the files lie;
resuming and exporting refuse a base whose weights differ, and adapters saved without a
fingerprint still load, with a warning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from colocate.checkpoint import ModelOptimizerState, load_checkpoint, save_checkpoint
from colocate.export import export
from colocate.lora.identity import NUM_SAMPLES, LoRASpec, sampled_ranges, weights_fingerprint
from colocate.models import from_pretrained
from colocate.trainer.lora import adapted_modules, add_adapters, init_adapters_
from tests.disk import snapshot
from tests.helpers import write_hf_model

SPEC = LoRASpec(4, 8.0, 0.0, ("q_proj", "v_proj"))
WEIGHTS = "model.safetensors"


def _ranges(model_dir: Path) -> list[tuple[int, int]]:
    file = model_dir / WEIGHTS
    header_size = int.from_bytes(file.read_bytes()[:8], "little")
    return sampled_ranges(8 + header_size, file.stat().st_size)


def _flip(file: Path, offset: int) -> None:
    data = bytearray(file.read_bytes())
    data[offset] ^= 0x01
    file.write_bytes(bytes(data))


def _sampled_byte(model_dir: Path) -> int:
    offset, length = _ranges(model_dir)[3]
    return offset + length // 2


def _model(model_dir: Path):
    model = from_pretrained(model_dir, dtype="float32")
    add_adapters(model, SPEC)
    init_adapters_(model, seed=3)
    return model


def _states(model_dir: Path, adapters: dict | None = None) -> dict:
    return {"model": ModelOptimizerState(_model(model_dir), adapters=adapters or SPEC.describe(model_dir))}


@pytest.fixture
def trained(tmp_path):
    """A base model directory and a checkpoint of adapters (B not zero) trained on it."""
    model_dir, _ = write_hf_model(tmp_path, "qwen2")
    model = _model(model_dir)
    with torch.no_grad():
        for _, m in adapted_modules(model):
            m.lora_B.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    states = {"model": ModelOptimizerState(model, adapters=SPEC.describe(model_dir))}
    return model_dir, save_checkpoint(tmp_path / "ckpt", 0, states, model_dir=model_dir)


def test_the_fingerprint_sees_header_and_sampled_bytes_not_the_place(tmp_path):
    model_dir, _ = write_hf_model(tmp_path, "qwen2")
    fingerprint = weights_fingerprint(model_dir)
    copy = Path(shutil.copytree(model_dir, tmp_path / "elsewhere"))
    assert weights_fingerprint(copy) == fingerprint
    file, ranges = copy / WEIGHTS, _ranges(copy)
    assert len(ranges) == NUM_SAMPLES  # the data is larger than the samples: not read whole
    _flip(file, _sampled_byte(copy))
    assert weights_fingerprint(copy) != fingerprint
    _flip(file, _sampled_byte(copy))
    assert weights_fingerprint(copy) == fingerprint
    between = ranges[3][0] + ranges[3][1]  # unread: what keeping it cheap costs
    assert between < ranges[4][0]
    _flip(file, between)
    assert weights_fingerprint(copy) == fingerprint
    _flip(file, between)
    data = file.read_bytes()
    assert data.count(b'"F32"') > 1
    file.write_bytes(data.replace(b'"F32"', b'"I32"', 1))  # same size, another header
    assert weights_fingerprint(copy) != fingerprint


def test_resuming_onto_other_weights_is_refused_and_an_identical_copy_accepted(trained, tmp_path):
    model_dir, ckpt = trained
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    load_checkpoint(ckpt, _states(copy))
    _flip(copy / WEIGHTS, _sampled_byte(copy))  # config.json unchanged
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        load_checkpoint(ckpt, _states(copy))
    assert str(info.value) == (
        f"the checkpoint's LoRA adapters were trained on the base {model_dir} (weights fingerprint "
        f"{weights_fingerprint(model_dir)[:12]}), not on this run's base {copy} (weights fingerprint "
        f"{weights_fingerprint(copy)[:12]}): same config.json, other weights"
    )
    assert snapshot(tmp_path) == before


def test_adapters_saved_without_a_fingerprint_load_with_a_warning(tmp_path):
    model_dir, _ = write_hf_model(tmp_path, "qwen2")
    older = {k: v for k, v in SPEC.describe(model_dir).items() if k != "base_weights_fingerprint"}
    ckpt = save_checkpoint(tmp_path / "ckpt", 0, _states(model_dir, older), model_dir=model_dir)
    with pytest.warns(UserWarning) as warned:
        load_checkpoint(ckpt, _states(model_dir))
    assert [str(w.message) for w in warned] == [
        f"the LoRA adapters of the base {model_dir} were saved without a fingerprint of its weights: that "
        "base is checked by its config.json only"
    ]
    with pytest.warns(UserWarning, match="checked by its config.json only"):
        export(ckpt, tmp_path / "merged", dtype="float32")


@pytest.mark.parametrize("adapter_only", [False, True], ids=["merged", "adapter_only"])
def test_export_refuses_a_base_whose_weights_changed(trained, tmp_path, adapter_only):
    model_dir, ckpt = trained
    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    out = export(ckpt, tmp_path / "out", dtype="float32", base=copy, adapter_only=adapter_only)
    if adapter_only:
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(copy)
    trained_fingerprint = weights_fingerprint(model_dir)
    for base in (copy, None):  # --base, then the base as trained, changed where it lies
        _flip((base or model_dir) / WEIGHTS, _sampled_byte(model_dir))
        changed = base or model_dir
        before = snapshot(tmp_path)
        with pytest.raises(ValueError) as info:
            export(ckpt, tmp_path / "refused", base=base, adapter_only=adapter_only)
        assert str(info.value) == (
            f"base model {changed} is not the one the adapters were trained on ({model_dir}): its weights differ "
            f"(fingerprint {weights_fingerprint(changed)[:12]}, {trained_fingerprint[:12]} when trained)"
        )
        assert snapshot(tmp_path) == before
