import os
import re
from pathlib import Path

import pytest
import torch
import yaml
from torch._inductor.runtime.cache_dir_utils import cache_dir

from colocate.config import Config, use_compile_cache
from colocate.config_checks import validate
from colocate.config_loading import load_config, save_yaml
from colocate.models import resolve_dtype

REPO = Path(__file__).resolve().parents[2]


def write_yaml(tmp_path, data, name="run.yaml"):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults_are_valid_and_describe_the_toy_run(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path / "cache"))
    cfg = Config()
    validate(cfg)
    assert cfg.model.path == str(tmp_path / "cache" / "toy" / "model")
    assert cfg.rollout.prompt_data == str(tmp_path / "cache" / "toy" / "train.jsonl")
    assert cfg.rollout.reward == "toy"
    assert cfg.global_batch_size == 16 * 8
    assert load_config([]) == cfg
    assert cfg.eval.interval is None and cfg.eval.datasets == []


def test_default_yaml_loads_and_expands_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    cfg = load_config(["--config", str(REPO / "configs" / "default.yaml")])
    assert cfg.model.path == f"{tmp_path}/toy/model"
    assert cfg.eval.datasets[0].path == f"{tmp_path}/toy/eval.jsonl"
    assert cfg.rollout.max_response_len == 8


def test_yaml_values_nested_by_section(tmp_path):
    path = write_yaml(
        tmp_path,
        {
            "output_dir": "~/runs/x",
            "rollout": {"top_p": 0.9, "temperature": 1, "stop_token_ids": [3, 4]},
            "algorithm": {"advantage_estimator": "gae", "eps_clip_high": 0.28},
            "eval": {"datasets": [{"name": "a", "path": "a.jsonl", "reward": "math"}]},
        },
    )
    cfg = load_config(["--config", path])
    assert cfg.rollout.top_p == 0.9
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.rollout.stop_token_ids == [3, 4]
    assert cfg.algorithm.use_critic and not cfg.algorithm.needs_ref
    assert cfg.eval.datasets[0].reward == "math"
    assert cfg.output_dir == str(Path.home() / "runs" / "x")


def test_cli_overrides_yaml(tmp_path):
    path = write_yaml(tmp_path, {"rollout": {"top_p": 0.9, "n_samples_per_prompt": 4}, "train": {"strict": False}})
    cfg = load_config(["--config", path, "--rollout.top_p", "0.5", "--train.strict", "True", "--algorithm.use-kl-loss", "True"])
    assert cfg.rollout.top_p == 0.5
    assert cfg.rollout.n_samples_per_prompt == 4
    assert cfg.train.strict is True
    assert cfg.algorithm.needs_ref
    assert load_config([f"--config={path}"]).rollout.top_p == 0.9


@pytest.mark.parametrize(
    "args, overwrite, resume, normalize",
    [
        ([], True, False, True),  # the YAML's, and the default
        (["--no-overwrite", "--checkpoint.resume", "--algorithm.no-normalize-advantage-std"], False, True, False),
        (
            ["--overwrite", "False", "--checkpoint.resume", "True", "--algorithm.normalize_advantage_std", "False"],
            False,
            True,
            False,
        ),
        (["--overwrite=False", "--checkpoint.resume=True", "--algorithm.normalize-advantage-std=False"], False, True, False),
        (["--overwrite", "--checkpoint.no-resume", "--algorithm.normalize-advantage-std"], True, False, True),
        (["--overwrite", "True", "--checkpoint.resume", "False", "--output-dir", "True"], True, False, True),
    ],
)
def test_a_bool_field_is_a_flag_that_also_takes_a_value(tmp_path, args, overwrite, resume, normalize):
    path = write_yaml(tmp_path, {"overwrite": True, "checkpoint": {"resume": False}})
    cfg = load_config(["--config", path, *args])
    assert (cfg.overwrite, cfg.checkpoint.resume, cfg.algorithm.normalize_advantage_std) == (overwrite, resume, normalize)
    if args[-2:] == ["--output-dir", "True"]:
        assert cfg.output_dir == "True"  # only a bool field's value becomes a flag


def test_a_bool_flag_refuses_another_value():
    with pytest.raises(ValueError, match="--checkpoint.resume is a flag: give it alone, or with True or False, not 'yes'"):
        load_config(["--checkpoint.resume=yes"])
    assert load_config(["--train.keep-gathered", "False"]).train.keep_gathered is False  # None|bool takes a value


