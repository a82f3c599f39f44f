"""User code named in the config as `module:function` (reward functions, rollout.custom_generate):
one syntax check, used by config validation, and one loader, used at start-up, with one error."""

from __future__ import annotations

import importlib
import re
from typing import Callable

_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_function_spec(spec: str) -> bool:
    """`spec` reads as `module.path:function`."""
    return bool(_SPEC.match(spec))


def load_function(spec: str, what: str) -> Callable:
    """Import `module:function`; every failure is a ValueError naming `what` (the config field)
    and the spec."""
    if not is_function_spec(spec):
        raise ValueError(f"{what}: expected 'module:function', got {spec!r}")
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail on import in any way
        raise ValueError(f"{what}: cannot import {spec!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{what}: cannot import {spec!r}: {module_name} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return fn
