"""Tiny random HF models written to disk, shared by the tests."""

from __future__ import annotations

import torch

FAMILIES = {
    # name: (config class, model class, extra config kwargs) — uneven shapes on purpose.
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=60, num_attention_heads=6, num_key_value_heads=2, head_dim=20, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        num_attention_heads=7, num_key_value_heads=1, head_dim=12, tie_word_embeddings=False)),
}


def write_hf_model(tmp_path, family: str, seed: int = 0, vocab_size: int = 101, **overrides):
    """Save a random transformers model of this family; return (directory, transformers model)."""
    import transformers

    cfg_name, model_name, extra = FAMILIES[family]
    kwargs = dict(vocab_size=vocab_size, hidden_size=56, intermediate_size=72, num_hidden_layers=2,
                  max_position_embeddings=256, eos_token_id=1, bos_token_id=0)
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
    path = tmp_path / family
    model.save_pretrained(path)
    return path, model


def capture_grads(trainer) -> dict:
    """Full gradients at the optimizer step (after clipping, before the update)."""
    names = {id(p): n for n, p in trainer.actor_module.named_parameters()}
    grads = {}

    def hook(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                grads[names[id(p)]] = p.grad.full_tensor().clone()

    trainer.actor.opt.optimizer.register_step_pre_hook(hook)
    return grads