@pytest.mark.parametrize(
    "args, use_tis, resolved",
    [
        ([], None, False),  # None: on only with FP8 rollout
        (["--rollout.weight-dtype", "fp8"], None, True),
        (["--algorithm.use-tis"], True, True),
        (["--algorithm.no-use-tis", "--rollout.kv-cache-dtype", "fp8_e4m3"], False, False),
        (["--algorithm.use-tis", "False"], False, False),
        (["--algorithm.use-tis=True"], True, True),
        (["--algorithm.use-tis", "None", "--rollout.weight-dtype", "fp8"], None, True),
    ],
)
def test_a_bool_or_none_field_is_a_flag_too(args, use_tis, resolved):
    cfg = load_config(args)
    assert (cfg.algorithm.use_tis, cfg.tis_on) == (use_tis, resolved)


def test_keep_gathered_is_a_flag_too():
    assert load_config(["--train.keep-gathered"]).train.keep_gathered is True


@pytest.mark.parametrize(
    "data, message",
    [
        ({"rollout": {"topp": 0.9}}, "unknown key rollout.topp (did you mean rollout.top_p?)"),
        ({"bogus": 1}, "unknown key bogus"),
        ({"eval": {"datasets": [{"name": "a", "path": "p", "colour": 1}]}}, "unknown key eval.datasets[0].colour"),
        ({"rollout": {"max_prompt_len": "long"}}, "rollout.max_prompt_len must be int, got 'long'"),
        ({"rollout": {"max_prompt_len": 1.5}}, "rollout.max_prompt_len must be int, got 1.5"),
        ({"train": {"strict": 1}}, "train.strict must be bool, got 1"),
        ({"train": {"lr": "fast"}}, "train.lr must be float, got 'fast'"),
        ({"rollout": {"stop_token_ids": [1, "x"]}}, "rollout.stop_token_ids[1] must be int"),
        ({"rollout": {"stop_token_ids": 5}}, "rollout.stop_token_ids must be a list"),
        ({"rollout": {"engine": "vllm"}}, "rollout.engine must be one of ['native', 'sglang']"),
        ({"rollout": 3}, "rollout must be a mapping"),
    ],
)
def test_yaml_errors_name_file_and_field(tmp_path, data, message):
    path = write_yaml(tmp_path, data)
    with pytest.raises(ValueError) as info:
        load_config(["--config", path])
    assert str(info.value).startswith(f"{path}: ")
    assert message in str(info.value)


def test_missing_or_malformed_file(tmp_path):
    with pytest.raises(ValueError, match="nope.yaml: config file not found"):
        load_config(["--config", str(tmp_path / "nope.yaml")])
    (tmp_path / "bad.yaml").write_text("rollout: [1, 2\n")
    with pytest.raises(ValueError, match="bad.yaml: not valid YAML"):
        load_config(["--config", str(tmp_path / "bad.yaml")])
    with pytest.raises(ValueError, match="--config needs a YAML file path"):
        load_config(["--config"])


