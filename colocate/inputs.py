"""Everything a run reads from the user, loaded and checked before any model is built."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from colocate import dist
from colocate.config import Config
from colocate.dist import DistInfo
from colocate.rollout.rewards import RewardFn
from colocate.timing import timed

if TYPE_CHECKING:
    from colocate.models import ArchConfig
    from colocate.rollout.prompts import PromptDataset


def _prepare_toy(cfg: Config, info: DistInfo):
    """Create (or refresh a stale) toy model and task when the config points into the toy cache."""
    from colocate.toy import default_cache_dir, ensure_toy

    cache = default_cache_dir()
    paths = [Path(cfg.model.path), Path(cfg.rollout.prompt_data)] + [Path(d.path) for d in cfg.eval.datasets]
    if any(p.is_relative_to(cache) for p in paths):
        if info.local_rank == 0:
            ensure_toy(cache)
        dist.barrier()


def _resolve_hub_ids(cfg: Config, info: DistInfo) -> None:
    """Replace Hub ids among the model paths by their cached snapshot directories, and fetch the
    Hub data sets that the prompt sources name; one process per node downloads."""
    from colocate.data import hub_repo
    from colocate.hub import fetch_once_per_node, resolve_model, snapshot

    m = cfg.model
    models = [(name, getattr(m, name)) for name in ("path", "ref_path", "critic_path") if getattr(m, name)]
    sources = [("rollout.prompt_data", cfg.rollout.prompt_data)]
    sources += [(f"eval.datasets.{i}.path", d.path) for i, d in enumerate(cfg.eval.datasets)]
    sets = [(field, repo) for field, spec in sources if (repo := hub_repo(spec)) is not None]

    def fetch(local_only: bool) -> list[str]:
        local = [resolve_model(path, f"model.{name}", local_only=local_only) for name, path in models]
        for field, (repo_id, revision) in sets:
            snapshot(repo_id, revision, "dataset", field, local_only=local_only)
        return local

    for (name, _), local in zip(models, fetch_once_per_node(fetch, info.local_rank)):
        setattr(m, name, local)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""A model directory holds a tokenizer when it has one of these (fast, sentencepiece, BPE, WordPiece)."""


def _check_tokenizer_files(model_dir: str) -> None:
    """Without tokenizer files transformers may still build a tokenizer, one that encodes every
    prompt as nothing; say what is missing instead."""
    if not any((Path(model_dir) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model.path: {model_dir} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): "
            "copy the model's tokenizer into it"
        )


def _projection_shapes(mc: ArchConfig) -> dict[str, tuple[int, int]]:
    """(in features, out features) of each projection of a block that can carry LoRA adapters."""
    q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
    h, i = mc.hidden_size, mc.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def _check_model_fit(cfg: Config, field: str, mc: ArchConfig) -> None:
    """Settings that depend on the model's shape: the stop ids must be tokens of its vocabulary,
    and a LoRA rank above an adapted projection's smaller side adds parameters but no rank."""
    where = f"{getattr(cfg.model, field)}/config.json"
    if field == "ref_path":
        return
    if field == "path":
        if mc.fp8_block_size is not None and cfg.rollout.engine == "sglang":
            raise ValueError(
                f"model.path {where} holds block-FP8 weights, which rollout.engine=sglang would load as its own FP8 "
                "layers that a weight sync cannot update: use rollout.engine=native (rollout.weight_dtype fp8 for FP8 rollout)"
            )
        widths = {"hidden_size": mc.hidden_size, "intermediate_size": mc.intermediate_size, "head_dim": mc.head_dim}
        odd = {name: width for name, width in widths.items() if width % 16}
        if cfg.rollout.weight_dtype == "fp8" and odd:
            raise ValueError(f"rollout.weight_dtype fp8 needs projection widths that are multiples of 16; {where} has {odd}")
        outside = [t for t in cfg.rollout.stop_token_ids if t >= mc.vocab_size]
        if outside:
            raise ValueError(
                f"rollout.stop_token_ids {outside} lie outside the vocabulary of {where} (vocab_size {mc.vocab_size})"
            )
    rank, shapes = cfg.model.lora_rank, _projection_shapes(mc)
    for name in cfg.model.lora_target_modules if rank else ():
        if rank > min(shapes[name]):
            raise ValueError(
                f"model.lora_rank {rank} exceeds the smaller side of {name} "
                f"({shapes[name][0]} -> {shapes[name][1]} in {where}): at most {min(shapes[name])}"
            )


def _check_fp8_dtype(cfg: Config, info: DistInfo) -> None:
    """FP8 GEMMs on CUDA (torch._scaled_mm with row scales) compute in bf16."""
    if cfg.rollout.weight_dtype != "fp8" or info.device.type != "cuda":
        return
    import torch

    from colocate.models import resolve_dtype

    dtype = resolve_dtype(cfg.model.dtype, info.device)
    if dtype != torch.bfloat16:
        raise ValueError(f"rollout.weight_dtype fp8 computes in bf16 on CUDA; model.dtype is {cfg.model.dtype} ({dtype})")


