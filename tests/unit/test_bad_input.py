"""Bad input that must end in one error naming what is wrong, with nothing on disk changed: config
ranges, reward-function contracts, unreadable or non-finite weights, directories a writer must not
replace, and the one-line errors of the command-line tools."""

import json
import re
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from colocate import cli, data, export, generate, parity, plot, toy
from colocate.config_loading import load_config
from colocate.models import from_pretrained, save_pretrained
from colocate.output_dir import MARKER
from colocate.rollout.rewards import RewardContractError, RewardInput, compute_rewards, load_reward_fn
from tests.disk import snapshot
from tests.helpers import write_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("model"), "qwen2")[0]


@pytest.fixture
def model_copy(model_dir, tmp_path):
    return shutil.copytree(model_dir, tmp_path / "model")


@pytest.mark.parametrize(
    "flag, field",
    [
        ("--rollout.n-samples-per-prompt", "rollout.n_samples_per_prompt"),
        ("--rollout.rollout-batch-size", "rollout.rollout_batch_size"),
    ],
)
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
        "fn(prompts, responses, labels, metadata) (too many positional arguments)"
    )
    # A function that never went through load_reward_fn is checked by its first call, and a
    # contract error is not a per-sample failure (which would train on all-zero rewards).
    import my_contract

    with pytest.raises(RewardContractError) as info:
        compute_rewards(my_contract.two_args, SAMPLES)
    assert str(info.value) == (
        "reward function my_contract:two_args cannot be called as fn(prompts, responses, labels, metadata) "
        "(two_args() takes 2 positional arguments but 4 were given)"
    )
    # A TypeError raised inside the function is still the samples' failure, not the contract's.
    assert compute_rewards(my_contract.buggy, SAMPLES) == ([0.0, 0.0, 0.0], 3)


def _first_weights_file(path):
    return sorted(path.glob("*.safetensors"))[0]


@pytest.mark.parametrize("damage", ["truncated", "not_safetensors"])
def test_an_unreadable_safetensors_file_is_named(model_copy, damage):
    file = _first_weights_file(model_copy)
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"version https://git-lfs\n")
    before = snapshot(model_copy.parent)
    with pytest.raises(ValueError) as info:
        from_pretrained(model_copy)
    assert str(info.value).startswith(f"{file}: not a readable safetensors file (Error while deserializing header")
    assert snapshot(model_copy.parent) == before


def test_an_index_naming_a_missing_shard_is_named(model_copy):
    index = model_copy / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError) as info:
        from_pretrained(model_copy)
    assert str(info.value) == f"{index} names missing files ['{model_copy / 'model-00002-of-00002.safetensors'}']"


@pytest.mark.parametrize("value, counts", [(float("nan"), "2 NaN, 0 inf"), (float("-inf"), "0 NaN, 2 inf")])
def test_non_finite_weights_are_caught_at_load_naming_tensor_and_file(model_copy, value, counts):
    file = _first_weights_file(model_copy)
    tensors = load_file(file)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name][3, :2] = value
    save_file(tensors, str(file), metadata={"format": "pt"})
    before = snapshot(model_copy.parent)
    with pytest.raises(ValueError) as info:
        from_pretrained(model_copy)
    assert str(info.value) == (f"{file}: tensor {name} holds non-finite values ({counts} of {tensors[name].numel()})")
    assert snapshot(model_copy.parent) == before