@pytest.mark.parametrize("text", ["", "# every setting commented out\n# rollout:\n#   top_p: 0.9\n"])
def test_an_empty_config_file_is_refused_naming_it(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        load_config(["--config", str(path)])
    assert str(info.value) == f"{path}: the config file is empty; leave out --config to run with the defaults"


def test_range_error_message_format(tmp_path):
    path = write_yaml(tmp_path, {"rollout": {"top_p": 1.5}})
    with pytest.raises(ValueError, match=re.escape(f"{path}: rollout.top_p must be in (0, 1], got 1.5")):
        load_config(["--config", path])
    with pytest.raises(ValueError, match=re.escape("command line: rollout.top_p must be in (0, 1]")):
        load_config(["--config", path, "--rollout.top_p", "2.0"])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"train": {"global_batch_size": 48}}, "train.global_batch_size must divide"),
        ({"rollout": {"over_sampling_batch_size": 8}}, "rollout.over_sampling_batch_size must be >="),
        ({"rollout": {"dynamic_sampling": True, "n_samples_per_prompt": 1}}, "rollout.dynamic_sampling"),
        ({"rollout": {"n_samples_per_prompt": 1}}, "algorithm.advantage_estimator needs"),
        (
            {"rollout": {"n_samples_per_prompt": 1}, "algorithm": {"advantage_estimator": "rloo"}},
            "algorithm.advantage_estimator needs",
        ),
        ({"algorithm": {"eps_clip_high": 0.1}}, "algorithm.eps_clip_high must be >= algorithm.eps_clip"),
        ({"algorithm": {"dual_clip_c": 1.0}}, "algorithm.dual_clip_c must be > 1"),
        ({"rollout": {"temperature": -0.1}}, "rollout.temperature must be >= 0"),
        ({"rollout": {"reward": "no_such_reward"}}, "rollout.reward must be one of"),
        ({"rollout": {"custom_generate": "not a path"}}, "rollout.custom_generate must be 'module:function' or"),
        ({"rollout": {"top_k": 0}}, "rollout.top_k must be -1 (all) or >= 1"),
        ({"algorithm": {"num_critic_only_steps": 2}}, "algorithm.num_critic_only_steps needs"),
        ({"algorithm": {"overlong_buffer_len": 8}}, "algorithm.overlong_buffer_len must be in"),
        ({"train": {"num_rollout": 0}}, "train.num_rollout is 0"),
        ({"train": {"max_tokens_per_gpu": 100}}, "train.max_tokens_per_gpu must hold one full sample"),
        ({"eval": {"interval": 5}}, "eval.datasets must not be empty"),
        (
            {"eval": {"datasets": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}},
            "eval.datasets.0.name must be non-empty and unique",
        ),
        ({"eval": {"datasets": [{"name": "a", "path": "x", "top_p": 1}]}}, "unknown key"),
        ({"checkpoint": {"keep_last": 0}}, "checkpoint.keep_last must be >= 1"),
        ({"model": {"recompute_fraction": 1.5}}, "model.recompute_fraction must be in [0, 1], got 1.5"),
        ({"model": {"recompute_rest": "all"}}, "model.recompute_rest must be one of ['auto', 'none', 'ops', 'mlp']"),
        (
            {"model": {"lora_rank": 8, "lora_dropout": 0.1}, "algorithm": {"true_on_policy": True}},
            "model.lora_dropout must be 0 with algorithm.true_on_policy",
        ),
    ],
)
def test_impossible_combinations(tmp_path, overrides, field):
    path = write_yaml(tmp_path, overrides)
    with pytest.raises(ValueError, match=re.escape(field)):
        load_config(["--config", path])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_greedy_sampling_with_a_group_baseline_is_refused(tmp_path, estimator):
    """Identical samples: every reward equals its group's mean, so nothing would be learnt."""
    path = write_yaml(tmp_path, {"rollout": {"temperature": 0}, "algorithm": {"advantage_estimator": estimator}})
    with pytest.raises(ValueError) as info:
        load_config(["--config", path])
    assert str(info.value) == (
        f"{path}: rollout.temperature is 0 (greedy): the 8 samples of a prompt are identical, so every "
        f"advantage of algorithm.advantage_estimator={estimator} (relative to the group) is 0; sample with "
        "rollout.temperature > 0, got 0.0"
    )
    with pytest.raises(ValueError, match="^command line: rollout.temperature is 0"):
        load_config(["--algorithm.advantage-estimator", estimator, "--rollout.temperature", "0"])


def test_greedy_sampling_is_allowed_without_a_group_baseline():
    for estimator in ("reinforce_plus_plus", "gae"):
        cfg = load_config(["--algorithm.advantage-estimator", estimator, "--rollout.temperature", "0"])
        assert cfg.rollout.temperature == 0.0
    assert load_config(["--eval.temperature", "0"]).eval.temperature == 0.0  # eval is not trained on


@pytest.mark.parametrize(
    "flags, field, feature, value",
    [
        (
            ["--rollout.over-sampling-batch-size", "32"],
            "rollout.over_sampling_batch_size",
            "rollout.dynamic_sampling or rollout.partial_rollout",
            "32",
        ),
        (["--rollout.max-staleness", "4"], "rollout.max_staleness", "rollout.partial_rollout", "4"),
        (
            ["--rollout.partial-mask-stale-tokens", "False"],
            "rollout.partial_mask_stale_tokens",
            "rollout.partial_rollout",
            "False",
        ),
    ],
)
def test_a_setting_without_the_feature_that_reads_it_is_refused(tmp_path, flags, field, feature, value):
    with pytest.raises(ValueError) as info:
        load_config(flags)
    assert str(info.value) == (f"command line: {field} is set but takes effect only with {feature}, which is off, got {value}")
    key = field.split(".")[1]
    path = write_yaml(tmp_path, {"rollout": {key: yaml.safe_load(value.lower())}})
    with pytest.raises(ValueError, match=f"^{re.escape(path)}: {field} is set but"):
        load_config(["--config", path])


