"""Tools for multi-turn RL (colocate/envs/tools.py): schemas from typed, documented functions and
how the chat templates render them; the policy's calls parsed in the Hermes (Qwen) and Llama 3
formats, malformed ones included; the calls run with every failure turned into text the policy
reads; the results rendered back as tool messages."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from colocate.envs.tool_calls import ToolCall, ToolCallError, detect_format, parse_tool_calls
from colocate.envs.tools import ToolResult, ToolRunner, tool_counts, tool_messages, tool_schemas
from tests.real_models import TEMPLATES, chat_tokenizer

# The published Llama 3.1 Instruct template (meta-llama/Llama-3.1-8B-Instruct): tests/chat_templates/
# llama3.jinja is Llama 3.0's, which renders no tools.
LLAMA31_TEMPLATE = (TEMPLATES / "llama3.1.jinja").read_text()
"""Llama 3.1 Instruct's template (tests/chat_templates/llama3.jinja is Llama 3.0's, which renders no tools)."""


# ----------------------------------------------------------------------------------- tools used


def search(query: str, k: int = 3, exact: bool = False, tags: list[str] | None = None) -> list[str]:
    """Search the notes.

    Args:
        query: What to look for.
        k: How many hits to return.
        exact: Match the whole query only.
        tags: Only notes with one of these tags.
    """
    return [f"{query}#{i}" for i in range(k)] + (["exact"] if exact else [])


def add(a: int, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def echo(text: str) -> str:
    """Say it back.

    Args:
        text: The text.
    """
    return text


def divide(a: float, b: float) -> float:
    """Divide.

    Args:
        a: Numerator.
        b: Denominator.
    """
    return a / b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "woke"


async def fetch(url: str, delay: float = 0.0) -> dict:
    """Fetch a page (pretend).

    Args:
        url: The address.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return {"url": url, "status": 200}


# ----------------------------------------------------------------------------------- schemas


def test_schema_of_a_typed_documented_function():
    (schema,) = tool_schemas([search])
    assert schema["type"] == "function"
    fn = schema["function"]
    assert fn["name"] == "search"
    assert fn["description"] == "Search the notes."
    params = fn["parameters"]
    assert params["type"] == "object"
    assert params["required"] == ["query"]
    props = params["properties"]
    assert list(props) == ["query", "k", "exact", "tags"]
    assert props["query"] == {"type": "string", "description": "What to look for."}
    assert props["k"] == {"type": "integer", "description": "How many hits to return."}
    assert props["exact"] == {"type": "boolean", "description": "Match the whole query only."}
    assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
    assert props["tags"]["description"] == "Only notes with one of these tags."


def untyped(x):
    """Untyped.

    Args:
        x: An x.
    """


def undocumented(x: int):
    return x


def no_args_section(x: int):
    """Has a description but no Args: section."""


def undescribed_arg(x: int, y: int):
    """One argument described.

    Args:
        x: An x.
    """


@pytest.mark.parametrize(
    "fn, words",
    [
        (untyped, ["'untyped'", "type hint", "'x'"]),
        (undocumented, ["'undocumented'", "no docstring"]),
        (no_args_section, ["'no_args_section'", "Args:"]),
        (undescribed_arg, ["'undescribed_arg'", "y"]),
    ],
)
def test_schema_refuses_untyped_or_undocumented_functions(fn, words):
    with pytest.raises(ValueError) as info:
        tool_schemas([echo, fn])
    message = str(info.value)
    assert "\n" not in message
    for word in words:
        assert word in message


def test_schema_refuses_duplicate_names_and_lambdas():
    with pytest.raises(ValueError, match="two tools are named 'echo'"):
        tool_schemas([echo, echo])
    with pytest.raises(ValueError, match="named function"):
        tool_schemas([lambda x: x])


