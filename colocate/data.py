"""Where prompt data comes from, and the public math sets converted to our rows.

A prompt source (`rollout.prompt_data`, `eval.datasets[].path`) is one of:

- a JSONL file (one object per line) or a Parquet file (`.parquet`);
- a directory written by `datasets`' `save_to_disk`, optionally `DIR:SPLIT` for a DatasetDict
  (default split: train);
- a Hugging Face Hub data set `owner/name[@revision][:CONFIG[:SPLIT]]` (CONFIG may be empty for
  the set's default; default split: train), e.g. `openai/gsm8k:main:train`, fetched into the Hub
  cache (see colocate/hub.py) and read with the `datasets` library; a local directory laid out
  like such a repository reads the same way.

Rows are mappings. Hub ids of the public sets below are converted on reading, exactly as
`python -m colocate.data prepare NAME OUT.jsonl [--split SPLIT]` converts them to our JSONL: a
`prompt` (text, or chat messages), the reference answer as `label` (gsm8k's "#### 72" becomes
"72"), so the default keys and the `math` reward apply to them unchanged.

`prepare reasoning_gym:TASK OUT.jsonl [--size N] [--seed S]` writes the generated problems of a
reasoning-gym task the same way, for the `reasoning_gym` environment (colocate/envs/reasoning_gym.py);
`prepare verifiers:TASKSET OUT.jsonl [--size N]` the tasks of an installed verifiers taskset, for the
`verifiers` environment (colocate/envs/verifiers_env.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from colocate.cli import DEBUG_HELP, entry_point
from colocate.hub import is_repo_id, snapshot, split_revision
from colocate.output_dir import replacing_file

BOXED = "Please reason step by step, and put your final answer within \\boxed{}."
"""Appended to the problems of the sets whose rows are bare problems: the `math` reward grades
the last boxed answer."""

FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
"""A missing path with one of these suffixes is a missing file, never taken for a Hub id."""


def _columns(row: dict, where: str, set_name: str, *names: str) -> list[Any]:
    missing = [n for n in names if n not in row]
    if missing:
        raise ValueError(f"{where}: a {set_name} row needs the columns {list(names)} (has {sorted(row)})")
    return [row[n] for n in names]


def gsm8k_row(row: dict, where: str) -> dict:
    """question -> prompt; the number after the answer's last '####' -> label (commas dropped)."""
    question, answer = _columns(row, where, "gsm8k", "question", "answer")
    if "####" not in answer:
        raise ValueError(f"{where}: a gsm8k answer ends with '#### <number>', got {answer[-60:]!r}")
    label = answer.rsplit("####", 1)[1].strip().replace(",", "")
    return {"prompt": f"{question}\n{BOXED}", "label": label}


def math500_row(row: dict, where: str) -> dict:
    """MATH-500: problem -> prompt, answer -> label (solution, subject and level are left out)."""
    problem, answer = _columns(row, where, "MATH-500", "problem", "answer")
    return {"prompt": f"{problem}\n{BOXED}", "label": str(answer)}


def dapo_row(row: dict, where: str) -> dict:
    """DAPO-Math-17k: the chat messages of `prompt` (they carry DAPO's answer-format instruction)
    stay a message list; reward_model.ground_truth -> label."""
    prompt, reward_model = _columns(row, where, "DAPO-Math-17k", "prompt", "reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise ValueError(f"{where}: a DAPO-Math-17k reward_model needs a ground_truth, got {reward_model!r}")
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and {"role", "content"} <= set(m) for m in prompt):
        raise ValueError(f"{where}: a DAPO-Math-17k prompt is a list of chat messages, got {str(prompt)[:80]!r}")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    return {"prompt": messages, "label": str(reward_model["ground_truth"])}


def aime_row(row: dict, where: str) -> dict:
    """AIME 2024: problem -> prompt, answer -> label."""
    problem, answer = _columns(row, where, "AIME 2024", "problem", "answer")
    return {"prompt": f"{problem}\n{BOXED}", "label": str(answer)}


