import logging
import math
import sys

import pytest

from colocate.rollout.rewards import (
    RewardError,
    RewardInput,
    compute_rewards,
    extract_final_answer,
    load_reward_fn,
    token_f1,
)


def score(name, pairs):
    fn = load_reward_fn(name)
    samples = [RewardInput("q", response, label) for response, label in pairs]
    rewards, errors = compute_rewards(fn, samples)
    assert errors == 0
    return rewards


def test_math_boxed_and_plain_final_answers():
    pairs = [
        ("Adding them gives \\boxed{42}.", "42"),
        ("So the total is 7", "7"),
        ("First 3, then 5, so the answer is 12", "12"),
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("The answer is $\\boxed{3}$", "\\frac{6}{2}"),
        ("\\boxed{41}", "42"),
        ("I do not know", "42"),
        ("", "3"),
    ]
    assert score("math", pairs) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]


def test_exact_normalises_the_final_answer():
    pairs = [
        ("The answer is Paris.", "paris"),
        ("\\boxed{\\text{Paris}}", "Paris"),
        ("#### 1,000", "1000"),
        ("London", "Paris"),
        ("answer: 3.5", "35"),
        ("Answer: -3", "3"),
        ("The answer is the Seine", ["Loire", "the seine"]),
    ]
    assert score("exact", pairs) == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_f1_token_overlap():
    # pred {cat, sat}, ref {cat, sat, down}: precision 1, recall 2/3, F1 = 0.8.
    assert token_f1("The cat sat.", "cat sat down") == pytest.approx(0.8)
    # Counts are clipped: pred {a1 x3}, ref {a1 x1}: common 1, P 1/3, R 1, F1 = 0.5.
    assert token_f1("x x x", "x") == pytest.approx(0.5)
    assert token_f1("", "") == 1.0 and token_f1("", "x") == 0.0
    rewards = score("f1", [("the answer is cat sat", "cat sat down"), ("dog", "cat"), ("blue sky", ["sky", "blue sky"])])
    assert rewards == pytest.approx([0.8, 0.0, 1.0])


def test_extract_final_answer():
    assert extract_final_answer("x \\boxed{a} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert extract_final_answer("work... #### 72") == "72"
    assert extract_final_answer("  plain  ") == "plain"


def test_toy_reward_on_hand_examples():
    pairs = [
        ("d e f", "d e f"),  # 3/3
        ("d e", "d e f"),  # 2/3
        ("d e f f", "d e f"),  # 3/4
        ("e f", "d e f"),  # 0/3: shifted by one
        ("d x f a b", "d e f"),  # 2/5
        ("", "d e f"),
    ]
    assert score("toy", pairs) == pytest.approx([1.0, 2 / 3, 0.75, 0.0, 0.4, 0.0])


CUSTOM = '''
def length_reward(prompts, responses, labels, metadata):
    return [len(r) + m.get("bonus", 0) for r, m in zip(responses, metadata)]

def short_reward(prompts, responses, labels, metadata):
    return [1.0]

def picky_reward(prompts, responses, labels, metadata):
    if any(r == "boom" for r in responses):
        raise RuntimeError("cannot score boom")
    return [float(l) for l in labels]

def nan_reward(prompts, responses, labels, metadata):
    return [float("nan") if r == "nan" else 1.0 for r in responses]

NOT_CALLABLE = 3
'''


@pytest.fixture
def custom_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(CUSTOM)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards"
    sys.modules.pop("my_rewards", None)


def test_custom_function_is_batched(custom_module):
    fn = load_reward_fn(f"{custom_module}:length_reward")
    samples = [RewardInput("p", "abc", None, {"bonus": 2}), RewardInput("p", "", None, None)]
    assert compute_rewards(fn, samples) == ([5.0, 0.0], 0)


def test_custom_function_errors_name_the_function(custom_module):
    with pytest.raises(ValueError, match="returned 1 rewards for 2 samples"):
        compute_rewards(
            load_reward_fn(f"{custom_module}:short_reward"), [RewardInput("p", "a", None), RewardInput("p", "b", None)]
        )
    with pytest.raises(ValueError, match="rollout.reward: cannot import 'no_such_module_xyz:f': ModuleNotFoundError"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="rollout.reward: 'my_rewards:NOT_CALLABLE' is not callable"):
        load_reward_fn(f"{custom_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="rollout.reward: 'gsm8k' is not a built-in reward"):
        load_reward_fn("gsm8k")


def test_raising_function_is_counted_and_logged_once(custom_module, caplog):
    fn = load_reward_fn(f"{custom_module}:picky_reward")
    samples = [RewardInput("p", r, label) for r, label in [("ok", "0.5"), ("boom", "1"), ("fine", "0.25"), ("boom", "1")]]
    with caplog.at_level(logging.WARNING, logger="colocate.rollout.rewards"):
        assert compute_rewards(fn, samples) == ([0.5, 0.0, 0.25, 0.0], 2)
        assert compute_rewards(fn, samples[1:2]) == ([0.0], 1)
    warnings = [r for r in caplog.records if "picky_reward" in r.getMessage()]
    assert len(warnings) == 1 and "cannot score boom" in warnings[0].getMessage()


def test_strict_mode_ends_in_one_line_naming_function_sample_and_error(custom_module):
    fn = load_reward_fn(f"{custom_module}:picky_reward")
    samples = [RewardInput("p", "ok", "1"), RewardInput("p", "boom", "1")]
    with pytest.raises(RewardError) as info:  # a ValueError: `error: ...`, no traceback
        compute_rewards(fn, samples, strict=True)
    assert str(info.value) == (
        f"reward function {custom_module}:picky_reward failed on sample 1 (train.strict is on): RuntimeError: cannot score boom"
    )
    assert isinstance(info.value, ValueError) and "cannot score boom" in str(info.value.__cause__)


def test_non_finite_reward_is_an_error(custom_module):
    fn = load_reward_fn(f"{custom_module}:nan_reward")
    samples = [RewardInput("p", "nan", None), RewardInput("p", "x", None)]
    rewards, errors = compute_rewards(fn, samples)
    assert rewards == [0.0, 1.0] and errors == 1
    assert all(math.isfinite(r) for r in rewards)
    with pytest.raises(RewardError, match="sample 0 \\(train.strict is on\\): ValueError: non-finite reward nan$"):
        compute_rewards(fn, [RewardInput("p", "nan", None)], strict=True)


def test_empty_batch():
    assert compute_rewards(load_reward_fn("exact"), []) == ([], 0)
