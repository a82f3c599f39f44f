"""`toy_turns`: a multi-turn game on the toy task that the random toy model learns on a CPU.

The first observation is a toy prompt ("c a f b after c"). Each turn the policy names a symbol (the
turn's first word counts) and ends its turn; the right one (the symbol after the cue: "d") moves the cue on ("after d"), a
wrong one repeats the cue (feedback: try again). The episode is done once the chain reaches the
alphabet's last symbol; the reward is the share of the answer's symbols named right, so a policy
that needs retries runs out of turns (rollout.max_turns) and scores less.
"""

from __future__ import annotations

from dataclasses import dataclass

from colocate.envs.base import Action, Environment, Observation
from colocate.toy import PROMPT_WORD, TOY_SYMBOLS


@dataclass
class ChainState:
    cue: str
    """The symbol whose successor the policy must name next."""
    answer_len: int
    correct: int = 0


class ToyTurns(Environment):
    def reset(self, row: dict) -> Observation:
        start = row["metadata"].get("start") or row["prompt"].split()[-1]
        if start not in TOY_SYMBOLS[:-1]:
            raise ValueError(f"toy_turns: the prompt's cue {start!r} is not one of {TOY_SYMBOLS[:-1]}")
        state = ChainState(cue=start, answer_len=len(TOY_SYMBOLS) - 1 - TOY_SYMBOLS.index(start))
        return Observation(messages=[{"role": "user", "content": row["prompt"]}], state=state)

    def step(self, state: ChainState, action: Action) -> Observation:
        expected = TOY_SYMBOLS[TOY_SYMBOLS.index(state.cue) + 1]
        right = action.text.split()[:1] == [expected]
        if right:
            state.correct += 1
            state.cue = expected
        done = state.cue == TOY_SYMBOLS[-1]
        return Observation(
            messages=[{"role": "user", "content": f"{PROMPT_WORD} {state.cue}"}],
            done=done,
            reward_parts={"correct": float(right)},
        )

    def reward(self, state: ChainState) -> float:
        return state.correct / state.answer_len
