"""Tools for multi-turn agentic RL: their schemas, the policy's calls run, and the results handed
back as chat messages.

A tool is a typed Python function with a Google-style docstring (an `Args:` section describing each
argument); `tool_schemas` turns tools into the JSON schemas a chat template's `tools` takes (through
transformers' `get_json_schema`). The policy calls them in its text (colocate/envs/tool_calls.py
reads the calls); `ToolRunner.run` runs them and gives one `ToolResult` per call, errors included as
text the policy reads ("Error: unknown tool 'foo'; available: python, search"); `tool_messages`
wraps the results as the chat messages the template renders ("tool", or Llama's "ipython"). The
episode runner (colocate/envs/episodes.py) does all of this for the tools an episode offers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from colocate.envs.tool_calls import FORMATS, ToolCall, ToolCallError

ERROR_KINDS = ("malformed", "unknown_tool", "bad_arguments", "raised", "timeout", "not_run")
MAX_CALLS_PER_TURN = 8
"""Calls of one turn that run; the rest are answered "not run" (a turn's calls run one after another)."""

_EXCEPTION_TEXT_CHARS = 2000
"""An exception's message is cut to this many characters in the content the policy sees."""


# --------------------------------------------------------------------------------------- schemas


def tool_schemas(tools: list[Callable]) -> list[dict]:
    """The JSON schema of each tool (`{"type": "function", "function": {name, description,
    parameters, ...}}`), for a chat template's `tools`.

    Each tool needs a type hint on every argument and a docstring whose `Args:` section describes
    each argument; a tool that lacks one, or two tools of the same name, raise ValueError."""
    from transformers.utils import get_json_schema

    schemas, seen = [], set()
    for fn in tools:
        name = _tool_name(fn)
        _check_documented(fn, name)
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # transformers' TypeHintParsingException / DocstringParsingException
            reason = " ".join(str(e).split())
            raise ValueError(f"tool {name!r} has no usable JSON schema: {reason}") from None
        if name in seen:
            raise ValueError(f"two tools are named {name!r}: tool names must be unique")
        seen.add(name)
        schemas.append(schema)
    return schemas


def _tool_name(fn: Callable) -> str:
    if not callable(fn):
        raise ValueError(f"a tool must be a function, got {type(fn).__name__}: {fn!r}")
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str) or not name or name == "<lambda>":
        raise ValueError(f"a tool must be a named function (def ...), got {fn!r}")
    return name


def _check_documented(fn: Callable, name: str) -> None:
    """The one-line reasons get_json_schema would give less plainly: a missing type hint, docstring
    or Args: section."""
    try:
        params = [p for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"tool {name!r} has no inspectable signature: {e}") from None
    untyped = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if untyped:
        raise ValueError(f"tool {name!r} is missing type hints for argument(s) {', '.join(map(repr, untyped))}")
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {name!r} has no docstring (it needs a description and an Args: section)")
    if params and not re.search(r"^\s*Args:\s*$", doc, re.MULTILINE):
        raise ValueError(f"tool {name!r} has no Args: section in its docstring describing its arguments")


# --------------------------------------------------------------------------------------- running


@dataclass
class ToolResult:
    """One call's outcome, as the policy sees it."""

    name: str
    """The tool's name ("" for a malformed call that gave none)."""
    content: str
    """What the policy reads: the tool's return value as text, or "Error: ..."."""
    error: str | None = None
    """None, or one of ERROR_KINDS: "malformed", "unknown_tool", "bad_arguments", "raised", "timeout"."""


def tool_counts(results: list[ToolResult]) -> dict[str, int]:
    """Counts of a list of results: "calls" (every entry, malformed ones included), "errors" (all
    kinds, timeouts included), "timeouts", and "errors/<kind>" for each error kind."""
    counts = {"calls": len(results), "errors": 0, "timeouts": 0, **{f"errors/{k}": 0 for k in ERROR_KINDS}}
    for r in results:
        if r.error is not None:
            counts["errors"] += 1
            counts[f"errors/{r.error}"] += 1
            if r.error == "timeout":
                counts["timeouts"] += 1
    return counts


class _TimedOut(Exception):
    pass


class _BadArgument(Exception):
    pass


