"""The verifiers adapter (colocate/envs/verifiers_env.py) on tasksets and envs written here: the
env's run() is driven by the episode runner with a scripted engine, its messages become the
observations exactly as the chat template renders them, and the reward is the tasks' own."""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import types

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra (pip install 'colocate[verifiers]')")

from colocate.envs.episodes import EpisodeLimits, EpisodeRunner  # noqa: E402
from colocate.envs.registry import load_env  # noqa: E402
from colocate.envs.render import TurnRenderer  # noqa: E402
from colocate.envs.verifiers_env import VerifiersEnv, assistant_message, task_rows  # noqa: E402
from colocate.rollout.prompts import PromptSample  # noqa: E402
from colocate.rollout.protocol import Completion, SamplingParams  # noqa: E402
from tests.real_models import chat_tokenizer  # noqa: E402

SYSTEM = "Answer with one number."


class GuessData(vf.TaskData):
    answer: int
    info: dict = {}


class GuessTask(vf.Task[GuessData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task, trace) -> float:
        return float(trace.last_reply == str(task.answer))

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class GuessTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    def load(self):
        for n in (3, 7):
            yield GuessTask(
                GuessData(prompt="Guess my number from 1 to 9.", system_prompt=SYSTEM, answer=n, info={"level": "easy"}),
                self.config.task,
            )


class GuessEnvConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()


SEEN: list[list[str]] = []
"""The replies GuessEnv.run read, one list per episode."""


class GuessEnv(vf.Env[GuessEnvConfig]):
    """A guessing game: the player guesses, the env says higher or lower until it is right; the
    env records its own `won` reward next to the task's `correct`."""

    async def run(self, task, agents):
        seen = []
        SEEN.append(seen)
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn()
            while not segment.terminated:
                seen.append(segment.last_reply)
                if segment.last_reply == str(task.data.answer):
                    break
                low = segment.last_reply.isdigit() and int(segment.last_reply) < task.data.answer
                segment = await chat.turn(f"No: {'higher' if low else 'lower'}.")
            seen.append("<terminated>" if segment.terminated else "<won>")
        chat.trace.record_reward("won", float(not segment.terminated), 0.5)


class OneShotTaskset(vf.Taskset[GuessTask, vf.TasksetConfig]):
    """No Env of its own: verifiers plays it with the single-agent env (`agents.agent.run`)."""

    def load(self):
        yield GuessTask(GuessData(prompt="Say 4.", answer=4), self.config.task)


class StoppingTask(GuessTask):
    @vf.stop
    async def enough(self, trace: vf.Trace) -> bool:
        return trace.num_turns >= 2


class OpenerTaskset(vf.Taskset[StoppingTask, vf.TasksetConfig]):
    def load(self):
        yield StoppingTask(GuessData(system_prompt=SYSTEM, answer=1), self.config.task)


class OpenerEnv(vf.Env[GuessEnvConfig]):
    """The env opens the exchange (a task without a prompt) and asks again until a @stop ends it."""

    async def run(self, task, agents):
        seen = []
        SEEN.append(seen)
        async with agents.player.interaction(task) as chat:
            segment = await chat.turn("Your move.")
            while not segment.terminated:
                seen.append(segment.last_reply)
                segment = await chat.turn("Again.")
        seen.append(chat.trace.stop_condition)


class Search(vf.Toolset):
    @vf.tool
    async def search(self, query: str) -> str:
        """Search."""
        return query


class ToolTask(GuessTask):
    @classmethod
    def toolsets(cls, config):
        return [Search(vf.ToolsetConfig())]


class ToolTaskset(vf.Taskset[ToolTask, vf.TasksetConfig]):
    def load(self):
        yield ToolTask(GuessData(prompt="x", answer=1), self.config.task)


class TwoSeatConfig(vf.EnvConfig):
    user: vf.AgentConfig = vf.AgentConfig()
    assistant: vf.AgentConfig = vf.AgentConfig()


class TwoSeatEnv(vf.Env[TwoSeatConfig]):
    """A modeled user opens the exchange: a seat colocate cannot play."""

    async def setup(self, agents):
        agents.user.trainable = False

    async def run(self, task, agents):
        async with agents.user.interaction(task) as user:
            await user.turn()


@pytest.fixture(autouse=True)
def tasksets(monkeypatch):
    """The tasksets above as installed taskset packages (verifiers imports a taskset by its id)."""
    for name, exports in {
        "colocate_vf_guess": [GuessTaskset, GuessEnv],
        "colocate_vf_oneshot": [OneShotTaskset],
        "colocate_vf_tools": [ToolTaskset],
        "colocate_vf_twoseat": [GuessTaskset, TwoSeatEnv],
        "colocate_vf_opener": [OpenerTaskset, OpenerEnv],
    }.items():
        module = types.ModuleType(name)
        for cls in exports:
            setattr(module, cls.__name__, cls)
        module.__all__ = [cls.__name__ for cls in exports]
        monkeypatch.setitem(sys.modules, name, module)
    SEEN.clear()


class Scripted:
    """An engine without generate_turns whose turns come from `policy(context_text)`."""

    weight_version = 0

    def __init__(self, tok, policy):
        self.tok, self.policy, self.contexts = tok, policy, []

    def generate(self, prompt_ids, sampling):
        out = []
        for i, ids in enumerate(prompt_ids):
            self.contexts.append(list(ids))
            turn = self.tok(self.policy(self.tok.decode(ids)) + "<|im_end|>", add_special_tokens=False)["input_ids"]
            out.append(Completion(0, 0, turn, [-0.5] * len(turn), "stop"))
        return out


def run_episodes(env, rows, policy, max_turns=6):
    tok = chat_tokenizer("qwen3")
    runner = EpisodeRunner(
        env,
        tok,
        EpisodeLimits(max_turns=max_turns, max_episode_tokens=4096, turn_max_new_tokens=256, tool_timeout_s=1.0),
        workers=2,
    )
    prompts = [PromptSample(i, [], "", row["label"], row["metadata"], row["prompt"]) for i, row in enumerate(rows)]
    try:
        samples = runner.run(Scripted(tok, policy), prompts, [SamplingParams(n=1, max_new_tokens=256)] * len(prompts))
    finally:
        runner.close()
    return tok, samples


def from_script(turns):
    turns = list(turns)
    return lambda context: turns.pop(0)


def ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_an_env_driven_game_is_played_token_exactly_and_scored_by_the_task_s_rewards():
    env = VerifiersEnv(taskset="colocate_vf_guess")
    rows = task_rows(env)
    turns = ["<think>\nHalf way.\n</think>\n\n5", "<think>\nHigher than 5.\n</think>\n\n7"]
    tok, [sample] = run_episodes(env, rows[1:], from_script(turns))
    # The env read each turn's answer without its thinking, and said "higher" after 5.
    assert SEEN[0] == ["5", "7", "<won>"]
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Guess my number from 1 to 9."}]
    assert sample.prompt_ids == ids(tok, tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False))
    # The sequence is the sampled ids, then the template's rendering of the env's message alone.
    turn1, turn2 = (ids(tok, t + "<|im_end|>") for t in turns)
    feedback = TurnRenderer(tok).observation([{"role": "user", "content": "No: higher."}], turn1)
    assert sample.response_ids == turn1 + feedback + turn2
    assert sample.loss_mask == [1] * len(turn1) + [0] * len(feedback) + [1] * len(turn2)
    # correct (weight 1) + the env's own won (weight 0.5); the parts carry the unweighted scores.
    assert sample.reward == 1.5
    meta = sample.metadata["env"]
    assert meta["turns"] == 2 and meta["end_reason"] == "done"
    assert meta["reward_parts"] == {"correct": 1.0, "won": 1.0, "metric_turns": 2.0}