def test_schemas_render_into_the_system_prompts():
    schemas = tool_schemas([search, add])
    messages = [{"role": "user", "content": "Find cats."}]
    for name in ("qwen3", "qwen2.5"):
        text = chat_tokenizer(name).apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\n") and "# Tools" in system
        tools_block = system.split("<tools>\n")[1].split("\n</tools>")[0]
        assert [json.loads(line) for line in tools_block.splitlines()] == schemas
        assert "<tool_call>" in system
    llama = chat_tokenizer("llama3")
    llama.chat_template = LLAMA31_TEMPLATE
    text = llama.apply_chat_template(messages, tools=schemas, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n")
    assert json.dumps(schemas[0], indent=4) in text and json.dumps(schemas[1], indent=4) in text
    assert '"parameters": dictionary of argument name and its value' in text
    assert text.endswith("Find cats.<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n")


# ----------------------------------------------------------------------------------- parsing


def test_hermes_one_call_with_text_around_it():
    text = 'Let me look.\n<tool_call>\n{"name": "search", "arguments": {"query": "cats", "k": 2}}\n</tool_call>'
    (call,) = parse_tool_calls(text, "hermes")
    assert call == ToolCall("search", {"query": "cats", "k": 2}, '{"name": "search", "arguments": {"query": "cats", "k": 2}}')
    assert parse_tool_calls("The answer is 4.", "hermes") == []


def test_hermes_two_calls_and_loose_whitespace():
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>  {"name" : "echo",\n "arguments": {"text": "hi"}}   </tool_call>'
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("echo", {"text": "hi"})]


def test_hermes_arguments_as_a_json_string_or_absent():
    text = (
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2.5}"}\n</tool_call>'
        '<tool_call>\n{"name": "now"}\n</tool_call>'
    )
    calls = parse_tool_calls(text, "hermes")
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2.5}), ("now", {})]


def test_hermes_malformed_calls_are_entries_not_exceptions():
    text = (
        '<tool_call>\n{"name": "add", "arguments": {"a": 1,}}\n</tool_call>'  # bad JSON
        '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'  # no name
        '<tool_call>\n{"name": "add", "arguments": [1, 2]}\n</tool_call>'  # arguments not an object
        '<tool_call>\n["add"]\n</tool_call>'  # not an object
        '<tool_call>\n{"name": "echo", "arguments": {"text": "ok"}}\n</tool_call>'
    )
    bad_json, no_name, not_object, array, good = parse_tool_calls(text, "hermes")
    assert isinstance(bad_json, ToolCallError) and bad_json.reason.startswith("invalid JSON")
    assert bad_json.raw == '{"name": "add", "arguments": {"a": 1,}}' and bad_json.name == "add"
    assert isinstance(no_name, ToolCallError) and "name" in no_name.reason and no_name.name is None
    assert isinstance(not_object, ToolCallError) and not_object.reason == '"arguments" is not a JSON object but an array'
    assert isinstance(array, ToolCallError) and "not a JSON object" in array.reason
    assert good == ToolCall("echo", {"text": "ok"}, '{"name": "echo", "arguments": {"text": "ok"}}')


def test_hermes_unclosed_block_at_the_end_of_a_turn():
    text = '<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call>\n<tool_call>\n{"name": "search", "argu'
    good, cut = parse_tool_calls(text, "hermes")
    assert isinstance(good, ToolCall) and good.name == "echo"
    assert isinstance(cut, ToolCallError) and "unclosed <tool_call>" in cut.reason
    assert cut.raw == '{"name": "search", "argu' and cut.name == "search"
    # a block left open before the next one: that one is an error, the next still counts
    text = '<tool_call>\n{"name": "x"\n<tool_call>\n{"name": "echo", "arguments": {"text": "b"}}\n</tool_call>'
    first, second = parse_tool_calls(text, "hermes")
    assert isinstance(first, ToolCallError) and isinstance(second, ToolCall)


def test_hermes_calls_inside_thinking_are_not_made():
    call = '<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call>'
    assert parse_tool_calls(f"<think>\nmaybe {call}\n</think>\n\n{call}", "hermes") == [
        ToolCall("echo", {"text": "a"}, '{"name": "echo", "arguments": {"text": "a"}}')
    ]
    assert parse_tool_calls(f"<think>\nstill thinking {call}", "hermes") == []