class ToolRunner:
    """Runs the policy's tool calls; built once from the tools, shared by the episodes of a rank
    (thread-safe). Call `run` from a worker thread: it blocks while the tools run, one call after
    another in the order the policy wrote them; `tool_counts` counts its results.

    Every failure becomes an error content the policy reads, never an exception: a malformed call,
    an unknown tool, arguments that do not bind to the tool's signature or do not fit its type
    hints, a tool that raises, and a tool that runs past `timeout_s`.

    Each call runs in a daemon thread of its own; at `timeout_s` the runner stops waiting for it and
    reports a timeout. Python cannot stop a thread, so a timed-out sync tool keeps running in its
    thread until it returns on its own (its result is dropped): a tool that can hang should enforce
    its own limit, as the sandboxed `python` tool does with its subprocess. An async tool (a
    coroutine function) runs in an event loop of its own in that thread and is cancelled at the
    timeout (unless it blocks its loop)."""

    def __init__(self, tools: list[Callable], timeout_s: float = 30.0):
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.schemas = tool_schemas(tools)
        self.tools = {_tool_name(fn): fn for fn in tools}
        self.timeout_s = float(timeout_s)
        self._hints = {name: _type_hints(fn) for name, fn in self.tools.items()}
        self._signatures = {name: inspect.signature(fn) for name, fn in self.tools.items()}

    def run(self, calls: list[ToolCall | ToolCallError]) -> list[ToolResult]:
        """One result per entry of `calls` (as `parse_tool_calls` gives them), in order; past
        MAX_CALLS_PER_TURN a call is not run, and its result says so."""
        skipped = [
            ToolResult(
                getattr(c, "name", None) or "",
                f"Error: more than {MAX_CALLS_PER_TURN} tool calls in one turn; this one was not run",
                "not_run",
            )
            for c in calls[MAX_CALLS_PER_TURN:]
        ]
        return [self._run_one(call) for call in calls[:MAX_CALLS_PER_TURN]] + skipped

    def _run_one(self, call: ToolCall | ToolCallError) -> ToolResult:
        if isinstance(call, ToolCallError):
            return ToolResult(call.name or "", f"Error: malformed tool call: {call.reason}", "malformed")
        fn = self.tools.get(call.name)
        if fn is None:
            available = ", ".join(self.tools) or "none"
            return ToolResult(call.name, f"Error: unknown tool {call.name!r}; available: {available}", "unknown_tool")
        try:
            kwargs = self._bind(call.name, call.arguments)
        except _BadArgument as e:
            return ToolResult(call.name, f"Error: bad arguments for tool {call.name!r}: {e}", "bad_arguments")
        try:
            value = _call_with_timeout(fn, kwargs, self.timeout_s)
        except _TimedOut:
            return ToolResult(call.name, f"Error: tool {call.name!r} timed out after {self.timeout_s:g} s", "timeout")
        except BaseException as e:
            return ToolResult(call.name, f"Error: tool {call.name!r} raised {_describe(e)}", "raised")
        return ToolResult(call.name, _as_text(value))

    def _bind(self, name: str, arguments: dict) -> dict:
        sig, hints = self._signatures[name], self._hints[name]
        try:
            bound = sig.bind(**arguments)
        except TypeError as e:
            raise _BadArgument(str(e)) from None
        kwargs = dict(bound.arguments)
        for arg, value in kwargs.items():
            param = sig.parameters[arg]
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD) or arg not in hints:
                continue
            kwargs[arg] = _coerce(value, hints[arg], repr(arg))
        # back to keywords (a **kwargs parameter's dict spread out again)
        out = {}
        for arg, value in kwargs.items():
            if sig.parameters[arg].kind is inspect.Parameter.VAR_KEYWORD:
                out.update(value)
            else:
                out[arg] = value
        return out


