"""The environment API: how a data row becomes a multi-turn episode.

An environment turns one data row into an episode. `reset(row)` gives the first observation: the
chat messages the policy sees first and the tools it is offered. Each time the policy ends a turn
(a stop token, or its turn's token budget), `step(state, action)` gets what the policy said and
returns the next observation: messages to append (tool results, feedback, a new question), reward
parts, and whether the episode is over. When it is over, `reward(state)` gives the episode's
reward, which the trainer's advantages use like a single-turn reward.

Either method may be a coroutine function (`async def`); sync ones run in a worker pool off the
rollout loop's thread (`rollout.env_workers`), so an environment or tool that waits (a sandbox, a
web call, a sleep) never stalls the decoding of the other episodes. Every episode has its own
`state` (whatever `reset` returns in `Observation.state`); the environment object itself is shared
by all episodes of a rank, so keep per-episode data in the state.

The policy's own tokens are never decoded and encoded again: `Action.text` is a decoding for the
environment to read, while the trained sequence keeps the sampled ids and appends the observation's
rendered ids (colocate/envs/render.py).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Observation:
    """What the policy sees next."""

    messages: list[dict] = field(default_factory=list)
    """Chat messages ({"role", "content"}, roles as the chat template knows them: "user", "tool",
    "system"); appended to the conversation after the policy's turn, or the whole first prompt
    from `reset`."""
    done: bool = False
    """The episode ends here: no more turns (the messages, if any, are not shown)."""
    state: Any = None
    """Per-episode state, handed back to `step` and `reward` (from `reset`; `step` may return a new
    one, or None to keep the one it was given)."""
    tools: list[Callable] | None = None
    """From `reset` only: the tools offered to the policy (typed Python functions; their schema
    goes to the chat template's `tools`, and the policy's calls are run by `colocate.envs.tools`)."""
    reward_parts: dict[str, float] = field(default_factory=dict)
    """Named per-turn reward terms, summed over the episode into `env/reward/<name>` metrics (the
    trained reward is `reward(state)`)."""


@dataclass
class Action:
    """The policy's turn as the environment sees it."""

    text: str
    """The turn's sampled tokens decoded (special tokens dropped)."""
    token_ids: list[int]
    """The sampled ids of this turn (the stop token included, when it ended on one)."""
    finish_reason: str
    """'stop' (a stop or eos token) or 'length' (the turn's token budget ran out)."""
    turn: int
    """0 for the first turn."""


class Environment:
    """Base class of environments (duck typing works too: `reset`, `step` and `reward`).

    Constructed once per rank with `rollout.env_args` as keyword arguments."""

    def reset(self, row: dict) -> Observation:
        """The first observation of the episode of `row` (the data row: `prompt`, `label`,
        `metadata`, as configured by rollout.input_key/label_key/metadata_key)."""
        raise NotImplementedError

    def step(self, state: Any, action: Action) -> Observation:
        """The observation after the policy's turn `action`."""
        raise NotImplementedError

    def reward(self, state: Any) -> float:
        """The episode's reward, once it is over (done, rollout.max_turns or the token budget)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the environment holds (servers, sandboxes, clients) at the end of the run;
        optional, sync or async."""


def is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn)
