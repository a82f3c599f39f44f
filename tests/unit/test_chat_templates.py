"""Prompts rendered by the published chat templates of Qwen2.5, Qwen3 and Llama 3, with a system
prompt and Qwen3's thinking switch, as the trainer tokenises them; and the config fields."""

from __future__ import annotations

import json

import pytest

from colocate.config_loading import load_config
from colocate.rollout.prompts import PromptDataset
from tests.real_models import FAMILIES, chat_tokenizer

QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
QUESTION = "What is 2+3?"

# The rendered prompt as pieces: special (and added) tokens alone, plain text between them.
EXPECTED = {
    ("qwen2.5", None, None): [
        "<|im_start|>",
        f"system\n{QWEN_DEFAULT_SYSTEM}",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        f"user\n{QUESTION}",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant\n",
    ],
    ("qwen2.5", "Be brief.", None): [
        "<|im_start|>",
        "system\nBe brief.",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        f"user\n{QUESTION}",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant\n",
    ],
    ("qwen3", None, None): ["<|im_start|>", f"user\n{QUESTION}", "<|im_end|>", "\n", "<|im_start|>", "assistant\n"],
    ("qwen3", "Be brief.", False): [
        "<|im_start|>",
        "system\nBe brief.",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        f"user\n{QUESTION}",
        "<|im_end|>",
        "\n",
        "<|im_start|>",
        "assistant\n",
        "<think>",
        "\n\n",
        "</think>",
        "\n\n",
    ],
    ("llama3", None, None): [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "user",
        "<|end_header_id|>",
        f"\n\n{QUESTION}",
        "<|eot_id|>",
        "<|start_header_id|>",
        "assistant",
        "<|end_header_id|>",
        "\n\n",
    ],
    ("llama3", "Be brief.", None): [
        "<|begin_of_text|>",
        "<|start_header_id|>",
        "system",
        "<|end_header_id|>",
        "\n\nBe brief.",
        "<|eot_id|>",
        "<|start_header_id|>",
        "user",
        "<|end_header_id|>",
        f"\n\n{QUESTION}",
        "<|eot_id|>",
        "<|start_header_id|>",
        "assistant",
        "<|end_header_id|>",
        "\n\n",
    ],
}


def piece_ids(tok, name: str, pieces: list[str]) -> list[int]:
    fam = FAMILIES[name]
    ids = []
    for piece in pieces:
        if piece in fam.specials + fam.added:
            ids.append(tok.convert_tokens_to_ids(piece))
        else:
            plain = tok.encode(piece, add_special_tokens=False)
            assert len(plain) == len(piece.encode())  # one token per byte
            ids += plain
    return ids


@pytest.mark.parametrize("name, system, thinking", list(EXPECTED), ids=lambda v: str(v))
def test_rendered_prompt_ids(tmp_path, name, system, thinking):
    tok = chat_tokenizer(name)
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION, "label": "5"}) + "\n")
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    ds = PromptDataset(data, tok, apply_chat_template=True, system_prompt=system, chat_template_kwargs=kwargs)
    pieces = EXPECTED[(name, system, thinking)]
    assert ds[0].prompt_text == "".join(pieces)
    assert ds[0].prompt_ids == piece_ids(tok, name, pieces)


def test_llama3_prompts_carry_one_bos_and_qwen3_keeps_think_tags_when_decoded(tmp_path):
    llama = chat_tokenizer("llama3")
    bos = llama.convert_tokens_to_ids("<|begin_of_text|>")
    assert llama.encode("hi")[0] == bos  # the tokenizer adds BOS to plain text...
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": "hi", "label": "x"}) + "\n")
    ids = PromptDataset(data, llama, apply_chat_template=True)[0].prompt_ids
    assert ids[0] == bos and ids.count(bos) == 1  # ...and a chat prompt has the template's only
    qwen3 = chat_tokenizer("qwen3")
    ids = qwen3.encode("<think>\nno\n</think>\n\n5<|im_end|>", add_special_tokens=False)
    assert qwen3.decode(ids, skip_special_tokens=True) == "<think>\nno\n</think>\n\n5"


def test_a_prompt_with_its_own_system_message_keeps_it(tmp_path):
    tok = chat_tokenizer("qwen2.5")
    data = tmp_path / "p.jsonl"
    messages = [{"role": "system", "content": "Own."}, {"role": "user", "content": QUESTION}]
    data.write_text(json.dumps({"prompt": messages, "label": "5"}) + "\n")
    ds = PromptDataset(data, tok, apply_chat_template=True, system_prompt="Configured.")
    assert ds[0].prompt_text.startswith("<|im_start|>system\nOwn.<|im_end|>\n<|im_start|>user\n")


def test_config_fields_from_yaml_and_command_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "rollout:\n  apply_chat_template: true\n  system_prompt: Be brief.\n  chat_template_kwargs: {enable_thinking: false}\n"
    )
    cfg = load_config(["--config", str(path)])
    assert cfg.rollout.system_prompt == "Be brief." and cfg.rollout.chat_template_kwargs == {"enable_thinking": False}
    cfg = load_config(
        ["--config", str(path), "--rollout.chat-template-kwargs.enable-thinking", "True", "--rollout.system-prompt", "Think."]
    )
    assert cfg.rollout.system_prompt == "Think." and cfg.rollout.chat_template_kwargs == {"enable_thinking": True}
    cfg = load_config(["--rollout.apply-chat-template", "True", "--rollout.chat-template-kwargs", "enable_thinking", "False"])
    assert cfg.rollout.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(
    "yaml_text, message",
    [
        (
            "rollout:\n  system_prompt: Be brief.\n",
            "{path}: rollout.system_prompt needs rollout.apply_chat_template (or rollout.env), got 'Be brief.'",
        ),
        (
            "rollout:\n  chat_template_kwargs: {enable_thinking: false}\n",
            "{path}: rollout.chat_template_kwargs needs rollout.apply_chat_template (or rollout.env), "
            "got {{'enable_thinking': False}}",
        ),
        (
            "rollout:\n  apply_chat_template: true\n  chat_template_kwargs: [enable_thinking]\n",
            "{path}: rollout.chat_template_kwargs must be a mapping with string keys, got ['enable_thinking']",
        ),
        (
            "rollout:\n  apply_chat_template: true\n  chat_template_kwargs: {tools: [a]}\n",
            "{path}: rollout.chat_template_kwargs.tools must be a bool, number or string, got ['a']",
        ),
    ],
)
def test_config_fields_are_checked(tmp_path, yaml_text, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError) as e:
        load_config(["--config", str(path)])
    assert str(e.value) == message.format(path=path)
