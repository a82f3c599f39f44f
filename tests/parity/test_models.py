import json

import pytest
import torch

from colocate.models import ArchConfig, from_pretrained, packing_from_lengths, save_pretrained
from tests.helpers import FAMILIES, write_hf_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_transformers(tmp_path, family):
    path, hf = write_hf_model(tmp_path, family)
    ours = from_pretrained(path, dtype="float32")
    ids = torch.randint(0, 101, (3, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= 1e-4, f"{family}: max |diff| {diff}"


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_gradients_match_transformers(tmp_path, family):
    """Training runs q/k/v as one GEMM over weights joined for the call; autograd must still give
    each projection (and every other parameter) transformers' gradient."""
    path, hf = write_hf_model(tmp_path, family)
    ours = from_pretrained(path, dtype="float32")
    ids = torch.randint(0, 101, (2, 24), generator=torch.Generator().manual_seed(4))
    for model in (hf, ours):
        logits = model(ids).logits if model is hf else model(ids)
        torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
    theirs = dict(hf.named_parameters())
    ours_named = dict(ours.named_parameters())
    assert set(ours_named) == set(theirs)
    for name, p in ours_named.items():
        ref = theirs[name].grad
        assert (p.grad - ref).abs().max().item() <= 1e-5 * max(1.0, ref.abs().max().item()), name


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_forward_equals_per_sequence(tmp_path, family):
    path, _ = write_hf_model(tmp_path, family)
    model = from_pretrained(path, dtype="float32")
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 101, (n,), generator=g) for n in (5, 17, 1, 30)]
    cu, positions = packing_from_lengths(torch.tensor([len(s) for s in seqs]))
    with torch.no_grad():
        packed = model(torch.cat(seqs), cu_seqlens=cu)  # (N, V)
        single = torch.cat([model(s[None])[0] for s in seqs])
    assert positions.tolist()[:6] == [0, 1, 2, 3, 4, 0]
    assert (packed - single).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_projections_keep_logits_and_alias_the_parameters(tmp_path, family):
    """The engine's layout: one GEMM for q/k/v and one for gate/up, the named parameters views."""
    path, _ = write_hf_model(tmp_path, family)
    model = from_pretrained(path, dtype="float32")
    ids = torch.randint(0, 101, (2, 12), generator=torch.Generator().manual_seed(3))
    names = [n for n, _ in model.named_parameters()]
    with torch.no_grad():
        before = model(ids)
        model.pack_projections()
        after = model(ids)
        assert [n for n, _ in model.named_parameters()] == names
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        attn.k_proj.weight.fill_(0.5)  # a copy into a parameter lands in the packed tensor
        mlp.up_proj.weight.fill_(-0.25)
    q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert bool((attn.qkv_weight[q_rows : q_rows + k_rows] == 0.5).all())
    assert bool((mlp.gate_up_weight[mlp.gate_proj.weight.shape[0] :] == -0.25).all())
    assert (after - before).abs().max().item() <= 1e-5


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_save_load_round_trip(tmp_path, family):
    import transformers

    path, hf = write_hf_model(tmp_path, family)
    ours = from_pretrained(path, dtype="float32")
    out = save_pretrained(ours, tmp_path / "saved", max_shard_bytes=20_000)  # forces several shards
    assert (out / "model.safetensors.index.json").is_file()
    again = from_pretrained(out, dtype="float32")
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 101, (2, 9))
    with torch.no_grad():
        assert torch.allclose(reloaded(ids).logits, hf(ids).logits, atol=1e-6)


def test_unsupported_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM"):
        ArchConfig.from_dir(tmp_path)


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    path, _ = write_hf_model(tmp_path, "qwen2")
    tensors = load_file(path / "model.safetensors")
    tensors.pop("model.norm.weight")
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match="model.norm.weight"):
        from_pretrained(path)
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.norm.weight has shape \(3,\)"):
        from_pretrained(path)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [12, 20, 64])
def test_packed_flash_attention_matches_per_sequence_sdpa(head_dim):
    """The CUDA varlen path (head_dim padded to a multiple of 8) against the per-sequence causal
    SDPA path, values and gradients, bf16 inputs in both."""
    from colocate.models.layers import packed_causal_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    lengths = torch.tensor([5, 130, 1, 64])
    cu, _ = packing_from_lengths(lengths)
    n = int(lengths.sum())
    leaves = [
        torch.randn(n, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_() for heads in (6, 2, 2)
    ]
    grad_out = torch.randn(n, 6, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    results = []
    for device in ("cuda", "cpu"):  # the CPU branch runs per-sequence SDPA in fp32
        inputs = [t.to(device, torch.float32 if device == "cpu" else t.dtype) for t in leaves]
        out = packed_causal_attention(*inputs, cu.to(device), int(lengths.max()))
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype).to(device))
        results.append([out.float().cpu(), *(x.float().cpu() for x in grads)])
    for name, flash, sdpa in zip(("out", "dq", "dk", "dv"), *results):
        assert (flash - sdpa).norm() <= 1e-2 * sdpa.norm(), name
