"""The policy's tool calls read from the text of its turn, in its model family's format.

- "hermes" (Qwen2.5, Qwen3 and other Hermes-style templates): zero or more blocks
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` anywhere in the turn (after its
  thinking, if it has a `<think>` part).
- "llama3" (Llama 3.1/3.2/3.3): the whole turn, possibly after `<|python_tag|>`, is a JSON object
  `{"name": ..., "parameters": {...}}` ("arguments" accepted too), or several separated by `;` or
  newlines.

`parse_tool_calls` gives one `ToolCall` per well-formed call and one `ToolCallError` per malformed
one, never an exception.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

FORMATS = ("hermes", "llama3")


@dataclass
class ToolCall:
    """One well-formed call from the policy's turn."""

    name: str
    arguments: dict
    raw: str
    """The call's text as the policy wrote it (the block's body, or the JSON object)."""


@dataclass
class ToolCallError:
    """A call the policy tried to make that could not be read; it becomes a "malformed" result."""

    raw: str
    reason: str
    name: str | None = None
    """The tool's name, where the text gave one."""


def detect_format(tokenizer_or_template_text: Any) -> str:
    """The call format of a chat template: "hermes" when it mentions `<tool_call>`, "llama3" when it
    mentions `<|python_tag|>` or the "ipython" role (or is a Llama 3 template at all: its headers
    `<|start_header_id|>`, as Llama 3.0's template that renders no tools); otherwise "hermes".

    Takes the template's text or a tokenizer (its `chat_template`; a dict of named templates is
    read as a whole)."""
    text = tokenizer_or_template_text
    if not isinstance(text, str):
        text = getattr(text, "chat_template", None)
    if isinstance(text, dict):
        text = "\n".join(str(v) for v in text.values())
    if not text:
        return "hermes"
    if "<tool_call>" in text:
        return "hermes"
    if "<|python_tag|>" in text or "ipython" in text or "<|start_header_id|>" in text:
        return "llama3"
    return "hermes"


def parse_tool_calls(text: str, fmt: str) -> list[ToolCall | ToolCallError]:
    """The tool calls in one turn's decoded text, in order; [] when the turn calls no tool.

    A malformed call (bad JSON, no name, arguments that are not an object, an unclosed
    `<tool_call>` at the end of a turn that ran out of tokens) is a ToolCallError entry."""
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3":
        return _parse_llama3(text)
    raise ValueError(f"unknown tool call format {fmt!r}; one of {', '.join(FORMATS)}")


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _after_thinking(text: str) -> str:
    """The turn's text after its thinking: calls written while thinking are not made. A turn that
    ran out of tokens while thinking (`<think>` never closed) has no text after it."""
    if "</think>" in text:
        return text.rsplit("</think>", 1)[1]
    if "<think>" in text:
        return text.split("<think>", 1)[0]
    return text


def _parse_hermes(text: str) -> list[ToolCall | ToolCallError]:
    text = _after_thinking(text)
    calls: list[ToolCall | ToolCallError] = []
    pos = text.find(_OPEN)
    while pos != -1:
        start = pos + len(_OPEN)
        close = text.find(_CLOSE, start)
        reopen = text.find(_OPEN, start)
        if close == -1 or (reopen != -1 and reopen < close):
            end = len(text) if reopen == -1 else reopen
            body = text[start:end].strip()
            reason = (
                f"unclosed {_OPEN} (the turn ended before {_CLOSE})"
                if reopen == -1
                else f"{_OPEN} without {_CLOSE} before the next {_OPEN}"
            )
            calls.append(ToolCallError(raw=body, reason=reason, name=_name_in(body)))
            pos = reopen
            continue
        body = text[start:close].strip()
        calls.append(_call_from_json_text(body))
        pos = text.find(_OPEN, close + len(_CLOSE))
    return calls


_PYTHON_TAG = "<|python_tag|>"
_LLAMA_END_TOKENS = ("<|eom_id|>", "<|eot_id|>")


def _parse_llama3(text: str) -> list[ToolCall | ToolCallError]:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    if tagged:
        body = body[len(_PYTHON_TAG) :].lstrip()
    for end in _LLAMA_END_TOKENS:
        if body.endswith(end):
            body = body[: -len(end)].rstrip()
    if not tagged and not body.startswith("{"):
        return []  # a plain answer
    if not body:
        return [ToolCallError(raw="", reason=f"nothing after {_PYTHON_TAG}")]
    decoder = json.JSONDecoder()
    calls: list[ToolCall | ToolCallError] = []
    pos = 0
    while pos < len(body):
        if not body.startswith("{", pos):
            rest = body[pos:].strip()
            if not calls and not tagged:
                return []
            calls.append(
                ToolCallError(
                    raw=rest, reason="expected a JSON object {\"name\": ..., \"parameters\": {...}}", name=_name_in(rest)
                )
            )
            break
        try:
            obj, end = decoder.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            rest = body[pos:].strip()
            if not calls and not tagged and '"name"' not in rest:
                return []  # text that starts with a brace, not a call
            calls.append(ToolCallError(raw=rest, reason=f"invalid JSON ({e.msg} at char {e.pos - pos})", name=_name_in(rest)))
            break
        if not calls and not tagged and not _looks_like_call(obj):
            return []  # a JSON answer, not a call
        calls.append(_call_from_object(obj, body[pos:end]))
        pos = end
        while pos < len(body) and (body[pos].isspace() or body[pos] == ";"):
            pos += 1
    return calls


def _looks_like_call(obj: Any) -> bool:
    if not isinstance(obj, dict):
        return False
    if isinstance(obj.get("function"), dict):
        return True
    return bool({"name", "parameters", "arguments"} & obj.keys())


def _call_from_json_text(raw: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(raw=raw, reason=f"invalid JSON ({e.msg} at char {e.pos})", name=_name_in(raw))
    return _call_from_object(obj, raw)


def _call_from_object(obj: Any, raw: str) -> ToolCall | ToolCallError:
    if not isinstance(obj, dict):
        return ToolCallError(raw=raw, reason=f"the call is not a JSON object but {_json_kind(obj)}")
    if isinstance(obj.get("function"), dict):  # OpenAI style {"type": "function", "function": {...}}
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return ToolCallError(raw=raw, reason='missing "name" (a non-empty string)')
    name = name.strip()
    key = "arguments" if "arguments" in obj else "parameters"
    arguments = obj.get(key)
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            return ToolCallError(raw=raw, reason=f'"{key}" is a string that is not JSON ({e.msg})', name=name)
    if not isinstance(arguments, dict):
        return ToolCallError(raw=raw, reason=f'"{key}" is not a JSON object but {_json_kind(arguments)}', name=name)
    return ToolCall(name=name, arguments=arguments, raw=raw)


def _json_kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return "null" if value is None else type(value).__name__


def _name_in(raw: str) -> str | None:
    m = re.search(r'"name"\s*:\s*"([^"\\]{1,200})"', raw)
    return m.group(1) if m else None
