"""Export the actor of a checkpoint as an HF model directory: `python -m colocate.export CKPT OUT`.

CKPT is one checkpoint directory or a checkpoint root (then its newest complete checkpoint). The
weights are read straight from the DCP shards in one process, without a process group, a bucket of
tensors at a time, so exporting needs about one bucket plus one safetensors shard of host memory
and no GPU. The model config and tokenizer files come from the checkpoint's `hf/` directory; a
model trained from a block-FP8 checkpoint is written as plain weights, without its config's
quantization_config.

A LoRA checkpoint holds adapters only. By default they are merged into the base model's weights
(read from the base directory the run trained on, or `--base`; its config.json and the fingerprint
of its weights must be as when training): each adapted weight becomes W + (alpha / rank) B A, as
the rollout engine had it. With `--adapter-only` OUT is a PEFT adapter directory instead
(adapter_config.json and adapter_model.safetensors under peft's key names), which
`peft.PeftModel.from_pretrained` loads onto the base it names: `--base` when given, else the one
the run trained on; that base is checked the same way when it exists here.

OUT is written beside itself and renamed into place. An existing OUT is replaced only when it is
empty or holds an earlier export (colocate's marker file), or with --overwrite; never when it is,
contains or lies inside the checkpoint being read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from colocate.checkpoint import (
    ACTOR_STATE,
    HF_DIR,
    MODEL_KEY,
    is_checkpoint,
    quiet_single_process,
    read_adapters,
    verify_checkpoint,
)
from colocate.checkpoint_manifest import latest_checkpoint
from colocate.cli import DEBUG_HELP, entry_point
from colocate.lora import peft_format
from colocate.lora.identity import config_sha256, same_base_weights, weights_fingerprint
from colocate.lora.merge import merged_weight
from colocate.models import ArchConfig, CausalLM, iter_safetensors, resolve_dtype, save_pretrained
from colocate.output_dir import check_output_dir, replacing_dir

# Keys of the actor weights inside a checkpoint: `model.model.<HF name>`; optimizer and scheduler
# entries (`model.optimizer.*`, `model.scheduler.*`) and other states (a critic) are skipped.
WEIGHT_PREFIX = f"{ACTOR_STATE}.{MODEL_KEY}."


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory as given, or the newest complete checkpoint under a root."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint path {path} does not exist")
    if is_checkpoint(path):
        verify_checkpoint(path)
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise ValueError(
            f"{path} is neither a checkpoint (meta.json + .metadata) nor a directory holding complete rollout_* checkpoints"
        )
    return latest


def _weight_entries(ckpt: Path, config: ArchConfig) -> list[tuple[str, TensorStorageMetadata]]:
    """DCP keys and metadata of the actor's weights, checked against the model config's names."""
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    entries = [(key, md) for key, md in stored.items() if key.startswith(WEIGHT_PREFIX) and isinstance(md, TensorStorageMetadata)]
    if not entries:
        raise ValueError(f"checkpoint {ckpt} has no '{ACTOR_STATE}' model weights (keys {WEIGHT_PREFIX}*)")
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in CausalLM(config).state_dict().items()}
    found = {key[len(WEIGHT_PREFIX) :]: tuple(md.size) for key, md in entries}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    if missing or unexpected or misshapen:
        raise ValueError(
            f"checkpoint {ckpt} does not match its config.json: missing {missing[:5]}, "
            f"unexpected {unexpected[:5]}, wrong shape {misshapen[:5]}"
        )
    # A tied lm_head is the embedding saved twice; save_pretrained would drop it anyway.
    return [(key, md) for key, md in entries if key[len(WEIGHT_PREFIX) :] not in optional]


def iter_actor_weights(
    ckpt: Path, config: ArchConfig, dtype: torch.dtype, bucket_bytes: int = 1 << 30
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full CPU tensor in `dtype`) for the actor's weights, one bucket per DCP read."""
    return _read_entries(ckpt, _weight_entries(ckpt, config), dtype, bucket_bytes)


def _read_entries(
    ckpt: Path, entries: list[tuple[str, TensorStorageMetadata]], dtype: torch.dtype | None, bucket_bytes: int = 1 << 30
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name less WEIGHT_PREFIX, full CPU tensor in `dtype`, None: as stored) of DCP entries."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for i, (key, md) in enumerate(entries):
        t = torch.empty(md.size, dtype=md.properties.dtype)
        bucket[key] = t
        size += t.nbytes
        if size >= bucket_bytes or i == len(entries) - 1:
            with quiet_single_process():
                dcp.load(bucket, checkpoint_id=ckpt, no_dist=True)
            for k, v in bucket.items():
                yield k[len(WEIGHT_PREFIX) :], v if dtype is None else v.to(dtype)
            bucket, size = {}, 0


def _adapters(ckpt: Path, config: ArchConfig, lora: dict) -> dict[str, torch.Tensor]:
    """The checkpoint's fp32 adapters by parameter name, checked against the base's shapes."""
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    entries = [(key, md) for key, md in stored.items() if key.startswith(WEIGHT_PREFIX) and isinstance(md, TensorStorageMetadata)]
    adapters = dict(_read_entries(ckpt, entries, None))
    with torch.device("meta"):
        weights = {
            name: tuple(t.shape)
            for name, t in CausalLM(config).state_dict().items()
            if name.endswith(".weight") and name.split(".")[-2] in lora["target_modules"]
        }
    rank, expected = lora["rank"], {}
    for name, (out_features, in_features) in weights.items():
        module = name[: -len(".weight")]
        expected[f"{module}.lora_A.weight"] = (rank, in_features)
        expected[f"{module}.lora_B.weight"] = (out_features, rank)
    found = {n: tuple(t.shape) for n, t in adapters.items()}
    if found != expected:
        wrong = sorted(set(found) ^ set(expected)) or sorted(n for n in found if found[n] != expected[n])
        raise ValueError(f"checkpoint {ckpt}: its adapters do not fit its config.json and LoRA settings (e.g. {wrong[:3]})")
    return adapters


