import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from colocate.rollout.prompts import PromptDataset, PromptSampler
from colocate.toy import build_toy_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer()


ROWS = [
    {"question": "a b after c", "answer": "d e f", "meta": {"id": 0}},
    {"question": "b after a", "answer": "b c d e f"},
    {"question": "f f f f f after b", "answer": "c d e f", "meta": {"id": 2}},
    {"question": "after c", "answer": "d e f", "meta": None},
]
KEYS = dict(input_key="question", label_key="answer", metadata_key="meta")


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_dataset(tmp_path, tokenizer, n, name="p.jsonl"):
    rows = [{"prompt": f"a after {'abc'[i % 3]}", "label": str(i)} for i in range(n)]
    return PromptDataset(write_jsonl(tmp_path / name, rows), tokenizer)


def test_jsonl_with_custom_keys(tmp_path, tokenizer):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, **KEYS)
    assert len(ds) == 4 and ds.num_dropped == 0
    for i, (sample, row) in enumerate(zip(ds.samples, ROWS)):
        assert sample.index == i
        assert sample.prompt_text == row["question"]
        assert sample.prompt_ids == tokenizer(row["question"])["input_ids"]
        assert sample.label == row["answer"]
    assert [s.metadata for s in ds.samples] == [{"id": 0}, {}, {"id": 2}, {}]
    assert ds[0].prompt_ids == [2, 3, 8, 4]  # a b after c in the toy vocabulary


def test_parquet_matches_jsonl(tmp_path, tokenizer):
    rows = [{**r, "meta": r.get("meta")} for r in ROWS]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    from_parquet = PromptDataset(tmp_path / "d.parquet", tokenizer, **KEYS)
    from_jsonl = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, **KEYS)
    assert from_parquet.samples == from_jsonl.samples


def test_chat_template(tmp_path, tokenizer):
    rows = [{"prompt": [{"role": "user", "content": "a after b"}], "label": "c d e f"}, {"prompt": "a after c", "label": "d e f"}]
    ds = PromptDataset(write_jsonl(tmp_path / "c.jsonl", rows), tokenizer, apply_chat_template=True)
    assert [s.prompt_text for s in ds.samples] == ["a after b ", "a after c "]
    assert ds[0].prompt_ids == tokenizer("a after b")["input_ids"]
    with pytest.raises(ValueError, match=r"c.jsonl:1: 'prompt' is a chat message list"):
        PromptDataset(tmp_path / "c.jsonl", tokenizer, apply_chat_template=False)


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ("{not json", "invalid JSON"),
        (json.dumps({"prompt": "a"}), "missing key 'label'"),
        (json.dumps({"label": "a"}), "missing key 'prompt'"),
        (json.dumps({"prompt": 3, "label": "a"}), "'prompt' must be a string or a message list"),
        (json.dumps({"prompt": [{"role": "user"}], "label": "a"}), "non-empty list"),
        (json.dumps({"prompt": "a", "label": "a", "metadata": [1]}), "'metadata' must be a mapping"),
        (json.dumps(["a", "b"]), "expected a JSON object"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, tokenizer, bad_line, message):
    good = json.dumps({"prompt": "a after b", "label": "c"})
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n\n{good}\n{bad_line}\n")
    with pytest.raises(ValueError) as info:
        PromptDataset(path, tokenizer, apply_chat_template=True)
    assert str(info.value).startswith(f"{path}:4: ")
    assert message in str(info.value)


def test_parquet_error_names_row(tmp_path, tokenizer):
    pq.write_table(pa.Table.from_pylist([{"prompt": "a"}, {"prompt": "b"}]), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match=r"x.parquet:row 0: missing key 'label'"):
        PromptDataset(tmp_path / "x.parquet", tokenizer)


def test_missing_file(tmp_path, tokenizer):
    with pytest.raises(ValueError, match="not found"):
        PromptDataset(tmp_path / "nope.jsonl", tokenizer)


