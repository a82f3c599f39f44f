"""Value checks of a loaded Config: ranges and impossible combinations, each naming its field."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from colocate import lora
from colocate.user_code import FORMS, is_function_spec

if TYPE_CHECKING:
    from colocate.config import Config

BUILTIN_REWARDS = ("toy", "math", "exact", "f1")


GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")
"""Advantage estimators whose baseline is the group of a prompt's samples."""


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = obj[int(part)] if isinstance(obj, list) else getattr(obj, part, None)
    return obj


def differs_from_default(cfg: Config, dotted: str) -> bool:
    """Whether a (non-list) field's value is not its default."""
    return _get(cfg, dotted) != _get(type(cfg)(), dotted)


class Origin:
    """Names where a field's value came from: the YAML file, or the command line if overridden."""

    def __init__(self, base: Config, yaml_path: str | None):
        self.base, self.yaml_path = base, yaml_path

    def __call__(self, cfg: Config, dotted: str) -> str:
        if self.yaml_path is None:
            return "command line"
        try:
            overridden = _get(self.base, dotted) != _get(cfg, dotted)
        except (IndexError, AttributeError):
            overridden = True
        return "command line" if overridden else self.yaml_path


def validate(cfg: Config, origin: Callable[[Config, str], str] | None = None) -> None:
    """Range and combination checks; the first failure raises ValueError naming field and source.

    Every range is checked before any combination, as combinations may divide by a range-checked
    value (rollout.n_samples_per_prompt, the batch sizes)."""
    origin = origin or (lambda _cfg, _name: "config")
    for check in (_range_checks, _combination_checks, _unused_checks):
        for name, ok, why, value in check(cfg):
            if not ok:
                raise ValueError(f"{origin(cfg, name)}: {name} {why}, got {value!r}")


def _unused_checks(cfg: Config) -> list[tuple[str, bool, str, Any]]:
    """Fields set without the feature that reads them, a setting that would silently do nothing.
    "Set" means changed from the default: the default is what the run does anyway, and a run's
    saved config.yaml, meant to be loaded again, spells out every field."""
    r = cfg.rollout
    needs = [
        (
            "rollout.over_sampling_batch_size",
            r.dynamic_sampling or r.partial_rollout,
            "rollout.dynamic_sampling or rollout.partial_rollout",
        ),
        ("rollout.max_staleness", r.partial_rollout, "rollout.partial_rollout"),
        ("rollout.partial_mask_stale_tokens", r.partial_rollout, "rollout.partial_rollout"),
    ]
    needs += [
        (f"rollout.{name}", r.env is not None, "rollout.env")
        for name in (
            "env_args",
            "max_turns",
            "max_episode_tokens",
            "turn_max_new_tokens",
            "env_workers",
            "tool_timeout_s",
            "env_timeout_s",
        )
    ]
    return [
        (
            name,
            on or not differs_from_default(cfg, name),
            f"is set but takes effect only with {feature}, which is off",
            _get(cfg, name),
        )
        for name, on, feature in needs
    ]


def _env_checks(cfg: Config) -> list[tuple[str, bool, str, Any]]:
    """rollout.env: a name that can be loaded, and the features that cannot run episodes."""
    from colocate.envs.registry import check_env_spec

    r, a = cfg.rollout, cfg.algorithm
    off = r.env is None
    why = None if off else check_env_spec(r.env)
    return [
        ("rollout.env", why is None, why or "", r.env),
        (
            "rollout.env",
            off or not r.partial_rollout,
            "cannot be combined with rollout.partial_rollout (an episode "
            "waiting for its environment cannot be aborted and continued in a later step)",
            r.env,
        ),
        (
            "rollout.env",
            off or r.custom_generate is None,
            "cannot be combined with rollout.custom_generate (both own generation)",
            r.env,
        ),
        (
            "rollout.reward",
            off or not differs_from_default(cfg, "rollout.reward"),
            "is not used with rollout.env (the environment's reward is the reward)",
            r.reward,
        ),
        (
            "rollout.env",
            off or a.overlong_buffer_len is None,
            "cannot be combined with algorithm.overlong_buffer_len (the environment's reward is the reward; shape it there)",
            r.env,
        ),
        (
            "eval.max_response_len",
            off or cfg.eval.max_response_len is None,
            "is not used with rollout.env (episodes keep rollout.max_episode_tokens and rollout.turn_max_new_tokens)",
            cfg.eval.max_response_len,
        ),
        *(
            (
                f"eval.datasets.{i}.reward",
                off or d.reward is None,
                "is not used with rollout.env (the environment scores the evaluation's episodes too)",
                d.reward,
            )
            for i, d in enumerate(cfg.eval.datasets)
        ),
        (
            "rollout.turn_max_new_tokens",
            off or r.turn_max_new_tokens is None or r.turn_max_new_tokens <= r.response_budget,
            f"must be <= the episode's budget ({r.response_budget} tokens: rollout.max_episode_tokens or "
            f"rollout.max_response_len)",
            r.turn_max_new_tokens,
        ),
    ]