@dataclass(frozen=True)
class PublicSet:
    repo_id: str
    config: str | None
    split: str
    """The split `prepare` converts unless --split says otherwise."""
    convert: Callable[[dict, str], dict]
    deduplicate: bool = False
    """Keep only the first of rows that convert identically (DAPO-Math-17k's ~17k prompts are
    stored about 100 times over)."""


PUBLIC_SETS = {
    "gsm8k": PublicSet("openai/gsm8k", "main", "train", gsm8k_row),
    "math500": PublicSet("HuggingFaceH4/MATH-500", None, "test", math500_row),
    "dapo-math-17k": PublicSet("BytedTsinghua-SIA/DAPO-Math-17k", None, "train", dapo_row, deduplicate=True),
    "aime24": PublicSet("HuggingFaceH4/aime_2024", None, "train", aime_row),
}


def read_rows(spec: str) -> Iterator[tuple[str, Any]]:
    """(location, row) for every row of a prompt source, as training reads it: Hub ids of the
    public sets are converted. Locations are 'file:line' (JSONL) or 'source:row N'."""
    rows = raw_rows(spec)
    known = _public_set(spec)
    return rows if known is None else _converted(known, rows)


def _converted(known: PublicSet, rows: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, dict]]:
    seen: set[str] = set()
    for where, row in rows:
        out = known.convert(row, where)
        if known.deduplicate:
            key = json.dumps(out, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
        yield where, out


def raw_rows(spec: str) -> Iterator[tuple[str, Any]]:
    """(location, row) for every row of a prompt source, as stored."""
    path = Path(spec)
    if path.is_file():
        return _file_rows(spec)
    if path.is_dir():
        return _dataset_rows(spec, spec, None, None)
    location, *rest = spec.split(":")
    if len(rest) > 2 or not location:
        raise ValueError(f"{spec}: a data set is SOURCE[:CONFIG[:SPLIT]], got {len(rest)} ':' parts")
    config, split = (rest + [None, None])[:2]
    if Path(location).is_dir():
        return _dataset_rows(spec, location, config or None, split)
    repo = hub_repo(spec)
    if repo is None:
        raise ValueError(
            f"{spec}: prompt data not found (not a file, a directory, or a Hub data set id owner/name[:config[:split]])"
        )
    return _dataset_rows(spec, snapshot(*repo, "dataset", spec), config or None, split)


def hub_repo(spec: str) -> tuple[str, str | None] | None:
    """The (repo id, revision) a prompt source names on the Hub; None for a local source."""
    location = spec.split(":")[0]
    if Path(spec).exists() or Path(location).exists() or location.endswith(FILE_SUFFIXES):
        return None
    return split_revision(location) if is_repo_id(location) else None


def _public_set(spec: str) -> PublicSet | None:
    repo = hub_repo(spec)
    return next((s for s in PUBLIC_SETS.values() if repo is not None and s.repo_id == repo[0]), None)


def _file_rows(path: str) -> Iterator[tuple[str, Any]]:
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is then named by its number
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start]:#04x}, {e.start + 1} bytes "
                    "into the line): save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {e.msg}") from None
            yield f"{path}:{lineno}", row


def _dataset_rows(spec: str, directory: str, config: str | None, split: str | None) -> Iterator[tuple[str, Any]]:
    """Rows of a save_to_disk directory (then `config` is its split) or of a data set repository's
    files (read with its README's configs). The latter are converted afresh into a temporary
    cache: `datasets` names its cache by directory and config alone, so a directory edited in
    place would otherwise be read stale."""
    import datasets

    root = Path(directory)
    saved = (root / "state.json").is_file() or (root / "dataset_dict.json").is_file()
    if saved and split is not None:
        raise ValueError(f"{spec}: a save_to_disk directory takes DIR[:SPLIT], not a config and a split")
    with tempfile.TemporaryDirectory(prefix="colocate-data-") as cache:
        try:
            data = (
                datasets.load_from_disk(directory)
                if saved
                else datasets.load_dataset(directory, config, split=split or "train", cache_dir=cache)
            )
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"{spec}: {e}") from None
        if isinstance(data, datasets.DatasetDict):
            name = config or "train"
            if name not in data:
                raise ValueError(f"{spec}: no split {name!r}; the directory has {sorted(data)}")
            data = data[name]
        elif saved and config is not None:
            raise ValueError(f"{spec}: the directory holds one Dataset, without splits")
        for i, row in enumerate(data):
            yield f"{spec}:row {i}", row


