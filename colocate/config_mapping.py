"""Dataclasses from plain mappings (parsed YAML), checking every key and value type.

`from_mapping(Config, yaml.safe_load(f), "run.yaml")` builds the nested dataclasses; an unknown key
(with the closest known one suggested) or a value of the wrong type raises ValueError naming the
dotted field and the source.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal


def from_mapping(cls: type, data: Any, source: str) -> Any:
    """Instantiate dataclass `cls` from `data`; errors name `source` and the dotted field."""
    return _build(cls, data, "", source)


def _build(cls: type, data: Any, prefix: str, source: str) -> Any:
    """Instantiate dataclass `cls` from a mapping, checking keys and value types recursively."""
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ValueError(f"{source}: {where} must be a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ValueError(f"{source}: unknown key {prefix}{key}{hint}")
        kwargs[key] = _coerce(value, hints[key], f"{prefix}{key}", source)
    return cls(**kwargs)


def _coerce(value: Any, tp: Any, name: str, source: str) -> Any:
    origin, targs = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in targs:
            return None
        inner = [t for t in targs if t is not type(None)]
        literals = [t for t in inner if typing.get_origin(t) is Literal]
        if len(inner) == 2 and len(literals) == 1:  # a number or a word such as "auto"
            if value in typing.get_args(literals[0]):
                return value
            inner.remove(literals[0])
        assert len(inner) == 1, f"unsupported union type {tp} for {name}"
        return _coerce(value, inner[0], name, source)
    if origin is Literal:
        if value not in targs:
            raise ValueError(f"{source}: {name} must be one of {list(targs)}, got {value!r}")
        return value
    if origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ValueError(f"{source}: {name} must be a mapping with string keys, got {value!r}")
        for key, v in value.items():
            if not isinstance(v, (bool, int, float, str)):
                raise ValueError(f"{source}: {name}.{key} must be a bool, number or string, got {v!r}")
        return dict(value)
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{source}: {name} must be a list, got {value!r}")
        return [_coerce(v, targs[0], f"{name}[{i}]", source) for i, v in enumerate(value)]
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, f"{name}.", source)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }
    assert tp in ok, f"unsupported field type {tp} for {name}"
    if not ok[tp]:
        raise ValueError(f"{source}: {name} must be {tp.__name__}, got {value!r}")
    return float(value) if tp is float else value
