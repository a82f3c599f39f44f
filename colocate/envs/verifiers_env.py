"""`verifiers`: the tasksets and environments of the verifiers package (0.4, `verifiers.v1`), played
by the policy in colocate's own episode loop, scored by the tasks' own rewards.

verifiers 0.4 is not the 0.1-0.3 API (`MultiTurnEnv.env_response`, `is_completed`, rubrics,
`ToolEnv`; 0.3 kept it as `verifiers.legacy`, 0.4 removed it). An environment is now an `Env`
whose `run(task, agents)` drives agent seats (`agents.<seat>.run(task)`, or
`agents.<seat>.interaction(task)` and `await interaction.turn(message)`), over a `Taskset` of typed
`Task`s whose `@vf.reward` / `@vf.metric` methods score the finished `Trace`. In verifiers' own
loop each seat is a harness program (a chat loop, a coding agent) run in a runtime box, and every
model call goes over HTTP through an interception server to an OpenAI-style client.

This adapter runs none of that. `VerifiersEnv` loads the env (`vf.load_environment`), and each
episode runs the env's own `setup`, `run` and `finalize` coroutines on the episode runner's event
loop against a stand-in for the agents: the policy's seat answers `turn()` with the policy's next
turn, pushed in by `step`. So:

- `reset(row)` rebuilds the row's task (`metadata.task`, as `task_rows` writes it), starts the
  env's `run` and returns what the seat is shown first: the task's system prompt and prompt (as
  verifiers' `null` harness sends them), plus the env's opening message if it opens the exchange.
- `step(state, action)` hands the turn to the env as an assistant message (the text after the
  turn's `<think>` part as `content`, the thinking as `reasoning_content`, as an OpenAI-style
  server with a reasoning parser would) and returns the messages the env sends next
  (`interaction.turn(message)`), or `done` when the env ends the exchange; `done` carries the
  trace's rewards and metrics as `reward_parts` (`metric_<name>` for metrics).
- `reward(state)` is the trace's reward once the env's `run` and `finalize` are over: the weighted
  sum of the task's `@vf.reward`s and what the env recorded (`trace.record_reward`), as verifiers
  computes it. An episode that colocate ended (rollout.max_turns, the token budget) is first
  closed as verifiers closes a run that hits a limit: the pending `turn()` returns a terminated
  segment, the trace's stop condition is `max_turns`, and it is scored as it stands.

Token-exactness: the env only ever reads the decoded text of a turn and produces the messages that
follow; the trained sequence is still the engine's sampled ids plus the observation ids rendered
from those messages (colocate/envs/render.py). No conversation is rendered to text and tokenised
again, and nothing goes through HTTP. What verifiers' own loop has and this one does not: no raw
OpenAI response objects, usage or log-probs reach the env (`trace.calls` holds one `ModelCall`
per turn with its finish reason only, so token caps other than `max_turns` of a seat's config do
not apply); sampling settings a seat or task sets (`AgentConfig.sampling`) are not used (the
rollout's sampling is); the trace's message nodes carry no token ids.

Not supported, refused with one line: MCP tools (a taskset's or task's `toolsets`); tasks that
need a runtime box (`NEEDS_CONTAINER`); `@vf.intercept` hooks, and `@vf.stop` hooks on a Request
or Response (stops on the Trace run before each turn, as in verifiers); envs that run more than
one conversation per episode or seat a model that is not trained (the user simulator of
`user-sim`, `best-of-n`); `interaction.send`/`steer`; image content. Not offered: the tools of a
seat's harness (`bash` and the like): the policy plays every seat as verifiers' tool-less `null`
harness would. A task's `setup`/`finalize` get `runtime=None`, and rewards that need a runtime are
skipped, as in verifiers' scoring without one. Judges a task plugs in are called as verifiers
calls them, over their own configured client.

Env args: `taskset` (the installed taskset's id, or its config as a mapping: `{"id": ..., ...}`),
`env_id` (an `Env` to pair with it; default: the taskset's own, else the single-agent env), and
any other `EnvConfig` field (e.g. a seat's `max_turns`: `{"player": {"max_turns": 6}}`).
`VerifiersEnv.from_env(env)` wraps an `Env` object directly. `task_rows(env, size)` writes a
taskset's tasks as colocate data rows.

The package is an optional extra: `pip install 'colocate[verifiers]'`.
"""

