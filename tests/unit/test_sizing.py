"""Sizes from free memory (colocate/sizing.py): the plan's arithmetic on given free bytes, the
`auto` values through the config, and the trainer resolving them before it builds anything."""

from __future__ import annotations

import pytest
import torch
import yaml

from colocate.config import Config
from colocate.config_loading import load_config
from colocate.models import ArchConfig, CausalLM
from colocate.sizing import (
    CPU_MAX_TOKENS,
    GIB,
    HEADROOM,
    KV_SLACK,
    LOGPROB_WORKSPACE,
    Shape,
    cpu_plan,
    needs_of,
    plan_memory,
)

# Qwen2.5-0.5B's shape, and the GRPO batch of bench/e2e.py: 16 prompts x 8 samples x (128 + 256) tokens.
QWEN_05B = ArchConfig(
    model_type="qwen2",
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    head_dim=64,
    tie_word_embeddings=True,
    attention_bias=True,
)
KV_PER_TOKEN = 2 * 24 * 2 * 64 * 2  # K and V, layers, KV heads, head_dim, bf16


def _cfg(offload: bool = False, **rollout) -> Config:
    cfg = Config()
    r = cfg.rollout
    r.rollout_batch_size, r.n_samples_per_prompt, r.max_prompt_len, r.max_response_len = 16, 8, 128, 256
    for key, value in rollout.items():
        setattr(r, key, value)
    cfg.offload.offload_train = cfg.offload.offload_rollout = offload
    return cfg


@pytest.mark.parametrize(
    "family",
    [
        dict(model_type="qwen2", tie_word_embeddings=True, attention_bias=True),
        dict(model_type="qwen3", tie_word_embeddings=False, qk_norm=True),
        dict(model_type="llama", tie_word_embeddings=False),
    ],
)
def test_shape_counts_the_models_parameters(family):
    mcfg = ArchConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=80,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **family,
    )
    with torch.device("meta"):
        model = CausalLM(mcfg)
    assert Shape.of(mcfg).num_params == sum(p.numel() for n, p in model.named_parameters())
    lora = Shape.of(mcfg, lora_rank=4, lora_targets=("q_proj", "down_proj"))
    assert lora.lora_params == 3 * 4 * ((32 + 32) + (80 + 32))  # layers x rank x (in + out) per target


def test_ample_memory_trains_the_step_in_one_micro_batch_without_recompute():
    shape, needs = Shape.of(QWEN_05B), needs_of(_cfg(offload=True), 1, 2, True, None)
    assert needs.step_tokens == 128 * 384 and needs.kv_tokens == 128 * 384
    plan = plan_memory(shape, needs, 139 * GIB, 140 * GIB, KV_PER_TOKEN)
    assert plan.max_tokens_per_gpu == 49152 and plan.recompute_rest == "none"
    # The KV cache holds one sampling round at full length, with slack, and no more.
    assert plan.kv_cache_tokens == int(49152 * KV_PER_TOKEN * KV_SLACK) // KV_PER_TOKEN
    assert "the step's tokens in one micro-batch" in plan.summary()


def test_tighter_memory_recomputes_more_before_splitting_the_step():
    shape, needs = Shape.of(QWEN_05B), needs_of(_cfg(offload=False), 1, 2, True, None)
    rests = [plan_memory(shape, needs, free * GIB, 140 * GIB, KV_PER_TOKEN).recompute_rest for free in (139, 79, 50)]
    assert rests == ["none", "ops", "mlp"]
    small = plan_memory(shape, needs, 30 * GIB, 80 * GIB, KV_PER_TOKEN)
    assert small.recompute_rest == "mlp" and 384 <= small.max_tokens_per_gpu < 49152
    # What it chose fits: state, engine, workspace and the micro-batch's activations within the room.
    assert small.forecast["memory/plan/train_peak_gib"] <= (30 - HEADROOM * 80) + 1e-6


def test_no_room_for_a_kv_cache_is_one_line_naming_the_settings():
    needs = needs_of(_cfg(offload=False), 1, 2, True, None)
    with pytest.raises(
        ValueError,
        match=r"^rollout.gpu_memory_fraction auto: 12.0 GiB free leave no room for a "
        r"KV cache .* turn on offload.offload_train, use more GPUs, or set "
        r"rollout.gpu_memory_fraction$",
    ):
        plan_memory(Shape.of(QWEN_05B), needs, 12 * GIB, 80 * GIB, KV_PER_TOKEN)


