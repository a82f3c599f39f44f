"""The GSM8K recipe as written, through Hub ids alone, end to end on CPU: an offline Hub cache
holds a tiny random model with Qwen2.5's tokenizer and template under Qwen/Qwen2.5-0.5B-Instruct,
and a data set in openai/gsm8k's layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from colocate.metrics import read_metrics
from tests.real_models import lay_out_hub_repo, write_chat_model
from tests.unit.test_prompt_sources import gsm8k_repo

ROOT = Path(__file__).resolve().parents[2]


def gsm8k_rows(answers: list[str]) -> list[dict]:
    return [
        {
            "question": f"Tom has {a} apples minus zero. How many apples does he have?",
            "answer": f"{a} - 0 = <<{a}-0={a}>>{a}\n#### {a}",
        }
        for a in answers
    ]


@pytest.mark.slow
def test_gsm8k_recipe_runs_from_hub_ids_offline(tmp_path):
    cache = tmp_path / "hub"
    snap = lay_out_hub_repo(cache, "Qwen/Qwen2.5-0.5B-Instruct", write_chat_model(tmp_path / "m", "qwen2.5"))
    # The model answers 7 to anything: every training prompt's answer is 7, one of two eval answers is.
    lay_out_hub_repo(
        cache,
        "openai/gsm8k",
        gsm8k_repo(tmp_path / "gsm8k", train=gsm8k_rows(["7"] * 8), test=gsm8k_rows(["7", "8"])),
        repo_type="dataset",
    )
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "colocate.train",
        "--config",
        "configs/qwen2.5-0.5b-grpo-gsm8k.yaml",
        "--model.path",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "--rollout.prompt-data",
        "openai/gsm8k:main:train",
        # a CPU-sized run of the same recipe
        "--output-dir",
        str(out),
        "--model.dtype",
        "float32",
        "--model.compile",
        "False",
        "--rollout.rollout-batch-size",
        "4",
        "--rollout.n-samples-per-prompt",
        "2",
        "--rollout.max-response-len",
        "8",
        "--rollout.max-kv-tokens",
        "8192",
        "--train.num-rollout",
        "2",
        "--train.global-batch-size",
        "8",
        "--train.max-tokens-per-gpu",
        "4096",
        "--logging.wandb",
        "False",
    ]
    env = {
        **os.environ,
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-8000:]
    saved = yaml.safe_load((out / "config.yaml").read_text())  # as the user gave it
    assert saved["model"]["path"] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert saved["rollout"]["prompt_data"] == "openai/gsm8k:main:train"
    rows = {r["step"]: r for r in read_metrics(out)}
    assert sorted(rows) == [0, 1]
    for r in rows.values():  # the answer, then <|im_end|>: stopped by generation_config.json's end of turn
        assert r["rollout/response_len/mean"] == 2.0 and r["rollout/truncated_ratio"] == 0.0
        assert r["rollout/raw_reward"] == 1.0  # "7" against the converted labels, graded by `math`
    assert rows[0]["eval/gsm8k/avg@4"] == 0.5 and rows[1]["eval/gsm8k/avg@4"] == 0.5
    ckpt = out / "checkpoints" / "rollout_000001"  # saved at the last step, with the snapshot's files
    assert json.loads((ckpt / "meta.json").read_text())["extra"]["data"]["dataset_size"] == 8
    assert (ckpt / "hf" / "generation_config.json").read_text() == (snap / "generation_config.json").read_text()
