"""Block-FP8 checkpoints as Qwen publishes them (e4m3 `X.weight` beside fp32 `X.weight_scale_inv`,
config.json's quantization_config): loading dequantizes them exactly, refuses what it cannot read
with one line naming the file, and export writes plain weights under a config without the
quantization."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from colocate.checkpoint import ModelOptimizerState, save_checkpoint
from colocate.export import export, merged_base_weights
from colocate.kernels.fp8 import E4M3, E4M3_MAX, block_dequantize, block_quantize
from colocate.lora.merge import merged_weight
from colocate.models import ArchConfig, from_config, from_pretrained, iter_safetensors, load_weights, save_pretrained
from colocate.models.loading import read_model_config
from colocate.trainer.parallelize import load_sharded

VOCAB = 101
# Qwen3-shaped, with sides that are not multiples of 128: q/o 160 (one full block and one of 32),
# k/v 32 (one partial block), gate/up/down 320 (two full blocks and one of 64).
SHAPE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": VOCAB,
    "hidden_size": 160,
    "intermediate_size": 320,
    "num_hidden_layers": 2,
    "num_attention_heads": 5,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
NOT_CONVERTED = "model.layers.1.self_attn.o_proj"
"""A projection the checkpoint keeps in bf16 and lists in modules_to_not_convert."""


def _bf16_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights of SHAPE whose magnitudes span four decades across rows and columns, so
    that every block has its own scale."""
    torch.manual_seed(seed)
    model = from_config(ArchConfig.from_hf_dict(SHAPE), torch.float32, init=True)
    out = {}
    for name, t in model.state_dict().items():
        if name.endswith("proj.weight"):
            n, k = t.shape
            t = t * torch.logspace(-2, 2, n)[:, None] * torch.logspace(1, -1, k)[None, :]
        out[name] = t.bfloat16()
    return out


def write_fp8_checkpoint(path, sharded: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint in the published layout: every projection but NOT_CONVERTED as e4m3 plus its
    fp32 `weight_scale_inv`, everything else bf16. Sharded: two files and an index, with the first
    scale in the other file than its weight. Returns the stored tensors by name."""
    stored = {}
    for name, t in _bf16_weights().items():
        if name.endswith("proj.weight") and not name.startswith(NOT_CONVERTED):
            stored[name], stored[name + "_scale_inv"] = block_quantize(t)
        else:
            stored[name] = t
    path.mkdir(parents=True)
    config = {**SHAPE, "quantization_config": {**QUANTIZATION, "modules_to_not_convert": [NOT_CONVERTED]}}
    (path / "config.json").write_text(json.dumps(config))
    if not sharded:
        save_file(stored, str(path / "model.safetensors"), metadata={"format": "pt"})
        return stored
    names = sorted(stored)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    scale = next(n for n in names if n.endswith("_scale_inv"))
    weight_half = 0 if scale[: -len("_scale_inv")] in halves[0] else 1
    for half in halves:
        if scale in half:
            half.remove(scale)
    halves[1 - weight_half].append(scale)  # loading must pair a weight with its scale across files
    files = {f"model-0000{i + 1}-of-00002.safetensors": half for i, half in enumerate(halves)}
    weight_map = {}
    for file, names_of in files.items():
        save_file({n: stored[n] for n in names_of}, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names_of, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return stored


def _dequantized(stored: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The stored tensors as a plain checkpoint in `dtype`: e4m3 weights through block_dequantize."""
    return {
        name: block_dequantize(t, stored[name + "_scale_inv"], dtype) if t.dtype == E4M3 else t.to(dtype)
        for name, t in stored.items()
        if not name.endswith("_scale_inv")
    }


@pytest.mark.parametrize("sharded", [False, True], ids=["one_file", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fp8_checkpoint_loads_as_its_dequantized_weights(tmp_path, sharded, dtype):
    path = tmp_path / "fp8"
    stored = write_fp8_checkpoint(path, sharded)
    assert ArchConfig.from_dir(path).fp8_block_size == (128, 128)
    expected = _dequantized(stored, dtype)
    model = from_pretrained(path, dtype=dtype)
    params = dict(model.named_parameters())
    assert set(params) == set(expected)
    quantized = [n for n, t in stored.items() if t.dtype == E4M3]
    assert len(quantized) == 2 * 7 - 1  # every projection of both layers but NOT_CONVERTED
    for name, p in params.items():
        assert p.dtype == dtype
        assert torch.equal(p, expected[name]), name
    # Non-quantized tensors are the stored bf16 values (exact in fp32 too).
    for name in ("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight", f"{NOT_CONVERTED}.weight"):
        assert torch.equal(params[name].bfloat16(), stored[name]), name

    reference = from_config(ArchConfig.from_hf_dict(SHAPE), dtype)
    load_weights(reference, expected.items())
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))  # (B, T)
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))

    # The stream every loader reads: fp32 dequantized weights by default (the exact product), no
    # scales; the trainer's load_sharded rounds them once into its parameters' dtype.
    streamed = dict(iter_safetensors(path))
    assert set(streamed) == set(expected)
    for name in quantized:
        assert torch.equal(streamed[name], block_dequantize(stored[name], stored[name + "_scale_inv"], torch.float32))
    trained = from_config(ArchConfig.from_dir(path), dtype)
    assert load_sharded(trained, iter_safetensors(path), str(path)) == set(expected)
    for name, p in trained.named_parameters():
        assert torch.equal(p, expected[name]), name


