"""`math_python`: math problems with a sandboxed `python` tool; the reward is math-verify's verdict.

The rows are the math sets' (`colocate data prepare gsm8k|math500|dapo-math-17k|aime24`, or their Hub
ids read directly): a prompt that is a string (the problem and the instruction to box the answer) or
chat messages (DAPO's), and the reference answer as `label`. The first observation is a system
message saying the python tool is there and the answer goes in \\boxed{}, then the prompt; a prompt
whose messages begin with a system message keeps its own.

Turns that call the tool are answered by the runner (colocate/envs/episodes.py), with the code's
output; the first turn without a call is the final answer and ends the episode (a turn cut off by
its token budget counts too, unless it was cut inside a call, which the policy then sees as a
malformed call). The reward is `math_reward` on that turn's text: 1.0 when its boxed
(else last) answer equals the label, 0.0 otherwise, and 0.0 for an episode that ran out of turns or
tokens while still calling the tool.

Env args: `system_prompt`; the sandbox's `timeout_s` (default 8 s), `cpu_s` and `memory_mb`
(defaults: those of colocate.envs.sandbox.DEFAULT_LIMITS). Keep `timeout_s` below
rollout.tool_timeout_s (default 10 s), so that the sandbox kills the code and reports the timeout
before the runner stops waiting for it.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable

from colocate.envs import sandbox
from colocate.envs.base import Action, Environment, Observation
from colocate.envs.sandbox import DEFAULT_LIMITS, SandboxLimits, network_isolation, run_python
from colocate.rollout.rewards import math_reward

SYSTEM_PROMPT = (
    "You can call the python tool to run Python code: use it to compute and to check your work. "
    "When you are done, give your final answer within \\boxed{}."
)


def python_tool(limits: SandboxLimits) -> Callable[[str], str]:
    """The `python` tool run with `limits`: the same name, signature and docstring as
    colocate.envs.sandbox.python, so its schema is the same."""

    @functools.wraps(sandbox.python)
    def python(code: str) -> str:
        return run_python(code, **asdict(limits)).as_text()

    return python


def first_messages(system_prompt: str, prompt: str | list[dict]) -> list[dict]:
    """`system_prompt`, then the row's prompt: a string is one user message; a message list is kept,
    and its own system message, if it begins with one, replaces `system_prompt`."""
    if isinstance(prompt, str):
        return [{"role": "system", "content": system_prompt}, {"role": "user", "content": prompt}]
    messages = [dict(m) for m in prompt]
    if messages and messages[0].get("role") == "system":
        return messages
    return [{"role": "system", "content": system_prompt}, *messages]


@dataclass
class MathState:
    label: Any
    answer: str | None = None
    """The final turn's text; None while the policy has only called the tool."""


class MathPython(Environment):
    def __init__(
        self,
        system_prompt: str = SYSTEM_PROMPT,
        timeout_s: float = 8.0,
        cpu_s: float = DEFAULT_LIMITS.cpu_s,
        memory_mb: int = DEFAULT_LIMITS.memory_mb,
    ):
        if min(timeout_s, cpu_s, memory_mb) <= 0:
            raise ValueError(
                f"math_python: timeout_s, cpu_s and memory_mb must be positive, got {timeout_s}, {cpu_s}, {memory_mb}"
            )
        if network_isolation() == "none":
            warnings.warn(
                "math_python: this kernel lets the sandbox open no network namespace; the python tool's "
                "code is kept off the network by an audit hook only",
                stacklevel=2,
            )
        self.system_prompt = system_prompt
        self.tool = python_tool(replace(DEFAULT_LIMITS, timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb))

    def reset(self, row: dict) -> Observation:
        return Observation(
            messages=first_messages(self.system_prompt, row["prompt"]), tools=[self.tool], state=MathState(label=row["label"])
        )

    def step(self, state: MathState, action: Action) -> Observation:
        state.answer = action.text
        return Observation(done=True)

    def reward(self, state: MathState) -> float:
        if state.answer is None:
            return 0.0
        return math_reward([""], [state.answer], [state.label], [{}])[0]
