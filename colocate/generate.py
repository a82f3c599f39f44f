"""Offline generation with the native engine: JSONL prompts in, JSONL completions out.

    python -m colocate.generate --model DIR_OR_HUB_ID --prompts IN.jsonl --out OUT.jsonl [--n 4] [--chat]

Each input line is a JSON object with `prompt` (text tokenised with the model's tokenizer; with
--chat, text or a list of chat messages formatted by its chat template) or `input_ids` (a list of
token ids). Output lines follow input order, the n samples of a prompt consecutive, each with
prompt_index, sample_index, output_ids, logprobs (null where not finite), finish_reason, and the
text without special tokens when the model has a tokenizer. Completions stop at the model's stop
ids (colocate.models.config.stop_token_ids); a budget of new tokens that does not fit the model's
context after a prompt is cut to what fits, with a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from colocate.cli import DEBUG_HELP, entry_point
from colocate.output_dir import check_output_file, replacing_file
from colocate.rollout.protocol import Completion, SamplingParams
from colocate.timing import process_age_s

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
FLAGS = {
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "min_p": "--min-p",
    "n_samples_per_prompt": "--n",
    "max_response_len": "--max-new-tokens",
}
"""The rollout config fields whose checks apply to these flags."""
MAX_NUM_SEQS = 256
"""Sequences the engine decodes at once."""
COMPILE_DECODE_MIN_STEPS = 8192
"""--compile-decode auto compiles the decode forward (CUDA only) for jobs of at least this many
decode steps. On an H200 at the 0.5B shape the engine with its decode compiled took 23 s to start
with warm caches and 111 s cold (bench/rollout_throughput.py), mostly compiling and capturing, and compiling
saves at most ~2.5 ms a step there (b256: 1.99 ms compiled; 4.56 ms for the uncompiled, slower still
batch-invariant path): a shorter job cannot win the compile back."""


def load_tokenizer(model_dir: Path):
    """The model directory's tokenizer, or None when it has none."""
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        return None
    from colocate.models.config import load_tokenizer as load

    return load(model_dir)


def read_prompts(path: Path, tokenizer, chat: bool = False) -> list[tuple[int, list[int]]]:
    """(line number, token ids) per non-blank line; errors name file:line."""
    from colocate.rollout.prompts import render_chat

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
                prompt = row["prompt"]
                if tokenizer is None:
                    raise ValueError(f"{where}: a text 'prompt' needs a tokenizer in the model directory")
                if not (isinstance(prompt, str) or chat and _is_messages(prompt)):
                    raise ValueError(
                        f"{where}: 'prompt' must be a string" + (" or a list of {'role', 'content'} messages" if chat else "")
                    )
                if chat:  # the template writes the special tokens (BOS too) itself
                    ids = tokenizer.encode(render_chat(tokenizer, prompt), add_special_tokens=False)
                else:
                    ids = tokenizer.encode(prompt)
            else:
                raise ValueError(f"{where}: needs a 'prompt' or an 'input_ids' field")
            out.append((lineno, ids))
    return out


def _is_messages(prompt) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in prompt)
    )