def _combination_checks(cfg: Config) -> list[tuple[str, bool, str, Any]]:
    """(dotted name, ok, requirement, value) for each rule that ties fields together."""
    r, a, t, e = cfg.rollout, cfg.algorithm, cfg.train, cfg.eval
    n = r.n_samples_per_prompt
    checks = [top_k_check(r.top_k, "rollout.top_k")]
    checks += _lora_checks(cfg.model)
    checks += [
        ("model.path", bool(cfg.model.path), "must name a model directory", cfg.model.path),
        ("rollout.prompt_data", bool(r.prompt_data), "must name a data file", r.prompt_data),
        ("rollout.input_key", bool(r.input_key), "must be non-empty", r.input_key),
        (
            "rollout.over_sampling_batch_size",
            r.over_sampling_batch_size is None or r.over_sampling_batch_size >= r.rollout_batch_size,
            f"must be >= rollout.rollout_batch_size ({r.rollout_batch_size})",
            r.over_sampling_batch_size,
        ),
        (
            "rollout.over_sampling_batch_size",
            not r.partial_rollout or r.over_sampling_batch_size is not None,
            "must be set (>= rollout.rollout_batch_size: the groups in flight) with rollout.partial_rollout",
            r.over_sampling_batch_size,
        ),
        (
            "rollout.over_sampling_batch_size",
            not r.partial_rollout
            or r.over_sampling_batch_size is None
            or r.over_sampling_batch_size <= (r.max_staleness + 1) * r.rollout_batch_size,
            f"must be <= (rollout.max_staleness + 1) x rollout.rollout_batch_size = "
            f"{(r.max_staleness + 1) * r.rollout_batch_size} with rollout.partial_rollout: each step trains "
            f"rollout_batch_size of the groups in flight, so a group waits over_sampling_batch_size / "
            f"rollout_batch_size steps, past the staleness bound; raise rollout.max_staleness or "
            f"over-sample less",
            r.over_sampling_batch_size,
        ),
        (
            "rollout.partial_rollout",
            not (r.partial_rollout and r.engine == "sglang"),
            "is not supported by rollout.engine=sglang (the adapter cannot abort a request and keep its tokens)",
            r.partial_rollout,
        ),
        (
            "rollout.partial_rollout",
            not (r.partial_rollout and r.custom_generate is not None),
            "cannot be combined with rollout.custom_generate (which owns generation: nothing to abort or continue)",
            r.partial_rollout,
        ),
        (
            "rollout.partial_rollout",
            not (r.partial_rollout and r.dynamic_sampling),
            "cannot be combined with rollout.dynamic_sampling",
            r.partial_rollout,
        ),
        (
            "rollout.dynamic_sampling",
            not (r.dynamic_sampling and n == 1),
            "needs rollout.n_samples_per_prompt >= 2 (a group of one always agrees)",
            r.dynamic_sampling,
        ),
        (
            "rollout.system_prompt",
            r.system_prompt is None or r.apply_chat_template or r.env is not None,
            "needs rollout.apply_chat_template (or rollout.env)",
            r.system_prompt,
        ),
        (
            "rollout.chat_template_kwargs",
            not r.chat_template_kwargs or r.apply_chat_template or r.env is not None,
            "needs rollout.apply_chat_template (or rollout.env)",
            r.chat_template_kwargs,
        ),
        ("rollout.reward", _reward_name_ok(r.reward), f"must be one of {list(BUILTIN_REWARDS)} or {FORMS}", r.reward),
        (
            "rollout.custom_generate",
            r.custom_generate is None or is_function_spec(r.custom_generate),
            f"must be {FORMS}",
            r.custom_generate,
        ),
        *_env_checks(cfg),
        (
            "algorithm.advantage_estimator",
            n >= 2 or a.advantage_estimator in ("reinforce_plus_plus", "gae"),
            "needs rollout.n_samples_per_prompt >= 2 (its baseline is the group)",
            a.advantage_estimator,
        ),
        (
            "rollout.temperature",
            r.temperature > 0 or a.advantage_estimator not in GROUP_ESTIMATORS,
            f"is 0 (greedy): the {n} samples of a prompt are identical, so every advantage of "
            f"algorithm.advantage_estimator={a.advantage_estimator} (relative to the group) is 0; "
            f"sample with rollout.temperature > 0",
            r.temperature,
        ),
        (
            "algorithm.eps_clip_high",
            a.eps_clip_high is None or a.eps_clip >= 1 or a.eps_clip_high >= a.eps_clip,
            f"must be >= algorithm.eps_clip ({a.eps_clip}) unless that is >= 1 (no lower bound)",
            a.eps_clip_high,
        ),
        (
            "algorithm.overlong_buffer_len",
            a.overlong_buffer_len is None or 0 < a.overlong_buffer_len < r.max_response_len,
            f"must be in (0, rollout.max_response_len={r.max_response_len})",
            a.overlong_buffer_len,
        ),
        (
            "algorithm.true_on_policy",
            not (a.true_on_policy and r.engine != "native"),
            "needs rollout.engine=native (the SGLang engine's kernels are its own)",
            a.true_on_policy,
        ),
        *[
            check
            for name, value in (("weight_dtype", r.weight_dtype), ("kv_cache_dtype", r.kv_cache_dtype))
            for check in (
                (f"rollout.{name}", "fp8" not in value or r.engine == "native", "fp8 needs rollout.engine=native", value),
                (
                    f"rollout.{name}",
                    "fp8" not in value or not a.true_on_policy,
                    "fp8 is not bitwise the trainer's numerics: not with algorithm.true_on_policy",
                    value,
                ),
            )
        ],
        (
            "model.lora_dropout",
            not (a.true_on_policy and cfg.model.lora_rank and cfg.model.lora_dropout),
            "must be 0 with algorithm.true_on_policy (the engine's merged weights have no dropout, so the "
            "trained forward would not be the rollout's)",
            cfg.model.lora_dropout,
        ),
        (
            "algorithm.num_critic_only_steps",
            a.num_critic_only_steps == 0 or a.use_critic,
            "needs algorithm.advantage_estimator=gae (no critic otherwise)",
            a.num_critic_only_steps,
        ),
        (
            "train.num_rollout",
            t.num_rollout > 0 or (e.interval is not None and bool(e.datasets)),
            "is 0 (eval-only) but eval is off: set eval.interval and eval.datasets",
            t.num_rollout,
        ),
        (
            "train.max_tokens_per_gpu",
            t.max_tokens_per_gpu == "auto" or t.max_tokens_per_gpu >= r.max_prompt_len + r.response_budget,
            f"must hold one full sample (rollout.max_prompt_len + rollout.max_response_len, or "
            f"rollout.max_episode_tokens with rollout.env = {r.max_prompt_len + r.response_budget})",
            t.max_tokens_per_gpu,
        ),
        (
            "train.global_batch_size",
            cfg.samples_per_rollout % cfg.global_batch_size == 0,
            f"must divide rollout.rollout_batch_size * rollout.n_samples_per_prompt ({cfg.samples_per_rollout})",
            t.global_batch_size,
        ),
        (
            "offload.method",
            not (cfg.offload.method == "tms" and _expandable_segments()),
            "tms cannot pause memory from expandable segments: unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF",
            cfg.offload.method,
        ),
        (
            "offload.offload_rollout",
            not (cfg.offload.offload_rollout and _expandable_segments()),
            "releases engine memory through torch_memory_saver, which cannot pause expandable "
            "segments: unset expandable_segments in PYTORCH_CUDA_ALLOC_CONF",
            cfg.offload.offload_rollout,
        ),
        ("eval.datasets", e.interval is None or bool(e.datasets), "must not be empty when eval is on", e.datasets),
    ]
    names = [ds.name for ds in e.datasets]
    for i, ds in enumerate(e.datasets):
        checks += [
            (f"eval.datasets.{i}.name", bool(ds.name) and names.count(ds.name) == 1, "must be non-empty and unique", ds.name),
            (f"eval.datasets.{i}.path", bool(ds.path), "must name a data file", ds.path),
            (
                f"eval.datasets.{i}.reward",
                ds.reward is None or _reward_name_ok(ds.reward),
                f"must be one of {list(BUILTIN_REWARDS)} or {FORMS}",
                ds.reward,
            ),
        ]
    return checks


