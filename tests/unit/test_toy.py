import json
import os
import random

import pytest
import torch
import transformers
from packaging.version import Version
from transformers import AutoModelForCausalLM, AutoTokenizer

from colocate.rollout.rewards import RewardInput, compute_rewards, load_reward_fn
from colocate.toy import TOY_SYMBOLS, TOY_VERSION, default_cache_dir, ensure_toy, toy_answer, write_toy


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    return write_toy(tmp_path_factory.mktemp("toy"))


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_model_and_tokenizer_load_with_transformers(toy):
    model = AutoModelForCausalLM.from_pretrained(toy / "model")
    tok = AutoTokenizer.from_pretrained(toy / "model")
    assert model.config.model_type == "qwen3"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.dtype == torch.float32
    assert tok.eos_token == "<eos>" and tok.pad_token_id == tok.eos_token_id == 0
    assert model.config.vocab_size == len(tok) == len(TOY_SYMBOLS) + 3
    assert tok.decode(tok("c a after b")["input_ids"] + [tok.eos_token_id], skip_special_tokens=True) == "c a after b"


def test_task_files(toy):
    train, evals = read_jsonl(toy / "train.jsonl"), read_jsonl(toy / "eval.jsonl")
    assert len(train) == 1024 and len(evals) == 64
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evals}
    tok = AutoTokenizer.from_pretrained(toy / "model")
    for row in evals:
        ids = tok(row["prompt"])["input_ids"]
        assert tok.unk_token_id not in ids and 1 not in ids  # <unk> is id 1
        assert row["label"] == toy_answer(row["prompt"].split()[-1])
    assert toy_answer("c") == "d e f"


def test_reward_follows_the_label_and_random_responses_score_low(toy):
    fn = load_reward_fn("toy")
    rows = read_jsonl(toy / "eval.jsonl")
    perfect, errors = compute_rewards(fn, [RewardInput(r["prompt"], r["label"], r["label"]) for r in rows])
    assert perfect == [1.0] * len(rows) and errors == 0
    rng = random.Random(0)
    words = [*TOY_SYMBOLS, "after"]
    random_responses = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 8))) for _ in rows]
    rewards, _ = compute_rewards(fn, [RewardInput(r["prompt"], resp, r["label"]) for r, resp in zip(rows, random_responses)])
    assert sum(rewards) / len(rewards) < 0.15


def test_untrained_model_scores_low(toy):
    model = AutoModelForCausalLM.from_pretrained(toy / "model")
    tok = AutoTokenizer.from_pretrained(toy / "model")
    rows = read_jsonl(toy / "eval.jsonl")[:16]
    ids = torch.tensor([tok(r["prompt"])["input_ids"] for r in rows])  # (B, T): same length
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=tok.eos_token_id
    )
    responses = tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)
    inputs = [RewardInput(r["prompt"], s, r["label"]) for r, s in zip(rows, responses)]
    rewards, _ = compute_rewards(load_reward_fn("toy"), inputs)
    assert sum(rewards) / len(rewards) < 0.2


def test_generation_is_deterministic(toy, tmp_path):
    again = write_toy(tmp_path / "again")
    for name in ("model/model.safetensors", "model/config.json", "model/tokenizer.json", "train.jsonl", "eval.jsonl"):
        assert (again / name).read_bytes() == (toy / name).read_bytes(), name


def test_ensure_toy_is_idempotent_and_replaces_stale_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("COLOCATE_CACHE", str(tmp_path))
    path = ensure_toy()
    assert path == default_cache_dir() == tmp_path / "toy"
    assert (path / "model" / "config.json").exists()
    stamp = os.stat(path / "model" / "model.safetensors").st_mtime_ns
    assert ensure_toy(path) == path
    assert os.stat(path / "model" / "model.safetensors").st_mtime_ns == stamp
    (path / "VERSION").write_text("0\n")
    (path / "train.jsonl").write_text("stale\n")
    assert ensure_toy(path) == path
    assert (path / "VERSION").read_text().strip() == TOY_VERSION
    assert read_jsonl(path / "train.jsonl")[0]["prompt"] == "d a a a after c"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["toy"]  # no temporary leftovers


def test_toy_tokenizer_loads_without_the_auto_registry(toy):
    """The toy's tokenizer (generic class, qwen3) loads without importing AutoTokenizer's model
    registry (that it is AutoTokenizer's tokenizer: test_load_tokenizer_equals_auto_tokenizer)."""
    import subprocess
    import sys

    code = (
        "import sys; from colocate.models.config import load_tokenizer; load_tokenizer(sys.argv[1]); "
        "print([m for m in ('transformers.models.auto.auto_factory', 'transformers.models.auto.tokenization_auto') "
        "if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code, str(toy / "model")], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("tokenizer_class", ["PreTrainedTokenizerFast", "TokenizersBackend", "Qwen2Tokenizer"])
@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_load_tokenizer_equals_auto_tokenizer(toy, tmp_path, arch, tokenizer_class):
    """For every supported architecture and a generic or specific declared class, load_tokenizer
    gives AutoTokenizer's class and ids (for qwen2 AutoTokenizer replaces a generic class by
    Qwen2Tokenizer from transformers 5.8 on, whose ids differ, so that model type is not loaded by
    the generic class; 5.0-5.7 keep the generic class)."""
    import shutil

    from colocate.models.config import ARCHITECTURES, GENERIC_TOKENIZERS, load_tokenizer

    model = tmp_path / "model"
    shutil.copytree(toy / "model", model)
    for name, update in (
        ("config.json", {"architectures": [arch], "model_type": ARCHITECTURES[arch]}),
        ("tokenizer_config.json", {"tokenizer_class": tokenizer_class}),
    ):
        (model / name).write_text(json.dumps({**json.loads((model / name).read_text()), **update}))
    mine, auto = load_tokenizer(model), AutoTokenizer.from_pretrained(model)
    assert type(mine) is type(auto)
    assert mine("c a after b")["input_ids"] == auto("c a after b")["input_ids"]
    replaced = Version(transformers.__version__) >= Version("5.8")
    if tokenizer_class in GENERIC_TOKENIZERS and arch == "Qwen2ForCausalLM" and replaced:
        assert type(auto).__name__ == "Qwen2Tokenizer"  # the case the model-type rule exists for
