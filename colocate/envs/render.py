"""Observations rendered into token ids, once and incrementally, in the chat template's own format.

A multi-turn episode's trained sequence is the first prompt's ids, then for each turn the ids the
engine sampled and the ids of the observation that follows, appended as they come. Nothing is
decoded and encoded again: re-encoding a conversation can split the policy's text into other
tokens than it sampled (the known source of train/rollout mismatch in multi-turn RL).

The observation's text is what the chat template adds when the messages follow the conversation:
rendered after a fixed one-message conversation and cut off where that conversation ends, so
earlier turns never enter it. In front go the ids that close an assistant turn in this template
(Qwen's `<|im_end|>` and "\\n"), less its end token when the turn's last sampled token closed it
already (that token, or Llama's `<|eom_id|>` after a tool call). Special-token strings inside the
messages' text are broken up, so a tool's output cannot write the template's markup.
"""

from __future__ import annotations

from typing import Any

from colocate.rollout.prompts import render_chat

_MARK = "COLOCATE_TURN_MARK"


class TurnRenderer:
    """The prompt and observation ids of one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, template_kwargs: dict | None = None, system_prompt: str | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("rollout.env: the tokenizer has no chat template to render the episodes' turns with")
        self.tokenizer, self.kwargs, self.system_prompt = tokenizer, dict(template_kwargs or {}), system_prompt
        closed = self._render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _MARK}], False)
        self.closing_ids = self.encode(closed[closed.rindex(_MARK) + len(_MARK) :])
        """What the template writes after an assistant message's content (Qwen: <|im_end|>, "\\n")."""
        added = getattr(tokenizer, "added_tokens_decoder", {})
        special_ids = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
        end = self.closing_ids[0] if self.closing_ids and self.closing_ids[0] in special_ids else None
        eom = tokenizer.convert_tokens_to_ids("<|eom_id|>") if "<|eom_id|>" in tokenizer.get_vocab() else None
        self._closers = {t for t in (end, eom) if t is not None}
        """Token ids that close an assistant turn when sampled last."""
        self._specials = sorted({tokenizer.convert_ids_to_tokens(i) for i in special_ids}, key=len, reverse=True)

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def prompt(self, messages: list[dict], tools: list[dict] | None = None) -> tuple[str, list[int]]:
        """The first observation: its text and ids, ending with the assistant's generation prompt."""
        text = render_chat(self.tokenizer, messages, self.system_prompt, self.kwargs, tools)
        return text, self.encode(text)

    def observation(self, messages: list[dict], turn_ids: list[int]) -> list[int]:
        """Ids to append after a turn that sampled `turn_ids`: the end of the assistant's turn, then
        `messages` and the next generation prompt."""
        base = [{"role": "user", "content": _MARK}]
        before = self._render(base, False)
        full = self._render(base + [self._escaped(m) for m in messages], True)
        if not full.startswith(before):
            raise ValueError(
                "the chat template renders a conversation differently once messages follow it, so "
                "observations cannot be rendered incrementally"
            )
        closed = bool(turn_ids) and turn_ids[-1] in self._closers
        closing = self.closing_ids[1:] if closed else self.closing_ids
        return closing + self.encode(full[len(before) :])

    def _escaped(self, message: dict) -> dict:
        content = message.get("content")
        if not isinstance(content, str) or "<" not in content:
            return message
        for token in self._specials:
            content = content.replace(token, token[:1] + "\u200b" + token[1:])
        return {**message, "content": content}
