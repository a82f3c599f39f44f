"""tools/model_sizes.py's table is docs/model-sizes.md's, and it follows the sizing plan's arithmetic."""

from pathlib import Path

from colocate.models import ArchConfig
from colocate.sizing import GIB, HEADROOM, Shape
from tools.model_sizes import CARDS, SHAPES, TARGETS, forecast, table

ROOT = Path(__file__).resolve().parents[2]


def _shape(name, rank=0):
    return Shape.of(ArchConfig(**SHAPES[name], eos_token_id=0), rank, TARGETS if rank else ())


def test_the_docs_page_holds_the_tools_table():
    assert table() in (ROOT / "docs" / "model-sizes.md").read_text()


def test_full_training_needs_sixteen_bytes_a_parameter():
    shape = _shape("Qwen3-8B")
    assert 8.1e9 < shape.num_params < 8.3e9
    assert shape.num_params * 16 > CARDS["80 GB"] * GIB  # fp32 masters, gradients, two moments
    assert not forecast(shape, CARDS["80 GB"], 0, False)["fits"]
    assert forecast(shape, CARDS["141 GB"], 0, False)["fits"]


def test_fp8_rollout_frees_the_engines_projection_bytes_for_the_kv_cache():
    shape = _shape("Qwen3-8B", 64)
    bf16, fp8 = (forecast(shape, CARDS["80 GB"], 64, on) for on in (False, True))
    freed = (shape.engine_weight_bytes(2, False) - shape.engine_weight_bytes(2, True)) / GIB
    assert abs(fp8["kv_gib"] - bf16["kv_gib"] - freed) < 1e-6
    assert 6.0 < freed < 7.0  # 6.9B projection parameters, one byte each instead of two, less their scales
    # Offloaded while generating, the trainer keeps only the adapters and their AdamW state there.
    usable = CARDS["80 GB"] * GIB * (1 - HEADROOM)
    expected = usable - shape.lora_params * 16 - shape.engine_weight_bytes(2, False)
    assert abs(bf16["kv_gib"] * GIB - expected) < 2  # the plan rounds to whole bytes
