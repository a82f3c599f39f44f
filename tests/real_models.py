"""Tiny stand-ins for real chat models and a Hub cache laid out on disk, for offline tests.

Each family's tokenizer is byte-level (one token per byte, no merges) plus the family's special
tokens, and carries the family's published chat template (tests/chat_templates/). Its model is a
random one of the family whose layers add nothing to the residual stream, with embeddings and
output head set so that whatever the prompt, greedy or sampled, it answers ANSWER and then the
family's end-of-turn token: a rollout that stops at that token is two tokens long.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tests.helpers import write_hf_model

TEMPLATES = Path(__file__).parent / "chat_templates"
ANSWER = "7"
"""The one text token the chat models say before their end-of-turn token."""


@dataclass(frozen=True)
class ChatFamily:
    model_family: str
    """tests.helpers family of the model (llama, qwen2, qwen3)."""
    template: str
    specials: tuple[str, ...]
    """Special tokens; decoding with skip_special_tokens drops them."""
    end_of_turn: str
    """The end-of-turn token, listed only in generation_config.json."""
    end_of_text: str
    """The eos of config.json and of the tokenizer (the base model's end of text)."""
    added: tuple[str, ...] = ()
    """Added tokens that are not special (Qwen3's thinking tags stay in decoded text)."""
    bos: str | None = None
    """Prepended by the tokenizer when it adds special tokens (Llama 3)."""


FAMILIES = {
    "qwen2.5": ChatFamily(
        "qwen2", "qwen2.5.jinja", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|endoftext|>"
    ),
    "qwen3": ChatFamily(
        "qwen3",
        "qwen3.jinja",
        ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        "<|im_end|>",
        "<|endoftext|>",
        added=("<think>", "</think>"),
    ),
    "llama3": ChatFamily(
        "llama",
        "llama3.jinja",
        ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        "<|eot_id|>",
        "<|end_of_text|>",
        bos="<|begin_of_text|>",
    ),
}


def chat_tokenizer(name: str):
    """A transformers fast tokenizer of this family (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in fam.specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in fam.added])
    if fam.bos is not None:
        bos_id = tok.token_to_id(fam.bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{fam.bos} $A", pair=f"{fam.bos} $A {fam.bos} $B", special_tokens=[(fam.bos, bos_id)]
        )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fam.end_of_text, bos_token=fam.bos, pad_token=fam.end_of_text)
    hf.chat_template = (TEMPLATES / fam.template).read_text()
    return hf


def write_chat_model(root: Path, name: str) -> Path:
    """A model directory of this family: tokenizer, config.json whose eos is the end of text, and
    generation_config.json that adds the end-of-turn token, as chat models ship it."""
    fam = FAMILIES[name]
    tokenizer = chat_tokenizer(name)
    eot, eos = tokenizer.convert_tokens_to_ids([fam.end_of_turn, fam.end_of_text])
    path, model = write_hf_model(
        root,
        fam.model_family,
        vocab_size=len(tokenizer),
        eos_token_id=eos,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
        max_position_embeddings=512,
    )
    answer = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(ANSWER))[0]
    with torch.no_grad():
        for layer in model.model.layers:  # the residual stream stays the current token's embedding
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        # Every token embeds to e0, ANSWER to e0 + e1; after the final norm the head scores
        # ANSWER by e0 and the end of turn twice as high by e1: ANSWER follows any prompt token,
        # the end of turn follows ANSWER.
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0
        emb[answer, 1] = 1.0
        head.zero_()
        head[answer, 0] = 50.0
        head[eot, 1] = 100.0
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eot, eos]}))
    return path


def lay_out_hub_repo(
    cache: Path, repo_id: str, source: Path, repo_type: str = "model", commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """Copy the files under `source` into a Hub cache as the `main` snapshot of `repo_id`, the
    layout snapshot_download writes (blobs omitted: files are copied into the snapshot)."""
    import shutil

    prefix = {"model": "models", "dataset": "datasets"}[repo_type]
    repo = cache / f"{prefix}--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def offline_hub(monkeypatch, cache: Path) -> None:
    """Point huggingface_hub (in this process and in subprocesses) and datasets at `cache`, offline."""
    import datasets
    from huggingface_hub import constants

    for var, value in (
        ("HF_HUB_CACHE", cache),
        ("HF_HUB_OFFLINE", "1"),
        ("HF_DATASETS_OFFLINE", "1"),
        ("HF_DATASETS_CACHE", cache.parent / "datasets-cache"),
    ):
        monkeypatch.setenv(var, str(value))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache.parent / "datasets-cache")