def test_block_layout_round_trip_within_e4m3_rounding():
    """block_quantize -> block_dequantize. Derivation of the bound: in a block of scale
    s = amax / 448, w / s lies in [-448, 448]; e4m3 keeps 3 mantissa bits, so rounding a normal value
    x to it errs by at most half a unit in the last place, 2^-4 |x|, and a subnormal one
    (|x| < 2^-6, step 2^-9) by at most 2^-10. Scaled back, |w' - w| <= max(2^-4 |w|, 2^-10 s), which
    is at most 2^-4 amax of the block (|w| <= amax and 2^-10 s = amax / 458752). The fp32 division
    and product add 2^-24 relative each: the factor 1 + 2^-20 covers them."""
    torch.manual_seed(0)
    n, k = 300, 200  # partial edge blocks in both directions (300 = 2 * 128 + 44, 200 = 128 + 72)
    w = torch.randn(n, k) * torch.logspace(-3, 3, n)[:, None] * torch.logspace(-1, 1, k)[None, :]
    w[128:256, :128] = 0.0  # an all-zero block
    w[5, 7] = 1e-30  # far below its block's subnormal step
    for block in [(128, 128), (64, 32)]:
        bn, bk = block
        w8, scale_inv = block_quantize(w, block)
        assert w8.dtype == E4M3 and w8.shape == w.shape
        assert scale_inv.dtype == torch.float32 and scale_inv.shape == (-(-n // bn), -(-k // bk))
        back = block_dequantize(w8, scale_inv, torch.float32, block)
        s = scale_inv.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]  # (n, k) each entry's scale
        padded = torch.zeros(scale_inv.shape[0] * bn, scale_inv.shape[1] * bk)
        padded[:n, :k] = w.abs()
        amax = padded.view(scale_inv.shape[0], bn, scale_inv.shape[1], bk).amax(dim=(1, 3))  # (rows, cols)
        nonzero = amax > 0
        assert torch.equal(scale_inv[nonzero], amax[nonzero] / E4M3_MAX)  # edge blocks: their real entries only
        err = (back - w).abs()
        slack = 1 + 2**-20
        assert bool((err <= torch.maximum(w.abs() * 2**-4, s * 2**-10) * slack).all())
        block_amax = amax.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        assert bool((err <= block_amax * 2**-4 * slack).all())
        assert torch.equal(back[128:256, :128], torch.zeros(128, 128))
        # The bound is nearly reached: e4m3 rounding, not a looser error, is what is measured.
        assert (err / block_amax.clamp(min=1e-30)).max().item() > 2**-6


@pytest.mark.parametrize(
    "quantization, named",
    [
        ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quantization method 'gptq'"),
        ({"quant_method": "awq", "bits": 4, "version": "gemm"}, "quantization method 'awq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantization method 'bitsandbytes'"),
        ({"quant_method": "compressed-tensors", "format": "float-quantized"}, "quantization method 'compressed-tensors'"),
        ({"load_in_8bit": True}, "quantization method None"),
        ({**QUANTIZATION, "activation_scheme": "static"}, "quantization method 'fp8' with activation_scheme 'static'"),
        ({**QUANTIZATION, "fmt": "e5m2"}, "quantization method 'fp8' with fmt 'e5m2'"),
        ({**QUANTIZATION, "scale_fmt": "ue8m0"}, "quantization method 'fp8' with scale_fmt 'ue8m0'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "quantization method 'fp8' without weight_block_size"),
        ({**QUANTIZATION, "weight_block_size": [128]}, "quantization method 'fp8' with weight_block_size [128]"),
    ],
)
def test_unsupported_quantization_is_refused_when_the_config_is_read(tmp_path, quantization, named):
    # No weights at all: the error must come from config.json alone.
    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "quantization_config": quantization}))
    file = tmp_path / "config.json"
    for read in (lambda: from_pretrained(tmp_path), lambda: read_model_config(tmp_path), lambda: ArchConfig.from_dir(tmp_path)):
        with pytest.raises(ValueError) as e:
            read()
        message = str(e.value)
        assert message.startswith(f"{file}: {named}") and "is not supported" in message, message
        assert "\n" not in message