def test_the_trace_the_rewards_read_is_the_conversation_as_verifiers_records_it():
    env = VerifiersEnv.from_env(vf.load_environment(vf.resolve_env_config({"taskset": {"id": "colocate_vf_guess"}})))
    traces = []
    original = GuessTask.correct

    async def spy(self, task, trace):
        traces.append(trace)
        return await original(self, task, trace)

    GuessTask.correct = vf.reward(spy)
    GuessTask.correct.__name__ = "correct"
    try:
        run_episodes(env, task_rows(env)[:1], from_script(["<think>\nx\n</think>\n\n5", "3"]))
    finally:
        GuessTask.correct = original
    [trace] = traces
    assert [(m.role, vf.types.content_text(m.content)) for m in trace.messages] == [
        ("system", SYSTEM),
        ("user", "Guess my number from 1 to 9."),
        ("assistant", "5"),
        ("user", "No: lower."),
        ("assistant", "3"),
    ]
    assert trace.messages[2].reasoning_content == "x"
    assert [n.sampled for n in trace.nodes] == [False, False, True, False, True]
    assert [c.finish_reason for c in trace.calls] == ["stop", "stop"]
    assert trace.stop_condition == "user_closed" and trace.agent.name == "player"


def test_episodes_of_different_tasks_keep_their_own_state():
    env = VerifiersEnv(taskset="colocate_vf_guess")

    def policy(context):  # 5, then 7 after "higher" and 3 after "lower"
        return "7" if context.endswith("higher.<|im_end|>\n<|im_start|>assistant\n") else ("3" if "lower." in context else "5")

    _, samples = run_episodes(env, task_rows(env), policy)
    assert sorted(map(tuple, SEEN)) == [("5", "3", "<won>"), ("5", "7", "<won>")]
    assert [s.reward for s in samples] == [1.5, 1.5]


def test_an_episode_colocate_ends_is_closed_as_a_verifiers_limit_and_scored():
    env = VerifiersEnv(taskset="colocate_vf_guess")
    _, [sample] = run_episodes(env, task_rows(env)[:1], from_script(["5", "4"]), max_turns=2)
    # The env got a terminated segment for the turn it waited for, and ran to its end.
    assert SEEN == [["5", "4", "<terminated>"]]
    assert sample.reward == 0.0 and sample.metadata["env"]["end_reason"] == "max_turns"