def test_settings_with_their_feature_or_at_their_defaults_are_accepted(tmp_path):
    cfg = load_config(["--rollout.over-sampling-batch-size", "32", "--rollout.dynamic-sampling", "True"])
    assert cfg.rollout.over_sampling_batch_size == 32
    cfg = load_config(
        [
            "--rollout.partial-rollout",
            "True",
            "--rollout.over-sampling-batch-size",
            "32",
            "--rollout.max-staleness",
            "3",
            "--rollout.partial-mask-stale-tokens",
            "False",
        ]
    )
    assert cfg.rollout.max_staleness == 3 and not cfg.rollout.partial_mask_stale_tokens
    # Spelled out at the default (as a run's saved config.yaml spells out every field): nothing is off.
    path = write_yaml(
        tmp_path, {"rollout": {"over_sampling_batch_size": None, "max_staleness": 1, "partial_mask_stale_tokens": True}}
    )
    assert load_config(["--config", path]).rollout.max_staleness == 1


def test_group_free_estimators_accept_one_sample(tmp_path):
    for estimator in ("reinforce_plus_plus", "gae"):
        path = write_yaml(tmp_path, {"rollout": {"n_samples_per_prompt": 1}, "algorithm": {"advantage_estimator": estimator}})
        assert load_config(["--config", path]).samples_per_rollout == 16


def test_custom_reward_syntax_accepted_without_import(tmp_path):
    path = write_yaml(tmp_path, {"rollout": {"reward": "my_pkg.rewards:score"}})
    assert load_config(["--config", path]).rollout.reward == "my_pkg.rewards:score"


def test_tms_refuses_expandable_segments(tmp_path, monkeypatch):
    path = write_yaml(tmp_path, {"offload": {"method": "tms"}})
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ValueError, match="offload.method tms cannot pause"):
        load_config(["--config", path])
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert load_config(["--config", path]).offload.method == "tms"


def test_world_size_check():
    cfg = Config()
    cfg.check_world_size(8)
    with pytest.raises(ValueError, match="rollout.rollout_batch_size=16 must be divisible by the world size 3"):
        cfg.check_world_size(3)


def test_dtype_resolution():
    assert resolve_dtype(Config().model.dtype, "cuda") == torch.bfloat16
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16


def test_save_yaml_round_trip(tmp_path):
    path = write_yaml(tmp_path, {"algorithm": {"eps_clip_high": 0.28, "dual_clip_c": 3}, "rollout": {"stop_token_ids": [7]}})
    cfg = load_config(["--config", path, "--train.lr", "1e-4"])
    saved = tmp_path / "resolved.yaml"
    save_yaml(cfg, saved)
    again = load_config(["--config", str(saved)])
    assert again == cfg
    assert again.to_dict()["algorithm"]["dual_clip_c"] == 3.0


def test_help_shows_field_docstrings(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as info:
        load_config(["--help"])
    assert info.value.code == 0
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", capsys.readouterr().out).split())
    assert "--rollout.top-p" in text
    assert "Nucleus sampling mass." in text
    assert "Samples per optimizer step across ranks" in text
    assert "--config FILE.yaml" in text


def test_eval_only_run_is_valid(tmp_path):
    datasets = [{"name": "a", "path": "a.jsonl"}]
    path = write_yaml(tmp_path, {"train": {"num_rollout": 0}, "eval": {"interval": 1, "datasets": datasets}})
    cfg = load_config(["--config", path])
    assert cfg.train.num_rollout == 0 and cfg.eval.datasets[0].reward is None


def test_clip_high_may_be_below_a_lower_clip_that_is_off():
    cfg = load_config(["--algorithm.eps-clip", "1.0", "--algorithm.eps-clip-high", "0.28"])
    assert cfg.algorithm.eps_clip == 1.0 and cfg.algorithm.eps_clip_high == 0.28
    with pytest.raises(ValueError, match=r"algorithm.eps_clip_high must be >= algorithm.eps_clip \(0.3\)"):
        load_config(["--algorithm.eps-clip", "0.3", "--algorithm.eps-clip-high", "0.28"])


def test_compile_cache_lives_under_the_cache_root_unless_set(monkeypatch, tmp_path):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    use_compile_cache()
    assert cache_dir() == str(tmp_path / "inductor")  # where inductor reads and writes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    use_compile_cache()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")
