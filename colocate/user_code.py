"""User code named in the config (reward functions, rollout.custom_generate) as `module:function`
(an importable module) or `path/to/file.py:function` (a file, relative to the working directory):
one syntax check, used by config validation, and one loader, used at start-up, with one error."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable

_SPEC = re.compile(r"^([A-Za-z_][\w.]*|[^:]+\.py):[A-Za-z_]\w*$")
FORMS = "'module:function' or 'path/to/file.py:function'"


def is_function_spec(spec: str) -> bool:
    """`spec` reads as `module.path:function` or `file.py:function`."""
    return bool(_SPEC.match(spec))


def _import_file(path: Path):
    """The module of a Python file, executed once per process and kept in sys.modules under its
    absolute path as its name (which error messages then show; dataclasses inside it need it)."""
    name = str(path.resolve())
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_function(spec: str, what: str) -> Callable:
    """Import `module:function` or `file.py:function`; every failure is a ValueError naming `what`
    (the config field) and the spec."""
    if not is_function_spec(spec):
        raise ValueError(f"{what}: expected {FORMS}, got {spec!r}")
    module_name, _, name = spec.rpartition(":")
    if module_name.endswith(".py") and not Path(module_name).is_file():
        raise ValueError(f"{what}: {spec!r}: no file {module_name} (relative to {Path.cwd()})")
    try:
        if module_name.endswith(".py"):
            module = _import_file(Path(module_name))
        else:
            module = importlib.import_module(module_name)
    except Exception as e:  # the user's module may fail on import in any way
        raise ValueError(f"{what}: cannot import {spec!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if fn is None:
        raise ValueError(f"{what}: cannot import {spec!r}: {module_name} has no attribute {name!r}")
    if not callable(fn):
        raise ValueError(f"{what}: {spec!r} is not callable")
    return fn
