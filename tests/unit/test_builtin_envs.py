"""The built-in environments: `math_python` (math prompts, the sandboxed python tool, math-verify's
reward), run alone and through the episode runner; `reasoning_gym` (rows written by `colocate data
prepare reasoning_gym:TASK`, the package's scorer, the feedback turn) and its one-line error when
the package is missing."""

from __future__ import annotations

import json
import sys

import pytest

from colocate.data import main as data_main
from colocate.envs import sandbox
from colocate.envs.base import Action
from colocate.envs.episodes import EpisodeLimits, EpisodeRunner
from colocate.envs.math_python import SYSTEM_PROMPT, MathPython
from colocate.envs.reasoning_gym import ReasoningGym, task_rows
from colocate.envs.registry import load_env
from colocate.envs.tools import tool_schemas
from colocate.rollout.prompts import PromptSample
from colocate.rollout.protocol import Completion, SamplingParams
from tests.real_models import chat_tokenizer


def _action(text: str, turn: int = 0) -> Action:
    return Action(text=text, token_ids=[1, 2], finish_reason="stop", turn=turn)


def _row(prompt, label="42", metadata=None) -> dict:
    return {"prompt": prompt, "label": label, "metadata": metadata or {}, "index": 0, "sample_index": 0}


# --------------------------------------------------------------------------------------- math_python


def test_math_python_reset_gives_a_system_message_the_prompt_and_the_python_tool():
    env = load_env("math_python", {})
    obs = env.reset(_row("What is 6 times 7?"))
    assert obs.messages == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "What is 6 times 7?"}]
    assert "python" in SYSTEM_PROMPT and "\\boxed{}" in SYSTEM_PROMPT
    assert [t.__name__ for t in obs.tools] == ["python"] and not obs.done
    assert tool_schemas(obs.tools) == tool_schemas([sandbox.python])  # the limits leave the schema as it was

    dapo = [{"role": "user", "content": "Solve x + 1 = 2."}]
    assert env.reset(_row(dapo)).messages == [{"role": "system", "content": SYSTEM_PROMPT}, *dapo]
    own = [{"role": "system", "content": "Be brief."}, *dapo]
    assert env.reset(_row(own)).messages == own  # the row's own system message wins
    assert MathPython(system_prompt="Compute.").reset(_row("1+1?")).messages[0] == {"role": "system", "content": "Compute."}


def test_math_python_scores_the_final_answer_with_math_verify():
    env = MathPython()

    def score(*turns: str) -> float:
        state = env.reset(_row("What is 6 times 7?", label="42")).state
        for i, text in enumerate(turns):
            obs = env.step(state, _action(text, i))
            assert obs.done and not obs.messages
        return env.reward(state)

    assert score("6 * 7 = 42, so the answer is \\boxed{42}.") == 1.0
    assert score("The answer is \\boxed{41}.") == 0.0
    assert score() == 0.0  # the turns ran out while it was still calling the tool: no final answer


def test_math_python_tool_runs_code_in_the_sandbox_with_the_env_args_limits():
    assert MathPython().tool("print(6*7)") == "42"
    quick = MathPython(timeout_s=1)
    assert quick.tool("import time; time.sleep(5)") == "[timeout] stopped at the wall-clock limit of 1 s"
    with pytest.raises(ValueError, match="math_python: timeout_s, cpu_s and memory_mb must be positive"):
        load_env("math_python", {"memory_mb": 0})


class ScriptedEngine:
    """An engine without generate_turns whose every sequence says the next scripted turn."""

    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.calls = tokenizer, turns, 0

    def generate(self, prompts, sampling):
        ids = self.tokenizer(self.turns[self.calls] + "<|im_end|>", add_special_tokens=False)["input_ids"]
        self.calls += 1
        return [Completion(i, 0, list(ids), [-0.5] * len(ids), "stop") for i in range(len(prompts))]


def test_math_python_episode_calls_the_tool_then_answers():
    tok = chat_tokenizer("qwen3")
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6*7)"}}\n</tool_call>'
    engine = ScriptedEngine(tok, [call, "The product is \\boxed{42}."])
    limits = EpisodeLimits(max_turns=4, max_episode_tokens=1024, turn_max_new_tokens=256, tool_timeout_s=10.0)
    runner = EpisodeRunner(MathPython(), tok, limits, workers=2)
    prompt = "What is 6 times 7?"
    sampling = [SamplingParams(n=1, temperature=1.0, max_new_tokens=256, seed=1)]
    try:
        [sample] = runner.run(engine, [PromptSample(0, [], prompt, "42", {}, prompt)], sampling)
    finally:
        runner.close()
    assert '"name": "python"' in sample.prompt_text and SYSTEM_PROMPT in sample.prompt_text
    assert "<tool_response>\n42\n</tool_response>" in tok.decode(sample.response_ids)
    env = sample.metadata["env"]
    assert (env["turns"], env["end_reason"], env["tools"]["calls"], env["tools"]["errors"]) == (2, "done", 1, 0)
    assert sample.reward == 1.0


