"""The model configuration we read from (and write to) an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# HF architecture name -> (model_type, family flags). One definition serves all three families.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    """None, or llama3 scaling: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings."""
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    """Bias on the q/k/v projections (always on for Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each head of q and k before rope (Qwen3)."""
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    fp8_block_size: tuple[int, int] | None = None
    """(rows, cols) of the scale blocks of a block-FP8 checkpoint (config.json's quantization_config:
    e4m3 linear weights, each with its `weight_scale_inv`), which loading dequantizes; None for a
    checkpoint of plain floats. Never written back: a saved model holds plain floats."""
    extra: dict = field(default_factory=dict)
    """Keys of config.json we do not interpret, written back unchanged on save."""

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    @classmethod
    def from_hf_dict(cls, raw: dict, source: str = "config.json") -> "ArchConfig":
        archs = raw.get("architectures") or []
        model_type = raw.get("model_type")
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if known:
            model_type = known[0]
        if model_type not in ARCHITECTURES.values():
            raise ValueError(f"{source}: unsupported architecture {archs or model_type!r}; supported: {sorted(ARCHITECTURES)}")
        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", raw.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{source}: unsupported rope type {rope_type!r}; supported: default, llama3")
        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: sliding-window attention is not supported")
        heads = raw["num_attention_heads"]
        used = {
            "architectures",
            "model_type",
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "rms_norm_eps",
            "rope_theta",
            "rope_scaling",
            "rope_parameters",
            "max_position_embeddings",
            "tie_word_embeddings",
            "attention_bias",
            "bos_token_id",
            "eos_token_id",
            "quantization_config",
        }
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope_type == "llama3" else None,
            max_position_embeddings=raw.get("max_position_embeddings", 32768),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=raw.get("eos_token_id"),
            fp8_block_size=fp8_block_size(raw.get("quantization_config"), source),
            extra={k: v for k, v in raw.items() if k not in used},
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> "ArchConfig":
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected an HF model directory)")
        return cls.from_hf_dict(json.loads(file.read_text()), source=str(file))

    def to_hf_dict(self) -> dict:
        arch = {v: k for k, v in ARCHITECTURES.items()}[self.model_type]
        out = dict(self.extra)
        d = asdict(self)
        for k in ("extra", "qk_norm", "rope_scaling", "rope_theta", "fp8_block_size"):
            d.pop(k)
        if self.model_type == "qwen2":
            d.pop("attention_bias")
        rope = {"rope_theta": self.rope_theta, "rope_type": "default"}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta, "rope_type": "llama3"}
        out.update(d, architectures=[arch], rope_parameters=rope, hidden_act="silu")
        return out


def fp8_block_size(quantization: object, source: str) -> tuple[int, int] | None:
    """The scale-block shape of config.json's `quantization_config` (None when there is none), or a
    ValueError naming the file and the method for any quantization loading cannot dequantize:
    raised when the config is read, before a weight is."""
    if quantization is None:
        return None
    if not isinstance(quantization, dict):
        raise ValueError(f"{source}: quantization_config must be a JSON object, got {type(quantization).__name__}")
    refused = _refused_quantization(quantization)
    if refused is not None:
        raise ValueError(
            f"{source}: {refused} is not supported; colocate loads plain checkpoints and block-wise FP8 ones "
            "(quant_method fp8, fmt e4m3, activation_scheme dynamic, weight_block_size [n, k])"
        )
    rows, cols = quantization["weight_block_size"]
    return rows, cols


def _refused_quantization(quantization: dict) -> str | None:
    """What of a quantization_config loading cannot dequantize, in words; None when it can. Skip
    lists (modules_to_not_convert, ignored_layers) need no reading: a weight stored as plain floats
    is loaded as it is."""
    method = quantization.get("quant_method")
    if method != "fp8":
        return f"quantization method {method!r}"
    for key, accepted in (("fmt", "e4m3"), ("activation_scheme", "dynamic"), ("scale_fmt", "float")):
        if quantization.get(key) not in (None, accepted):
            return f"quantization method 'fp8' with {key} {quantization[key]!r}"
    block = quantization.get("weight_block_size")
    if block is None:
        return "quantization method 'fp8' without weight_block_size (per-tensor scales)"
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        return f"quantization method 'fp8' with weight_block_size {block!r} (two positive integers expected)"
    return None


GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""tokenizer_config.json classes that are the tokenizers library's backend itself, with no
model-specific class: the toy's, and any tokenizer saved from a bare tokenizer.json."""
GENERIC_TOKENIZER_MODEL_TYPES = ("llama", "qwen3")
"""Model types for which AutoTokenizer keeps a generic class that tokenizer_config.json names. For
qwen2 it substitutes Qwen2Tokenizer, whose own pre-tokenizer gives other ids (transformers >= 5.8)."""


def load_tokenizer(model_dir: str | Path):
    """The model directory's tokenizer, as `AutoTokenizer.from_pretrained` loads it.

    A tokenizer_config.json that names the generic fast class (GENERIC_TOKENIZERS) and no remote
    code, for a model type whose AutoTokenizer keeps that class (GENERIC_TOKENIZER_MODEL_TYPES), is
    loaded by that class directly: the same tokenizer, without AutoTokenizer's import of the model
    registry, which on some transformers versions pulls in the generation utilities and their
    optional dependencies (2-3 s of the toy run's start on a GPU machine).
    """
    model_dir = Path(model_dir)

    def read(name: str) -> dict:
        try:
            value = json.loads((model_dir / name).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    config = read("tokenizer_config.json")
    if (
        config.get("tokenizer_class") in GENERIC_TOKENIZERS
        and "auto_map" not in config
        and read("config.json").get("model_type") in GENERIC_TOKENIZER_MODEL_TYPES
        and (model_dir / "tokenizer.json").is_file()
    ):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def stop_token_ids(model_dir: str | Path, tokenizer=None) -> list[int]:
    """The token ids that end a completion of this model directory's model, sorted.

    The union of config.json's eos_token_id, generation_config.json's eos_token_id (where chat
    models list their end-of-turn token, e.g. Qwen2.5's <|im_end|> or Llama 3's <|eot_id|>,
    beside the base model's end of text) and the tokenizer's eos token when a tokenizer is given.
    Training rollouts, evaluation and offline generation all stop by this one rule.
    """
    ids = set(ArchConfig.from_dir(model_dir).eos_token_ids)
    generation = Path(model_dir) / "generation_config.json"
    if generation.is_file():
        try:
            eos = json.loads(generation.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ValueError(f"{generation}: not valid JSON ({e.msg})") from None
        ids |= set(_as_ids(eos, generation))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def _as_ids(eos, source: Path) -> list[int]:
    """An eos_token_id entry (None, an id or a list of ids) as a list."""
    values = [] if eos is None else [eos] if isinstance(eos, int) else eos
    if not isinstance(values, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in values):
        raise ValueError(f"{source}: eos_token_id must be an integer or a list of integers, got {eos!r}")
    return values
