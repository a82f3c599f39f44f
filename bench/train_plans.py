"""What bench/trainer_throughput.py measures: the model shapes, the plans tried on each, the trainer
config of a plan, the FLOPs that MFU counts, and the rollout-like batches the steps train on
(bench/colocation.py shares the shapes, bench/true_on_policy.py the plans and batches)."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch

from colocate.config import Config
from colocate.models import ArchConfig, CausalLM
from colocate.rollout.sample import Sample

GROUP = 4
STEP_TOKENS = 131072
"""Tokens of one optimizer step: an RL rollout batch, e.g. 32 samples of up to 4k tokens."""
SHAPES = {
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960),
}


class Plan(NamedTuple):
    """Fraction of blocks fully recomputed, the others' mode, whether the full ones keep attention's
    output (colocate.trainer.parallelize.ActivationCheckpointing), the micro-batch token budget,
    train.keep_gathered (gathered parameters kept through a step, gradients reduced once), and
    whether the optimizer state goes to the host between steps, as in the colocated loop with
    offload.offload_train: it streams back during each step's last backward (untimed offloads)."""

    full: float
    rest: str
    keep_attention: bool
    max_tokens: int
    keep_gathered: bool = True
    offload: bool = False

    def fields(self) -> dict:
        return dict(
            full_fraction=round(self.full, 4),
            rest=self.rest,
            full_keeps_attention=self.keep_attention,
            max_tokens_per_gpu=self.max_tokens,
            keep_gathered=self.keep_gathered,
            offload=self.offload,
        )

    def label(self) -> str:
        return (
            f"full {self.full:.2f}{' keeping attention' if self.keep_attention else ''} + {self.rest}, "
            f"{self.max_tokens} tok/mb{'' if self.keep_gathered else ', resharded'}"
            f"{', optimizer state offloaded' if self.offload else ''}"
        )

    @staticmethod
    def of(run: dict) -> "Plan":
        return Plan(
            run["full_fraction"],
            run["rest"],
            run["full_keeps_attention"],
            run["max_tokens_per_gpu"],
            run.get("keep_gathered", True),
            run.get("offload", False),
        )


# Most informative first; each block kind ("none", "ops", "mlp", "full", "attention") compiles once,
# at its first use. The first 1.5B plan ignores the memory limit on purpose: it is the no-recompute
# ceiling; the second is the best one with the optimizer state resident. At 32k tokens a block keeps
# about 1.7 GB under "ops", 0.5 under "mlp" and 0.2 under "attention". With the optimizer state
# offloaded between steps (11.5 GiB at 1.5B) smaller micro-batches pay off: activations shrink with
# the tokens, so fewer blocks need recomputing, and a 20-22k-token GEMM loses little against 32k.
GRID = {
    "1.5b": [
        Plan(0.0, "none", False, 32768),
        Plan(0.82, "ops", True, 32768),
        Plan(0.11, "ops", True, 22528, offload=True),
        Plan(0.18, "ops", True, 22528, offload=True),
        Plan(0.0, "ops", True, 20480, offload=True),
        Plan(0.07, "ops", True, 20480, offload=True),
        Plan(0.25, "ops", True, 26624, offload=True),
        Plan(0.46, "ops", True, 32768, offload=True),
    ],
    "0.5b": [Plan(0.0, "none", False, 32768), Plan(0.0, "none", False, 16384)],
}


def trainer_config(num_samples: int, plan: Plan, method: str, compiled: bool) -> Config:
    """The trainer's config for steps of `num_samples` samples under `plan`, offloading by `method`."""
    cfg = Config()
    cfg.train.keep_gathered = plan.keep_gathered
    cfg.model.compile = compiled
    cfg.rollout.n_samples_per_prompt, cfg.rollout.rollout_batch_size = GROUP, num_samples // GROUP
    cfg.train.max_tokens_per_gpu, cfg.train.lr, cfg.train.num_rollout = plan.max_tokens, 1e-6, 1000
    cfg.offload.method = method
    return cfg


def best_plan(entry: dict) -> dict | None:
    """Of one model's entry in the results, the fastest plan within the memory limit (any plan when
    the model has no limit)."""
    runs = [r for r in entry["ours"] if "mfu" in r]
    if entry.get("memory_limit_gib") is not None:
        runs = [r for r in runs if r["fits"]]
    return max(runs, key=lambda r: r["mfu"]) if runs else None


def model_config(name: str) -> ArchConfig:
    s = SHAPES[name]
    return ArchConfig(
        model_type="qwen2",
        vocab_size=151936,
        head_dim=s["hidden_size"] // s["num_attention_heads"],
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        tie_word_embeddings=True,
        attention_bias=True,
        **s,
    )


def num_params(cfg: ArchConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in CausalLM(cfg).parameters())


def model_flops(cfg: ArchConfig, seq_lengths: list[int], num_logits: int) -> tuple[float, float]:
    """(PaLM FLOPs, causal FLOPs) of one forward + backward over these sequences."""
    head = cfg.vocab_size * cfg.hidden_size
    tables = head * (1 if cfg.tie_word_embeddings else 2)
    dense = 6.0 * (num_params(cfg) - tables) * sum(seq_lengths) + 6.0 * head * num_logits
    attn = 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * sum(n * n for n in seq_lengths)
    return dense + attn, dense + attn / 2


def make_samples(rng: random.Random, vocab: int, step_tokens: int) -> list[Sample]:
    """Groups of GROUP samples (a shared 32..64-token prompt, 128..4096 response tokens each),
    as many as fit in `step_tokens`."""
    samples, total = [], 0
    while True:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(32, 64))]
        lengths = [rng.randint(128, 4096) for _ in range(GROUP)]
        if samples and total + sum(len(prompt) + n for n in lengths) > step_tokens:
            return samples
        group = len(samples) // GROUP
        for j, n in enumerate(lengths):
            samples.append(
                Sample(prompt, [rng.randrange(vocab) for _ in range(n)], [0.0] * n, [1] * n, group, j, reward=rng.random())
            )
            total += len(prompt) + n
