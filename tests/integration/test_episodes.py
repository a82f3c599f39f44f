"""Multi-turn episodes on the native engine (CPU): token-exact trajectories, masks, the KV cache kept
across turns, the turn-by-turn path of other engines, and environments that fail."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from colocate import dist
from colocate.envs.base import Environment, Observation
from colocate.envs.episodes import EpisodeLimits, EpisodeRunner
from colocate.rollout.native import NativeEngine
from colocate.rollout.prompts import PromptSample
from colocate.rollout.protocol import SamplingParams
from tests.helpers import write_hf_model
from tests.real_models import chat_tokenizer

TURNS = 3


@pytest.fixture(scope="module", autouse=True)
def single_process():
    dist.init()
    yield
    dist.destroy()


class Chat(Environment):
    """Three policy turns; after each the user says which turn comes next."""

    def __init__(
        self,
        fail_reset_at: int | None = None,
        fail_step_at: int | None = None,
        sleep_s: float = 0.0,
        fail_sample: int | None = None,
    ):
        self.fail_reset_at, self.fail_step_at, self.sleep_s = fail_reset_at, fail_step_at, sleep_s
        self.fail_sample = fail_sample

    def reset(self, row):
        if row["index"] == self.fail_reset_at:
            raise RuntimeError("no episode for this row")
        return Observation(
            messages=[{"role": "user", "content": row["prompt"]}], state={"turns": 0, "sample": row["sample_index"]}
        )

    def step(self, state, action):
        time.sleep(self.sleep_s)
        state["turns"] += 1
        if state["turns"] == self.fail_step_at and self.fail_sample in (None, state["sample"]):
            raise ValueError("the environment broke")
        return Observation(
            messages=[{"role": "user", "content": f"turn {state['turns']}"}],
            done=state["turns"] == TURNS,
            reward_parts={"turn": 1.0},
        )

    def reward(self, state):
        return state["turns"] / TURNS


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    tok = chat_tokenizer("qwen3")
    path, _ = write_hf_model(tmp_path_factory.mktemp("chat"), "qwen3", vocab_size=len(tok), seed=4)
    return tok, path


def _prompts(tok, texts):
    return [PromptSample(i, tok(t)["input_ids"], t, None, {}, t) for i, t in enumerate(texts)]


def _run(tok, engine, env, *, n=2, turn_tokens=6, strict=False, recorder=None, env_timeout_s=None):
    limits = EpisodeLimits(
        max_turns=5, max_episode_tokens=200, turn_max_new_tokens=turn_tokens, tool_timeout_s=1.0, env_timeout_s=env_timeout_s
    )
    runner = EpisodeRunner(env, tok, limits, workers=4, strict=strict)
    if recorder is not None:
        turn = runner._turn

        def record(episode, end):
            cont = turn(episode, end)
            recorder.setdefault((episode.prompt.index, episode.sample_index), []).append(
                (list(end.turn_ids), None if cont is None else list(cont.observation_ids))
            )
            return cont

        runner._turn = record
    prompts = _prompts(tok, ["Hello there", "What is 2+3?"])
    sampling = [
        SamplingParams(
            n=n, temperature=1.0, max_new_tokens=turn_tokens, seed=11, stop_token_ids=(tok.convert_tokens_to_ids("<|im_end|>"),)
        )
    ] * len(prompts)
    try:
        return runner.run(engine, prompts, sampling), runner
    finally:
        runner.close()


def test_trajectories_are_the_sampled_ids_and_the_observations_token_for_token(chat_model):
    tok, path = chat_model
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=0)
    turns = {}
    samples, runner = _run(tok, engine, Chat(), recorder=turns)
    assert len(samples) == 4
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    not_round_trip = 0
    for s in samples:
        record = turns[(s.group_index, s.sample_index)]
        assert len(record) == TURNS and record[-1][1] is None  # done after the third turn
        expected, mask = [], []
        for k, (sampled, observation) in enumerate(record):
            expected += sampled
            mask += [1] * len(sampled)
            if observation is not None:
                closing = "\n" if sampled[-1] == im_end else "<|im_end|>\n"
                text = f"{closing}<|im_start|>user\nturn {k + 1}<|im_end|>\n<|im_start|>assistant\n"
                assert observation == tok(text, add_special_tokens=False)["input_ids"]
                expected += observation
                mask += [0] * len(observation)
        assert s.response_ids == expected and s.loss_mask == mask
        assert [lp == 0.0 for lp in s.rollout_logprobs] == [m == 0 for m in mask]
        assert s.reward == 1.0 and s.metadata["env"]["end_reason"] == "done"
        not_round_trip += tok(tok.decode(s.response_ids), add_special_tokens=False)["input_ids"] != s.response_ids
    # The random model samples bytes that are no valid UTF-8: decoding and encoding again would
    # change the tokens it was trained on, which never happens here.
    assert not_round_trip > 0
    # No history was computed twice: the prefills covered the prompts (once per group: its samples
    # share them), each observation and each turn's last sampled token (never fed back during its turn).
    continuations = [obs for rec in turns.values() for _, obs in rec if obs is not None]
    prompts = sum(len(s.prompt_ids) for s in samples if s.sample_index == 0)
    assert samples[0].prompt_ids == tok("<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert engine.stats["prefill_tokens"] == prompts + sum(len(o) + 1 for o in continuations)
    assert engine.stats["reused_history_tokens"] == engine.stats["history_tokens"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    metrics = runner.metrics(runner.take())
    assert metrics["env/turns_mean"] == TURNS and metrics["env/end/done"] == 1.0 and metrics["env/reward/turn"] == 3.0


class TurnByTurn:
    """An engine without generate_turns: the runner submits each episode's whole context every turn."""

    def __init__(self, engine):
        self.engine, self.weight_version, self.calls = engine, engine.weight_version, 0

    def generate(self, prompt_ids, sampling):
        self.calls += 1
        return self.engine.generate(prompt_ids, sampling)