from __future__ import annotations

import asyncio
import json
import weakref
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from colocate.envs.base import Action, Environment, Observation

INSTALL_HINT = "pip install 'colocate[verifiers]'"


def import_verifiers() -> Any:
    """`verifiers.v1`, imported on first use: the package is an optional extra."""
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise ImportError(f"the verifiers environment needs the verifiers package, 0.4 or later ({e}); {INSTALL_HINT}") from None
    return vf


# --------------------------------------------------------------------------------------- messages


def _text(content: Any) -> str:
    """A verifiers message's content as text (image parts are refused)."""
    if content is None or isinstance(content, str):
        return content or ""
    from verifiers.v1.types import TextContentPart

    if any(not isinstance(part, TextContentPart) for part in content):
        raise ValueError("verifiers: a message has image content, which colocate's episodes cannot show")
    return "\n".join(part.text for part in content)


def wire_messages(messages: list) -> list[dict]:
    """verifiers messages as the chat messages colocate renders (text content)."""
    from verifiers.v1.dialects.chat import message_to_wire

    out = []
    for message in messages:
        wire = message_to_wire(message)
        wire["content"] = _text(message.content)
        out.append(wire)
    return out


def opening_messages(data: Any) -> list:
    """What a seat is shown first for a task, as verifiers' `null` harness sends it: the task's
    system prompt as a system message, then its prompt (a string is one user message); none for a
    task without a prompt (the env opens the exchange)."""
    from verifiers.v1.types import SystemMessage, UserMessage

    messages: list = [SystemMessage(content=data.system_prompt)] if data.system_prompt else []
    if isinstance(data.prompt, str):
        messages.append(UserMessage(content=data.prompt))
    elif data.prompt is not None:
        messages.extend(data.prompt)
    return messages


def assistant_message(text: str) -> Any:
    """The policy's turn as verifiers' AssistantMessage: the text after its thinking is the
    content, the thinking (`<think>...</think>`) its reasoning_content; a turn that ran out of
    tokens while thinking has no content (as verifiers parses an empty reply)."""
    from verifiers.v1.types import AssistantMessage

    reasoning = None
    if "</think>" in text:
        reasoning, text = text.split("</think>", 1)
        reasoning = reasoning.split("<think>", 1)[-1].strip()
    elif "<think>" in text:
        text, reasoning = text.split("<think>", 1)
        reasoning = reasoning.strip()
    return AssistantMessage(content=text.strip() or None, reasoning_content=reasoning or None)


# --------------------------------------------------------------------------------------- data rows


def _taskset(env: Any) -> Any:
    env = getattr(env, "env", env)  # a VerifiersEnv
    return getattr(env, "taskset", env)  # a verifiers Env, or a Taskset


def task_rows(env: Any, size: int | None = None) -> list[dict]:
    """The tasks of a verifiers taskset as colocate data rows (the first `size`; all of a finite
    taskset by default): {"prompt": the opening chat messages, "label": the task's `answer` (None
    when its data has none), "metadata": {"task": its TaskData as JSON}}. `env` is a VerifiersEnv,
    a verifiers Env or a Taskset.

    A task whose data does not come back the same from JSON (its content hash differs) is refused:
    rows read back from the file would be other tasks."""
    from verifiers.v1.task import task_key

    taskset = _taskset(env)
    if size is None and not taskset.bounded:
        raise ValueError(f"verifiers: taskset {type(taskset).__name__} is infinite; give a size")
    rows = []
    for task in taskset if size is None else taskset.take(size):
        data = task.data.model_dump(mode="json", exclude_defaults=True)
        stored = json.loads(json.dumps(data))
        back = type(task.data).model_validate(stored).model_dump(mode="json", exclude_none=True)
        if task_key(back) != task.hash:
            raise ValueError(
                f"verifiers: task {task.data.idx} of {type(taskset).__name__} is not the same task once its "
                "data went through JSON, so its rows cannot be kept in a file"
            )
        rows.append(
            {
                "prompt": wire_messages(opening_messages(task.data)),
                "label": task.data.model_dump(mode="json").get("answer"),
                "metadata": {"task": stored},
            }
        )
    return rows


