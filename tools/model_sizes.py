"""What fits on one GPU, by model shape and card: the start-up's memory forecast (colocate/sizing.py)
for common shapes, printed as the table of docs/model-sizes.md.

For each shape and setup (full training, LoRA rank 64, LoRA with FP8 rollout), both halves
offloaded between phases (offload.offload_train and offload_rollout, the setting that fits the
most), the plan (`plan_memory`, asked for more than fits) gives: the KV cache room while the engine
generates, beside the engine's weights and what the trainer keeps on the device; and the tokens a
training micro-batch can hold with every block recomputed (model.gradient_checkpointing). A shape
fits when there is room for a KV cache and a micro-batch of one sample of 1024 + 1024 tokens.
The forecast overstates a step's peak (by 1.1-1.4x in the GPU tests of the sizing,
docs/benchmarks/2026-12-sizing.md), so a borderline entry may fit; measured runs are listed in the
docs page beside it.

Run: python -m tools.model_sizes
"""

from __future__ import annotations

import torch

from colocate.kernels.paged_attention import kv_bytes_per_token
from colocate.models import ArchConfig
from colocate.sizing import GIB, HEADROOM, RunNeeds, Shape, plan_memory

QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128, qk_norm=True)
SHAPES = {
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
                         tie_word_embeddings=True, attention_bias=True),
    "Qwen2.5-1.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, head_dim=128,
                         tie_word_embeddings=True, attention_bias=True),
    "Qwen3-4B": dict(QWEN3, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=True),
    "Qwen3-8B": dict(QWEN3, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     tie_word_embeddings=False),
    "Qwen3-14B": dict(QWEN3, hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
                      tie_word_embeddings=False),
    "Qwen3-32B": dict(QWEN3, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                      tie_word_embeddings=False),
}  # fmt: skip
CARDS = {"24 GB": 24.0, "40 GB": 40.0, "80 GB": 79.6, "141 GB": 139.8}
"""Device memory in GiB as torch reports it (an H100 80GB: 79.6 GiB, an H200: 139.8)."""
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SETUPS = {"full": (0, False), "LoRA r64": (64, False), "LoRA r64, FP8 rollout": (64, True)}
SAMPLE = 2048
"""One sample of 1024 prompt and 1024 response tokens: the smallest micro-batch."""


def forecast(shape: Shape, total_gib: float, lora_rank: int, fp8: bool) -> dict:
    """The start-up's plan (colocate/sizing.py) for this shape on an idle card of `total_gib`, asked
    for more KV cache and training tokens than can fit, so that it reports the room there is."""
    huge = 1 << 40
    needs = RunNeeds(
        step_tokens=huge, sample_tokens=SAMPLE, kv_tokens=huge, world_size=1, itemsize=2, fp8_weights=fp8,
        keep_gathered=False, offload_train=True, offload_rollout=True, critic=False, lora=lora_rank > 0,
        modes=("full",) * shape.num_layers, max_tokens=None, kv_fraction=None,
    )  # fmt: skip
    total = int(total_gib * GIB)
    try:
        plan = plan_memory(shape, needs, total, total, kv_bytes_per_token=1)
    except ValueError:  # no KV cache fits beside the engine's weights
        return {"kv_gib": 0.0, "train_tokens": 0, "fits": False}
    peak = plan.forecast["memory/plan/train_peak_gib"] * GIB
    fits = peak <= total * (1 - HEADROOM)  # a micro-batch of one sample fits
    return {"kv_gib": plan.forecast["memory/plan/kv_cache_gib"], "train_tokens": plan.max_tokens_per_gpu, "fits": fits}


def table() -> str:
    """docs/model-sizes.md's table: per shape and setup, each card's KV room and training tokens."""
    lines = ["| shape | setup | " + " | ".join(CARDS) + " |", "| --- | --- | " + " | ".join("---" for _ in CARDS) + " |"]
    for name, fields in SHAPES.items():
        cfg = ArchConfig(**fields, eos_token_id=0)
        for setup, (rank, fp8) in SETUPS.items():
            shape = Shape.of(cfg, rank, TARGETS if rank else ())
            token_bytes = cfg.num_hidden_layers * kv_bytes_per_token(
                cfg.num_key_value_heads, cfg.head_dim, torch.float8_e4m3fn if fp8 else torch.bfloat16
            )
            cells = []
            for total in CARDS.values():
                f = forecast(shape, total, rank, fp8)
                kv_tokens = f["kv_gib"] * GIB / token_bytes
                cells.append(
                    f"{f['kv_gib']:.0f} GiB / {kv_tokens / 1e3:,.0f}k; {f['train_tokens'] / 1e3:,.0f}k" if f["fits"] else "no"
                )
            lines.append(f"| {name} | {setup} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    print(table())


if __name__ == "__main__":
    main()
