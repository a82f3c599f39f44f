"""Export the actor of a checkpoint as an HF model directory: `python -m colocate.export CKPT OUT`.

CKPT is one checkpoint directory or a checkpoint root (then its newest complete checkpoint). The
weights are read straight from the DCP shards in one process, without a process group, a bucket of
tensors at a time, so exporting needs about one bucket plus one safetensors shard of host memory
and no GPU. The model config and tokenizer files come from the checkpoint's `hf/` directory.

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
    ACTOR_STATE, HF_DIR, MODEL_KEY, is_checkpoint, latest_checkpoint, quiet_single_process, verify_checkpoint,
)
from colocate.cli import DEBUG_HELP, entry_point
from colocate.models import CausalLM, ModelConfig, resolve_dtype, save_pretrained
from colocate.output_dir import check_output_dir

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
        raise ValueError(f"{path} is neither a checkpoint (meta.json + .metadata) nor a directory "
                         "holding complete rollout_* checkpoints")
    return latest


def _weight_entries(ckpt: Path, config: ModelConfig) -> list[tuple[str, TensorStorageMetadata]]:
    """DCP keys and metadata of the actor's weights, checked against the model config's names."""
    stored = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    entries = [(key, md) for key, md in stored.items()
               if key.startswith(WEIGHT_PREFIX) and isinstance(md, TensorStorageMetadata)]
    if not entries:
        raise ValueError(f"checkpoint {ckpt} has no '{ACTOR_STATE}' model weights (keys {WEIGHT_PREFIX}*)")
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in CausalLM(config).state_dict().items()}
    found = {key[len(WEIGHT_PREFIX):]: tuple(md.size) for key, md in entries}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    missing = sorted(set(expected) - set(found) - optional)
    unexpected = sorted(set(found) - set(expected))
    misshapen = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
    if missing or unexpected or misshapen:
        raise ValueError(f"checkpoint {ckpt} does not match its config.json: missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]}, wrong shape {misshapen[:5]}")
    # A tied lm_head is the embedding saved twice; save_pretrained would drop it anyway.
    return [(key, md) for key, md in entries if key[len(WEIGHT_PREFIX):] not in optional]


def iter_actor_weights(ckpt: Path, config: ModelConfig, dtype: torch.dtype,
                       bucket_bytes: int = 1 << 30) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full CPU tensor in `dtype`) for the actor's weights, one bucket per DCP read."""
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    entries = _weight_entries(ckpt, config)
    for i, (key, md) in enumerate(entries):
        t = torch.empty(md.size, dtype=md.properties.dtype)
        bucket[key] = t
        size += t.nbytes
        if size >= bucket_bytes or i == len(entries) - 1:
            with quiet_single_process():
                dcp.load(bucket, checkpoint_id=ckpt, no_dist=True)
            for k, v in bucket.items():
                yield k[len(WEIGHT_PREFIX):], v.to(dtype)
            bucket, size = {}, 0


def export(ckpt: str | Path, out: str | Path, dtype: str = "bfloat16", overwrite: bool = False) -> Path:
    """Write the checkpoint's actor as an HF directory (config, safetensors, tokenizer) at `out`;
    an existing `out` is replaced only under the rule of `colocate.output_dir`."""
    if dtype not in ("bfloat16", "float32"):
        raise ValueError(f"dtype must be bfloat16 or float32, got {dtype!r}")
    ckpt = resolve_checkpoint(ckpt)
    check_output_dir(out, overwrite=overwrite, reading=[ckpt])
    hf_dir = ckpt / HF_DIR
    if not (hf_dir / "config.json").is_file():
        raise ValueError(f"checkpoint {ckpt} has no {HF_DIR}/config.json "
                         "(it was saved without model_dir, so the model config is unknown)")
    config = ModelConfig.from_dir(hf_dir)
    state = iter_actor_weights(ckpt, config, resolve_dtype(dtype, "cpu"))
    return save_pretrained(None, out, config=config, state=state, tokenizer_dir=hf_dir, overwrite=overwrite)


@entry_point
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.export", description=__doc__.split("\n\n")[0],
                                epilog=DEBUG_HELP)
    p.add_argument("ckpt", help="a checkpoint directory, or a root holding rollout_* checkpoints (newest used)")
    p.add_argument("out", help="output HF model directory; an existing one is replaced only if it holds "
                               "an earlier export")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT even if it holds files colocate did not write")
    args = p.parse_args(argv)
    ckpt = resolve_checkpoint(args.ckpt)
    out = export(ckpt, args.out, args.dtype, args.overwrite)
    print(f"exported {ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