# --------------------------------------------------------------------------------------- the agents' stand-in


class _Episode:
    """One episode's channel between the env's `run` (awaiting the policy's turns) and the runner
    (pushing them in through `step`)."""

    def __init__(self, env: VerifiersEnv, task: Any):
        self.env, self.task = env, task
        self.events: asyncio.Queue = asyncio.Queue()
        """("turn", messages) when the policy's seat waits for a turn; ("end", None) or
        ("error", exception) when the env's run is over."""
        self.reply: asyncio.Future | None = None
        self.trace: Any = None
        """The policy's trace (one conversation per episode)."""
        self.env_episode: Any = None
        """The verifiers Episode that `finalize` gets."""
        self.driver: asyncio.Task | None = None

    async def ask(self, messages: list) -> tuple[Any, str] | None:
        """The policy's next turn after `messages`: (assistant message, finish reason), or None
        when colocate ended the episode first."""
        self.reply = asyncio.get_running_loop().create_future()
        self.events.put_nowait(("turn", wire_messages(messages)))
        return await self.reply

    def answer(self, value: tuple[Any, str] | None) -> None:
        reply, self.reply = self.reply, None
        if reply is None:
            raise RuntimeError("verifiers: step called while the env waits for no turn")
        reply.set_result(value)

    async def next_event(self) -> tuple[str, Any]:
        return await self.events.get()