# --------------------------------------------------------------------------------------- reasoning_gym


@pytest.fixture(scope="module")
def leg_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("rg") / "legs.jsonl"
    assert data_main(["prepare", "reasoning_gym:leg_counting", str(out), "--size", "3", "--seed", "5"]) == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_reasoning_gym_rows_are_the_tasks_questions_answers_and_entries(leg_rows):
    import reasoning_gym

    entries = list(reasoning_gym.create_dataset("leg_counting", size=3, seed=5))
    assert len(leg_rows) == 3
    for row, entry in zip(leg_rows, entries):
        assert row == {
            "prompt": entry["question"],
            "label": entry["answer"],
            "metadata": {"task": "leg_counting", "entry": json.loads(json.dumps(entry))},
        }
    assert task_rows("leg_counting", 3, 5) == leg_rows  # seeded: the same rows again
    with pytest.raises(ValueError, match="reasoning_gym:no_such_task: Dataset 'no_such_task' not registered"):
        task_rows("no_such_task", 3, 5)
    with pytest.raises(ValueError, match=r"reasoning_gym:arc_agi: its scorer grades .* \(tuples become lists\)"):
        task_rows("arc_agi", 1, 0)


def _episode(env: ReasoningGym, row: dict, *answers: str) -> tuple[list, float]:
    row = {**row, "index": 0, "sample_index": 0}
    state = env.reset(row).state
    observations = [env.step(state, _action(a, i)) for i, a in enumerate(answers)]
    return observations, env.reward(state)


def test_reasoning_gym_scores_the_answer_tag_with_the_tasks_scorer(leg_rows):
    from reasoning_gym.utils import SYSTEM_PROMPTS

    env = load_env("reasoning_gym", {})
    row = leg_rows[0]
    label = row["label"]
    obs = env.reset({**row, "index": 0, "sample_index": 0})
    assert obs.messages == [{"role": "system", "content": SYSTEM_PROMPTS["default"]}, {"role": "user", "content": row["prompt"]}]
    assert "<answer>" in obs.messages[0]["content"] and obs.tools is None

    [done], reward = _episode(env, row, f"Counting each animal's legs... <answer>{label}</answer>")
    assert done.done and reward == 1.0 and done.reward_parts == {"first_score": 1.0, "score_errors": 0.0}
    # The default scorer: an answer that contains the reference gets len(reference) / len(answer).
    [done], reward = _episode(env, row, f"<answer>{label}0</answer>")
    assert done.done and reward == len(label) / (len(label) + 1)
    assert _episode(env, row, "<answer>1</answer>")[1] == 0.0
    assert _episode(env, row, f"The answer is {label}.")[1] == 0.0  # no <answer> tags: no answer


def test_reasoning_gym_feedback_turn_gives_a_wrong_answer_a_second_try(leg_rows):
    env = ReasoningGym(feedback_turn=True)
    row = leg_rows[1]
    label = row["label"]

    (first, second), reward = _episode(env, row, "<answer>1</answer>", f"<answer>{label}</answer>")
    assert not first.done and first.reward_parts == {"first_score": 0.0, "score_errors": 0.0}
    assert first.messages == [
        {
            "role": "user",
            "content": "Your answer is not correct (score 0 out of 1). Try again, "
            "and give your final answer within <answer></answer> tags.",
        }
    ]
    assert second.done and reward == 1.0

    (first, second), reward = _episode(env, row, f"<answer>{label}0</answer>", "<answer>1</answer>")
    assert f"(score {len(label) / (len(label) + 1):g} out of 1)" in first.messages[0]["content"]
    assert second.done and reward == 0.0  # the last answer's score, not the best one

    (first, _), _ = _episode(env, row, "I am not sure.", "<answer>1</answer>")
    assert first.messages[0]["content"].startswith("I found no answer in <answer></answer> tags (score 0 out of 1)")

    [first], reward = _episode(env, row, f"<answer>{label}</answer>")
    assert first.done and reward == 1.0  # a right first answer ends the episode


def test_reasoning_gym_refuses_rows_without_a_task_entry():
    env = ReasoningGym()
    with pytest.raises(ValueError, match="needs the task's name"):
        env.reset(_row("How many legs?"))
    with pytest.raises(ValueError, match="Dataset 'no_such_task' not registered"):
        env.reset(_row("How many legs?", metadata={"task": "no_such_task", "entry": {}}))


def test_reasoning_gym_without_the_package_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # `import reasoning_gym` raises ImportError
    with pytest.raises(ValueError) as error:
        load_env("reasoning_gym", {"feedback_turn": True})
    message = str(error.value)
    assert "\n" not in message and "needs the reasoning-gym package" in message
    assert message.endswith("pip install 'colocate[envs]'")
    assert data_main(["prepare", "reasoning_gym:leg_counting", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: the reasoning_gym environment needs the reasoning-gym package") and "\n" not in err