def test_sglang_gets_the_fraction_that_leaves_the_planned_kv_cache():
    """SGLang's KV cache: free memory after its weights, less (1 - mem_fraction_static) of the device."""
    shape, needs = Shape.of(QWEN_05B), needs_of(_cfg(offload=False), 1, 2, True, None)
    free, total = 60 * GIB, 80 * GIB
    plan = plan_memory(shape, needs, free, total, KV_PER_TOKEN)
    trainer_state = shape.num_params * (16 + 2)
    after_weights = free - trainer_state - shape.num_params * 2
    assert after_weights - (1 - plan.static_fraction) * total == pytest.approx(
        plan.kv_cache_tokens * KV_PER_TOKEN, abs=KV_PER_TOKEN
    )


def test_the_forecast_adds_up():
    """Offload off: the trainer's state (16 bytes a parameter and a gathered bf16 copy), the engine's
    weights and KV cache, the log-prob workspace and the micro-batch's activations."""
    shape, needs = Shape.of(QWEN_05B), needs_of(_cfg(offload=False), 1, 2, True, None)
    plan = plan_memory(shape, needs, 140 * GIB, 140 * GIB, KV_PER_TOKEN)
    f = plan.forecast
    held = shape.num_params * (16 + 2) + shape.num_params * 2 + f["memory/plan/kv_cache_gib"] * GIB
    activations = plan.max_tokens_per_gpu * f["memory/plan/activation_mib_per_token"] * (1 << 20)
    assert f["memory/plan/train_peak_gib"] * GIB == pytest.approx(held + LOGPROB_WORKSPACE + activations, rel=1e-9)


def test_offloading_the_engine_frees_its_kv_cache_for_training():
    """Offload off, the engine's weights and KV cache stay through training: the least free memory
    at which the step fits with "ops" recomputed is larger by exactly their bytes."""
    shape = Shape.of(QWEN_05B)

    def least_free(offload: bool) -> float:
        needs = needs_of(_cfg(offload=offload), 1, 2, True, None)
        free = 20 * GIB
        while plan_memory(shape, needs, free, 80 * GIB, KV_PER_TOKEN).recompute_rest == "mlp":
            free += 1 << 20
        return free

    kv = plan_memory(shape, needs_of(_cfg(), 1, 2, True, None), 80 * GIB, 80 * GIB, KV_PER_TOKEN)
    engine = shape.num_params * 2 + kv.forecast["memory/plan/kv_cache_gib"] * GIB
    assert least_free(False) - least_free(True) == pytest.approx(engine, abs=1 << 20)


def test_the_users_settings_stand():
    cfg = _cfg(gpu_memory_fraction=0.3)
    cfg.train.max_tokens_per_gpu = 8192
    plan = plan_memory(Shape.of(QWEN_05B), needs_of(cfg, 1, 2, True, ("none",) * 24), 70 * GIB, 80 * GIB, KV_PER_TOKEN)
    assert plan.max_tokens_per_gpu == 8192 and plan.recompute_rest is None and plan.kv_cache_tokens is None
    assert "train.max_tokens_per_gpu" not in plan.reason and "KV cache" not in plan.reason


def test_ranks_share_the_step_and_the_kv_cache():
    needs = needs_of(_cfg(), 4, 2, False, None)
    assert needs.step_tokens == 32 * 384 and needs.kv_tokens == 32 * 384 and needs.world_size == 4


def test_cpu_takes_the_step_up_to_a_cap():
    assert cpu_plan(needs_of(_cfg(), 1, 4, True, None)).max_tokens_per_gpu == min(49152, CPU_MAX_TOKENS)
    small = _cfg()
    small.rollout.rollout_batch_size = 2
    assert cpu_plan(needs_of(small, 1, 4, True, None)).max_tokens_per_gpu == 16 * 384


def test_auto_and_numbers_load_from_yaml_and_flags(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"max_tokens_per_gpu": "auto"}, "rollout": {"gpu_memory_fraction": 0.4}}))
    cfg = load_config(["--config", str(path)])
    assert cfg.train.max_tokens_per_gpu == "auto" and cfg.rollout.gpu_memory_fraction == 0.4
    cfg = load_config(["--config", str(path), "--train.max_tokens_per_gpu", "2048", "--rollout.gpu_memory_fraction", "auto"])
    assert cfg.train.max_tokens_per_gpu == 2048 and cfg.rollout.gpu_memory_fraction == "auto"
    assert Config().train.max_tokens_per_gpu == "auto" and Config().model.recompute_rest == "auto"


@pytest.mark.parametrize(
    "data, message",
    [
        ({"train": {"max_tokens_per_gpu": "lots"}}, "train.max_tokens_per_gpu must be int"),
        ({"train": {"max_tokens_per_gpu": 0}}, "train.max_tokens_per_gpu"),
        ({"rollout": {"gpu_memory_fraction": 1.5}}, "rollout.gpu_memory_fraction"),
    ],
)
def test_bad_sizes_are_refused(tmp_path, data, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=message):
        load_config(["--config", str(path)])
