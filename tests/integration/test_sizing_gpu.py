"""The memory plan's forecast against the allocator's real peak of a training step on the GPU: it
must cover the peak (a plan that fits on paper must fit on the device) without overstating it by
more than half (or `auto` would split steps and recompute for nothing)."""

import pytest
import torch

from colocate.config import Config
from colocate.models import ArchConfig
from colocate.rollout.sample import Sample
from colocate.sizing import GIB

pytestmark = pytest.mark.gpu

GROUP, NUM_GROUPS, PROMPT, RESPONSE = 4, 10, 128, 256
SHAPE = ArchConfig(
    model_type="qwen2",
    vocab_size=32768,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    tie_word_embeddings=True,
    attention_bias=True,
)


@pytest.fixture(scope="module")
def info():
    from colocate import dist

    yield dist.init()
    dist.destroy()


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for group in range(NUM_GROUPS):
        prompt = torch.randint(2, SHAPE.vocab_size, (PROMPT,), generator=g).tolist()
        for j in range(GROUP):
            response = torch.randint(2, SHAPE.vocab_size, (RESPONSE,), generator=g).tolist()
            out.append(
                Sample(prompt, response, [0.0] * RESPONSE, [1] * RESPONSE, group, j, reward=float(torch.rand(1, generator=g)))
            )
    return out


@pytest.mark.parametrize("rest", ["none", "ops", "mlp"])
def test_forecast_covers_the_measured_training_peak(info, rest, tmp_path):
    from colocate.trainer import Trainer

    cfg = Config()
    cfg.model.path = str(tmp_path)  # unused: the model is built from SHAPE with random weights
    cfg.model.recompute_rest = rest
    r = cfg.rollout
    r.rollout_batch_size, r.n_samples_per_prompt = NUM_GROUPS, GROUP
    r.max_prompt_len, r.max_response_len = PROMPT, RESPONSE
    cfg.offload.offload_rollout = True  # no engine beside the trainer in the forecast either
    cfg.train.lr, cfg.train.num_rollout = 1e-5, 1
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = Trainer(cfg, info, model_config=SHAPE)
    plan = trainer.memory_plan
    assert plan.max_tokens_per_gpu == NUM_GROUPS * GROUP * (PROMPT + RESPONSE)  # one micro-batch
    trainer.train(_samples(), 0)
    peak = torch.cuda.max_memory_allocated() - base
    forecast = plan.forecast["memory/plan/train_peak_gib"] * GIB
    print(f"{rest}: peak {peak / GIB:.2f} GiB, forecast {forecast / GIB:.2f} GiB ({peak / forecast:.2f})")
    assert 0.5 * forecast <= peak <= forecast
    del trainer
