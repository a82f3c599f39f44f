"""colocate's one command: `colocate COMMAND [ARGS...]` (or `python -m colocate COMMAND ...`) runs
the tool colocate.COMMAND with ARGS, exactly as `python -m colocate.COMMAND ARGS...` does."""

from __future__ import annotations

import importlib
import sys

# Command -> its one-line summary; each is the module colocate.<command>, whose `main(argv)` runs it.
COMMANDS = {
    "train": "train a policy: a YAML config (--config) and flags that override it",
    "generate": "sample completions of JSONL prompts with the native engine",
    "export": "write a checkpoint's actor as a Hugging Face model directory",
    "parity": "compare per-token log-probs: transformers, our model, the engine",
    "plot": "draw a run's metrics.jsonl as PNGs, one per metric group",
    "data": "write prompt rows: a public math set (gsm8k, math500, ...), reasoning-gym tasks or a verifiers taskset",
    "toy": "write the tiny toy model and its synthetic task",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: colocate COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<{width}}  {summary}" for name, summary in COMMANDS.items()]
    lines += ["", "colocate COMMAND --help lists its arguments."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}; choose one of {', '.join(COMMANDS)} (colocate --help)", file=sys.stderr)
        return 2
    sys.argv = [f"colocate {name}", *rest]  # the program name train's --help prints
    code = importlib.import_module(f"colocate.{name}").main(rest)
    if name == "train":
        from colocate import dist

        dist.exit_process(code)  # as `python -m colocate.train` ends: see exit_process
    return code


if __name__ == "__main__":
    sys.exit(main())