def _lora_checks(m: Any) -> list[tuple[str, bool, str, Any]]:
    targets = m.lora_target_modules
    unknown = [t for t in targets if t not in lora.TARGET_MODULES]
    return [
        (
            "model.lora_target_modules",
            not unknown,
            f"has unknown names {unknown}: expected some of {list(lora.TARGET_MODULES)}",
            targets,
        ),
        (
            "model.lora_target_modules",
            not m.lora_rank or (targets and len(set(targets)) == len(targets)),
            "must name each adapted projection once (model.lora_rank > 0)",
            targets,
        ),
        (
            "model.ref_path",
            not m.lora_rank or m.ref_path in (None, m.path),
            "must be unset with model.lora_rank > 0: the reference policy is the base with the adapters off",
            m.ref_path,
        ),
    ]


def top_k_check(top_k: int, name: str) -> tuple[str, bool, str, int]:
    """The top-k rule of training, which offline generation applies to its --top-k too."""
    return name, top_k == -1 or top_k >= 1, "must be -1 (all) or >= 1", top_k


def sampling_checks(rollout: Any, names: dict[str, str]) -> list[tuple[str, bool, str, Any]]:
    """The checks of a RolloutConfig's sampling fields, each under the name `names` gives it
    (e.g. {"top_k": "--top-k"}): the ranges declared on the fields and the top-k rule."""
    checks = [(names[n], ok, why, value) for n, ok, why, value in _range_checks(rollout, "") if n in names]
    if "top_k" in names:
        checks.append(top_k_check(rollout.top_k, names["top_k"]))
    return checks


