"""Which adapters, on which base: `LoRASpec`, the adapters' parameter names, and the identity of the
base model.

Adapters fit only the base they were trained on. `LoRASpec.describe` names it by its path, the
SHA-256 of its config.json and `weights_fingerprint`, a hash of each safetensors file's name, size,
header and a few fixed byte ranges of its tensor data, cheap for any model size; resuming
(`check_same_adapters`, colocate/checkpoint.py) and colocate.export compare them.
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

from colocate.models.loading import safetensors_files

ADAPTER_PARTS = ("lora_A", "lora_B")
"""The modules an adapted projection gains (peft's names, less peft's adapter name)."""
NUM_SAMPLES = 8
"""Byte ranges of each safetensors file's tensor data that `weights_fingerprint` reads."""
SAMPLE_BYTES = 4096
"""Length of each of them."""


@dataclass(frozen=True)
class LoRASpec:
    """What `add_adapters` (colocate/trainer/lora.py) builds: `model.lora_*` of the config."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_config(cls, model_cfg) -> "LoRASpec | None":
        """The spec of a colocate.config.ModelConfig, or None when LoRA is off (rank 0)."""
        if not model_cfg.lora_rank:
            return None
        return cls(
            model_cfg.lora_rank, float(model_cfg.lora_alpha), float(model_cfg.lora_dropout), tuple(model_cfg.lora_target_modules)
        )

    def describe(self, base_path: str | Path) -> dict:
        """JSON-able identity of the adapters and of the base they belong to (saved in checkpoints)."""
        return {
            **asdict(self),
            "target_modules": list(self.target_modules),
            "base_path": str(base_path),
            "base_config_sha256": config_sha256(base_path),
            "base_weights_fingerprint": weights_fingerprint(base_path),
        }


def is_adapter(name: str) -> bool:
    """Whether a parameter name belongs to an adapter (`...proj.lora_A.weight`)."""
    return any(f".{part}." in f".{name}" for part in ADAPTER_PARTS)


def config_sha256(model_dir: str | Path) -> str:
    """SHA-256 of a model directory's config.json: which base a checkpoint's adapters belong to."""
    return hashlib.sha256((Path(model_dir) / "config.json").read_bytes()).hexdigest()


def sampled_ranges(data_start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the bytes of a safetensors file's tensor data (from `data_start` to
    `size`) that `weights_fingerprint` reads: all of it when short, else NUM_SAMPLES ranges of
    SAMPLE_BYTES spread evenly from its first byte to its last."""
    span = size - data_start
    if span <= NUM_SAMPLES * SAMPLE_BYTES:
        return [(data_start, max(span, 0))]
    step = (span - SAMPLE_BYTES) // (NUM_SAMPLES - 1)
    return [(data_start + i * step, SAMPLE_BYTES) for i in range(NUM_SAMPLES)]


def weights_fingerprint(model_dir: str | Path) -> str:
    """SHA-256 over each safetensors file of a model directory (as loading finds them): its name,
    size, JSON header (every tensor's name, dtype, shape and place) and `sampled_ranges` of its
    data. A copy of the same files elsewhere gives the same fingerprint; other weights of the same
    shapes almost surely do not (an edit between the sampled ranges is not seen). It reads each
    file's header and NUM_SAMPLES * SAMPLE_BYTES (32 KiB) of its data, however large the file."""
    digest = hashlib.sha256()
    for file in safetensors_files(model_dir):
        size = file.stat().st_size
        with open(file, "rb") as f:
            header_size = int.from_bytes(f.read(8), "little")
            digest.update(f"{file.name}\0{size}\0".encode())
            digest.update(f.read(min(header_size, size)))
            for offset, length in sampled_ranges(8 + header_size, size):
                f.seek(offset)
                digest.update(f.read(length))
    return digest.hexdigest()


def same_base_weights(saved: dict, fingerprint: str) -> bool:
    """Whether saved adapters' base had the weights of `fingerprint` (weights_fingerprint). Adapters
    saved without a fingerprint pass, with a warning that their base was checked by config.json only."""
    if "base_weights_fingerprint" not in saved:
        warnings.warn(
            f"the LoRA adapters of the base {saved['base_path']} were saved without a fingerprint of "
            "its weights: that base is checked by its config.json only",
            stacklevel=3,
        )
        return True
    return saved["base_weights_fingerprint"] == fingerprint


def check_same_adapters(saved: dict, current: dict) -> None:
    """ValueError naming both bases when saved adapters belong to another base model (its
    config.json or its weights differ), or naming the setting when rank, alpha or target modules
    differ."""
    if saved["base_config_sha256"] != current["base_config_sha256"]:
        raise ValueError(
            f"the checkpoint's LoRA adapters were trained on the base {saved['base_path']} "
            f"(config.json SHA-256 {saved['base_config_sha256'][:12]}), not on this run's base "
            f"{current['base_path']} (config.json SHA-256 {current['base_config_sha256'][:12]})"
        )
    if not same_base_weights(saved, current["base_weights_fingerprint"]):
        raise ValueError(
            f"the checkpoint's LoRA adapters were trained on the base {saved['base_path']} "
            f"(weights fingerprint {saved['base_weights_fingerprint'][:12]}), not on this run's "
            f"base {current['base_path']} (weights fingerprint "
            f"{current['base_weights_fingerprint'][:12]}): same config.json, other weights"
        )
    for key in ("rank", "alpha", "target_modules"):
        if saved[key] != current[key]:
            raise ValueError(
                f"the checkpoint's LoRA adapters have {key} {saved[key]!r}, this run's model.lora_{key} is {current[key]!r}"
            )
