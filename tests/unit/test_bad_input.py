"""Bad input that must end in one error naming what is wrong, with nothing on disk changed."""

import sys

import pytest

from colocate.config import load_config
from colocate.rollout.rewards import RewardContractError, RewardInput, compute_rewards, load_reward_fn
from tests.disk import snapshot


@pytest.mark.parametrize("flag, field", [("--rollout.n-samples-per-prompt", "rollout.n_samples_per_prompt"),
                                         ("--rollout.rollout-batch-size", "rollout.rollout_batch_size")])
def test_a_zero_batch_size_is_a_range_error_not_a_division_by_zero(flag, field, tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        load_config([flag, "0"])
    assert str(info.value) == f"command line: {field} must be >= 1, got 0"
    assert snapshot(tmp_path) == before


CONTRACT = '''
def two_args(prompts, responses):
    return [1.0] * len(prompts)

def one_short(prompts, responses, labels, metadata):
    return [1.0] * (len(prompts) - 1)

def scalar(prompts, responses, labels, metadata):
    return 1.0

def buggy(prompts, responses, labels, metadata):
    return [len(r) + "" for r in responses]
'''


@pytest.fixture
def contract_module(tmp_path, monkeypatch):
    (tmp_path / "my_contract.py").write_text(CONTRACT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_contract", None)


SAMPLES = [RewardInput("p", "a", "1"), RewardInput("p", "b", "1"), RewardInput("p", "c", "1")]


def test_a_reward_returning_the_wrong_count_is_one_line_naming_function_and_counts(contract_module):
    before = snapshot(contract_module)
    with pytest.raises(RewardContractError) as info:
        compute_rewards(load_reward_fn("my_contract:one_short"), SAMPLES)
    assert str(info.value) == "reward function my_contract:one_short returned 2 rewards for 3 samples"
    with pytest.raises(RewardContractError) as info:
        compute_rewards(load_reward_fn("my_contract:scalar"), SAMPLES[:2])
    assert str(info.value) == "reward function my_contract:scalar returned a float, not a list of 2 rewards"
    assert snapshot(contract_module) == before


def test_a_reward_with_the_wrong_signature_fails_at_load_or_at_its_first_call(contract_module):
    with pytest.raises(RewardContractError) as info:
        load_reward_fn("my_contract:two_args", "eval.datasets.gsm8k.reward")
    assert str(info.value) == (
        "eval.datasets.gsm8k.reward: reward function my_contract:two_args cannot be called as "
        "fn(prompts, responses, labels, metadata) (too many positional arguments)")
    # A function that never went through load_reward_fn is checked by its first call, and a
    # contract error is not a per-sample failure (which would train on all-zero rewards).
    import my_contract

    with pytest.raises(RewardContractError) as info:
        compute_rewards(my_contract.two_args, SAMPLES)
    assert str(info.value) == (
        "reward function my_contract:two_args cannot be called as fn(prompts, responses, labels, metadata) "
        "(two_args() takes 2 positional arguments but 4 were given)")
    # A TypeError raised inside the function is still the samples' failure, not the contract's.
    assert compute_rewards(my_contract.buggy, SAMPLES) == ([0.0, 0.0, 0.0], 3)
