"""Load and save HF model directories (config.json + one or many safetensors files)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from colocate.kernels.fp8 import E4M3, block_dequantize
from colocate.models.config import ArchConfig
from colocate.models.layers import rope_inv_freq
from colocate.models.transformer import CausalLM
from colocate.output_dir import replacing_dir

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# aminmax has no kernels for the float8 types; integer tensors cannot hold NaN.
_CHECKED_DTYPES = (torch.float64, *DTYPES.values())
SCALE_SUFFIX = "_scale_inv"
"""A block-FP8 checkpoint's weight `X.weight` has its block scales in `X.weight_scale_inv`."""


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str) -> torch.dtype:
    """'auto' is bf16 on CUDA and fp32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def read_model_config(path: str | Path, field: str = "model.path") -> ArchConfig:
    """ArchConfig.from_dir, with a config.json that is not UTF-8 JSON, not an object, or lacks a
    required key reported as ValueError naming the file and `field` (the setting naming the directory)."""
    file = Path(path) / "config.json"
    if not file.is_file():
        return ArchConfig.from_dir(path)  # its error says what a model directory needs
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{field}: {file} is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{field}: {file} is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{field}: {file} must hold a JSON object, got {type(raw).__name__}")
    try:
        return ArchConfig.from_hf_dict(raw, source=str(file))
    except KeyError as e:
        raise ValueError(f"{field}: {file} has no {e}") from None


def safetensors_files(path: str | Path) -> list[Path]:
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{index}: not a safetensors index (a JSON object with a weight_map): {type(e).__name__}: {e}"
            ) from None
        files = [path / f for f in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names missing files {missing[:3]}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def _check_finite(name: str, tensor: torch.Tensor, source: str | Path) -> None:
    """Raise ValueError naming the tensor and its file when it holds a NaN or an infinity."""
    if tensor.dtype not in _CHECKED_DTYPES or tensor.numel() == 0:
        return
    # Min and max are finite only if every value is, and cost a tenth of isfinite on CPU.
    low, high = torch.aminmax(tensor)
    if bool(torch.isfinite(low) & torch.isfinite(high)):
        return
    num_nan, num_inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
    raise ValueError(f"{source}: tensor {name} holds non-finite values ({num_nan} NaN, {num_inf} inf of {tensor.numel()})")


def iter_safetensors(path: str | Path, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, CPU tensor) for every tensor of a model directory, one file at a time.

    In a block-FP8 checkpoint (`ArchConfig.fp8_block_size`) each float8_e4m3fn weight comes
    dequantized with its `weight_scale_inv` (`block_dequantize`) in `dtype`, one tensor at a time,
    and the scales are not yielded; other tensors come as stored. The default fp32 is the product
    rounded to fp32, which a copy into a parameter rounds again: the same values as
    `block_dequantize` into the parameter's dtype, which computes in fp32 too. A file that
    safetensors cannot read (truncated, not safetensors), a tensor holding NaN or inf, a float8
    weight without its scales or with scales of the wrong shape, and scales of no float8 weight
    raise ValueError naming the file and the tensor."""
    block = ArchConfig.from_dir(path).fp8_block_size if (Path(path) / "config.json").is_file() else None
    files = safetensors_files(path)
    scale_files = {name: file for file in files for name in _names(file) if name.endswith(SCALE_SUFFIX)} if block else {}
    used = set()
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in scale_files:
                        continue  # read with its weight
                    tensor = f.get_tensor(name)
                    if tensor.dtype.is_floating_point and tensor.dtype.itemsize == 1:
                        tensor = _dequantized(name, tensor, file, scale_files, block, dtype)
                        used.add(name + SCALE_SUFFIX)
                    _check_finite(name, tensor, file)
                    yield name, tensor
        except SafetensorError as e:
            raise ValueError(f"{file}: not a readable safetensors file ({e})") from None
    unused = sorted(set(scale_files) - used)
    if unused:
        raise ValueError(f"{scale_files[unused[0]]}: tensor {unused[0]} scales no float8 weight of {path}")


def _names(file: Path) -> list[str]:
    """The tensor names of a safetensors file (its header only)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            return list(f.keys())
    except SafetensorError as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e})") from None


def _dequantized(
    name: str,
    w8: torch.Tensor,
    file: Path,
    scale_files: dict[str, Path],
    block: tuple[int, int] | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The weight (N, K) of a block-FP8 checkpoint in `dtype`, from its e4m3 values and the
    `weight_scale_inv` (ceil(N/bn), ceil(K/bk)) named by `scale_files`, after checking both."""
    if block is None or w8.dtype != E4M3 or w8.dim() != 2:
        raise ValueError(
            f"{file}: tensor {name} of shape {tuple(w8.shape)} is stored as {w8.dtype}; float8 tensors are read only as "
            "the e4m3 matrices of a block-FP8 checkpoint (config.json's quantization_config)"
        )
    scale_name = name + SCALE_SUFFIX
    if scale_name not in scale_files:
        raise ValueError(f"{file}: float8 weight {name} has no {scale_name} (its block scales)")
    scale_file = scale_files[scale_name]
    try:
        with safe_open(str(scale_file), framework="pt") as f:
            scale_inv = f.get_tensor(scale_name)
    except SafetensorError as e:
        raise ValueError(f"{scale_file}: not a readable safetensors file ({e})") from None
    (n, k), (bn, bk) = w8.shape, block
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected or scale_inv.dtype not in DTYPES.values():
        raise ValueError(
            f"{scale_file}: tensor {scale_name} is {scale_inv.dtype} of shape {tuple(scale_inv.shape)}; the ({n}, {k}) "
            f"weight {name} in {bn}x{bk} blocks needs floats of shape {expected}"
        )
    return block_dequantize(w8, scale_inv, dtype, block)