def test_llama3_single_call_parameters_or_arguments():
    (call,) = parse_tool_calls('{"name": "search", "parameters": {"query": "cats"}}', "llama3")
    assert call == ToolCall("search", {"query": "cats"}, '{"name": "search", "parameters": {"query": "cats"}}')
    (call,) = parse_tool_calls(' {"type": "function", "name": "add", "arguments": {"a": 1, "b": 2}}\n', "llama3")
    assert (call.name, call.arguments) == ("add", {"a": 1, "b": 2})


def test_llama3_python_tag_prefix():
    (call,) = parse_tool_calls('<|python_tag|>{"name": "echo", "parameters": {"text": "hi"}}<|eom_id|>', "llama3")
    assert (call.name, call.arguments) == ("echo", {"text": "hi"})
    (bad,) = parse_tool_calls('<|python_tag|>brave_search.call(query="cats")', "llama3")
    assert isinstance(bad, ToolCallError) and "expected a JSON object" in bad.reason


def test_llama3_several_calls():
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "echo", "parameters": {"text": "x; y"}}'
    calls = parse_tool_calls(text, "llama3")
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 1, "b": 2}), ("echo", {"text": "x; y"})]
    text = '{"name": "add", "parameters": {"a": 1, "b": 2}}\n{"name": "echo",\n "parameters": {"text": "z"}}'
    assert [c.name for c in parse_tool_calls(text, "llama3")] == ["add", "echo"]


def test_llama3_plain_answers_and_malformed_calls():
    assert parse_tool_calls("The answer is 4.", "llama3") == []
    assert parse_tool_calls('{"answer": 4}', "llama3") == []  # a JSON answer, not a call
    (bad,) = parse_tool_calls('{"name": "add", "parameters": {"a": 1', "llama3")
    assert isinstance(bad, ToolCallError) and bad.reason.startswith("invalid JSON") and bad.name == "add"
    (bad,) = parse_tool_calls('{"parameters": {"a": 1}}', "llama3")
    assert isinstance(bad, ToolCallError) and "name" in bad.reason
    good, trailing = parse_tool_calls('{"name": "echo", "parameters": {"text": "a"}} and then', "llama3")
    assert isinstance(good, ToolCall) and isinstance(trailing, ToolCallError) and trailing.raw == "and then"


def test_parse_refuses_an_unknown_format():
    with pytest.raises(ValueError, match="hermes, llama3"):
        parse_tool_calls("", "mistral")


def test_detect_format_of_the_templates():
    assert detect_format((TEMPLATES / "qwen2.5.jinja").read_text()) == "hermes"
    assert detect_format(chat_tokenizer("qwen3")) == "hermes"
    assert detect_format(chat_tokenizer("llama3")) == "llama3"  # Llama 3.0's: headers, no tools
    assert detect_format(LLAMA31_TEMPLATE) == "llama3"
    assert detect_format("{{ messages }}") == "hermes" and detect_format(None) == "hermes"


# ----------------------------------------------------------------------------------- running


def run_one(runner: ToolRunner, name: str, arguments: dict) -> ToolResult:
    (result,) = runner.run([ToolCall(name, arguments, raw="")])
    return result


def test_runner_runs_a_good_call_and_serialises_non_strings():
    runner = ToolRunner([search, add, echo])
    assert runner.schemas == tool_schemas([search, add, echo])
    assert run_one(runner, "echo", {"text": "hi"}) == ToolResult("echo", "hi", None)
    result = run_one(runner, "search", {"query": "cats", "k": 2, "exact": True})
    assert result.error is None and json.loads(result.content) == ["cats#0", "cats#1", "exact"]
    assert run_one(runner, "add", {"a": 1, "b": 2}).content == "3.0"


def test_runner_unknown_tool():
    runner = ToolRunner([search, echo])
    assert run_one(runner, "foo", {}) == ToolResult("foo", "Error: unknown tool 'foo'; available: search, echo", "unknown_tool")


