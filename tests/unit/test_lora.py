"""LoRA on plain models (no process group): the adapters' forward and gradients against a model
whose weights are W + (alpha / rank) B A, the merge against peft's, the config's checks."""

from __future__ import annotations

import pytest
import torch

from colocate.config_loading import load_config
from colocate.lora.identity import LoRASpec, is_adapter
from colocate.lora.merge import merged_weight
from colocate.models import from_pretrained
from colocate.trainer.lora import adapted_modules, adapters_disabled, add_adapters, init_adapters_
from tests.helpers import write_hf_model

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SOME = ("q_proj", "v_proj", "down_proj")


def _lora_model(path, targets=ALL, rank=4, alpha=8.0, dropout=0.0, random_b=True):
    """The plain fp32 model with adapters; B random (not peft's zero) so every path has a gradient."""
    model = from_pretrained(path, dtype="float32")
    add_adapters(model, LoRASpec(rank, alpha, dropout, tuple(targets)))
    init_adapters_(model, seed=3)
    if random_b:
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for _, m in adapted_modules(model):
                m.lora_B.weight.copy_(0.05 * torch.randn(m.lora_B.weight.shape, generator=g))
    return model


def _merged_reference(path, model):
    """A fresh plain model whose adapted weights are W + scale * B A of leaf copies of `model`'s
    adapters: (logits function, {adapter name: leaf})."""
    plain = from_pretrained(path, dtype="float32")
    leaves = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters() if is_adapter(n)}
    params = dict(plain.named_parameters())
    scales = {f"{n}.weight": m.scale for n, m in adapted_modules(model)}
    weights = {
        name: params[name]
        + scale * leaves[name.replace(".weight", ".lora_B.weight")] @ leaves[name.replace(".weight", ".lora_A.weight")]
        for name, scale in scales.items()
    }
    return (lambda *args, **kwargs: torch.func.functional_call(plain, weights, args, kwargs)), leaves


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    return {family: write_hf_model(root, family)[0] for family in ("qwen2", "qwen3")}


def _packed_ids(vocab: int):
    ids = torch.randint(0, vocab, (19,), generator=torch.Generator().manual_seed(0))
    return ids, torch.tensor([0, 7, 12, 19], dtype=torch.int32)  # three packed sequences


def test_adapters_start_as_the_base_and_freeze_it(models):
    ids, cu = _packed_ids(101)
    base = from_pretrained(models["qwen2"], dtype="float32")
    model = _lora_model(models["qwen2"], random_b=False)
    assert torch.equal(model(ids, cu_seqlens=cu), base(ids, cu_seqlens=cu))
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trained) == 2 * 7 * 2 and all(is_adapter(n) for n in trained)
    a = model.model.layers[0].self_attn.q_proj.lora_A.weight
    assert a.dtype == torch.float32 and a.abs().max() <= 56**-0.5  # peft: U(-1/sqrt(in), 1/sqrt(in))
    assert a.std() > 0.5 * 56**-0.5 / 3**0.5
    with torch.no_grad():  # the same seed draws the same adapters
        assert torch.equal(
            _lora_model(models["qwen2"], random_b=False).model.layers[1].mlp.down_proj.lora_A.weight,
            model.model.layers[1].mlp.down_proj.lora_A.weight,
        )


@pytest.mark.parametrize("family, targets, dropout", [("qwen2", ALL, 0.0), ("qwen3", SOME, 0.0), ("qwen3", SOME, 1e-9)])
def test_forward_and_gradients_match_the_merged_weights(models, family, targets, dropout):
    """The LoRA model (q/k/v joined, some parts without adapters) is the model with merged weights,
    in value and in the adapters' gradients: through the merged product, and with dropout (so small
    that it keeps every element) through the low-rank terms beside the base GEMM."""
    ids, cu = _packed_ids(101)
    model = _lora_model(models[family], targets, dropout=dropout)
    reference, leaves = _merged_reference(models[family], model)
    logits, expected = model(ids, cu_seqlens=cu), reference(ids, cu_seqlens=cu)
    assert (logits - expected).abs().max() <= 1e-5
    weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(1))
    (logits * weights).mean().backward()
    (expected * weights).mean().backward()
    params = dict(model.named_parameters())
    assert set(leaves) == {n for n, p in params.items() if p.grad is not None}
    assert len(leaves) == 2 * len(targets) * 2
    for name, leaf in leaves.items():
        assert leaf.grad.abs().max() > 0, name
        assert (params[name].grad - leaf.grad).abs().max() <= 1e-5, name


def test_disabled_adapters_give_the_base(models):
    ids, cu = _packed_ids(101)
    base = from_pretrained(models["qwen3"], dtype="float32")
    model = _lora_model(models["qwen3"])
    with adapters_disabled(model):
        assert torch.equal(model(ids, cu_seqlens=cu), base(ids, cu_seqlens=cu))
    assert not torch.allclose(model(ids, cu_seqlens=cu), base(ids, cu_seqlens=cu))


def test_dropout_applies_only_to_the_training_forward(models):
    ids, cu = _packed_ids(101)
    model = _lora_model(models["qwen2"], dropout=0.5)
    with torch.no_grad():
        scored = model(ids, cu_seqlens=cu)
        assert torch.equal(scored, model(ids, cu_seqlens=cu))
    torch.manual_seed(0)
    trained = model(ids, cu_seqlens=cu)
    torch.manual_seed(0)
    assert torch.equal(trained, model(ids, cu_seqlens=cu))  # the RNG decides the mask
    assert not torch.allclose(trained, scored)