def _type_hints(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolvable string annotations: no checking
        return {}


def _call_with_timeout(fn: Callable, kwargs: dict, timeout_s: float) -> Any:
    """fn(**kwargs) in a daemon thread; raises _TimedOut at timeout_s, or what fn raised."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def target():
        try:
            value = fn(**kwargs)
            if inspect.isawaitable(value):
                value = asyncio.run(_await_with_timeout(value, timeout_s))
            box["value"] = value
        except BaseException as e:  # reported to the policy, SystemExit included
            box["error"] = e
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"tool-{getattr(fn, '__name__', 'fn')}", daemon=True)
    thread.start()
    if not done.wait(timeout_s):
        raise _TimedOut
    if "error" in box:
        raise box["error"]
    return box["value"]


async def _await_with_timeout(awaitable: Any, timeout_s: float) -> Any:
    """Like asyncio.wait_for, but a TimeoutError the tool raises itself stays the tool's."""
    task = asyncio.ensure_future(awaitable)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        raise _TimedOut
    return task.result()


def _describe(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if len(text) > _EXCEPTION_TEXT_CHARS:
        text = text[:_EXCEPTION_TEXT_CHARS] + " ..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str, ensure_ascii=False)
    except (TypeError, ValueError):  # circular references and the like
        return repr(value)


# ---- light type checking and coercion of JSON arguments against the tool's type hints

_TYPE_WORDS = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean (true or false)",
    list: "a list (JSON array)",
    dict: "an object (JSON object)",
    tuple: "a list (JSON array)",
}


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _hint_words(hint: Any) -> str:
    origin = typing.get_origin(hint) or hint
    if origin in _TYPE_WORDS:
        return _TYPE_WORDS[origin]
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _coerce(value: Any, hint: Any, where: str) -> Any:
    """`value` checked against `hint` and converted where the JSON form is a plain stand-in ("3" or
    3.0 for an int, 3 for a float, "true" for a bool, a JSON string for a list or dict); raises
    _BadArgument naming `where`. Types other than str/int/float/bool/list/dict/tuple, Optional,
    unions of those and Literal pass unchecked."""
    if hint is Any or hint is inspect.Parameter.empty:
        return value
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union or (hasattr(types, "UnionType") and origin is types.UnionType):
        if value is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        if len(options) == 1:  # Optional[X]: X's own message
            return _coerce(value, options[0], where)
        for option in options:  # an exact fit first: "5" for int | str stays a string
            if _fits_exactly(value, option):
                return value
        for option in options:
            try:
                return _coerce(value, option, where)
            except _BadArgument:
                pass
        raise _BadArgument(f"argument {where} should be {' or '.join(_hint_words(o) for o in options)}, got {_shown(value)}")
    if origin is typing.Literal:
        if value in args:
            return value
        raise _BadArgument(f"argument {where} should be one of {', '.join(_shown(a) for a in args)}, got {_shown(value)}")
    base = origin or hint
    bad = _BadArgument(f"argument {where} should be {_hint_words(hint)}, got {_shown(value)}")
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        raise bad
    if base in (int, float):  # numbers, integral floats for an int, and numbers written as text
        if isinstance(value, bool):
            raise bad
        if isinstance(value, str):
            try:
                return base(value.strip())
            except ValueError:
                raise bad from None
        if base is int and isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, (int, float)) and (base is float or isinstance(value, int)):
            return base(value)
        raise bad
    if base is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise bad
    if base in (list, tuple):
        if isinstance(value, str):
            value = _json_or(value, bad)
        if not isinstance(value, (list, tuple)):
            raise bad
        if base is tuple:
            return tuple(value)
        if args:
            return [_coerce(v, args[0], f"{where}[{i}]") for i, v in enumerate(value)]
        return list(value)
    if base is dict:
        if isinstance(value, str):
            value = _json_or(value, bad)
        if not isinstance(value, dict):
            raise bad
        if len(args) == 2:
            return {k: _coerce(v, args[1], f"{where}[{k!r}]") for k, v in value.items()}
        return value
    return value


def _fits_exactly(value: Any, hint: Any) -> bool:
    base = typing.get_origin(hint) or hint
    if base is bool:
        return isinstance(value, bool)
    if base in (int, float):
        return isinstance(value, base) and not isinstance(value, bool)
    if base in (str, list, dict):
        return isinstance(value, base) and not typing.get_args(hint)
    return False


def _json_or(text: str, bad: _BadArgument) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise bad from None


# --------------------------------------------------------------------------------------- messages


def tool_messages(results: list[ToolResult], fmt: str) -> list[dict]:
    """The chat messages that hand the results back, one per result, in order.

    "hermes": role "tool" (Qwen's templates gather consecutive ones into one user turn of
    `<tool_response>` blocks). "llama3": role "ipython", the role Llama 3.1+'s templates render a
    "tool" message as, and the one a Llama 3.0 template (which renders roles verbatim) must be given.
    Each carries "name" too, for templates that show it (these do not)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown tool call format {fmt!r}; one of {', '.join(FORMATS)}")
    role = "tool" if fmt == "hermes" else "ipython"
    return [{"role": role, "name": r.name, "content": r.content} for r in results]