def test_engines_without_turns_are_driven_turn_by_turn_to_the_same_tokens(chat_model):
    tok, path = chat_model
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=0)
    together, _ = _run(tok, engine, Chat())
    other = TurnByTurn(engine)
    before = engine.stats["prefill_tokens"]
    apart, _ = _run(tok, other, Chat())
    assert other.calls == TURNS
    # Sampling noise depends on (seed, position) only: the same tokens, whichever way they were computed.
    assert [s.response_ids for s in apart] == [s.response_ids for s in together]
    assert [s.loss_mask for s in apart] == [s.loss_mask for s in together]
    lps = [(a, b) for x, y in zip(apart, together) for a, b in zip(x.rollout_logprobs, y.rollout_logprobs)]
    assert max(abs(a - b) for a, b in lps) < 1e-5
    # ... but every turn computed its whole history again.
    history = sum(len(s.prompt_ids) * TURNS + len(s.response_ids) for s in apart)
    assert engine.stats["prefill_tokens"] - before > history // 2


def test_an_environment_that_raises_drops_its_episode_and_is_counted(chat_model):
    tok, path = chat_model
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=0)
    samples, runner = _run(tok, engine, Chat(fail_reset_at=0, fail_step_at=2))
    first, second = samples[:2], samples[2:]
    for s in first:  # reset raised: one untrained token stands for the episode
        assert s.reward == 0.0 and s.loss_mask == [0] and s.metadata["env"]["end_reason"] == "error"
        assert "reset: RuntimeError: no episode for this row" in s.metadata["env"]["error"]
    for s in second:  # step raised at the second turn: kept in its group, untrained
        assert s.reward == 0.0 and set(s.loss_mask) == {0} and len(s.response_ids) > 0
        assert "step: ValueError: the environment broke" in s.metadata["env"]["error"]
    assert runner.metrics(runner.take())["env/end/error"] == 1.0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # One episode of each group fails: it trains nothing, and takes the mean reward of the others so
    # that the group's baseline is theirs.
    samples, runner = _run(tok, engine, Chat(fail_step_at=2, fail_sample=1))
    for s in samples:
        assert s.reward == 1.0 and (set(s.loss_mask) == {0}) == (s.sample_index == 1)
    assert runner.metrics(runner.take())["env/end/error"] == 0.5
    # A step that hangs past rollout.env_timeout_s drops its episode; the others go on.
    start = time.perf_counter()
    samples, runner = _run(tok, engine, Chat(sleep_s=5.0), env_timeout_s=0.3)
    assert time.perf_counter() - start < 3
    assert all(
        "step: TimeoutError: step took more than rollout.env_timeout_s=0.3 s" in s.metadata["env"]["error"] for s in samples
    )
    with pytest.raises(ValueError, match="rollout.env: step raised ValueError: the environment broke"):
        _run(tok, engine, Chat(fail_step_at=2), strict=True)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_slow_environments_run_while_the_other_episodes_decode(chat_model):
    """Each step sleeps 0.2 s in its own worker: 4 episodes x 3 steps add about 0.6 s to the
    rollout, not the 2.4 s of one step at a time."""
    tok, path = chat_model
    engine = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=0)
    threads = set()

    class Slow(Chat):
        def step(self, state, action):
            threads.add(threading.current_thread().name)
            return super().step(state, action)

    def elapsed(env) -> float:
        start = time.perf_counter()
        samples, _ = _run(tok, engine, env)
        assert all(s.reward == 1.0 for s in samples)
        return time.perf_counter() - start

    elapsed(Chat())  # warm-up
    fast = elapsed(Chat())
    waited = engine.stats["env_wait_seconds"]
    assert elapsed(Slow(sleep_s=0.2)) - fast < 1.6
    assert len(threads) > 1 and all(name.startswith("colocate-env") for name in threads)
    assert engine.stats["env_wait_seconds"] - waited > 0.4


def test_parked_episodes_give_their_blocks_up_when_the_cache_runs_short(chat_model):
    """A cache too small for every episode's history: parked sequences are evicted (and recomputed
    when they resume) rather than the engine stalling; the tokens do not change."""
    tok, path = chat_model
    roomy = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=4096, seed=0)
    tight = NativeEngine(path, dtype=torch.float32, device="cpu", max_kv_tokens=160, block_size=4, seed=0)
    expected, _ = _run(tok, roomy, Chat(sleep_s=0.05))
    got, _ = _run(tok, tight, Chat(sleep_s=0.05))
    assert [s.response_ids for s in got] == [s.response_ids for s in expected]
    assert tight.stats["evictions"] > 0
    assert tight.stats["reused_history_tokens"] < tight.stats["history_tokens"]
    assert tight.block_manager.num_free_blocks == tight.block_manager.num_blocks
