"""Reading the run configuration (colocate/config.py) from YAML and the command line, and writing it.

`load_config(["--config", "configs/x.yaml", "--rollout.top_p", "0.9"])` reads the YAML file into
the dataclasses (checking every key and type), passes the result to tyro as the default so that
command-line flags win, then checks value ranges and combinations. Every problem raises ValueError
naming the dotted field and where it came from, before anything heavy is imported or allocated.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from pathlib import Path
from typing import Any

import tyro
import yaml

from colocate.config import Config, cache_root
from colocate.config_checks import Origin, validate
from colocate.config_mapping import from_mapping


def save_yaml(cfg: Config, path: str | Path) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(cfg.to_dict(), f, sort_keys=False)


def load_config(argv: list[str] | None = None) -> Config:
    """Parse `[--config FILE.yaml] [--section.field VALUE ...]` into a validated Config."""
    args = list(sys.argv[1:] if argv is None else argv)
    yaml_path, args = _pop_config_flag(args)
    base = Config()
    if yaml_path is not None:
        base = config_from_yaml(yaml_path)
    _expand_paths(base)
    cfg = tyro.cli(
        Config,
        args=_bool_values_as_flags(args, base),
        default=base,
        description="colocate run configuration. --config FILE.yaml sets the defaults; "
        "flags override them. A yes/no field is a flag (--overwrite, --no-overwrite) that also "
        "takes True or False (--overwrite True).",
    )
    origin = Origin(base, yaml_path)
    _expand_paths(cfg)
    validate(cfg, origin)
    return cfg


def config_from_yaml(path: str | Path) -> Config:
    """Build a Config from a YAML file; unknown keys and wrong types raise ValueError."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: config file not found")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    if data is None:  # an empty file (or one of comments) is more likely a mistake than a wish for defaults
        raise ValueError(f"{path}: the config file is empty; leave out --config to run with the defaults")
    return from_mapping(Config, data, str(path))


def _bool_fields(section: Any, prefix: str = "", optional: bool = False) -> set[str]:
    """The command-line names, hyphenated, that tyro makes flags of: the bool fields of `section`
    and of its sections (`overwrite`, `checkpoint.resume`, `rollout.partial-rollout`), and the bool
    entries of a mapping's default (`rollout.chat-template-kwargs.enable-thinking`). With
    `optional`, the `bool | None` fields instead (`algorithm.use-tis`), which tyro gives a value."""
    names = set()
    hints = typing.get_type_hints(type(section))
    for f in dataclasses.fields(section):
        name, value = prefix + f.name.replace("_", "-"), getattr(section, f.name)
        if hints[f.name] == (bool | None if optional else bool):
            names.add(name)
        elif dataclasses.is_dataclass(value):
            names |= _bool_fields(value, name + ".", optional)
        elif isinstance(value, dict) and not optional:
            names |= {f"{name}.{key.replace('_', '-')}" for key, v in value.items() if isinstance(v, bool)}
    return names


def _bool_values_as_flags(args: list[str], base: Config) -> list[str]:
    """tyro makes a bool field a pair of flags (`--overwrite`, `--no-overwrite`); the spelling with a
    value that scripts use (`--overwrite True`, `--checkpoint.resume=False`) becomes one of them. A
    `bool | None` field (None: chosen by other settings) takes a value in tyro; its flag spellings
    (`--algorithm.use-tis`, `--algorithm.no-use-tis`) become `--algorithm.use-tis True` / `False`."""
    fields, optional = _bool_fields(base), _bool_fields(base, optional=True)
    negated = {f"{s}{'.' if s else ''}no-{last}": f for f in optional for s, _, last in [f.rpartition(".")]}
    out, i = [], 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        field_name = name[2:].replace("_", "-") if name.startswith("--") else None
        if field_name in negated and not eq:
            out += [f"--{negated[field_name]}", "False"]
            i += 1
            continue
        if field_name not in fields | optional:
            out.append(args[i])
            i += 1
            continue
        if not eq and i + 1 < len(args) and args[i + 1] in ("True", "False", "None"):
            value, i = args[i + 1], i + 1
        elif not eq:
            value = "True"
        if value not in ("True", "False") and not (field_name in optional and value == "None"):
            raise ValueError(f"--{field_name} is a flag: give it alone, or with True or False, not {value!r}")
        section, _, last = field_name.rpartition(".")
        if field_name in optional:
            out += [f"--{field_name}", value]
        else:
            out.append(f"--{field_name}" if value == "True" else f"--{section}{'.' if section else ''}no-{last}")
        i += 1
    return out


def _pop_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    rest, path = [], None
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a YAML file path")
            path, i = args[i + 1], i + 2
            continue
        if arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return path, rest


def expand_path(path: str) -> str:
    """Expand ~ and environment variables; $COLOCATE_CACHE defaults to the cache root."""
    root = str(cache_root())
    path = path.replace("${COLOCATE_CACHE}", root).replace("$COLOCATE_CACHE", root)
    return os.path.expanduser(os.path.expandvars(path))


def _expand_paths(cfg: Config) -> None:
    cfg.output_dir = expand_path(cfg.output_dir)
    cfg.model.path = expand_path(cfg.model.path)
    for attr in ("critic_path", "ref_path"):
        if getattr(cfg.model, attr) is not None:
            setattr(cfg.model, attr, expand_path(getattr(cfg.model, attr)))
    cfg.rollout.prompt_data = expand_path(cfg.rollout.prompt_data)
    for ds in cfg.eval.datasets:
        ds.path = expand_path(ds.path)
    if cfg.checkpoint.dir is not None:
        cfg.checkpoint.dir = expand_path(cfg.checkpoint.dir)
