"""Environments by name: the built-in ones, or user classes as `module:Class` / `path.py:Class`."""

from __future__ import annotations

from typing import Any

from colocate.user_code import is_function_spec, load_function

BUILTIN = {
    "toy_turns": "colocate.envs.toy:ToyTurns",
    "math_python": "colocate.envs.math_python:MathPython",
    "reasoning_gym": "colocate.envs.reasoning_gym:ReasoningGym",
    "verifiers": "colocate.envs.verifiers_env:VerifiersEnv",
}
"""Built-in environments (name -> class)."""


def check_env_spec(spec: str) -> str | None:
    """Why `spec` cannot name an environment, or None."""
    if spec in BUILTIN or is_function_spec(spec):
        return None
    return f"must be a built-in environment ({', '.join(BUILTIN)}), 'module:Class' or 'path/to/file.py:Class'"


def load_env(spec: str, args: dict[str, Any]) -> Any:
    """The environment object of rollout.env, constructed with rollout.env_args; one-line errors."""
    why = check_env_spec(spec)
    if why:
        raise ValueError(f"rollout.env {why}, got {spec!r}")
    cls = load_function(BUILTIN.get(spec, spec), "rollout.env")
    try:
        env = cls(**args)
    except Exception as e:
        raise ValueError(f"rollout.env: {spec} could not be built from rollout.env_args={args}: {type(e).__name__}: {e}") from e
    missing = [m for m in ("reset", "step", "reward") if not callable(getattr(env, m, None))]
    if missing:
        raise ValueError(f"rollout.env: {spec} has no {', '.join(missing)} method (see colocate/envs/base.py)")
    return env
