"""Offline generation with the native engine: JSONL prompts in, JSONL completions out.

    python -m colocate.generate --model DIR --prompts IN.jsonl --out OUT.jsonl [--n 4] [--temperature 0.7]

Each input line is a JSON object with `prompt` (text, tokenised with the model directory's
tokenizer) or `input_ids` (a list of token ids). Output lines follow input order, the n samples
of a prompt consecutive, each with prompt_index, sample_index, output_ids, logprobs,
finish_reason, and text when the model directory has a tokenizer.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from colocate.rollout.protocol import SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer, or None when it has none."""
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def eos_token_ids(model_dir: Path, tokenizer) -> list[int]:
    """Stop ids: config.json's eos, generation_config.json's (chat models often add the end of
    turn there), and the tokenizer's."""
    from colocate.models import ModelConfig

    ids = set(ModelConfig.from_dir(model_dir).eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        eos = json.loads(generation.read_text()).get("eos_token_id")
        ids |= set([eos] if isinstance(eos, int) else eos or [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(ids)


def read_prompts(path: Path, tokenizer) -> list[tuple[int, list[int]]]:
    """(line number, token ids) per non-blank line; errors name file:line."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object with 'prompt' or 'input_ids'")
            if "input_ids" in row:
                ids = row["input_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise ValueError(f"{where}: 'input_ids' must be a list of integers")
            elif "prompt" in row:
                if not isinstance(row["prompt"], str):
                    raise ValueError(f"{where}: 'prompt' must be a string")
                if tokenizer is None:
                    raise ValueError(f"{where}: a text 'prompt' needs a tokenizer in the model directory")
                ids = tokenizer.encode(row["prompt"])
            else:
                raise ValueError(f"{where}: needs a 'prompt' or an 'input_ids' field")
            out.append((lineno, ids))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m colocate.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="HF model directory (Llama, Qwen2, Qwen3)")
    p.add_argument("--prompts", type=Path, required=True, help="input JSONL, one prompt per line")
    p.add_argument("--out", type=Path, required=True, help="output JSONL")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1, help="-1 means the whole vocabulary")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the tokenizer's eos")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="auto: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--max-kv-tokens", type=int, default=None, help="KV-cache capacity in tokens")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from colocate.rollout.native import NativeEngine

    args = parse_args(argv)
    sampling = SamplingParams(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_new_tokens=args.max_new_tokens, ignore_eos=args.ignore_eos, seed=args.seed)
    tokenizer = load_tokenizer(args.model)
    prompts = read_prompts(args.prompts, tokenizer)
    engine = NativeEngine(str(args.model), dtype=args.dtype, device=args.device, max_kv_tokens=args.max_kv_tokens,
                          eos_token_ids=eos_token_ids(args.model, tokenizer), seed=args.seed)
    for index, (lineno, ids) in enumerate(prompts):
        try:
            engine.add_request(ids, sampling, prompt_index=index)
        except ValueError as e:
            raise ValueError(f"{args.prompts}:{lineno}: {e}") from None
    completions = []
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"),
               TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("generate", total=len(prompts) * args.n, tps="")
        while engine.has_unfinished_requests():
            finished = engine.step()
            completions += finished
            elapsed = progress.tasks[0].elapsed or 1e-9
            progress.update(task, advance=len(finished), tps=f"{engine.stats['decode_tokens'] / elapsed:,.0f} tok/s")
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        for c in completions:
            row = dict(prompt_index=c.prompt_index, sample_index=c.sample_index, output_ids=c.output_ids,
                       logprobs=c.logprobs, finish_reason=c.finish_reason)
            if tokenizer is not None:
                row["text"] = tokenizer.decode(c.output_ids)
            f.write(json.dumps(row) + "\n")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
