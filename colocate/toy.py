"""A tiny model and a synthetic task that RL visibly improves in a couple of CPU minutes.

`python -m colocate.toy --out DIR` writes a HF-format model directory (a randomly initialised
Qwen3 with tied embeddings, fp32) with a word-level tokenizer, plus `train.jsonl` and
`eval.jsonl`. The default config points at the cache written by `ensure_toy`, so a fresh
checkout trains end to end without downloading anything.

The task: the prompt lists a few distractor symbols, then `after X`; the answer is the symbols
that follow X in the alphabet a-f, in order, then end of sequence ("c a f b after c" -> "d e f").
The `toy` reward is the number of response symbols matching the answer position by position,
over max(response length, answer length): a random policy already scores a little, running past
the answer costs reward, and only the prompt's last symbol tells where to start, so the reward
and eval accuracy on unseen prompts measure what the policy learned. Every answer token is a
function of the token before it (the prompt's last symbol, then its own previous symbol, then
eos after f), which a two-layer model picks up from GRPO's group signal within a few dozen steps.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from colocate.cli import DEBUG_HELP, entry_point
from colocate.config import cache_root
from colocate.output_dir import replacing_dir

TOY_VERSION = "1"
"""Bumped whenever the model or the task changes, so that `ensure_toy` replaces older caches."""
TOY_SYMBOLS = tuple("abcdef")
"""The alphabet the answers walk through; longer alphabets make RL on the toy much slower."""
TOY_NUM_STARTS = 3
"""Prompts start from one of the first this-many symbols, so answers are 3 to 5 symbols long."""
TOY_NUM_DISTRACTORS = 4
TOY_SEED = 1234
TOY_NUM_TRAIN = 1024
TOY_NUM_EVAL = 64
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
PROMPT_WORD = "after"


def default_cache_dir() -> Path:
    """Where `ensure_toy` writes the toy by default: <cache root>/toy."""
    return cache_root() / "toy"


def toy_prompt(distractors: list[str], start: str) -> str:
    return " ".join([*distractors, PROMPT_WORD, start])


def toy_answer(start: str) -> str:
    return " ".join(TOY_SYMBOLS[TOY_SYMBOLS.index(start) + 1 :])


def toy_score(response: str, label: str) -> float:
    """Position-wise matches of response and label words over the longer of the two lengths."""
    words, answer = response.split(), label.split()
    matches = sum(w == a for w, a in zip(words, answer))
    return matches / max(len(words), len(answer), 1)


def _task_rows(rng: random.Random, num: int, seen: set[str]) -> list[dict]:
    """`num` prompts not in `seen` (which is updated), so eval prompts are unseen in training."""
    capacity = len(TOY_SYMBOLS) ** TOY_NUM_DISTRACTORS * TOY_NUM_STARTS
    assert len(seen) + num <= capacity, f"only {capacity} distinct toy prompts exist"
    rows = []
    while len(rows) < num:
        distractors = [rng.choice(TOY_SYMBOLS) for _ in range(TOY_NUM_DISTRACTORS)]
        start = rng.choice(TOY_SYMBOLS[:TOY_NUM_STARTS])
        prompt = toy_prompt(distractors, start)
        if prompt in seen:
            continue
        seen.add(prompt)
        rows.append({"prompt": prompt, "label": toy_answer(start), "metadata": {"start": start}})
    return rows


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def build_toy_tokenizer():
    """A word-level tokenizer loadable by AutoTokenizer; eos doubles as pad, as in Qwen base models.

    `<unk>` is deliberately not registered as special: decoding with skip_special_tokens keeps
    it visible, so the only token a reward cannot see is eos, which ends the completion.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [EOS_TOKEN, UNK_TOKEN, *TOY_SYMBOLS, PROMPT_WORD]
    vocab = {w: i for i, w in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN)
    # Chat-formatted prompts reduce to their message contents, so the toy also exercises the
    # chat-template path of the data source without unknown tokens.
    hf.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return hf


def _build_model(vocab_size: int, eos_id: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        # Larger than the usual 0.02: with tiny widths the default leaves logits and gradients
        # too flat for RL to move the policy within a few dozen steps.
        initializer_range=0.1,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        torch_dtype="float32",
    )
    torch.manual_seed(TOY_SEED)
    return Qwen3ForCausalLM(config).to(torch.float32)


def write_toy(out: str | Path, overwrite: bool = False) -> Path:
    """Write `out/model`, `out/{train,eval}.jsonl` and the `out/VERSION` stamp; deterministic.

    Written into a temporary sibling and renamed into place (see `colocate.output_dir`), so a
    reader never sees a half-written directory; an existing non-empty `out` is replaced only if
    colocate wrote it or `overwrite` is set."""
    with replacing_dir(out, "colocate.toy", overwrite=overwrite) as tmp:
        tokenizer = build_toy_tokenizer()
        model = _build_model(len(tokenizer), tokenizer.eos_token_id)
        model.save_pretrained(tmp / "model", safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        rng = random.Random(TOY_SEED)
        seen: set[str] = set()
        _write_jsonl(tmp / "train.jsonl", _task_rows(rng, TOY_NUM_TRAIN, seen))
        _write_jsonl(tmp / "eval.jsonl", _task_rows(rng, TOY_NUM_EVAL, seen))
        (tmp / "VERSION").write_text(TOY_VERSION + "\n")
    return Path(out)


def ensure_toy(cache_dir: str | Path | None = None) -> Path:
    """Create the toy directory on first use (or when it is from an older toy) and return it.

    Call it from one process per machine while the others wait: concurrent callers write
    identical (seeded) copies, but replacing a stale copy briefly leaves no directory. A directory
    at that place that is not a toy is never replaced (ValueError naming it).
    """
    target = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    if _is_current(target):
        return target
    try:
        # A toy from before the output marker existed is recognised by its VERSION stamp.
        write_toy(target, overwrite=(target / "VERSION").is_file())
    except OSError:
        if not _is_current(target):  # another process won the race to write it
            raise
    return target


def _is_current(path: Path) -> bool:
    stamp = path / "VERSION"
    return stamp.is_file() and stamp.read_text().strip() == TOY_VERSION


@entry_point
def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m colocate.toy", description=__doc__.splitlines()[0], epilog=DEBUG_HELP)
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: the toy cache); an existing one is replaced only if colocate wrote it",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace --out even if it holds files colocate did not write")
    args = parser.parse_args(argv)
    path = write_toy(args.out, args.overwrite) if args.out is not None else ensure_toy()
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
