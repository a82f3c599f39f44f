"""Every `--help` text agrees with the checks: a field that a check refuses in combination with
another field names that field in its help, and a help text names no requirement the checks do not
make (the two are compared for every combination rule of colocate/config_checks.py)."""

from __future__ import annotations

import ast
import inspect
import re

import colocate.config as config_module
from colocate.config import Config
from colocate.config_checks import _combination_checks, _unused_checks

SECTIONS = {
    "model": "ModelConfig",
    "rollout": "RolloutConfig",
    "algorithm": "AlgorithmConfig",
    "train": "TrainConfig",
    "offload": "OffloadConfig",
    "eval": "EvalConfig",
    "checkpoint": "CheckpointConfig",
    "logging": "LoggingConfig",
}
DOTTED = re.compile(r"\b(" + "|".join(SECTIONS) + r")\.([a-z_]+)")


def help_texts() -> dict[str, str]:
    """'section.field' -> the docstring under the field in colocate/config.py (what --help prints)."""
    tree = ast.parse(inspect.getsource(config_module))
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    out = {}
    for section, class_name in SECTIONS.items():
        body = classes[class_name].body
        for field, doc in zip(body, body[1:]):
            if isinstance(field, ast.AnnAssign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                out[f"{section}.{field.target.id}"] = " ".join(doc.value.value.split())
    return out


def _rules() -> list[tuple[str, set[str]]]:
    """(refused field, the other fields its rule names) for every combination and unused-field rule."""
    rules = []
    for name, _, why, _ in _combination_checks(Config()) + _unused_checks(Config()):
        others = {f"{s}.{f}" for s, f in DOTTED.findall(why)} - {name}
        if others and not name.startswith("eval.datasets."):
            rules.append((name, others))
    return rules


def _mentions(text: str, dotted: str) -> bool:
    return dotted in text or re.search(rf"\b{re.escape(dotted.split('.')[1])}\b", text) is not None


def test_every_refused_combination_is_in_the_help_of_the_field_it_refuses():
    helps = help_texts()
    missing = [
        f"{name}: help does not name {other}"
        for name, others in _rules()
        for other in sorted(others)
        if not _mentions(helps[name], other)
    ]
    assert not missing, "\n".join(missing)


def test_help_texts_name_only_requirements_the_checks_make():
    """A help text that says a field 'needs' or 'requires' another names a rule of the checks."""
    helps, rules = help_texts(), _rules()
    ruled = {(name, other) for name, others in rules for other in others}
    ruled |= {(other, name) for name, other in ruled}
    claims = []
    for name, text in helps.items():
        for sentence in re.split(r"(?<=[.;])\s", text):
            if re.search(r"\b(needs|requires|must be off|only with)\b", sentence, re.IGNORECASE):
                for s, f in DOTTED.findall(sentence):
                    if (name, f"{s}.{f}") not in ruled and f"{s}.{f}" != name:
                        claims.append(f"{name}: '{sentence}' names {s}.{f}, which no check ties to it")
    assert not claims, "\n".join(claims)