def _range_checks(obj: Any, prefix: str = ""):
    """(dotted name, ok, requirement, value) for each field declared with `_ranged`, recursively."""
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _range_checks(value, f"{name}.")
        elif isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                yield from _range_checks(item, f"{name}.{i}.")
        elif "range" in f.metadata and value is not None and value != "auto":  # auto: sized at start
            spec = f.metadata["range"]
            ok = all(_in_range(v, spec) for v in (value if isinstance(value, list) else [value]))
            why = f"must be in {spec}" if spec[0] in "[(" else f"must be {spec}"
            yield name, ok, why, value


def _reward_name_ok(name: str) -> bool:
    return name in BUILTIN_REWARDS or is_function_spec(name)


def _expandable_segments() -> bool:
    keys = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
    conf = ",".join(os.environ.get(k, "") for k in keys)
    return bool(re.search(r"expandable_segments\s*:\s*true", conf, re.IGNORECASE))


def _in_range(value: float, spec: str) -> bool:
    if spec[0] in "[(":
        lo, hi = (float(x) for x in spec[1:-1].split(","))
        return (lo <= value if spec[0] == "[" else lo < value) and (value <= hi if spec[-1] == "]" else value < hi)
    op, bound = spec.split()
    return value >= float(bound) if op == ">=" else value > float(bound)