def prepare(name: str, out: str | Path, split: str | None = None, source: str | None = None, *, overwrite: bool = False) -> int:
    """Convert a public set to our JSONL at `out`; returns the number of rows written.

    `source` replaces the Hub id (a local copy: JSONL, Parquet, save_to_disk directory or a data
    set repository directory, in the set's own columns)."""
    known = PUBLIC_SETS[name]
    if source is None:
        source = f"{known.repo_id}:{known.config or ''}:{split or known.split}"
    rows = [row for _, row in _converted(known, raw_rows(source))]
    with replacing_file(out, overwrite=overwrite) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)


REASONING_GYM = "reasoning_gym:"
"""The prefix of `prepare`'s names that are reasoning-gym tasks."""
VERIFIERS = "verifiers:"
"""The prefix of `prepare`'s names that are verifiers tasksets."""
GENERATED = (REASONING_GYM, VERIFIERS)


def prepare_generated(name: str, out: str | Path, size: int, seed: int, *, overwrite: bool = False) -> int:
    """Write `size` rows of a reasoning-gym task (generated from `seed`) or of a verifiers taskset
    (its first tasks) to our JSONL at `out`, by the `task_rows` of their environment's module;
    returns the number of rows written."""
    try:
        if name.startswith(REASONING_GYM):
            from colocate.envs.reasoning_gym import task_rows

            rows = task_rows(name[len(REASONING_GYM) :], size, seed)
        else:
            from colocate.envs.verifiers_env import VerifiersEnv, task_rows

            rows = task_rows(VerifiersEnv(name[len(VERIFIERS) :]), size)
    except ImportError as e:  # the optional extra is missing: a user error, in one line
        raise ValueError(str(e)) from None
    with replacing_file(out, overwrite=overwrite) as tmp:
        tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return len(rows)


def _set_name(name: str) -> str:
    if name in PUBLIC_SETS or any(name.startswith(g) and name != g for g in GENERATED):
        return name
    raise argparse.ArgumentTypeError(
        f"{name!r} is neither a public set ({', '.join(sorted(PUBLIC_SETS))}) nor {REASONING_GYM}TASK nor {VERIFIERS}TASKSET"
    )


@entry_point
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.data", description=__doc__.split("\n\n")[0], epilog=DEBUG_HELP)
    sub = p.add_subparsers(dest="command", required=True)
    prep = sub.add_parser(
        "prepare",
        help="convert a public set, or write a reasoning-gym task's or a verifiers "
        "taskset's problems, to our JSONL (prompt, label)",
    )
    prep.add_argument(
        "name",
        type=_set_name,
        help=f"the public set ({', '.join(sorted(PUBLIC_SETS))}), "
        f"{REASONING_GYM}TASK for a task of the reasoning-gym package (pip install 'colocate[envs]'), "
        f"or {VERIFIERS}TASKSET for an installed verifiers taskset (pip install 'colocate[verifiers]')",
    )
    prep.add_argument("out", help="output JSONL")
    prep.add_argument(
        "--split",
        default=None,
        help="split of the Hub data set (default: the set's " + ", ".join(f"{k} {v.split}" for k, v in PUBLIC_SETS.items()) + ")",
    )
    prep.add_argument("--source", default=None, help="read this local copy instead of the Hub (same columns as the Hub set)")
    prep.add_argument("--size", type=int, default=1000, help="reasoning-gym and verifiers: the number of rows")
    prep.add_argument("--seed", type=int, default=0, help=f"{REASONING_GYM}TASK: the seed they are generated from")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    args = p.parse_args(argv)
    if args.name.startswith(GENERATED):
        if args.split is not None or args.source is not None:
            p.error(f"--split and --source are for the public sets, not {args.name}")
        if args.size < 1:
            p.error(f"--size must be at least 1, got {args.size}")
        n = prepare_generated(args.name, args.out, args.size, args.seed, overwrite=args.overwrite)
    else:
        n = prepare(args.name, args.out, args.split, args.source, overwrite=args.overwrite)
    print(f"wrote {n} {args.name} prompts to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
