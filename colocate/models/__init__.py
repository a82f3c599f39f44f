"""Plain-torch model families with HF parameter names, shared by the trainer and the native engine."""

from colocate.models.config import ARCHITECTURES, ArchConfig
from colocate.models.loading import (
    from_config,
    from_pretrained,
    iter_safetensors,
    load_weights,
    resolve_dtype,
    save_pretrained,
)
from colocate.models.transformer import CausalLM, packing_from_lengths

__all__ = [
    "ARCHITECTURES",
    "CausalLM",
    "ArchConfig",
    "from_config",
    "from_pretrained",
    "iter_safetensors",
    "load_weights",
    "packing_from_lengths",
    "resolve_dtype",
    "save_pretrained",
]
