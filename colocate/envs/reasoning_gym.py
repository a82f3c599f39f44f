"""`reasoning_gym`: any task of the reasoning-gym package, scored by the package's own scorer.

The rows come from `colocate data prepare reasoning_gym:TASK OUT.jsonl [--size N] [--seed S]`
(`task_rows`): the task's question as `prompt`, its reference answer as `label`, and
`{"task": TASK, "entry": the dataset entry}` as `metadata`. The first observation is the package's
default system prompt (reason, then give the answer alone within <answer></answer> tags; env arg
`system_prompt` replaces it), then the question. The policy's answer is the last <answer> block of
its turn (the package's `extract_answer`), scored by the task's `score_answer` against the entry:
1.0 right, less (often partial credit) otherwise; an answer the scorer cannot read scores 0.

Single turn by default: the first answer ends the episode and its score is the reward. With env arg
`feedback_turn: true` (and rollout.max_turns >= 2), a first answer that scores below 1 gets a user
message saying it was wrong, with its score, and asking for another try; the second answer ends the
episode. The reward is the last answer's score: a second answer worse than the first scores worse,
so the policy learns to use the feedback, not to keep its first guess. `env/reward/first_score` logs
the first answers' mean score, `env/reward/score_errors` the answers whose scorer raised.

The package is an optional extra: `pip install 'colocate[envs]'`.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from colocate.envs.base import Action, Environment, Observation
from colocate.envs.math_python import first_messages

INSTALL_HINT = "pip install 'colocate[envs]'"


def import_reasoning_gym() -> Any:
    """The reasoning_gym package, imported on first use: it is an optional extra."""
    try:
        import reasoning_gym
    except ImportError as e:
        raise ImportError(f"the reasoning_gym environment needs the reasoning-gym package ({e}); {INSTALL_HINT}") from None
    return reasoning_gym


@functools.lru_cache(maxsize=None)
def scorer(task: str) -> Callable[[str | None, dict], float]:
    """The task's `score_answer(answer, entry)`."""
    try:
        return import_reasoning_gym().get_score_answer_fn(task)
    except ValueError as e:  # an unknown task
        raise ValueError(f"reasoning_gym: {e}") from None


def task_rows(task: str, size: int, seed: int) -> list[dict]:
    """`size` rows of a reasoning-gym task, generated from `seed`: {"prompt": question, "label":
    answer, "metadata": {"task", "entry"}}, the entry as JSON gives it back.

    A task whose scorer grades its own reference answer differently from the JSON copy of the entry
    (ARC's grids are tuples, which JSON turns into lists) is refused: rows read back from the file
    would be scored wrong."""
    try:
        data = import_reasoning_gym().create_dataset(task, size=size, seed=seed)
    except (ValueError, AssertionError) as e:  # an unknown task, or one that needs a config (composite)
        raise ValueError(f"reasoning_gym:{task}: {e}") from None
    score = scorer(task)
    rows = []
    for i, entry in enumerate(data):
        try:
            stored = json.loads(json.dumps(entry))
        except (TypeError, ValueError) as e:
            raise ValueError(f"reasoning_gym:{task}: entry {i} is not JSON-serialisable ({e})") from None
        if score(entry["answer"], stored) != score(entry["answer"], entry):
            raise ValueError(
                f"reasoning_gym:{task}: its scorer grades the reference answer of entry {i} differently "
                "once the entry went through JSON (tuples become lists), so its rows cannot be kept in a file"
            )
        rows.append({"prompt": entry["question"], "label": stored["answer"], "metadata": {"task": task, "entry": stored}})
    return rows


@dataclass
class GymState:
    task: str
    entry: dict
    scores: list[float] = field(default_factory=list)
    """The score of each answer, in order."""


class ReasoningGym(Environment):
    def __init__(self, feedback_turn: bool = False, system_prompt: str | None = None):
        import_reasoning_gym()
        from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

        self.feedback_turn = feedback_turn
        self.system_prompt = SYSTEM_PROMPTS["default"] if system_prompt is None else system_prompt
        self.extract_answer = extract_answer

    def reset(self, row: dict) -> Observation:
        meta = row["metadata"]
        if not isinstance(meta.get("task"), str) or not isinstance(meta.get("entry"), dict):
            raise ValueError(
                "reasoning_gym: a row's metadata needs the task's name ('task') and its dataset entry "
                "('entry'); write the rows with `colocate data prepare reasoning_gym:TASK OUT.jsonl`"
            )
        scorer(meta["task"])  # an unknown task fails here, before any turn
        return Observation(
            messages=first_messages(self.system_prompt, row["prompt"]), state=GymState(meta["task"], meta["entry"])
        )

    def step(self, state: GymState, action: Action) -> Observation:
        answer = self.extract_answer(action.text)
        try:
            score, failed = float(scorer(state.task)(answer, state.entry)), 0.0
        except Exception:  # some scorers raise on an answer they cannot parse: it is wrong
            score, failed = 0.0, 1.0
        state.scores.append(score)
        parts = {"score_errors": failed}
        if len(state.scores) == 1:
            parts["first_score"] = score
        if score >= 1.0 or not self.feedback_turn or len(state.scores) > 1:
            return Observation(done=True, reward_parts=parts)
        what = "I found no answer in <answer></answer> tags" if answer is None else "Your answer is not correct"
        feedback = f"{what} (score {score:g} out of 1). Try again, and give your final answer within <answer></answer> tags."
        return Observation(messages=[{"role": "user", "content": feedback}], reward_parts=parts)

    def reward(self, state: GymState) -> float:
        return state.scores[-1] if state.scores else 0.0