def _check_prompt_count(cfg: Config, data: PromptDataset) -> None:
    """A step samples rollout_batch_size distinct prompts; fewer would repeat prompts within it."""
    r = cfg.rollout
    if len(data) < r.rollout_batch_size:
        dropped = f", after dropping {data.num_dropped} longer than rollout.max_prompt_len={r.max_prompt_len}"
        raise ValueError(
            f"rollout.prompt_data {r.prompt_data} holds {len(data)} prompts"
            f"{dropped if data.num_dropped else ''}, fewer than rollout.rollout_batch_size="
            f"{r.rollout_batch_size}"
        )


def _episode_runner(cfg: Config, tokenizer):
    """rollout.env's environment, built and wrapped in its runner (None without rollout.env)."""
    r = cfg.rollout
    if r.env is None:
        return None
    from colocate.envs.episodes import EpisodeLimits, EpisodeRunner
    from colocate.envs.registry import load_env

    budget = r.response_budget
    limits = EpisodeLimits(
        r.max_turns, budget, r.turn_max_new_tokens or budget, r.tool_timeout_s, r.max_prompt_len, r.env_timeout_s
    )
    return EpisodeRunner(
        load_env(r.env, r.env_args),
        tokenizer,
        limits,
        workers=r.env_workers,
        strict=cfg.train.strict,
        template_kwargs=r.chat_template_kwargs,
        system_prompt=r.system_prompt,
    )


@dataclass
class RunInputs:
    tokenizer: object
    data: object
    reward_fn: RewardFn
    eval_sets: list
    eos_token_ids: list[int]
    """The model directory's stop ids (colocate.models.config.stop_token_ids)."""
    overlong: tuple[int, float] | None
    custom_generate: Callable | None
    num_dropped_prompts: int = 0
    """Training prompts dropped as longer than rollout.max_prompt_len."""
    episodes: object | None = None
    """rollout.env's EpisodeRunner (colocate/envs/episodes.py), None for single-turn sampling."""
    startup_seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Where the time of loading went: imports, models (their configs), tokenizer, reward, data,
    hooks (rollout.custom_generate, rollout.env)."""

    @classmethod
    def load(cls, cfg: Config, info: DistInfo) -> "RunInputs":
        parts: dict[str, float] = {}
        part = functools.partial(timed, parts, device=info.device)
        with part("imports"):  # colocate.models brings torch's compiler stack
            from colocate.models.config import load_tokenizer, stop_token_ids
            from colocate.models.loading import read_model_config
            from colocate.rollout.prompts import PromptDataset, PromptSampler
            from colocate.rollout.rewards import load_reward_fn
            from colocate.user_code import load_function

        with part("models"):
            cfg.check_world_size(info.world_size)
            _check_fp8_dtype(cfg, info)
            _prepare_toy(cfg, info)
            _resolve_hub_ids(cfg, info)
            r = cfg.rollout
            # Unreadable config.json files and unsupported architectures fail here.
            m, a = cfg.model, cfg.algorithm
            used = {"path": True, "ref_path": a.needs_ref, "critic_path": a.use_critic}
            for field in [f for f, on in used.items() if on and getattr(m, f)]:
                _check_model_fit(cfg, field, read_model_config(getattr(m, field), f"model.{field}"))
            _check_tokenizer_files(cfg.model.path)
        with part("tokenizer"):  # with transformers' import
            tokenizer = load_tokenizer(cfg.model.path)
            eos = stop_token_ids(cfg.model.path, tokenizer)
        with part("reward"):
            reward_fn = load_reward_fn(r.reward)

        def dataset(path, input_key, label_key, metadata_key):
            return PromptDataset(
                path,
                tokenizer,
                input_key=input_key,
                label_key=label_key,
                metadata_key=metadata_key,
                max_prompt_len=r.max_prompt_len,
                apply_chat_template=r.apply_chat_template,
                system_prompt=r.system_prompt,
                chat_template_kwargs=r.chat_template_kwargs,
            )

        with part("data"):
            train_set = dataset(r.prompt_data, r.input_key, r.label_key, r.metadata_key)
            _check_prompt_count(cfg, train_set)
            data = PromptSampler(train_set, rank=info.rank, world_size=info.world_size, seed=r.seed, shuffle=r.shuffle)
            eval_sets = []
            for d in cfg.eval.datasets:
                ds = dataset(d.path, d.input_key, d.label_key, d.metadata_key)
                mine = [ds[i] for i in range(info.rank, len(ds), info.world_size)]
                field = f"eval.datasets.{d.name}.reward" if d.reward else "rollout.reward"
                eval_sets.append((d.name, mine, load_reward_fn(d.reward or r.reward, field)))

        a = cfg.algorithm
        overlong = (a.overlong_buffer_len, a.overlong_penalty_factor) if a.overlong_buffer_len else None
        with part("hooks"):
            hook = load_function(r.custom_generate, "rollout.custom_generate") if r.custom_generate else None
            episodes = _episode_runner(cfg, tokenizer)
        return cls(
            tokenizer,
            data,
            reward_fn,
            eval_sets,
            eos,
            overlong,
            hook,
            num_dropped_prompts=train_set.num_dropped,
            episodes=episodes,
            startup_seconds=parts,
        )