class _Interaction:
    """The policy's side of `agent.interaction(task)`: `turn()` as verifiers' Interaction.turn,
    answered by the policy's next turn instead of a harness segment."""

    def __init__(self, episode: _Episode, seat: _Seat, task: Any, trace: Any):
        self.episode, self.seat, self.task, self.trace = episode, seat, task, trace
        self._started = self._over = self._closed = False
        self._head: int | None = None
        """The last message node of the conversation."""
        self._lock = asyncio.Lock()

    async def turn(self, message: Any = None) -> Any:
        async with self._lock:
            return await self._turn(message)

    async def _turn(self, message: Any) -> Any:
        from verifiers.v1.agent import Segment
        from verifiers.v1.dialects import parse_message
        from verifiers.v1.types import UserMessage

        if self._closed:
            raise RuntimeError("this interaction is closed")
        if self._over:
            raise RuntimeError("the exchange is over (the run ended); read interaction.trace")
        prompted = not self._started and self.trace.task.data.prompt is not None
        if message is None and not prompted:
            raise ValueError(
                "nothing to run a turn on: a bare turn() takes a prompted task's opening reply; this "
                "exchange takes its next user message"
            )
        if message is not None and prompted:
            raise ValueError(
                "the task's prompt opens this exchange: take its first reply with a bare turn() before "
                "answering (or hand the interaction a task with `prompt=None` to open the conversation "
                "yourself)"
            )
        inputs = [] if self._started else opening_messages(self.trace.task.data)
        if isinstance(message, str):
            inputs.append(UserMessage(content=message))
        elif message is not None:
            inputs.extend(parse_message(m) if isinstance(m, dict) else m for m in message)
        self._started = True
        if await self._refused():
            self._over = True
            return Segment(messages=[], terminated=True)
        answered = await self.episode.ask(inputs)
        if answered is None:  # colocate ended the episode (rollout.max_turns or the token budget)
            self.trace.stop("max_turns")
            self._over = True
            return Segment(messages=[], terminated=True)
        reply, finish_reason = answered
        self._commit(inputs, reply, finish_reason)
        return Segment(messages=[reply])

    async def _refused(self) -> bool:
        """verifiers' checks before a model call: the seat's max_turns, then the task's @stop hooks
        on the trace; the first that holds stops the trace."""
        from verifiers.v1.session import RolloutLimits, call_hook
        from verifiers.v1.trace import Trace

        if (limit := RolloutLimits(max_turns=self.seat.config.max_turns).reached(self.trace)) is not None:
            self.trace.stop(limit)
            return True
        for stop in self.task.hooks("stop"):
            result = await call_hook(stop, {Trace: self.trace})
            if not isinstance(result, bool):
                raise TypeError(f"verifiers: @stop {stop.__name__} must return bool, got {type(result).__name__}")
            if result:
                self.trace.stop(stop.__name__)
                return True
        return False

    def _commit(self, inputs: list, reply: Any, finish_reason: str) -> None:
        from verifiers.v1.graph import MessageNode
        from verifiers.v1.trace import ModelCall

        nodes = self.trace.nodes
        for message in inputs:
            nodes.append(MessageNode(parent=self._head, message=message))
            self._head = len(nodes) - 1
        nodes.append(MessageNode(parent=self._head, message=reply, sampled=True))
        self._head = len(nodes) - 1
        self.trace.calls.append(
            ModelCall(
                node=self._head, model=self.seat.config.model, finish_reason="length" if finish_reason == "length" else "stop"
            )
        )

    async def close(self) -> Any:
        """End the exchange and finish the run, as verifiers does: the task's finalize, then its
        scoring (without a runtime)."""
        from verifiers.v1.utils.decorators import invoke

        async with self._lock:
            if self._closed:
                return self.trace
            self._closed = True
            self.trace.stop("user_closed")  # the first stop condition stays
            await _awaited(invoke(self.task.finalize, {"trace": self.trace, "runtime": None}))
            await self.task.score(self.trace)
            self.trace.is_completed, self.trace.ok = True, True
            return self.trace

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("verifiers: interaction.send is not supported in colocate's episodes")

    steer = send


async def _awaited(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) or isinstance(value, asyncio.Future) else value