def test_runner_bad_arguments():
    runner = ToolRunner([search, add])
    missing = run_one(runner, "add", {"a": 1})
    assert missing.error == "bad_arguments"
    assert missing.content == "Error: bad arguments for tool 'add': missing a required argument: 'b'"
    extra = run_one(runner, "add", {"a": 1, "b": 2, "c": 3})
    assert extra.error == "bad_arguments" and "'c'" in extra.content
    wrong = run_one(runner, "add", {"a": "one", "b": 2})
    assert wrong.error == "bad_arguments"
    assert wrong.content == "Error: bad arguments for tool 'add': argument 'a' should be an integer, got \"one\""
    assert run_one(runner, "add", {"a": True, "b": 2}).error == "bad_arguments"  # a bool is no integer
    assert run_one(runner, "add", {"a": 1.5, "b": 2}).error == "bad_arguments"
    bad_item = run_one(runner, "search", {"query": "q", "tags": ["a", {"b": 1}]})
    assert bad_item.error == "bad_arguments" and "argument 'tags'[1] should be a string" in bad_item.content
    assert run_one(runner, "search", {"query": "q", "exact": "maybe"}).error == "bad_arguments"


def test_runner_coerces_plain_stand_ins():
    runner = ToolRunner([search, add])
    assert run_one(runner, "add", {"a": "2", "b": "0.5"}).content == "2.5"  # numbers as strings
    assert run_one(runner, "add", {"a": 2.0, "b": 1}).content == "3.0"  # an integral float for an int
    result = run_one(runner, "search", {"query": 7, "k": "1", "exact": "true", "tags": '["x"]'})
    assert result.error is None and json.loads(result.content) == ["7#0", "exact"]
    assert run_one(runner, "search", {"query": "q", "k": 0, "tags": None}).content == "[]"


def test_runner_reports_a_raising_tool_without_a_traceback():
    result = run_one(ToolRunner([divide]), "divide", {"a": 1, "b": 0})
    assert result == ToolResult("divide", "Error: tool 'divide' raised ZeroDivisionError: float division by zero", "raised")


def test_runner_stops_waiting_at_the_timeout():
    runner = ToolRunner([slow, echo], timeout_s=0.2)
    start = time.monotonic()
    timed_out, after = runner.run([ToolCall("slow", {"seconds": 2}, ""), ToolCall("echo", {"text": "next"}, "")])
    assert time.monotonic() - start < 1.0
    assert timed_out == ToolResult("slow", "Error: tool 'slow' timed out after 0.2 s", "timeout")
    assert after == ToolResult("echo", "next", None)
    assert run_one(runner, "slow", {"seconds": 0.01}).content == "woke"


def test_runner_runs_async_tools_and_times_them_out():
    runner = ToolRunner([fetch], timeout_s=0.2)
    result = run_one(runner, "fetch", {"url": "http://x"})
    assert result.error is None and json.loads(result.content) == {"url": "http://x", "status": 200}
    start = time.monotonic()
    assert run_one(runner, "fetch", {"url": "http://x", "delay": 2}).error == "timeout"
    assert time.monotonic() - start < 1.0


def test_runner_turns_malformed_calls_into_results_and_counts():
    runner = ToolRunner([echo, divide, slow], timeout_s=0.2)
    text = (
        '<tool_call>\n{"name": "echo", "arguments": {"text": "a"}}\n</tool_call>'
        '<tool_call>\n{"name": "echo", "arguments": {"text": }}\n</tool_call>'
        '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
        '<tool_call>\n{"name": "divide", "arguments": {"a": 1, "b": 0}}\n</tool_call>'
        '<tool_call>\n{"name": "slow", "arguments": {"seconds": 1}}\n</tool_call>'
        '<tool_call>\n{"name": "echo", "arguments": {}}\n</tool_call>'
    )
    results = runner.run(parse_tool_calls(text, "hermes"))
    assert [r.error for r in results] == [None, "malformed", "unknown_tool", "raised", "timeout", "bad_arguments"]
    assert results[1].name == "echo" and results[1].content.startswith("Error: malformed tool call: invalid JSON")
    expected = {
        "calls": 6,
        "errors": 5,
        "timeouts": 1,
        "errors/malformed": 1,
        "errors/unknown_tool": 1,
        "errors/bad_arguments": 1,
        "errors/raised": 1,
        "errors/timeout": 1,
        "errors/not_run": 0,
    }
    assert tool_counts(results) == expected


