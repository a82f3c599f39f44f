"""Tiny random HF models written to disk, shared by the tests."""

from __future__ import annotations

import contextlib
import copy

import torch

FAMILIES = {
    # name: (config class, model class, extra config kwargs) — uneven shapes on purpose.
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=60,
            num_attention_heads=6,
            num_key_value_heads=2,
            head_dim=20,
            tie_word_embeddings=False,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(num_attention_heads=7, num_key_value_heads=1, head_dim=12, tie_word_embeddings=False),
    ),
}


def write_hf_model(tmp_path, family: str, seed: int = 0, vocab_size: int = 101, bf16_weights: bool = False, **overrides):
    """Save a random transformers model of this family; return (directory, transformers model).
    bf16_weights: round every weight to bf16 (kept in fp32), so that an fp32 forward of these
    weights is the exact reference of a bf16 one and their errors measure compute rounding only."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    kwargs = dict(
        vocab_size=vocab_size,
        hidden_size=56,
        intermediate_size=72,
        num_hidden_layers=2,
        max_position_embeddings=256,
        eos_token_id=1,
        bos_token_id=0,
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    if config.model_type == "qwen2":
        with torch.no_grad():  # HF zero-inits biases; random ones make the parity test meaningful.
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    if bf16_weights:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.bfloat16())
    path = tmp_path / family
    model.save_pretrained(path)
    return path, model


@contextlib.contextmanager
def exact_fp32_matmuls():
    """fp32 matmuls in full precision (no TF32) inside, whatever the process had set before."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def bf16_copy(hf):
    """The same transformers model in bf16 as its own loading with dtype=bfloat16 makes it:
    parameters in bf16, buffers (the rotary frequencies) left in fp32. `.to(torch.bfloat16)`
    would round the frequencies too, an error that no bf16 deployment has."""
    out = copy.deepcopy(hf)
    for p in out.parameters():  # a tied weight is one parameter: it stays tied
        p.data = p.data.bfloat16()
    return out


def hf_logprobs(hf, sequences, temperature: float = 1.0) -> torch.Tensor:
    """(T,) log-probs of every response token under a transformers model, all sequences joined;
    `sequences` holds (prompt ids, response ids) pairs. Logits are the model's final hidden states
    (in its own dtype) times the lm_head in fp32, as the engine and the trainer compute theirs:
    transformers' bf16 logits would carry a rounding that neither has."""
    device = hf.lm_head.weight.device
    weight = hf.lm_head.weight.float()  # (V, H)
    out = []
    with torch.no_grad(), exact_fp32_matmuls():
        for prompt, response in sequences:
            ids = torch.tensor([list(prompt) + list(response)], device=device)
            hidden = hf.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1 : -1]  # (T, H)
            logp = torch.log_softmax((hidden.float() @ weight.T) / temperature, dim=-1)  # (T, V)
            out.append(logp.gather(1, torch.tensor(response, device=device)[:, None]).squeeze(1))
    return torch.cat(out).cpu()


def capture_grads(trainer, part: str = "actor") -> dict:
    """Full gradients of the trainer's actor (or critic) at its optimizer step (after clipping,
    before the update)."""
    trained = getattr(trainer, part)
    names = {id(p): n for n, p in trained.model.named_parameters()}
    grads = {}

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = p.grad.full_tensor().clone()

    trained.opt.optimizer.register_step_pre_hook(hook)
    return grads


def cuda_graph_of(step):
    """(a CUDA graph of `step()`, the output tensor it replays into): `step` runs once first on a
    side stream, so that its kernels compile outside the capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out