class _Seat:
    """One agent seat of the env (`agents.<name>`), played by the policy."""

    def __init__(self, episode: _Episode, name: str, config: Any):
        self.episode, self.name, self.config = episode, name, config
        self.trainable = True

    @asynccontextmanager
    async def interaction(self, task: Any, **_: Any):
        from verifiers.v1.state import state_cls
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask
        from verifiers.v1.utils.decorators import invoke

        episode = self.episode
        if not self.trainable:
            raise ValueError(
                f"verifiers: seat {self.name!r} is not trained (a modeled user or judge): it needs a model "
                "of its own, which colocate does not serve"
            )
        if episode.trace is not None:
            raise ValueError(
                f"verifiers: {type(episode.env.env).__name__} runs a second agent conversation in one "
                f"episode (seat {self.name!r}); colocate trains one conversation per episode"
            )
        episode.env.check_task(task)
        trace = Trace(
            task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            state=state_cls(type(task))(),
            agent=AgentInfo(config=self.config, name=self.name, trainable=self.trainable),
        )
        episode.trace = trace
        await _awaited(invoke(task.setup, {"trace": trace, "runtime": None}))
        chat = _Interaction(episode, self, task, trace)
        try:
            yield chat
        except Exception as e:  # the run failed: recorded on the trace, not scored (as in verifiers)
            trace.record_error(e)
            chat._closed = True
            raise
        else:
            await chat.close()
        finally:
            episode.env_episode.traces.append(trace)

    async def run(self, task: Any, **_: Any) -> Any:
        """One segment on a prompted task: the policy's one turn."""
        if task.data.prompt is None:
            raise ValueError("verifiers: task has no prompt and no user to open the conversation")
        async with self.interaction(task) as chat:
            await chat.turn()
            chat.trace.stop("agent_completed")
        return chat.trace

    async def provision(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("verifiers: runtime boxes are not supported in colocate's episodes")


class _Agents:
    """`agents` of an episode: its env config's seats by name."""

    def __init__(self, seats: dict[str, _Seat]):
        self._seats = seats

    def __getattr__(self, name: str) -> _Seat:
        seats = self.__dict__.get("_seats")
        if seats is None or name not in seats:
            raise AttributeError(f"no agent {name!r}; this config declares {sorted(seats or [])}")
        return seats[name]


# --------------------------------------------------------------------------------------- the environment


@dataclass
class VerifiersState:
    episode: _Episode
    done: bool = False
    """The env's run is over (ended, or raised `error`)."""
    error: BaseException | None = None


def _cancel(loop: asyncio.AbstractEventLoop, task: asyncio.Task) -> None:
    if not loop.is_closed():
        loop.call_soon_threadsafe(task.cancel)


class VerifiersEnv(Environment):
    def __init__(self, taskset: str | dict, env_id: str = "", **config: Any):
        vf = import_verifiers()
        taskset_config = {"id": taskset} if isinstance(taskset, str) else dict(taskset)
        if not taskset_config.get("id"):
            raise ValueError("verifiers: env arg `taskset` must name an installed taskset (its id, or {'id': ...})")
        self._setup(vf.load_environment(vf.resolve_env_config({**config, "id": env_id, "taskset": taskset_config})))

    @classmethod
    def from_env(cls, env: Any) -> VerifiersEnv:
        """The adapter of a verifiers `Env` object."""
        self = cls.__new__(cls)
        self._setup(env)
        return self

    def _setup(self, env: Any) -> None:
        from verifiers.v1.configs.agent import agent_config_fields

        self.env = env
        self.task_cls = type(env.taskset).task_type()
        self.seats = agent_config_fields(env.config)
        self._checked: set[type] = set()
        self._started: asyncio.Task | None = None
        self._drivers: set[asyncio.Task] = set()
        """The episodes' env runs (held here: the loop keeps only weak references to its tasks)."""
        name = type(env).__name__
        if self.task_cls.NEEDS_CONTAINER:
            raise ValueError(f"verifiers: {name}'s tasks need a runtime box (NEEDS_CONTAINER), which colocate does not run")
        if env.taskset.toolsets(env.taskset.config) or self.task_cls.toolsets(env.taskset.config.task):
            raise ValueError(f"verifiers: {name}'s tasks offer MCP tools (toolsets), which colocate's episodes do not serve yet")

    def check_task(self, task: Any) -> None:
        """Refuse what this adapter cannot run of a task's hooks (once per task class)."""
        from verifiers.v1.session import hook_boundary
        from verifiers.v1.trace import Trace
        from verifiers.v1.utils.decorators import discover_decorated

        if type(task) in self._checked:
            return
        if type(task).NEEDS_CONTAINER or task.toolsets(task.config):
            raise ValueError(
                f"verifiers: task {type(task).__name__} needs a runtime box or MCP tools, which colocate does not run"
            )
        if intercepts := discover_decorated(task, "intercept"):
            raise ValueError(
                f"verifiers: task {type(task).__name__} rewrites model requests or responses "
                f"(@vf.intercept {', '.join(fn.__name__ for fn in intercepts)}), which colocate does not support"
            )
        for stop in task.hooks("stop"):
            if hook_boundary(stop, allow_trace=True) is not Trace:
                raise ValueError(
                    f"verifiers: task {type(task).__name__}'s @vf.stop {stop.__name__} reads a model Request "
                    "or Response; colocate runs only stops on the Trace"
                )
        self._checked.add(type(task))

    def task(self, row: dict) -> Any:
        """The verifiers task of a data row: its metadata's `task` (as `task_rows` writes it), else a
        task of the taskset's type with the row's prompt (and its label as `answer`, when the task
        data has that field)."""
        data_type = self.task_cls.data_type()
        meta = row.get("metadata") or {}
        if isinstance(meta.get("task"), dict):
            data = data_type.model_validate(meta["task"])
        else:
            fields = {"prompt": row["prompt"]}
            if "answer" in data_type.model_fields and row.get("label") is not None:
                fields["answer"] = row["label"]
            try:
                data = data_type.model_validate(fields)
            except Exception as e:
                raise ValueError(
                    f"verifiers: the row has no metadata.task and is no {data_type.__name__} from its prompt "
                    f"and label ({type(e).__name__}: {e}); write the rows with task_rows"
                ) from None
        return self.task_cls(data, self.env.taskset.config.task)

    async def close(self) -> None:
        """The env's own `stop()`, when it was started (the runner calls this at the end of a run)."""
        if self._started is not None:
            await self._started
            await self.env.stop()
            self._started = None

    async def _start(self) -> None:
        """The env's own `start()` (shared resources), once."""
        if self._started is None:
            self._started = asyncio.ensure_future(self.env.start())
        await asyncio.shield(self._started)

    async def _drive(self, episode: _Episode, task: Any) -> None:
        """The env's setup, run and finalize on this episode's seats; the outcome goes to the channel."""
        vf = import_verifiers()
        try:
            episode.env_episode = vf.Episode(
                env=vf.EnvInfo(id=self.env.config.env_id),
                task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
            )
            agents = _Agents({name: _Seat(episode, name, config) for name, config in self.seats.items()})
            await self.env.setup(agents)
            await self.env.run(task, agents)
            if episode.trace is None:
                raise ValueError(f"{type(self.env).__name__}.run() ran no agent")
            await self.env.finalize(task, episode.env_episode)
            episode.env_episode.ok = True
            episode.events.put_nowait(("end", None))
        except BaseException as e:
            episode.events.put_nowait(("error", e))
            if not isinstance(e, Exception):
                raise

    async def reset(self, row: dict) -> Observation:
        task = self.task(row)
        self.check_task(task)
        await self._start()
        episode = _Episode(self, task)
        loop = asyncio.get_running_loop()
        episode.driver = loop.create_task(self._drive(episode, task))
        self._drivers.add(episode.driver)
        episode.driver.add_done_callback(self._drivers.discard)
        state = VerifiersState(episode)
        # An episode the runner drops without its reward (a first prompt over rollout.max_prompt_len,
        # an observation the template cannot render) leaves the env's run waiting for a turn: it is
        # cancelled once the runner lets go of the episode's state.
        weakref.finalize(state, _cancel, loop, episode.driver).atexit = False
        kind, value = await episode.next_event()
        if kind == "turn":
            return Observation(messages=value, state=state)
        if kind == "error":
            raise value
        raise ValueError(f"verifiers: {type(self.env).__name__} ended the episode before the policy's first turn")

    async def step(self, state: VerifiersState, action: Action) -> Observation:
        state.episode.answer((assistant_message(action.text), action.finish_reason))
        kind, value = await state.episode.next_event()
        if kind == "turn":
            return Observation(messages=value)
        state.done = True
        if kind == "error":
            state.error = value
            raise value
        return Observation(done=True, reward_parts=self._parts(state.episode.trace))

    async def reward(self, state: VerifiersState) -> float:
        episode = state.episode
        while not state.done:  # colocate ended the episode: the env's pending turn() ends as a limit would end it
            if episode.reply is not None:
                episode.answer(None)
            kind, value = await episode.next_event()
            if kind != "turn":
                state.done = True
                state.error = value if kind == "error" else None
        if state.error is not None:
            raise state.error
        return float(episode.trace.reward)

    @staticmethod
    def _parts(trace: Any) -> dict[str, float]:
        parts = {name: r.score for name, r in trace.rewards.items() if r is not None}
        parts.update({f"metric_{name}": v for name, v in trace.metrics.items() if v is not None})
        return parts