def test_merged_weight_equals_peft_merge(models):
    """Our merge of the same adapters is peft's merge_and_unload, bit for bit in fp32, and its
    rounding in bf16 (merged in fp32, rounded once)."""
    peft = pytest.importorskip("peft")
    import transformers

    path = models["qwen3"]
    model = _lora_model(path, rank=4, alpha=12.0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = peft.LoraConfig(r=4, lora_alpha=12.0, target_modules=list(ALL), lora_dropout=0.0)
    wrapped = peft.get_peft_model(hf, config)
    adapters = {f"base_model.model.{n}": p.detach() for n, p in model.named_parameters() if is_adapter(n)}
    result = peft.set_peft_model_state_dict(wrapped, adapters)
    assert not result.unexpected_keys
    merged = wrapped.merge_and_unload().state_dict()
    count = 0
    for name, m in adapted_modules(model):
        a, b = m.lora_A.weight.detach(), m.lora_B.weight.detach()
        ours = merged_weight(m.weight.detach(), a, b, m.scale, torch.float32)
        assert torch.equal(ours, merged[f"{name}.weight"]), name
        bf16 = merged_weight(m.weight.detach(), a, b, m.scale, torch.bfloat16)
        assert torch.equal(bf16, merged[f"{name}.weight"].to(torch.bfloat16)), name
        count += 1
    assert count == 14


def test_merge_rounds_adapters_to_the_base_dtype_and_computes_in_fp32():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 5, generator=g).to(torch.bfloat16)
    a, b = torch.randn(2, 5, generator=g), torch.randn(6, 2, generator=g)
    expected = (w.float() + (b.bfloat16().float() @ a.bfloat16().float()) * 0.5).bfloat16()
    assert torch.equal(merged_weight(w, a, b, 0.5, torch.bfloat16), expected)


@pytest.mark.gpu
def test_gpu_merge_on_tensor_cores_equals_the_fp32_merge():
    """The CUDA merge multiplies the 16-bit A and B with fp32 sums: up to the order of those sums,
    the fp32 merge of the CPU. Rank 64 and 1536 x 8960, as a 1.5B model's MLP projection."""
    g = torch.Generator().manual_seed(0)
    w = (0.02 * torch.randn(8960, 1536, generator=g)).bfloat16()
    a, b = torch.randn(64, 1536, generator=g) / 40, torch.randn(8960, 64, generator=g) / 100
    expected = merged_weight(w, a, b, 0.5, torch.float32)
    got = merged_weight(w.cuda(), a.cuda(), b.cuda(), 0.5, torch.float32).cpu()
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    rounded = merged_weight(w.cuda(), a.cuda(), b.cuda(), 0.5, torch.bfloat16).cpu()
    assert (rounded != expected.bfloat16()).float().mean() < 1e-3  # a sum-order difference rarely flips a bf16


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gpu_compiled_merge_equals_the_direct_launch(dtype):
    """Inside a compiled graph (inductor launches the kernel itself) the merge gives the direct
    launch's bits: a scale that fp32 does not hold exactly (alpha 32 / rank 48) is rounded to fp32
    as in the direct launch, and the multiply and the add stay two roundings. 8960 x 1536 (a 1.5B
    model's MLP projection) and 256 x 1536 (its k and v)."""
    g = torch.Generator().manual_seed(0)
    compiled = torch.compile(merged_weight, fullgraph=True)
    for rows in (8960, 256):
        w = (0.02 * torch.randn(rows, 1536, generator=g)).bfloat16().cuda()
        a, b = (torch.randn(48, 1536, generator=g) / 40).cuda(), (torch.randn(rows, 48, generator=g) / 100).cuda()
        direct = merged_weight(w, a, b, 32 / 48, dtype)
        assert torch.equal(compiled(w, a, b, 32 / 48, dtype), direct), rows
        assert not torch.equal(direct, merged_weight(w, a, b, 0.5, dtype))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--model.lora-target-modules", "q_proj", "qkv"], "model.lora_target_modules has unknown names ['qkv']"),
        (
            ["--model.lora-rank", "8", "--model.lora-target-modules"],
            "model.lora_target_modules must name each adapted projection once",
        ),
        (
            ["--model.lora-rank", "8", "--model.lora-target-modules", "q_proj", "q_proj"],
            "model.lora_target_modules must name each adapted projection once",
        ),
        (["--model.lora-rank", "8", "--model.ref-path", "other"], "model.ref_path must be unset with model.lora_rank > 0"),
        (["--model.lora-alpha", "0"], "model.lora_alpha must be > 0"),
        (["--model.lora-dropout", "1"], "model.lora_dropout must be in [0, 1)"),
    ],
)
def test_config_checks_name_the_field(flags, message):
    with pytest.raises(
        ValueError,
        match=f"^command line: {message}".replace("[", r"\[").replace("(", r"\(").replace(")", r"\)").replace("]", r"\]"),
    ):
        load_config(flags)


def test_config_defaults():
    m = load_config([]).model
    assert m.lora_rank == 0 and m.lora_alpha == 32.0 and m.lora_dropout == 0.0
    assert tuple(m.lora_target_modules) == ALL
    assert LoRASpec.from_config(m) is None
    spec = LoRASpec.from_config(load_config(["--model.lora-rank", "8"]).model)
    assert spec == LoRASpec(8, 32.0, 0.0, ALL) and spec.scale == 4.0
