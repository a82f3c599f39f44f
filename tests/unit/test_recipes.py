from pathlib import Path

import pytest

from colocate.config_loading import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_validates(path):
    cfg = load_config(["--config", str(path)])
    assert cfg.train.num_rollout > 0 and cfg.rollout.n_samples_per_prompt >= 1
    cfg.check_world_size(8 if "dapo" in path.name else 1)


def test_recipes_cover_the_documented_algorithms():
    by_name = {p.name: load_config(["--config", str(p)]) for p in CONFIGS}
    assert by_name["qwen2.5-0.5b-ppo.yaml"].algorithm.use_critic
    dapo = by_name["qwen3-4b-dapo.yaml"]
    assert dapo.rollout.dynamic_sampling and dapo.algorithm.eps_clip_high > dapo.algorithm.eps_clip
    assert dapo.algorithm.overlong_buffer_len
    assert by_name["qwen2.5-0.5b-grpo-gsm8k.yaml"].rollout.reward == "math"
