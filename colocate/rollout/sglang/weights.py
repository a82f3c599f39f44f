"""Weight payloads for the SGLang engine, and the bookkeeping that proves a sync was complete.

Weights reach SGLang's scheduler process as CUDA IPC handles: per dtype, the tensors of one
`update_weights` call are concatenated into one uint8 buffer (SGLang's FlattenedTensorBucket),
and the dict {"flattened_tensor", "metadata"} is pickled with SGLang's MultiprocessingSerializer.
The scheduler opens the handle, copies the tensors into its parameters through the model's
`load_weights` (HF names in, q/k/v and gate/up stacking done there) and drops the handle, so the
buffer must stay alive until the call returns.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open

from colocate.models.loading import safetensors_files

BUFFER_DEVICE_TYPE = "cuda"
"""Where weight buffers must live: CUDA IPC exports device memory only."""
FLATTENED_BUCKET_FORMAT = "flattened_bucket"
BUCKET_KEYS = ("flattened_tensor", "metadata")
"""Keys of the payload dict the scheduler reads."""
TIED_HEAD = "lm_head.weight"
NON_PARAMETER_SUFFIXES = (".rotary_emb.inv_freq",)
"""Buffers some older checkpoints store; the engine recomputes them and nobody sends them."""


def ties_word_embeddings(model_path: str | Path) -> bool:
    """Whether config.json ties lm_head to the embeddings (absent means untied, as in Llama/Qwen)."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    return bool(config.get("tie_word_embeddings", False))


def checkpoint_parameter_names(model_path: str | Path, tied: bool) -> frozenset[str] | None:
    """HF names every full sync must send: the tensors of the checkpoint, less a tied lm_head.

    None when the directory holds no safetensors (a config-only directory for `load_dummy`);
    the first completed sync then defines the set.
    """
    try:
        files = safetensors_files(model_path)
    except FileNotFoundError:
        return None
    names = set()
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names.update(f.keys())
    return frozenset(n for n in names if not (tied and n == TIED_HEAD) and not n.endswith(NON_PARAMETER_SUFFIXES))


def check_buffer(name: str, tensor: torch.Tensor) -> None:
    """The caller hands us plain, full, contiguous device tensors (gathered, not sharded)."""
    from torch.distributed.tensor import DTensor

    assert not isinstance(tensor, DTensor), f"{name}: send DTensor.full_tensor(), not the shard"
    assert tensor.device.type == BUFFER_DEVICE_TYPE, (
        f"{name}: on {tensor.device}, expected a {BUFFER_DEVICE_TYPE} tensor (shared over CUDA IPC)"
    )
    assert tensor.is_contiguous(), f"{name}: not contiguous"


def group_by_dtype(named: Iterable[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """One group per dtype, in first-seen order: a bucket mixing dtypes could place a tensor at a
    byte offset its dtype cannot be viewed at."""
    groups: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        groups.setdefault(tensor.dtype, []).append((name, tensor))
    return list(groups.values())


def serialize_bucket(sgl, named: list[tuple[str, torch.Tensor]]) -> tuple[torch.Tensor, bytes]:
    """(flattened buffer, payload) for one same-dtype group. Keep the buffer alive until the
    engine has answered: the payload only carries a handle to it."""
    bucket = sgl.FlattenedTensorBucket(named_tensors=named)
    flat = bucket.get_flattened_tensor()  # (total bytes,) uint8
    payload = {"flattened_tensor": flat, "metadata": bucket.get_metadata()}  # keys: BUCKET_KEYS
    return flat, sgl.MultiprocessingSerializer.serialize(payload)
