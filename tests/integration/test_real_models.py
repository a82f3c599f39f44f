"""Chat models as they ship (end of turn only in generation_config.json), by path or Hub id: the
stop rule in training rollouts, eval and `colocate.generate`, and generate's defaults (CPU)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from colocate import dist
from colocate.config_loading import load_config
from colocate.generate import completion_row
from colocate.generate import main as generate
from colocate.inputs import RunInputs
from colocate.models.config import stop_token_ids
from colocate.rollout.factory import build_engine
from colocate.rollout.orchestrator import RolloutManager
from colocate.rollout.protocol import Completion
from colocate.toy import write_toy
from tests.real_models import ANSWER, FAMILIES, chat_tokenizer, lay_out_hub_repo, offline_hub, write_chat_model


@pytest.fixture(scope="module")
def info():
    yield dist.init()
    dist.destroy()


def ids(name: str, *tokens: str) -> list[int]:
    return chat_tokenizer(name).convert_tokens_to_ids(list(tokens))


def test_stop_ids_come_from_config_generation_config_and_tokenizer(tmp_path):
    path = write_chat_model(tmp_path, "llama3")
    eot, eos = ids("llama3", "<|eot_id|>", "<|end_of_text|>")
    assert json.loads((path / "config.json").read_text())["eos_token_id"] == eos
    assert stop_token_ids(path) == sorted([eot, eos])
    tok = chat_tokenizer("llama3")
    tok.eos_token = "<|begin_of_text|>"
    assert stop_token_ids(path, tok) == sorted([eot, eos, tok.eos_token_id])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ValueError, match=r"generation_config.json: eos_token_id must be an integer or a list"):
        stop_token_ids(path)
    (path / "generation_config.json").unlink()
    assert stop_token_ids(path) == [eos]


def run_config(tmp_path, model: str, data: str, **rollout) -> list[str]:
    cfg = {
        "model": {"path": model},
        "rollout": {
            "prompt_data": data,
            "apply_chat_template": True,
            "reward": "exact",
            "rollout_batch_size": 2,
            "n_samples_per_prompt": 2,
            "max_response_len": 6,
            "max_kv_tokens": 4096,
            **rollout,
        },
        "train": {"max_tokens_per_gpu": 4096},
        "eval": {"interval": 1, "datasets": [{"name": "held_out", "path": data}]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return ["--config", str(path)]


def write_prompts(path, labels=(ANSWER, ANSWER, "8")):
    path.write_text(
        "".join(json.dumps({"prompt": f"What is {i} + {i}?", "label": label}) + "\n" for i, label in enumerate(labels))
    )
    return path


@pytest.mark.parametrize("name", list(FAMILIES))
def test_training_rollouts_and_eval_stop_at_the_end_of_turn(tmp_path, info, name):
    model = write_chat_model(tmp_path, name)
    extra = {"chat_template_kwargs": {"enable_thinking": False}} if name == "qwen3" else {}
    cfg = load_config(run_config(tmp_path, str(model), str(write_prompts(tmp_path / "p.jsonl")), **extra))
    inputs = RunInputs.load(cfg, info)
    end_of_turn = ids(name, FAMILIES[name].end_of_turn)[0]
    assert end_of_turn in inputs.eos_token_ids and end_of_turn not in json.loads((model / "config.json").read_text()).values()
    engine = build_engine(cfg, info, inputs.eos_token_ids)  # as the loop builds it
    rm = RolloutManager(engine, inputs.tokenizer, cfg.rollout, reward_fn=inputs.reward_fn, seed=1)
    samples, metrics = rm.generate(inputs.data, rollout_id=0)
    answer = inputs.tokenizer.convert_tokens_to_ids(inputs.tokenizer.tokenize(ANSWER))[0]
    assert len(samples) == 4
    assert all(s.response_ids == [answer, end_of_turn] and s.finish_reason == "stop" for s in samples)
    assert all(s.response_text == ANSWER for s in samples)  # special tokens removed
    assert metrics["rollout/response_len/mean"] == 2.0 and metrics["rollout/truncated_ratio"] == 0.0
    evals = rm.evaluate(inputs.eval_sets, 0, cfg.eval)
    assert evals["eval/held_out/avg@1"] == pytest.approx(2 / 3) and evals["eval/held_out/response_len"] == 2.0
    engine.shutdown()


def test_hub_ids_become_snapshot_directories_before_any_model_work(tmp_path, monkeypatch, info):
    cache = tmp_path / "hub"
    snap = lay_out_hub_repo(cache, "Qwen/Qwen2.5-0.5B-Instruct", write_chat_model(tmp_path / "m", "qwen2.5"))
    data = tmp_path / "gsm8k"
    (data / "main").mkdir(parents=True)
    (data / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
    )
    (data / "main" / "train.jsonl").write_text(json.dumps({"question": "1+6?", "answer": "1+6=7\n#### 7"}) + "\n")
    lay_out_hub_repo(cache, "openai/gsm8k", data, repo_type="dataset")
    offline_hub(monkeypatch, cache)
    cfg = load_config(
        run_config(tmp_path, "Qwen/Qwen2.5-0.5B-Instruct", "openai/gsm8k:main:train")
        + ["--model.ref-path", "Qwen/Qwen2.5-0.5B-Instruct@main", "--rollout.rollout-batch-size", "1"]
    )
    inputs = RunInputs.load(cfg, info)
    assert cfg.model.path == cfg.model.ref_path == str(snap) and cfg.model.critic_path is None
    assert [
        (s.prompt_text.endswith("\\boxed{}.<|im_end|>\n<|im_start|>assistant\n"), s.label) for s in inputs.data.dataset.samples
    ] == [(True, "7")]
    cfg = load_config(run_config(tmp_path, "Qwen/Qwen2.5-7B-Instruct", "openai/gsm8k:main:train"))
    with pytest.raises(ValueError, match=r"^model.path: the Hub model Qwen/Qwen2.5-7B-Instruct is not in the cache"):
        RunInputs.load(cfg, info)
    cfg = load_config(
        run_config(tmp_path, str(snap), "openai/gsm8k:main:train") + ["--rollout.prompt-data", "openai/gsm8k@v2:main:train"]
    )
    with pytest.raises(ValueError) as e:
        RunInputs.load(cfg, info)
    assert str(e.value) == (
        f"rollout.prompt_data: the Hub data set openai/gsm8k@v2 is not in the cache {cache}, and HF_HUB_OFFLINE is set"
    )


def test_generate_as_the_readme_shows_it(tmp_path, capsys):
    model = write_toy(tmp_path / "toy") / "model"
    prompts = tmp_path / "in.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b c d after a", "f e after c")))
    out = tmp_path / "out.jsonl"
    assert (
        generate(["--model", str(model), "--prompts", str(prompts), "--out", str(out), "--n", "4", "--temperature", "0.8"]) == 0
    )
    assert (
        "warning: --max-new-tokens 128 cut to fit the model's context of 128 tokens for 2 of 2 prompts" in capsys.readouterr().err
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(p, s) for p in range(2) for s in range(4)]
    assert {r["finish_reason"] for r in rows} <= {"stop", "length"} and "stop" in {r["finish_reason"] for r in rows}
    assert all(len(r["output_ids"]) <= 128 - 6 and "<eos>" not in r["text"] for r in rows)


def test_generate_chat_with_a_hub_id_stops_at_the_end_of_turn(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    lay_out_hub_repo(cache, "meta-llama/Meta-Llama-3-8B-Instruct", write_chat_model(tmp_path / "m", "llama3"))
    offline_hub(monkeypatch, cache)
    prompts = write_prompts(tmp_path / "in.jsonl", labels=("x",))
    with open(prompts, "a") as f:
        f.write(json.dumps({"prompt": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "out.jsonl"
    assert (
        generate(["--model", "meta-llama/Meta-Llama-3-8B-Instruct", "--prompts", str(prompts), "--out", str(out), "--chat"]) == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["output_ids"], r["finish_reason"], r["text"]) for r in rows] == [
        (ids("llama3", ANSWER, "<|eot_id|>"), "stop", ANSWER)
    ] * 2


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--top-k", "0"], "--top-k must be -1 (all) or >= 1, got 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
        (["--n", "0"], "--n must be >= 1, got 0"),
        (["--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
    ],
)
def test_generate_checks_sampling_as_training_does(tmp_path, flags, message, capsys):
    assert generate(["--model", str(tmp_path), "--prompts", "p.jsonl", "--out", "o.jsonl", *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
    with pytest.raises(ValueError, match=r"command line: rollout.top_k must be -1 \(all\) or >= 1, got 0"):
        load_config(["--rollout.top-k", "0"])


def test_generate_errors_name_the_missing_directory_and_the_long_prompt(tmp_path, capsys):
    prompts = tmp_path / "in.jsonl"
    prompts.write_text(json.dumps({"input_ids": list(range(2, 8)) * 22}) + "\n")
    assert generate(["--model", str(tmp_path / "nope"), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == f"error: --model: model directory {tmp_path}/nope does not exist\n"
    model = write_toy(tmp_path / "toy") / "model"
    capsys.readouterr()  # writing the toy reports progress
    assert generate(["--model", str(model), "--prompts", str(prompts), "--out", str(tmp_path / "o")]) == 2
    assert capsys.readouterr().err == (
        f"error: {prompts}:1: the prompt's 132 tokens leave no room for a new token in the model's context of 128\n"
    )


def test_generate_never_writes_invalid_json():
    row = completion_row(Completion(0, 1, [5, 6, 7], [math.nan, -0.5, -math.inf], "length"), tokenizer=None)
    line = json.dumps(row, allow_nan=False)
    assert json.loads(line)["logprobs"] == [None, -0.5, None] and "NaN" not in line and "Infinity" not in line
