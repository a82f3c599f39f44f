"""Prompt sources beyond JSONL and Parquet (`datasets` directories, Hub data set ids, offline) and
the converters of the public math sets, each fed rows in that set's own column layout."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

datasets = pytest.importorskip("datasets")  # a dependency of colocate, missing on some GPU images

from colocate.data import BOXED, main, prepare, raw_rows, read_rows
from colocate.rollout.prompts import PromptDataset
from colocate.toy import build_toy_tokenizer
from tests.real_models import lay_out_hub_repo, offline_hub

GSM8K = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
        "altogether in April and May.\n#### 72",
    },
    {"question": "A shop sells 1,200 pens a day. How many in 2 days?", "answer": "1200*2=2400\n#### 2,400"},
]
MATH500 = [
    {
        "problem": "What is $\\frac{1}{2} + \\frac{1}{4}$?",
        "solution": "$\\frac{3}{4}$.",
        "answer": "\\frac{3}{4}",
        "subject": "Prealgebra",
        "level": 1,
        "unique_id": "test/prealgebra/1.json",
    }
]
DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [
            {
                "content": "Solve the following math problem step by step. The last line of your response "
                "should be of the form Answer: $Answer (without quotes) where $Answer is the "
                "answer to the problem.\n\nFind 3+4.\n\nRemember to put your answer on its own "
                "line after \"Answer:\".",
                "role": "user",
            }
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "7", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a1b2"},
    }
]
AIME24 = [
    {
        "id": 60,
        "problem": "Find the number of integers $n$ with $1 \\le n \\le 10$.",
        "solution": "There are 10.",
        "answer": "10",
        "url": "https://example.invalid/aime",
        "year": "2024",
    }
]

README = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
"""


def gsm8k_repo(root, train=GSM8K, test=GSM8K[:1]):
    """A directory laid out like the openai/gsm8k repository (README configs, parquet per split)."""
    (root / "main").mkdir(parents=True)
    (root / "README.md").write_text(README)
    pq.write_table(pa.Table.from_pylist(train), root / "main" / "train-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(test), root / "main" / "test-00000-of-00001.parquet")
    return root


@pytest.fixture
def datasets_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")


@pytest.mark.parametrize(
    "name, rows, expected",
    [
        (
            "gsm8k",
            GSM8K,
            [
                {"prompt": GSM8K[0]["question"] + "\n" + BOXED, "label": "72"},
                {"prompt": GSM8K[1]["question"] + "\n" + BOXED, "label": "2400"},
            ],
        ),
        ("math500", MATH500, [{"prompt": MATH500[0]["problem"] + "\n" + BOXED, "label": "\\frac{3}{4}"}]),
        (
            "dapo-math-17k",
            DAPO * 3,
            [{"prompt": [{"role": "user", "content": DAPO[0]["prompt"][0]["content"]}], "label": "7"}],
        ),  # stored many times over, converted once
        ("aime24", AIME24, [{"prompt": AIME24[0]["problem"] + "\n" + BOXED, "label": "10"}]),
    ],
)
def test_prepare_converts_each_public_set(tmp_path, datasets_cache, name, rows, expected):
    source = tmp_path / "source.parquet"
    pq.write_table(pa.Table.from_pylist(rows), source)
    out = tmp_path / "out" / f"{name}.jsonl"
    assert prepare(name, out, source=str(source)) == len(expected)
    assert [json.loads(line) for line in out.read_text().splitlines()] == expected


def test_prepare_names_the_row_and_the_columns(tmp_path, capsys):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n" + json.dumps({"problem": "p"}) + "\n")
    assert main(["prepare", "gsm8k", str(tmp_path / "o.jsonl"), "--source", str(source)]) == 2
    assert capsys.readouterr().err == f"error: {source}:1: a gsm8k answer ends with '#### <number>', got 'no marker'\n"
    assert main(["prepare", "aime24", str(tmp_path / "o.jsonl"), "--source", str(source)]) == 2
    assert capsys.readouterr().err == (
        f"error: {source}:1: a AIME 2024 row needs the columns ['problem', 'answer'] (has ['answer', 'question'])\n"
    )


def test_save_to_disk_directories(tmp_path, datasets_cache):
    single = tmp_path / "single"
    datasets.Dataset.from_list([{"prompt": "a after b", "label": "c d e f"}]).save_to_disk(single)
    splits = tmp_path / "splits"
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list([{"prompt": "x", "label": "1"}] * 3),
            "test": datasets.Dataset.from_list([{"prompt": "y", "label": "2"}]),
        }
    ).save_to_disk(splits)
    assert list(read_rows(str(single))) == [(f"{single}:row 0", {"prompt": "a after b", "label": "c d e f"})]
    assert [row["label"] for _, row in read_rows(str(splits))] == ["1", "1", "1"]
    assert list(read_rows(f"{splits}:test")) == [(f"{splits}:test:row 0", {"prompt": "y", "label": "2"})]
    with pytest.raises(ValueError, match=rf"^{splits}:val: no split 'val'; the directory has \['test', 'train'\]$"):
        list(read_rows(f"{splits}:val"))
    with pytest.raises(ValueError, match=r"takes DIR\[:SPLIT\], not a config and a split"):
        list(read_rows(f"{splits}:main:test"))
    tok = build_toy_tokenizer()
    ds = PromptDataset(single, tok)
    assert ds[0].prompt_ids == tok("a after b")["input_ids"] and ds[0].label == "c d e f"


def test_hub_data_set_ids_read_offline_and_public_sets_are_converted(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    lay_out_hub_repo(cache, "openai/gsm8k", gsm8k_repo(tmp_path / "gsm8k"), repo_type="dataset")
    lay_out_hub_repo(cache, "acme/raw", gsm8k_repo(tmp_path / "raw", train=GSM8K[1:]), repo_type="dataset")
    offline_hub(monkeypatch, cache)
    assert [row["label"] for _, row in read_rows("openai/gsm8k:main:train")] == ["72", "2400"]
    assert [row["label"] for _, row in read_rows("openai/gsm8k:main:test")] == ["72"]
    assert [row for _, row in raw_rows("acme/raw:main")] == GSM8K[1:]  # other repos keep their columns
    assert next(read_rows("acme/raw:main"))[0] == "acme/raw:main:row 0"
    assert prepare("gsm8k", tmp_path / "test.jsonl", split="test") == 1
    with pytest.raises(ValueError, match=r"^openai/gsm8k:main:val: .*Unknown split \"val\""):
        list(read_rows("openai/gsm8k:main:val"))
    with pytest.raises(ValueError, match=r"^acme/missing:main: the Hub data set acme/missing is not in the cache"):
        list(read_rows("acme/missing:main"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "data/train.jsonl",
            "data/train.jsonl: prompt data not found (not a file, a directory, or a Hub data set id owner/name[:config[:split]])",
        ),
        ("a/b:c:d:e", "a/b:c:d:e: a data set is SOURCE[:CONFIG[:SPLIT]], got 3 ':' parts"),
    ],
)
def test_bad_sources_are_named(spec, message):
    with pytest.raises(ValueError) as e:
        list(read_rows(spec))
    assert str(e.value) == message