def test_runner_refuses_bad_tools_up_front():
    with pytest.raises(ValueError, match="'untyped'"):
        ToolRunner([untyped])
    with pytest.raises(ValueError, match="timeout_s"):
        ToolRunner([echo], timeout_s=0)


# ----------------------------------------------------------------------------------- messages


def test_tool_messages_render_as_tool_responses_in_qwen3():
    runner = ToolRunner([echo, add])
    results = runner.run(
        [ToolCall("echo", {"text": "first result"}, ""), ToolCall("add", {"a": 1, "b": 2}, ""), ToolCall("nope", {}, "")]
    )
    messages = tool_messages(results, "hermes")
    assert messages[0] == {"role": "tool", "name": "echo", "content": "first result"}
    turn = '<tool_call>\n{"name": "echo", "arguments": {"text": "first result"}}\n</tool_call>'
    conversation = [{"role": "user", "content": "Go."}, {"role": "assistant", "content": turn}, *messages]
    for name in ("qwen3", "qwen2.5"):
        text = chat_tokenizer(name).apply_chat_template(
            conversation, tools=tool_schemas([echo, add]), tokenize=False, add_generation_prompt=True
        )
        assert text.endswith(
            "<|im_start|>user\n<tool_response>\nfirst result\n</tool_response>\n<tool_response>\n3.0\n</tool_response>\n"
            "<tool_response>\nError: unknown tool 'nope'; available: echo, add\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )


def test_tool_messages_render_as_ipython_turns_in_llama3():
    results = [ToolResult("echo", "first result"), ToolResult("add", "3.0")]
    messages = tool_messages(results, "llama3")
    assert [m["role"] for m in messages] == ["ipython", "ipython"]
    conversation = [
        {"role": "user", "content": "Go."},
        {"role": "assistant", "content": '{"name": "echo", "parameters": {"text": "first result"}}'},
        *messages,
    ]
    llama31 = chat_tokenizer("llama3")
    llama31.chat_template = LLAMA31_TEMPLATE
    text = llama31.apply_chat_template(conversation, tools=tool_schemas([echo, add]), tokenize=False, add_generation_prompt=True)
    # Llama 3.1's template writes a string content as JSON
    assert text.endswith(
        '<|start_header_id|>ipython<|end_header_id|>\n\n"first result"<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"3.0"<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\n'
    )
    text = chat_tokenizer("llama3").apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert text.endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\nfirst result<|eot_id|>"
        "<|start_header_id|>ipython<|end_header_id|>\n\n3.0<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    with pytest.raises(ValueError, match="unknown tool call format"):
        tool_messages(results, "json")


def test_a_turn_s_calls_past_the_cap_are_answered_without_running():
    from colocate.envs.tools import MAX_CALLS_PER_TURN

    ran = []

    def note(text: str) -> str:
        """Note it.

        Args:
            text: What to note.
        """
        ran.append(text)
        return text

    calls = [ToolCall("note", {"text": str(i)}, "") for i in range(MAX_CALLS_PER_TURN + 2)]
    results = ToolRunner([note]).run(calls)
    assert ran == [str(i) for i in range(MAX_CALLS_PER_TURN)]
    assert [r.error for r in results[MAX_CALLS_PER_TURN:]] == ["not_run", "not_run"]
    assert results[-1].content == f"Error: more than {MAX_CALLS_PER_TURN} tool calls in one turn; this one was not run"
    assert tool_counts(results)["errors/not_run"] == 2