def _rewrite(path, change) -> None:
    """Apply `change` to the tensors of a one-file checkpoint."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _one_line_error(path) -> str:
    with pytest.raises(ValueError) as e:
        from_pretrained(path, dtype="float32")
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_scales_are_named_with_their_file(tmp_path):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(path)
    file = path / "model.safetensors"
    q = "model.layers.0.self_attn.q_proj.weight"

    _rewrite(path, lambda t: t.pop(q + "_scale_inv"))
    message = _one_line_error(path)
    assert message == f"{file}: float8 weight {q} has no {q}_scale_inv (its block scales)"

    _rewrite(path, lambda t: t.update({q + "_scale_inv": torch.ones(1, 2)}))
    message = _one_line_error(path)
    assert message.startswith(f"{file}: tensor {q}_scale_inv is torch.float32 of shape (1, 2); ")
    assert "(160, 160) weight" in message and "needs floats of shape (2, 2)" in message

    _rewrite(path, lambda t: t.update({q + "_scale_inv": torch.ones(2, 2, dtype=torch.int32)}))
    assert _one_line_error(path).startswith(f"{file}: tensor {q}_scale_inv is torch.int32 of shape (2, 2); ")

    # A scale beside a weight stored as plain floats belongs to nothing.
    _rewrite(path, lambda t: t.update({q: block_dequantize(t[q], torch.ones(2, 2), torch.bfloat16)}))
    assert _one_line_error(path) == f"{file}: tensor {q}_scale_inv scales no float8 weight of {path}"


def test_float8_weights_need_the_quantization_config(tmp_path):
    path = tmp_path / "fp8"
    write_fp8_checkpoint(path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    message = _one_line_error(path)
    assert message.startswith(f"{path / 'model.safetensors'}: tensor model.layers.0.mlp.down_proj.weight of shape (160, 320)")
    assert "float8_e4m3fn" in message and "quantization_config" in message


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_export_of_a_model_trained_from_fp8_writes_plain_weights(tmp_path, dtype):
    path = tmp_path / "fp8"
    stored = write_fp8_checkpoint(path)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    model = from_pretrained(path, dtype="float32")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))  # (B, T)
    torch.nn.functional.cross_entropy(model(ids)[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).backward()
    opt.step()
    trained = {n: p.detach().clone() for n, p in model.named_parameters()}
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(trained[q], block_dequantize(stored[q], stored[q + "_scale_inv"], torch.float32))  # trained
    root = tmp_path / "ckpt"
    save_checkpoint(root, 1, {"model": ModelOptimizerState(model, opt)}, model_dir=path)
    assert "quantization_config" in json.loads((root / "rollout_000001" / "hf" / "config.json").read_text())

    out = export(root, tmp_path / "out", dtype=dtype)
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["torch_dtype"] == dtype
    torch_dtype = getattr(torch, dtype)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        assert names == set(trained)
        for name in names:
            t = f.get_tensor(name)
            assert t.dtype == torch_dtype, name
            assert torch.equal(t, trained[name].to(torch_dtype)), name
    assert ArchConfig.from_dir(out).fp8_block_size is None
    assert json.loads((out / "tokenizer_config.json").read_text()) == {"model_max_length": 64}

    # save_pretrained of the loaded model itself writes no quantization either.
    saved = save_pretrained(model, tmp_path / "saved")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text())
    again = from_pretrained(saved, dtype="float32")
    for name, p in again.named_parameters():
        assert torch.equal(p, trained[name]), name


def test_lora_merge_into_an_fp8_base_dequantizes_into_the_export_dtype(tmp_path):
    path = tmp_path / "fp8"
    stored = write_fp8_checkpoint(path)
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    g = torch.Generator().manual_seed(3)
    adapters = {f"{q}.lora_A.weight": torch.randn(4, 160, generator=g), f"{q}.lora_B.weight": torch.randn(160, 4, generator=g)}
    for dtype in (torch.bfloat16, torch.float32):
        merged = dict(merged_base_weights(path, adapters, 0.5, dtype))
        base = _dequantized(stored, dtype)
        assert set(merged) == set(base)
        expected = merged_weight(base[f"{q}.weight"], adapters[f"{q}.lora_A.weight"], adapters[f"{q}.lora_B.weight"], 0.5, dtype)
        assert torch.equal(merged[f"{q}.weight"], expected)
        assert torch.equal(merged[f"{k}.weight"], base[f"{k}.weight"])
        assert all(t.dtype == dtype for t in merged.values())


def test_an_fp8_checkpoint_is_refused_with_the_sglang_engine(tmp_path):
    from colocate.config import Config, ModelConfig, RolloutConfig
    from colocate.inputs import _check_model_fit
    from colocate.models.loading import read_model_config

    path = tmp_path / "fp8"
    write_fp8_checkpoint(path)
    arch = read_model_config(path)
    _check_model_fit(Config(model=ModelConfig(path=str(path))), "path", arch)  # the native engine loads it
    cfg = Config(model=ModelConfig(path=str(path)), rollout=RolloutConfig(engine="sglang"))
    with pytest.raises(ValueError, match=r"^model.path .*/fp8/config.json holds block-FP8 weights, .*rollout.engine=native"):
        _check_model_fit(cfg, "path", arch)


def test_fp8_weights_are_checked_against_the_model_before_any_model_work(tmp_path):
    """Widths that are not multiples of 16 (the FP8 GEMM's), and a compute dtype other than bf16 on
    CUDA, are one-line errors naming rollout.weight_dtype, raised by the inputs' checks."""
    import dataclasses

    import torch

    from colocate.config import Config, ModelConfig, RolloutConfig
    from colocate.dist import DistInfo
    from colocate.inputs import _check_fp8_dtype, _check_model_fit
    from colocate.models.loading import read_model_config
    from tests.helpers import write_hf_model

    path = tmp_path / "fp8"
    write_fp8_checkpoint(path)  # hidden 160, intermediate 320: multiples of 16
    fp8 = RolloutConfig(weight_dtype="fp8")
    _check_model_fit(Config(model=ModelConfig(path=str(path)), rollout=fp8), "path", read_model_config(path))
    odd, _ = write_hf_model(tmp_path, "qwen3")  # hidden 56
    with pytest.raises(
        ValueError, match=r"^rollout.weight_dtype fp8 needs projection widths that are multiples of 16; .*'hidden_size': 56"
    ):
        _check_model_fit(Config(model=ModelConfig(path=str(odd)), rollout=fp8), "path", read_model_config(odd))
    cuda = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"^rollout.weight_dtype fp8 computes in bf16 on CUDA; model.dtype is float32"):
        _check_fp8_dtype(Config(model=ModelConfig(dtype="float32"), rollout=fp8), cuda)
    _check_fp8_dtype(Config(model=ModelConfig(dtype="auto"), rollout=fp8), cuda)  # bf16 on CUDA
    _check_fp8_dtype(
        Config(model=ModelConfig(dtype="float32"), rollout=fp8), dataclasses.replace(cuda, device=torch.device("cpu"))
    )