class _ShowDefaults(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows the default of each option that has one (not of flags, nor of required ones)."""

    def _get_help_string(self, action):
        if action.required or action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m colocate.generate", description=__doc__.split("\n\n")[0], formatter_class=_ShowDefaults, epilog=DEBUG_HELP
    )
    p.add_argument("--model", required=True, help="HF model directory (Llama, Qwen2, Qwen3) or a Hub id owner/name[@revision]")
    p.add_argument("--prompts", type=Path, required=True, help="input JSONL, one prompt per line")
    p.add_argument("--out", type=Path, required=True, help="output JSONL (not replaced without --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    p.add_argument("--chat", action="store_true", help="format text prompts with the tokenizer's chat template")
    p.add_argument("--n", type=int, default=1, help="samples per prompt")
    p.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--top-k", type=int, default=-1, help="keep the k most likely tokens; -1 keeps all")
    p.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min-p times the top probability")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=128,
        help="new tokens per completion, cut to what the model's context leaves after the prompt",
    )
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's stop ids")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (sample j of a prompt uses seed + j)")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"], help="auto: bf16 on CUDA, fp32 on CPU"
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument(
        "--max-kv-tokens",
        type=int,
        default=None,
        help="KV-cache capacity in tokens (default: 65536 on CPU, a share of free memory on CUDA)",
    )
    p.add_argument(
        "--compile-decode",
        default="auto",
        choices=["auto", "on", "off"],
        help=f"torch.compile the decode forward; auto: on CUDA for jobs of at least "
        f"{COMPILE_DECODE_MIN_STEPS} decode steps, where the compile pays for itself",
    )
    args = p.parse_args(argv)
    check_sampling(args)
    return args


def check_sampling(args: argparse.Namespace) -> None:
    """The sampling flags pass the checks of the training config's fields, or raise ValueError."""
    from colocate.config import RolloutConfig
    from colocate.config_checks import sampling_checks

    values = RolloutConfig(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        n_samples_per_prompt=args.n,
        max_response_len=args.max_new_tokens,
    )
    for name, ok, why, value in sampling_checks(values, FLAGS):
        if not ok:
            raise ValueError(f"{name} {why}, got {value!r}")


def fit_budgets(prompts: list[tuple[int, list[int]]], max_new_tokens: int, max_len: int, where: Path) -> list[int]:
    """Per prompt, the new-token budget cut to what `max_len` leaves; warns once when any is cut."""
    budgets = []
    for lineno, ids in prompts:
        room = max_len - len(ids)
        if room < 1:
            raise ValueError(
                f"{where}:{lineno}: the prompt's {len(ids)} tokens leave no room for a new "
                f"token in the model's context of {max_len}"
            )
        budgets.append(min(max_new_tokens, room))
    cut = sum(b < max_new_tokens for b in budgets)
    if cut:
        print(
            f"warning: --max-new-tokens {max_new_tokens} cut to fit the model's context of {max_len} "
            f"tokens for {cut} of {len(prompts)} prompts",
            file=sys.stderr,
        )
    return budgets


def decode_steps(num_prompts: int, n: int, max_new_tokens: int) -> int:
    """Decode steps of a job at most: one per new token, per wave of MAX_NUM_SEQS sequences."""
    return max_new_tokens * math.ceil(num_prompts * n / MAX_NUM_SEQS)


def compile_decode(choice: str, steps: int) -> bool | None:
    """The engine's compile_decode for --compile-decode `choice` (None: the engine's device default)."""
    if choice == "auto":
        return None if steps >= COMPILE_DECODE_MIN_STEPS else False
    return choice == "on"


def startup_line(seconds: float, engine, process_s: float | None = None) -> str:
    """'start-up 4.5 s: process 1.4, inputs 0.7, engine 2.4 (weights 0.4, runner 0.3, cuda graphs
    1.7), decode compiled': `seconds` since `main` began (inputs: all but the engine), after the
    `process_s` before it (interpreter, imports)."""
    from colocate.metrics import startup_line as line

    engine_s = sum(engine.startup_seconds.values())
    parts = {"process": process_s} if process_s is not None else {}
    parts.update(inputs=seconds - engine_s, engine=engine_s)
    parts.update({f"engine_{k}": v for k, v in engine.startup_seconds.items()})
    return f"{line(parts)}, decode {'compiled' if engine.runner.compiled_decode else 'not compiled'}"


def completion_row(c: Completion, tokenizer) -> dict:
    """One output line; log-probs that are not finite (overflow in half precision) become null."""
    row = dict(
        prompt_index=c.prompt_index,
        sample_index=c.sample_index,
        output_ids=c.output_ids,
        logprobs=[lp if math.isfinite(lp) else None for lp in c.logprobs],
        finish_reason=c.finish_reason,
    )
    if tokenizer is not None:
        row["text"] = tokenizer.decode(c.output_ids, skip_special_tokens=True)
    return row


@entry_point
def main(argv: list[str]) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from colocate.config import use_compile_cache
    from colocate.hub import resolve_model
    from colocate.models.config import stop_token_ids
    from colocate.rollout.native import NativeEngine

    process_s = process_age_s()  # the interpreter's start and the imports so far
    start = time.perf_counter()
    use_compile_cache()
    args = parse_args(argv)
    check_output_file(args.out, overwrite=args.overwrite, reading=[args.prompts])  # before any model work
    sampling = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_new_tokens=args.max_new_tokens,
        ignore_eos=args.ignore_eos,
        seed=args.seed,
    )
    model_dir = Path(resolve_model(args.model, "--model"))
    tokenizer = load_tokenizer(model_dir)
    if args.chat and not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"--chat: the tokenizer of {args.model} has no chat template")
    prompts = read_prompts(args.prompts, tokenizer, chat=args.chat)
    steps = decode_steps(len(prompts), args.n, args.max_new_tokens)
    engine = NativeEngine(
        str(model_dir),
        dtype=args.dtype,
        device=args.device,
        max_kv_tokens=args.max_kv_tokens,
        eos_token_ids=stop_token_ids(model_dir, tokenizer),
        seed=args.seed,
        max_num_seqs=MAX_NUM_SEQS,
        cuda_graph_max_bs=max(1, min(MAX_NUM_SEQS, len(prompts) * args.n)),  # the job's batch
        compile_decode=compile_decode(args.compile_decode, steps),
    )
    budgets = fit_budgets(prompts, args.max_new_tokens, engine.max_model_len, args.prompts)
    for index, ((lineno, ids), budget) in enumerate(zip(prompts, budgets)):
        try:
            engine.add_request(ids, dataclasses.replace(sampling, max_new_tokens=budget), prompt_index=index)
        except ValueError as e:
            raise ValueError(f"{args.prompts}:{lineno}: {e}") from None
    print(startup_line(time.perf_counter() - start, engine, process_s), file=sys.stderr)
    completions = []
    columns = (TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[tps]}"), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("generate", total=len(prompts) * args.n, tps="")
        while engine.has_unfinished_requests():
            finished = engine.step()
            completions += finished
            elapsed = progress.tasks[0].elapsed or 1e-9
            progress.update(task, advance=len(finished), tps=f"{engine.stats['decode_tokens'] / elapsed:,.0f} tok/s")
    completions.sort(key=lambda c: (c.prompt_index, c.sample_index))
    with replacing_file(args.out, overwrite=args.overwrite, reading=[args.prompts]) as tmp, open(tmp, "w") as f:
        for c in completions:
            f.write(json.dumps(completion_row(c, tokenizer), allow_nan=False) + "\n")
    engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
