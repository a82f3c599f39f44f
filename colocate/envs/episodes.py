"""Multi-turn episodes: environments stepped while the engine keeps decoding the other episodes.

`EpisodeRunner.run` turns a batch of prompts into groups of episodes. On an engine that implements
`generate_turns` (the native one) every episode of the step decodes in one continuous batch: when a
sequence ends its turn, its environment step (or tool calls) runs in a worker while the others
decode, and the observation's ids are appended to the same sequence, whose KV cache was kept. Other
engines (SGLang) are driven turn by turn: every episode's turn is sampled, the environments step,
and each context goes back to the engine whole, token ids in and out.

A turn that calls tools, in an episode that offers them, is answered by the tools
(colocate/envs/tools.py); any other turn goes to the environment's `step`. An episode ends when the
environment says done, after `rollout.max_turns` turns, or when the next observation and turn would
not fit `rollout.max_episode_tokens` (or the engine's context); its reward is `env.reward(state)`,
scored once every episode is over: a sync one on the calling thread (math-verify's time limits work
only there), async ones together on the runner's event loop. `reset` and `step` calls are bounded
by `rollout.env_timeout_s`.

An environment that raises (or renders what the template cannot, or a first prompt over
rollout.max_prompt_len) drops its episode: the sample stays in its group so the batch keeps its
shape, but trains no token, and its reward is the mean of the group's other episodes, so that it
leaves the group's mean reward as it is; it is counted in env/end/error (`train.strict` makes it
fatal).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass, field
from typing import Any, Callable

from colocate.envs.base import Action, Observation, is_async
from colocate.envs.render import TurnRenderer
from colocate.rollout.protocol import Completion, Continue, Request, SamplingParams, TurnEnd
from colocate.rollout.sample import Sample

END_REASONS = ("done", "max_turns", "token_budget", "error")
TOOL_COUNTS = {"tool_calls": "calls", "tool_errors": "errors", "tool_timeouts": "timeouts"}
"""env/<metric>: the tool count (colocate.envs.tools.tool_counts) it sums."""


@dataclass
class Episode:
    prompt: Any
    """The PromptSample the episode started from."""
    sample_index: int
    state: Any = None
    prompt_ids: list[int] = field(default_factory=list)
    prompt_text: str = ""
    tools: Any = None
    """The ToolRunner of the tools the episode offers (None: no tools)."""
    turns: int = 0
    end_reason: str | None = None
    error: str | None = None
    env_seconds: float = 0.0
    reward_parts: dict[str, float] = field(default_factory=dict)
    tool_counts: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    """Tokens after the first prompt: sampled and observations."""


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int
    max_episode_tokens: int
    turn_max_new_tokens: int
    tool_timeout_s: float
    max_prompt_len: int | None = None
    env_timeout_s: float | None = None
    """Seconds an environment call may take (None: no limit)."""


def _run_into(future: Future, fn: Callable, args: tuple) -> None:
    """fn(*args) into `future` (from a thread of its own)."""
    if not future.set_running_or_notify_cancel():
        return
    try:
        future.set_result(fn(*args))
    except BaseException as e:
        future.set_exception(e)


class EpisodeRunner:
    """Runs one environment's episodes on a rank; its calls run in `workers` threads."""

    def __init__(
        self,
        env: Any,
        tokenizer: Any,
        limits: EpisodeLimits,
        *,
        workers: int = 64,
        strict: bool = False,
        template_kwargs: dict | None = None,
        system_prompt: str | None = None,
    ):
        self.env, self.tokenizer, self.limits, self.strict = env, tokenizer, limits, strict
        self.renderer = TurnRenderer(tokenizer, template_kwargs, system_prompt)
        self.pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="colocate-env")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()
        self._tools: dict[tuple, Any] = {}
        """A ToolRunner per tuple of tools offered (built once, shared by episodes)."""
        self._tool_format: str | None = None
        self._max_len: int | None = None
        self.collected: list[Episode] = []
        """Every episode run since the last `take`."""

    # ------------------------------------------------------------ calling the environment

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="colocate-env-loop", daemon=True).start()
            return self._loop

    def _timed(self, episode: Episode, fn: Callable, *args, bounded: bool = True) -> Any:
        """fn(*args), within the limits' env_timeout_s when `bounded` (TimeoutError past it): a
        coroutine function on the runner's event loop (so async environments share one loop), any
        other in a thread of its own, which a call that never returns keeps (Python cannot stop a
        thread); unbounded sync calls run right here."""
        start = time.perf_counter()
        limit = self.limits.env_timeout_s if bounded else None
        try:
            if is_async(fn):
                future = asyncio.run_coroutine_threadsafe(fn(*args), self._event_loop())
            elif limit is None:
                return fn(*args)
            else:
                future = Future()
                threading.Thread(target=_run_into, args=(future, fn, args), name="colocate-env-call", daemon=True).start()
            try:
                return future.result(timeout=limit)
            except FuturesTimeout:
                future.cancel()
                raise TimeoutError(
                    f"{getattr(fn, '__name__', 'the call')} took more than rollout.env_timeout_s={limit:g} s"
                ) from None
        finally:
            episode.env_seconds += time.perf_counter() - start

    def _fail(self, episode: Episode, where: str, error: BaseException) -> None:
        if self.strict:
            raise ValueError(
                f"rollout.env: {where} raised {type(error).__name__}: {error} (train.strict: true stops the run)"
            ) from error
        episode.end_reason, episode.error = "error", f"{where}: {type(error).__name__}: {error}"

    def _tool_runner(self, tools: list[Callable]) -> Any:
        from colocate.envs.tool_calls import detect_format
        from colocate.envs.tools import ToolRunner

        key = tuple(tools)
        with self._lock:
            if key not in self._tools:
                self._tools[key] = ToolRunner(tools, timeout_s=self.limits.tool_timeout_s)
                self._tool_format = self._tool_format or detect_format(self.tokenizer)
            return self._tools[key]

    # ------------------------------------------------------------ episodes

    def _reset(self, episode: Episode) -> None:
        p = episode.prompt
        row = {
            "prompt": p.prompt,
            "label": p.label,
            "metadata": p.metadata,
            "index": p.index,
            "sample_index": episode.sample_index,
        }
        try:
            obs = self._timed(episode, self.env.reset, row)
            if not isinstance(obs, Observation):
                raise TypeError(f"reset must return an Observation, got {type(obs).__name__}")
            if not obs.messages:
                raise ValueError("reset returned no messages")
            if obs.tools:
                episode.tools = self._tool_runner(obs.tools)
            schemas = episode.tools.schemas if episode.tools is not None else None
            episode.prompt_text, episode.prompt_ids = self.renderer.prompt(obs.messages, schemas)
            n, limit = len(episode.prompt_ids), self.limits.max_prompt_len
            if limit is not None and n > limit:
                raise ValueError(f"the first observation has {n} tokens, more than rollout.max_prompt_len={limit}")
            if self._first_budget(n) < 1:
                raise ValueError(
                    f"the first observation has {n} tokens, which leave no room to sample in the engine's {self._max_len}"
                )
            episode.state = obs.state
        except Exception as e:
            self._fail(episode, "reset", e)
            episode.prompt_ids, episode.prompt_text = list(p.prompt_ids), p.prompt_text

    def _turn(self, episode: Episode, turn: TurnEnd) -> Continue | None:
        """The environment's (or the tools') answer to a turn: the next turn, or None at the end."""
        episode.turns += 1
        try:
            messages = self._observe(episode, turn)
            if messages is None:
                return None
            ids = self.renderer.observation(messages, turn.turn_ids)
        except Exception as e:
            self._fail(episode, "step", e)
            return None
        room = self.limits.max_episode_tokens - len(turn.output_ids) - len(ids)
        if self._max_len is not None:  # the engine's context limit (positions, KV capacity)
            room = min(room, self._max_len - len(episode.prompt_ids) - len(turn.output_ids) - len(ids))
        if room < 1:
            episode.end_reason = "token_budget"
            return None
        return Continue(ids, min(self.limits.turn_max_new_tokens, room))

    def _observe(self, episode: Episode, turn: TurnEnd) -> list[dict] | None:
        """The messages that answer the turn, or None when the episode ends here (end_reason set)."""
        last = episode.turns >= self.limits.max_turns
        if episode.tools is not None:
            from colocate.envs.tool_calls import parse_tool_calls
            from colocate.envs.tools import tool_counts, tool_messages

            # Special tokens kept: Llama's calls follow <|python_tag|>.
            calls = parse_tool_calls(self.tokenizer.decode(turn.turn_ids), self._tool_format)
            if calls:
                if last:  # no turn left to read the results
                    episode.end_reason = "max_turns"
                    return None
                start = time.perf_counter()
                results = episode.tools.run(calls)
                episode.env_seconds += time.perf_counter() - start
                for k, v in tool_counts(results).items():
                    episode.tool_counts[k] = episode.tool_counts.get(k, 0) + v
                return tool_messages(results, self._tool_format)
        action = Action(
            text=self.tokenizer.decode(turn.turn_ids, skip_special_tokens=True),
            token_ids=list(turn.turn_ids),
            finish_reason=turn.finish_reason,
            turn=episode.turns - 1,
        )
        obs = self._timed(episode, self.env.step, episode.state, action)
        if not isinstance(obs, Observation):
            raise TypeError(f"step must return an Observation, got {type(obs).__name__}")
        if obs.state is not None:
            episode.state = obs.state
        for name, value in obs.reward_parts.items():
            episode.reward_parts[name] = episode.reward_parts.get(name, 0.0) + float(value)
        if obs.done or last:
            episode.end_reason = "done" if obs.done else "max_turns"
            return None
        if not obs.messages:
            raise ValueError("step returned no messages for an episode that goes on")
        return obs.messages

    def _reward(self, episode: Episode) -> float | None:
        """The episode's reward (None when it was dropped), on this thread."""
        if episode.end_reason == "error":
            return None
        try:
            return float(self._timed(episode, self.env.reward, episode.state, bounded=False))
        except Exception as e:
            self._fail(episode, "reward", e)
            return None

    def _rewards(self, episodes: list[Episode]) -> list[float | None]:
        """Every episode's reward: an async `reward` for all episodes at once on the event loop."""
        if not is_async(self.env.reward):
            return [self._reward(e) for e in episodes]
        scored = [e for e in episodes if e.end_reason != "error"]

        async def all_of():
            return await asyncio.gather(*(self.env.reward(e.state) for e in scored), return_exceptions=True)

        results = dict(zip(map(id, scored), asyncio.run_coroutine_threadsafe(all_of(), self._event_loop()).result()))
        out = []
        for e in episodes:
            value = results.get(id(e))
            if isinstance(value, BaseException):
                self._fail(e, "reward", value)
                value = None
            out.append(None if value is None else float(value))
        return out

    def _first_budget(self, prompt_len: int) -> int:
        """Tokens the first turn may sample after a prompt of this length."""
        budget = min(self.limits.turn_max_new_tokens, self.limits.max_episode_tokens)
        return budget if self._max_len is None else min(budget, self._max_len - prompt_len)

    def run(self, engine: Any, prompts: list, sampling: list[SamplingParams]) -> list[Sample]:
        """`sampling[i].n` episodes of prompts[i], prompt-major, each a Sample with its reward."""
        self._max_len = getattr(engine, "max_model_len", None)
        episodes = [Episode(p, j) for p, sp in zip(prompts, sampling) for j in range(sp.n)]
        list(self.pool.map(self._reset, episodes))
        by_key: dict[tuple[int, int], Episode] = {}
        requests: list[Request] = []
        groups = []
        i = 0
        for sp in sampling:
            group = episodes[i : i + sp.n]
            groups.append(group)
            i += sp.n
            live = [e for e in group if e.end_reason is None]
            if not live:
                continue
            turn = dataclasses.replace(sp, max_new_tokens=self._first_budget(max(len(e.prompt_ids) for e in live)))
            if len(live) == len(group) and all(e.prompt_ids == live[0].prompt_ids for e in live):
                by_key.update({(len(requests), e.sample_index): e for e in group})
                requests.append(Request(live[0].prompt_ids, turn))  # the group shares its prompt's prefill
                continue
            for e in live:  # different first observations: one request each, seeded as in a group
                by_key[(len(requests), e.sample_index)] = e
                requests.append(Request(e.prompt_ids, dataclasses.replace(turn, n=1), sample_index=e.sample_index))

        def next_turn(turn: TurnEnd) -> Future:
            return self.pool.submit(self._turn, by_key[(turn.prompt_index, turn.sample_index)], turn)

        if hasattr(engine, "generate_turns"):
            completions = engine.generate_turns(requests, next_turn) if requests else []
        else:
            completions = self._turn_by_turn(engine, requests, next_turn)
        done = {id(by_key[(c.prompt_index, c.sample_index)]): c for c in completions}
        rewards = dict(zip(map(id, episodes), self._rewards(episodes)))
        self.collected += episodes
        version = getattr(engine, "weight_version", 0)
        samples = []
        for group in groups:
            kept = [rewards[id(e)] for e in group if rewards[id(e)] is not None]
            stand_in = sum(kept) / len(kept) if kept else 0.0
            for e in group:
                reward = rewards[id(e)]
                samples.append(self._sample(e, done.get(id(e)), stand_in if reward is None else reward, version))
        return samples

    def _turn_by_turn(self, engine: Any, requests: list[Request], next_turn: Callable[[TurnEnd], Future]) -> list[Completion]:
        """Engines without generate_turns: one generate call per turn for every episode still on,
        its whole context (prompt, turns, observations) submitted again each time."""
        active = []  # [request index, sample index, prompt ids, output ids, log-probs, mask, sampling]
        for index, r in enumerate(requests):
            for j in range(r.sampling.n):
                seed = None if r.sampling.seed is None else r.sampling.seed + r.sample_index + j
                active.append(
                    [index, r.sample_index + j, list(r.prompt_ids), [], [], [], dataclasses.replace(r.sampling, n=1, seed=seed)]
                )
        out = []
        while active:
            comps = engine.generate([a[2] + a[3] for a in active], [a[6] for a in active])
            futures = []
            for a, c in zip(active, comps):
                a[3] += c.output_ids
                a[4] += c.logprobs
                a[5] += [1] * len(c.output_ids)
                futures.append(next_turn(TurnEnd(a[0], a[1], list(a[3]), list(c.output_ids), c.finish_reason)))
            still = []
            for a, future, c in zip(active, futures, comps):
                cont = future.result()
                if cont is None:
                    out.append(Completion(a[0], a[1], a[3], a[4], c.finish_reason, c.weight_version, extra={"loss_mask": a[5]}))
                    continue
                a[3] += list(cont.observation_ids)
                a[4] += [0.0] * len(cont.observation_ids)
                a[5] += [0] * len(cont.observation_ids)
                a[6] = dataclasses.replace(a[6], max_new_tokens=cont.max_new_tokens)
                still.append(a)
            active = still
        return out

    def _sample(self, e: Episode, c: Completion | None, reward: float, version: int) -> Sample:
        p = e.prompt
        if c is None:  # reset failed: one untrained end-of-sequence token stands for the episode
            eos = self.tokenizer.eos_token_id
            ids, logprobs, reason = [eos if eos is not None else 0], [0.0], "stop"
        else:
            ids, logprobs, reason, version = c.output_ids, c.logprobs, c.finish_reason, c.weight_version
        mask = c.extra["loss_mask"] if c is not None and e.end_reason != "error" else [0] * len(ids)
        e.tokens = len(ids)
        metadata = {
            **p.metadata,
            "env": {
                "turns": e.turns,
                "end_reason": e.end_reason,
                "error": e.error,
                "env_seconds": e.env_seconds,
                "reward_parts": dict(e.reward_parts),
                "tools": dict(e.tool_counts),
            },
        }
        return Sample(
            prompt_ids=list(e.prompt_ids),
            response_ids=list(ids),
            rollout_logprobs=list(logprobs),
            loss_mask=list(mask),
            group_index=p.index,
            sample_index=e.sample_index,
            reward=reward,
            raw_reward=reward,
            finish_reason=reason,
            weight_version=version,
            prompt_text=e.prompt_text,
            label=p.label,
            metadata=metadata,
        )

    def take(self) -> list[Episode]:
        episodes, self.collected = self.collected, []
        return episodes

    def metrics(self, episodes: list[Episode]) -> dict[str, float]:
        """env/* metrics of these episodes over all ranks (collective): turns and tokens per
        episode, how episodes ended, tool calls and their failures, environment seconds, and the
        episode means of the environment's named reward parts."""
        from colocate import dist

        parts = sorted(set().union(*dist.all_gather_object(sorted({k for e in episodes for k in e.reward_parts}))))
        values = [
            len(episodes),
            sum(e.turns for e in episodes),
            sum(e.env_seconds for e in episodes),
            sum(e.tokens for e in episodes),
            *(sum(e.end_reason == r for e in episodes) for r in END_REASONS),
            *(sum(e.tool_counts.get(k, 0) for e in episodes) for k in TOOL_COUNTS.values()),
            *(sum(e.reward_parts.get(k, 0.0) for e in episodes) for k in parts),
        ]
        sums = iter(dist.all_reduce_sum(values).tolist())
        n = max(next(sums), 1)
        metrics = {
            "env/turns_mean": next(sums) / n,
            "env/seconds_per_episode": next(sums) / n,
            "env/episode_tokens_mean": next(sums) / n,
        }
        metrics.update({f"env/end/{r}": next(sums) / n for r in END_REASONS})
        metrics.update({f"env/{k}": next(sums) for k in TOOL_COUNTS})
        metrics.update({f"env/reward/{k}": next(sums) / n for k in parts})
        return metrics

    def close(self) -> None:
        """Close the environment (its optional `close`, sync or async), then the workers and loop."""
        close = getattr(self.env, "close", None)
        if callable(close):
            if is_async(close):
                asyncio.run_coroutine_threadsafe(close(), self._event_loop()).result()
            else:
                close()
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