def _base_dir(lora: dict, base: str | Path | None) -> Path:
    """The base model directory the adapters were trained on, checked by its config.json hash and
    the fingerprint of its weights."""
    path = Path(base if base is not None else lora["base_path"])
    if not (path / "config.json").is_file():
        hint = "" if base is not None else " (pass its new place with --base)"
        raise ValueError(f"base model {path} of the LoRA checkpoint has no config.json{hint}")
    if config_sha256(path) != lora["base_config_sha256"]:
        raise ValueError(
            f"base model {path} is not the one the adapters were trained on ({lora['base_path']}): its config.json differs"
        )
    fingerprint = weights_fingerprint(path)
    if not same_base_weights(lora, fingerprint):
        raise ValueError(
            f"base model {path} is not the one the adapters were trained on ({lora['base_path']}): "
            f"its weights differ (fingerprint {fingerprint[:12]}, "
            f"{lora['base_weights_fingerprint'][:12]} when trained)"
        )
    return path


def merged_base_weights(
    base: Path, adapters: dict[str, torch.Tensor], scale: float, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) of the base's weights, adapted ones merged, one at a time. A
    block-FP8 base is dequantized into `dtype` (bf16: the base weights of a bf16 run's engine)."""
    for name, tensor in iter_safetensors(base, dtype):
        if name.endswith("rotary_emb.inv_freq"):
            continue
        module = name[: -len(".weight")]
        if f"{module}.lora_A.weight" in adapters:
            yield (
                name,
                merged_weight(tensor, adapters[f"{module}.lora_A.weight"], adapters[f"{module}.lora_B.weight"], scale, dtype),
            )
        else:
            yield name, tensor.to(dtype)


def write_peft_adapter(
    out: str | Path,
    lora: dict,
    adapters: dict[str, torch.Tensor],
    dtype: torch.dtype,
    *,
    base: str | Path | None = None,
    overwrite: bool = False,
    reading=(),
) -> Path:
    """A PEFT LoRA adapter directory (colocate.lora.peft_format) naming `base`, else the base the
    run trained on."""
    with replacing_dir(out, "colocate export --adapter-only", overwrite=overwrite, reading=reading) as tmp:
        peft_format.write_adapter(tmp, lora, adapters, dtype, base if base is not None else lora["base_path"])
    return Path(out)


def export(
    ckpt: str | Path,
    out: str | Path,
    dtype: str = "bfloat16",
    overwrite: bool = False,
    *,
    adapter_only: bool = False,
    base: str | Path | None = None,
) -> Path:
    """Write the checkpoint's actor as an HF directory (config, safetensors, tokenizer) at `out`
    (LoRA adapters merged into their base, found at `base` or where the run read it), or with
    `adapter_only` a LoRA checkpoint's adapters as a PEFT adapter directory; an existing `out` is
    replaced only under the rule of `colocate.output_dir`."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    ckpt = resolve_checkpoint(ckpt)
    check_output_dir(out, overwrite=overwrite, reading=[ckpt])
    hf_dir = ckpt / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise ValueError(
            f"checkpoint {ckpt} has no {HF_DIR}/config.json (it was saved without model_dir, so the model config is unknown)"
        )
    config = ArchConfig.from_dir(hf_dir)
    torch_dtype = resolve_dtype(dtype, "cpu")
    lora = read_adapters(ckpt, ACTOR_STATE)
    if lora is None:
        if adapter_only or base is not None:
            raise ValueError(
                f"checkpoint {ckpt} holds a whole model, not LoRA adapters: "
                f"{'--adapter-only' if adapter_only else '--base'} does not apply"
            )
        state = iter_actor_weights(ckpt, config, torch_dtype)
        return save_pretrained(None, out, config=config, state=state, tokenizer_dir=hf_dir, overwrite=overwrite)
    adapters = _adapters(ckpt, config, lora)
    if adapter_only:
        # The directory only names its base; refuse one that is here and is not the trained one.
        if base is not None or Path(lora["base_path"]).is_dir():
            base = _base_dir(lora, base)
        return write_peft_adapter(out, lora, adapters, torch_dtype, base=base, overwrite=overwrite, reading=[ckpt])
    state = merged_base_weights(_base_dir(lora, base), adapters, lora["alpha"] / lora["rank"], torch_dtype)
    return save_pretrained(None, out, config=config, state=state, tokenizer_dir=hf_dir, overwrite=overwrite)


@entry_point
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.export", description=__doc__.split("\n\n")[0], epilog=DEBUG_HELP)
    p.add_argument("ckpt", help="a checkpoint directory, or a root holding rollout_* checkpoints (newest used)")
    p.add_argument("out", help="output HF model directory; an existing one is replaced only if it holds an earlier export")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--overwrite", action="store_true", help="replace OUT even if it holds files colocate did not write")
    p.add_argument(
        "--adapter-only", action="store_true", help="LoRA checkpoints: write a PEFT adapter directory instead of merged weights"
    )
    p.add_argument("--base", default=None, help="LoRA checkpoints: the base model directory, when it moved since training")
    args = p.parse_args(argv)
    ckpt = resolve_checkpoint(args.ckpt)
    out = export(ckpt, args.out, args.dtype, args.overwrite, adapter_only=args.adapter_only, base=args.base)
    print(f"exported {ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