def _foreign_dir(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("not colocate's\n")
    return out


def test_save_pretrained_replaces_only_what_colocate_wrote(model_dir, tmp_path):
    model = from_pretrained(model_dir, dtype="float32")
    foreign = _foreign_dir(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        save_pretrained(model, foreign)
    assert str(info.value) == (
        f"output {foreign} is not empty and was not written by colocate: choose a new directory, or replace it with --overwrite"
    )
    assert snapshot(tmp_path) == before  # no partial directory left beside it either
    out = save_pretrained(model, tmp_path / "saved")
    assert (out / MARKER).is_file()
    save_pretrained(model, out)  # an earlier save is replaced
    save_pretrained(model, foreign, overwrite=True)
    assert not (foreign / "notes.txt").exists() and (foreign / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "saved"]


def test_toy_writers_refuse_a_directory_colocate_did_not_write(tmp_path, monkeypatch, capsys):
    foreign = _foreign_dir(tmp_path)
    before = snapshot(tmp_path)
    assert toy.main(["--out", str(foreign)]) == 2
    assert capsys.readouterr().err == (
        f"error: output {foreign} is not empty and was not written by colocate: "
        "choose a new directory, or replace it with --overwrite\n"
    )
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    (tmp_path / "toy").mkdir()
    (tmp_path / "toy" / "data.bin").write_bytes(b"\0")
    before = snapshot(tmp_path)
    with pytest.raises(ValueError, match=f"output {tmp_path / 'toy'} is not empty and was not written by colocate"):
        toy.ensure_toy()
    assert snapshot(tmp_path) == before


def _boom(argv):
    raise ValueError("the value is wrong")


def test_entry_points_end_a_user_error_in_one_line_with_status_2(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    missing = tmp_path / "nope"
    cases = [
        (export.main, [str(missing), str(tmp_path / "out")], f"checkpoint path {missing} does not exist"),
        (plot.main, [str(tmp_path)], f"no metrics file at {tmp_path / 'metrics.jsonl'}"),
        (parity.main, ["--model", str(missing), "--device", "cpu"], f"--model: model directory {missing} does not exist"),
        (
            generate.main,
            ["--model", str(missing), "--prompts", str(missing / "p.jsonl"), "--out", str(tmp_path / "o")],
            f"--model: model directory {missing} does not exist",
        ),
        (
            data.main,
            ["prepare", "gsm8k", str(tmp_path / "o.jsonl"), "--source", str(missing)],
            f"{missing}: prompt data not found (not a file, a directory, or a Hub data set id owner/name[:config[:split]])",
        ),
    ]
    before = snapshot(tmp_path)
    for main, argv, message in cases:
        assert main(argv) == 2, main.__module__
        assert capsys.readouterr().err == f"error: {message}\n"
    assert snapshot(tmp_path) == before


def test_debug_flag_or_environment_adds_the_traceback(monkeypatch, capsys):
    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    main = cli.entry_point(_boom)
    assert main(["--debug"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and err.endswith("error: the value is wrong\n")
    monkeypatch.setenv(cli.DEBUG_ENV, "1")
    assert main([]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv(cli.DEBUG_ENV, "0")
    assert main([]) == 2
    assert capsys.readouterr().err == "error: the value is wrong\n"

    def bug(argv):
        raise KeyError("a bug keeps its traceback")

    with pytest.raises(KeyError):
        cli.entry_point(bug)([])
    assert cli.entry_point(lambda argv: None)([]) == 0


def test_user_code_loads_from_a_file_path_and_its_errors_name_the_file(contract_module, monkeypatch):
    from colocate.user_code import load_function

    monkeypatch.chdir(contract_module)
    spec = "my_contract.py:one_short"
    with pytest.raises(RewardContractError) as info:
        compute_rewards(load_reward_fn(spec), SAMPLES)
    assert str(info.value) == (f"reward function {contract_module / 'my_contract.py'}:one_short returned 2 rewards for 3 samples")
    assert load_function(spec, "rollout.reward") is load_function(f"./{spec}", "rollout.reward")  # run once
    with pytest.raises(ValueError, match=r"rollout.custom_generate: 'nope.py:f': no file nope.py \(relative to "):
        load_function("nope.py:f", "rollout.custom_generate")
    with pytest.raises(ValueError, match="rollout.reward: cannot import 'my_contract.py:absent': .* no attribute"):
        load_function("my_contract.py:absent", "rollout.reward")
    (contract_module / "broken.py").write_text("1 / 0\n")
    with pytest.raises(ValueError, match="rollout.reward: cannot import 'broken.py:f': ZeroDivisionError"):
        load_function("broken.py:f", "rollout.reward")
    assert str(contract_module / "broken.py") not in sys.modules


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return toy.ensure_toy(tmp_path_factory.mktemp("toy") / "toy")


def _load_inputs(toy_dir, model=None, data=None, **fields):
    """RunInputs of the toy (its model and training prompts unless `model`, `data` say otherwise)."""
    from colocate.config import Config
    from colocate.dist import DistInfo
    from colocate.inputs import RunInputs

    cfg = Config()
    cfg.model.path, cfg.rollout.prompt_data = str(model or toy_dir / "model"), str(data or toy_dir / "train.jsonl")
    for name, value in fields.items():
        section, field = name.split("__")
        setattr(getattr(cfg, section), field, value)
    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    return RunInputs.load(cfg, info)


def test_stop_ids_outside_the_vocabulary_are_refused(toy_dir):
    with pytest.raises(ValueError) as info:
        _load_inputs(toy_dir, rollout__stop_token_ids=[3, 9, 40])
    assert str(info.value) == (
        f"rollout.stop_token_ids [9, 40] lie outside the vocabulary of {toy_dir / 'model'}/config.json (vocab_size 9)"
    )
    assert _load_inputs(toy_dir, rollout__stop_token_ids=[8]).eos_token_ids == [0]  # the model's own


def test_a_lora_rank_above_the_smallest_adapted_projection_is_refused(toy_dir):
    # The toy: hidden 64, 4 query heads and 2 key/value heads of 16, MLP 256: k_proj is 64 -> 32.
    with pytest.raises(ValueError) as info:
        _load_inputs(toy_dir, model__lora_rank=33)
    assert str(info.value) == (
        f"model.lora_rank 33 exceeds the smaller side of k_proj (64 -> 32 in {toy_dir / 'model'}/config.json): at most 32"
    )
    _load_inputs(toy_dir, model__lora_rank=32)
    _load_inputs(toy_dir, model__lora_rank=64, model__lora_target_modules=["q_proj", "o_proj", "up_proj"])


def test_fewer_prompts_than_a_rollout_batch_are_refused(toy_dir, tmp_path):
    data = tmp_path / "few.jsonl"
    rows = [{"prompt": "a b after a", "label": "b"}] * 3 + [{"prompt": "a " * 40 + "after a", "label": "b"}] * 2
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError) as info:
        _load_inputs(toy_dir, data=data, rollout__rollout_batch_size=4, rollout__max_prompt_len=10)
    assert str(info.value) == (
        f"rollout.prompt_data {data} holds 3 prompts, after dropping 2 longer than "
        "rollout.max_prompt_len=10, fewer than rollout.rollout_batch_size=4"
    )
    assert len(_load_inputs(toy_dir, data=data, rollout__rollout_batch_size=4).data.dataset) == 5


def test_a_corrupt_model_config_or_missing_tokenizer_is_named(toy_dir, tmp_path):
    model = shutil.copytree(toy_dir / "model", tmp_path / "model")
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"],\n "hidden_size": 64,,\n}')
    before = snapshot(model)
    with pytest.raises(ValueError) as info:
        _load_inputs(toy_dir, model=model)
    assert str(info.value) == (
        f"model.path: {model}/config.json is not valid JSON (Expecting property name enclosed in double quotes at line 2)"
    )
    (model / "config.json").write_text('{"architectures": ["Qwen3ForCausalLM"]}')
    with pytest.raises(ValueError, match=f"^model.path: {model}/config.json has no 'num_attention_heads'$"):
        _load_inputs(toy_dir, model=model)
    shutil.copy(toy_dir / "model" / "config.json", model / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).unlink()
    with pytest.raises(ValueError) as info:
        _load_inputs(toy_dir, model=model)
    assert str(info.value) == (
        f"model.path: {model} has no tokenizer files (none of tokenizer.json, "
        "tokenizer.model, vocab.json, vocab.txt): copy the model's tokenizer into it"
    )
    assert (model / "model.safetensors").read_bytes() == (toy_dir / "model" / "model.safetensors").read_bytes()
    assert before.keys() - snapshot(model).keys() == {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"}


def test_a_data_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes('{"prompt": "a", "label": "b"}\n{"prompt": "caf\u00e9", "label": "b"}\n'.encode("latin-1"))
    before = snapshot(tmp_path)
    with pytest.raises(ValueError) as info:
        list(data.read_rows(str(path)))
    assert str(info.value) == f"{path}:2: not UTF-8 text (byte 0xe9, 16 bytes into the line): save the file as UTF-8"
    assert snapshot(tmp_path) == before


def test_a_diverging_run_ends_in_one_line_naming_the_settings(tmp_path, monkeypatch, capsys):
    from colocate.train import main

    monkeypatch.delenv(cli.DEBUG_ENV, raising=False)
    argv = [
        "--output-dir",
        str(tmp_path / "run"),
        "--train.lr",
        "1e20",
        "--train.max-skipped-steps",
        "2",
        "--train.num-rollout",
        "6",
        "--rollout.rollout-batch-size",
        "4",
        "--logging.console",
        "False",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert re.fullmatch(
        r"error: 2 optimizer steps in a row \(train.max_skipped_steps\) were skipped for a "
        r"non-finite loss \(\S+\) or grad norm \(\S+\): training diverged; lower train.lr "
        r"\(now 1e\+20\)\n",
        err.splitlines(keepends=True)[-1],
    ), err
