"""Per-token log-prob parity: transformers vs our model definition vs the native engine.

    python -m colocate.parity --model DIR [--prompts a.jsonl] [--dtype float32] [--tol 1e-4]

Prompts come from a JSONL file (`prompt` text or `input_ids`) or are random token ids. The engine
samples the continuations; all three columns then score the same tokens (temperature-scaled log-probs,
the protocol's definition). Exits 1 when a column differs from transformers by more than --tol,
2 on a user error (a missing model or prompts file, a malformed prompt line).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from colocate.cli import DEBUG_HELP, entry_point
from colocate.hub import resolve_model


def _prompts(args, vocab_size: int) -> list[list[int]]:
    if args.prompts is None:
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab_size, (8 + 5 * i,), generator=g).tolist() for i in range(args.num_prompts)]
    from colocate.models.config import load_tokenizer

    tok = None
    out = []
    for n, line in enumerate(Path(args.prompts).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{args.prompts}:{n}: not a JSON line ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{args.prompts}:{n}: expected a JSON object, got {type(row).__name__}")
        if "input_ids" in row:
            ids = row["input_ids"]
            if not (isinstance(ids, list) and ids and all(isinstance(i, int) and 0 <= i < vocab_size for i in ids)):
                raise ValueError(f"{args.prompts}:{n}: input_ids must be a non-empty list of token ids in [0, {vocab_size})")
            out.append(ids)
        elif "prompt" in row:
            tok = tok or load_tokenizer(args.model)
            out.append(tok(row["prompt"])["input_ids"])
        else:
            raise ValueError(f"{args.prompts}:{n}: needs 'prompt' or 'input_ids'")
    if not out:
        raise ValueError(f"{args.prompts}: no prompts")
    return out


def sequence_logprobs(logits: torch.Tensor, tokens: list[int], start: int, temperature: float) -> torch.Tensor:
    """Log-probs of tokens[start:] given logits (T, V) of the whole sequence."""
    scaled = logits[start - 1 : len(tokens) - 1].float() / (temperature if temperature > 0 else 1.0)
    target = torch.tensor(tokens[start:], device=logits.device)
    return torch.log_softmax(scaled, -1).gather(-1, target[:, None])[:, 0]


@entry_point
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m colocate.parity", description=__doc__.split("\n\n")[0], epilog=DEBUG_HELP)
    p.add_argument("--model", required=True, help="HF model directory or Hub id owner/name[@revision]")
    p.add_argument("--prompts", default=None, help="JSONL with 'prompt' or 'input_ids' per line")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tol", type=float, default=None, help="max |diff| allowed (default 1e-4 fp32, 0.1 otherwise)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine column (random continuations)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    args.model = resolve_model(args.model, "--model")
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "float32" else 0.1)

    from rich.console import Console
    from rich.table import Table
    from transformers import AutoModelForCausalLM

    from colocate.models import from_pretrained
    from colocate.rollout.protocol import SamplingParams

    dtype = getattr(torch, args.dtype)
    ours = from_pretrained(args.model, dtype=dtype, device=args.device).eval()
    prompts = _prompts(args, ours.config.vocab_size)
    if args.no_engine:
        g = torch.Generator().manual_seed(args.seed + 1)
        outputs = [
            (torch.randint(0, ours.config.vocab_size, (args.max_new_tokens,), generator=g).tolist(), None) for _ in prompts
        ]
    else:
        from colocate.rollout.native import NativeEngine

        engine = NativeEngine(args.model, dtype=dtype, device=args.device, cuda_graph=False)
        sampling = SamplingParams(
            temperature=args.temperature, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=args.seed
        )
        outputs = [(c.output_ids, torch.tensor(c.logprobs)) for c in engine.generate(prompts, sampling)]
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()

    table = Table(title=f"log-prob parity vs transformers ({args.dtype}, T={args.temperature})")
    for col in ("prompt", "tokens", "ours max", "ours mean", "engine max", "engine mean"):
        table.add_column(col, justify="right")
    worst = 0.0
    with torch.no_grad():
        for i, (prompt, (out_ids, engine_lp)) in enumerate(zip(prompts, outputs)):
            tokens = prompt + out_ids
            ids = torch.tensor([tokens], device=args.device)
            ref = sequence_logprobs(hf(ids).logits[0], tokens, len(prompt), args.temperature)
            mine = sequence_logprobs(ours(ids)[0], tokens, len(prompt), args.temperature)
            d_ours = (mine - ref).abs()
            row = [str(i), str(len(out_ids)), f"{d_ours.max():.2e}", f"{d_ours.mean():.2e}"]
            worst = max(worst, d_ours.max().item())
            if engine_lp is not None:
                d_eng = (engine_lp.to(ref.device) - ref).abs()
                row += [f"{d_eng.max():.2e}", f"{d_eng.mean():.2e}"]
                worst = max(worst, d_eng.max().item())
            else:
                row += ["-", "-"]
            table.add_row(*row)
    console = Console()
    console.print(table)
    ok = worst <= tol
    console.print(f"max |diff| {worst:.3e} {'<=' if ok else '>'} tol {tol:.1e}: {'OK' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