def test_overlong_prompts_dropped_and_counted(tmp_path, tokenizer):
    ds = PromptDataset(write_jsonl(tmp_path / "d.jsonl", ROWS), tokenizer, max_prompt_len=4, **KEYS)
    # Token counts are 4, 3, 7, 2: the third prompt is dropped and the indices stay dense.
    assert ds.num_dropped == 1
    assert [s.label for s in ds.samples] == ["d e f", "b c d e f", "d e f"]
    assert [s.index for s in ds.samples] == [0, 1, 2]
    with pytest.raises(ValueError, match="no prompts left"):
        PromptDataset(tmp_path / "d.jsonl", tokenizer, max_prompt_len=1, **KEYS)


def labels(batch):
    return [int(s.label) for s in batch]


def test_shuffle_is_seeded_and_covers_each_epoch(tmp_path, tokenizer):
    ds = make_dataset(tmp_path, tokenizer, 12)
    a, b, c = (PromptSampler(ds, seed=s) for s in (3, 3, 4))
    epoch_a = [labels(a.next_batch(4)) for _ in range(3)]
    assert epoch_a == [labels(b.next_batch(4)) for _ in range(3)]
    assert epoch_a != [labels(c.next_batch(4)) for _ in range(3)]
    assert sorted(sum(epoch_a, [])) == list(range(12))
    assert a.epoch == 1 and a.epoch_done
    epoch_a2 = sum((labels(a.next_batch(4)) for _ in range(3)), [])
    assert sorted(epoch_a2) == list(range(12)) and epoch_a2 != sum(epoch_a, [])
    ordered = PromptSampler(ds, shuffle=False)
    assert labels(ordered.next_batch(5)) == [0, 1, 2, 3, 4]


def test_epochs_wrap_around(tmp_path, tokenizer):
    ds = make_dataset(tmp_path, tokenizer, 10)
    sampler = PromptSampler(ds, shuffle=False)
    batches, done = [], []
    for _ in range(5):
        batches.append(labels(sampler.next_batch(4)))
        done.append(sampler.epoch_done)
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 0, 1], [2, 3, 4, 5], [6, 7, 8, 9]]
    assert done == [False, False, True, False, True]
    assert (sampler.epoch, sampler.offset) == (2, 0)


def test_sharding_is_disjoint_and_complete(tmp_path, tokenizer):
    ds = make_dataset(tmp_path, tokenizer, 10)
    whole = PromptSampler(ds, seed=7)
    ranks = [PromptSampler(ds, rank=r, world_size=4, seed=7) for r in range(4)]
    for _ in range(4):
        expected = labels(whole.next_batch(8))
        shares = [labels(s.next_batch(8)) for s in ranks]
        assert all(len(share) == 2 for share in shares)
        assert sum(shares, []) == expected
    with pytest.raises(ValueError, match="multiple of the world size 4"):
        ranks[0].next_batch(6)


def test_state_round_trip_resumes_the_same_batches(tmp_path, tokenizer):
    ds = make_dataset(tmp_path, tokenizer, 10)
    sampler = PromptSampler(ds, seed=5)
    for _ in range(3):
        sampler.next_batch(4)
    state = sampler.state_dict()
    assert state == {"epoch": 1, "offset": 2, "seed": 5, "dataset_size": 10}
    resumed = PromptSampler(ds, seed=0)
    resumed.load_state_dict(state)
    assert [labels(resumed.next_batch(4)) for _ in range(4)] == [labels(sampler.next_batch(4)) for _ in range(4)]
    smaller = make_dataset(tmp_path, tokenizer, 9, name="q.jsonl")
    with pytest.raises(ValueError, match="saw 10 prompts, the data now has 9"):
        PromptSampler(smaller).load_state_dict(state)


def test_empty_file(tmp_path, tokenizer):
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="e.jsonl: no prompts"):
        PromptDataset(tmp_path / "e.jsonl", tokenizer)