def load_weights(model: CausalLM, named: Iterable[tuple[str, torch.Tensor]], source: str = "weights"):
    """Copy HF-named tensors into the model; every parameter must be covered exactly once."""
    params = dict(model.named_parameters())
    tied = model.config.tie_word_embeddings
    seen = set()
    for name, tensor in named:
        if tied and name == "lm_head.weight":
            continue
        if name not in params:
            if name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"{source}: unexpected tensor {name!r} for a {model.config.model_type} model")
        p = params[name]
        if tuple(tensor.shape) != tuple(p.shape):
            raise ValueError(f"{source}: {name} has shape {tuple(tensor.shape)}, expected {tuple(p.shape)}")
        with torch.no_grad():
            p.copy_(tensor)
        seen.add(name)
    missing = sorted(set(params) - seen)
    if missing:
        raise ValueError(f"{source}: missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")


def from_config(cfg: ArchConfig, dtype=torch.float32, device="cpu", init: bool = False) -> CausalLM:
    """A model with this config on `device`; parameters uninitialised unless `init` (then random
    normal(0, 0.02) weights and unit norms, for tests and new models)."""
    with torch.device("meta"):
        model = CausalLM(cfg).to(dtype)  # cast before allocating: no transient fp32 copy
    model = model.to_empty(device=device)
    model.tie_weights()
    # Rotary frequencies stay fp32 whatever the parameter dtype, as in the HF implementations.
    model.model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    if init:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                elif name.endswith("bias"):
                    p.zero_()
                else:
                    p.normal_(0.0, 0.02)
    return model


def from_pretrained(path: str | Path, dtype: str | torch.dtype = "auto", device="cpu") -> CausalLM:
    """Load an HF model directory (Llama, Qwen2 or Qwen3) into our plain-torch definition."""
    cfg = ArchConfig.from_dir(path)
    dtype = resolve_dtype(dtype, device)
    model = from_config(cfg, dtype, device)
    load_weights(model, iter_safetensors(path, dtype), source=str(path))
    return model


def save_pretrained(
    model: CausalLM | None,
    out: str | Path,
    *,
    config: ArchConfig | None = None,
    state: Iterable[tuple[str, torch.Tensor]] | None = None,
    tokenizer_dir: str | Path | None = None,
    max_shard_bytes: int = 4 << 30,
    overwrite: bool = False,
) -> Path:
    """Write an HF directory that transformers loads, under the rule of `colocate.output_dir`: an
    existing non-empty `out` is replaced only if colocate wrote it or `overwrite` is set.

    Either a model, or a config plus an iterable of HF-named full tensors (e.g. from a checkpoint).
    Tokenizer files are copied from `tokenizer_dir` when given.
    """
    config = config or model.config
    named = state if state is not None else model.state_dict().items()
    with replacing_dir(out, "colocate save_pretrained", overwrite=overwrite) as tmp:
        _write_hf_dir(tmp, config, named, tokenizer_dir, max_shard_bytes)
    return Path(out)


def _write_hf_dir(
    tmp: Path,
    config: ArchConfig,
    named: Iterable[tuple[str, torch.Tensor]],
    tokenizer_dir: str | Path | None,
    max_shard_bytes: int,
) -> None:
    shards, current, size = [], {}, 0
    for name, t in named:
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue
        t = t.detach().to("cpu").contiguous()
        if current and size + t.nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t.clone() if t.untyped_storage().size() != t.nbytes else t
        size += t.nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    if len(shards) > 1:
        total = sum(t.nbytes for s in shards for t in s.values())
        (tmp / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    dtype = next(iter(shards[0].values())).dtype if shards[0] else torch.float32
    hf = config.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = {v: k for k, v in DTYPES.items()}.get(dtype, "float32")
    (tmp / "config.json").write_text(json.dumps(hf, indent=2))
    if tokenizer_dir is not None:
        for f in Path(tokenizer_dir).iterdir():
            if f.name.startswith(
                ("tokenizer", "special_tokens", "added_tokens", "vocab", "merges", "generation_config", "chat_template")
            ):
                shutil.copy(f, tmp / f.name)