def test_a_seat_s_max_turns_ends_the_exchange_before_the_policy_s_turn():
    env = VerifiersEnv(taskset="colocate_vf_guess", player={"max_turns": 1})
    _, [sample] = run_episodes(env, task_rows(env)[:1], from_script(["5"]))
    assert SEEN == [["5", "<terminated>"]]
    assert sample.metadata["env"]["end_reason"] == "done" and sample.metadata["env"]["turns"] == 1
    assert sample.reward == 0.0


def test_an_env_that_opens_the_exchange_and_a_stop_on_the_trace():
    env = VerifiersEnv(taskset="colocate_vf_opener")
    [row] = task_rows(env)
    assert row["prompt"] == [{"role": "system", "content": SYSTEM}] and row["label"] == 1
    tok, [sample] = run_episodes(env, [row], from_script(["1", "2"]))
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Your move."}]
    assert sample.prompt_ids == ids(tok, tok.apply_chat_template(first, add_generation_prompt=True, tokenize=False))
    assert SEEN == [["1", "2", "enough"]]  # the @stop held before a third turn
    assert sample.metadata["env"]["turns"] == 2 and sample.metadata["env"]["end_reason"] == "done"
    assert sample.reward == 0.0  # the last reply, 2, is not the answer


def test_a_plain_taskset_is_one_turn_of_the_single_agent_env_through_the_registry():
    env = load_env("verifiers", {"taskset": "colocate_vf_oneshot"})
    [row] = task_rows(env)
    assert row == {
        "prompt": [{"role": "user", "content": "Say 4."}],
        "label": 4,
        "metadata": {"task": {"idx": 0, "prompt": "Say 4.", "answer": 4}},
    }
    _, [sample] = run_episodes(env, [row], from_script(["4"]))
    assert sample.reward == 1.0 and sample.metadata["env"]["turns"] == 1
    # A row without metadata.task: a task of the taskset's type from its prompt and label.
    _, [sample] = run_episodes(env, [{"prompt": "Say 4.", "label": 5, "metadata": {}}], from_script(["4"]))
    assert sample.reward == 0.0


def test_task_rows_keep_what_the_task_is():
    env = VerifiersEnv(taskset="colocate_vf_guess")
    rows = task_rows(env)
    assert [r["label"] for r in rows] == [3, 7]
    assert rows[0]["prompt"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Guess my number from 1 to 9."},
    ]
    assert rows[0]["metadata"]["task"]["info"] == {"level": "easy"}
    tasks = list(env.env.taskset)
    assert [env.task(r).hash for r in rows] == [t.hash for t in tasks]
    assert task_rows(env.env.taskset, 1) == rows[:1]


def test_the_data_command_writes_a_taskset_s_rows(tmp_path):
    from colocate.data import main

    out = tmp_path / "guess.jsonl"
    assert main(["prepare", "verifiers:colocate_vf_guess", str(out), "--size", "2"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == task_rows(VerifiersEnv(taskset="colocate_vf_guess"))


def test_assistant_messages_split_the_thinking_off():
    assert assistant_message("<think>\nhm\n</think>\n\n42").model_dump(exclude_none=True) == {
        "role": "assistant",
        "content": "42",
        "reasoning_content": "hm",
    }
    assert assistant_message("<think>\nstill thinking").content is None
    assert assistant_message(" 42 ").reasoning_content is None


def test_what_colocate_cannot_run_is_refused_with_one_line():
    with pytest.raises(ValueError, match="offer MCP tools"):
        VerifiersEnv(taskset="colocate_vf_tools")
    with pytest.raises(ValueError, match="must name an installed taskset"):
        VerifiersEnv(taskset={})
    env = VerifiersEnv(taskset="colocate_vf_twoseat", env_id="")
    assert type(env.env).__name__ == "TwoSeatEnv"
    _, [sample] = run_episodes(env, task_rows(env)[:1], from_script(["5"]))
    assert sample.metadata["env"]["end_reason"] == "error"
    assert "seat 'user' is not trained" in sample.metadata["env"]["error"]


def test_the_env_run_of_an_episode_dropped_before_its_reward_is_cancelled():
    env = VerifiersEnv(taskset="colocate_vf_guess")
    row = task_rows(env)[0]

    async def drop():
        state = (await env.reset(row)).state
        driver = state.episode.driver
        del state
        gc.collect()
        await asyncio.sleep(0.01)
        return driver

    driver = asyncio.run(drop())
    assert driver.done() and not env._drivers


def test_without_the_package_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)
    with pytest.raises(ImportError, match=r"needs the verifiers package, 0.4 or later .*pip install 'colocate\[verifiers\]'"):
        VerifiersEnv(taskset="colocate_vf_guess")
