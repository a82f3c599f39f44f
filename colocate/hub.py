"""Hugging Face Hub ids wherever a model directory or a data set is taken.

A model path that is not an existing directory and looks like `owner/name[@revision]` is
fetched with `huggingface_hub.snapshot_download` into the Hub cache (only the files a run reads:
config, generation config, tokenizer, safetensors) and replaced by the cached snapshot's
directory. Data set repositories are fetched whole. The usual variables apply: HF_HOME and
HF_HUB_CACHE place the cache, HF_HUB_OFFLINE=1 reads only the cache, HF_TOKEN authenticates.

Under torchrun, `fetch_once_per_node` lets local rank 0 of each node download while the other
ranks wait, then read the same snapshot from the cache.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

MODEL_FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.*",
    "*.safetensors",
    "model.safetensors.index.json",
]
"""What a run reads of a model repository; other weights (pytorch_model.bin, gguf, onnx) are skipped."""

_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]*[A-Za-z0-9_](@[\w./-]+)?")

_fetched: dict[tuple, str] = {}
"""(cache directory, repo type, repo id, revision) -> snapshot directory, so that one process
resolves each repository once (a training set and an eval set of one data set repository)."""


def is_repo_id(spec: str) -> bool:
    """Whether `spec` has the shape of a Hub repository id: owner/name, optionally @revision."""
    return _REPO_ID.fullmatch(spec) is not None and ".." not in spec


def split_revision(spec: str) -> tuple[str, str | None]:
    """'owner/name@rev' -> ('owner/name', 'rev'); without @, the revision is None (main)."""
    repo_id, _, revision = spec.partition("@")
    return repo_id, revision or None


def resolve_model(path: str, field: str, local_only: bool = False) -> str:
    """A local model directory for `path`: itself when it is one, else the Hub snapshot of the
    repository it names. Errors name `field` (the config field or command-line flag)."""
    p = Path(path)
    if p.is_dir():
        return path
    if p.exists():
        raise ValueError(f"{field}: {path} is a file, not a model directory")
    if not is_repo_id(path):
        raise ValueError(f"{field}: model directory {path} does not exist")
    repo_id, revision = split_revision(path)
    return snapshot(repo_id, revision, "model", field, local_only=local_only)


def snapshot(repo_id: str, revision: str | None, repo_type: str, field: str, local_only: bool = False) -> str:
    """The cached snapshot directory of a Hub repository, downloaded when needed.

    Raises ValueError naming `field` and the repository, and saying whether it does not exist,
    is gated, has no such revision, or is neither reachable nor cached."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    key = (constants.HF_HUB_CACHE, repo_type, repo_id, revision)
    if key in _fetched:
        return _fetched[key]
    kind = "model" if repo_type == "model" else "data set"
    name = repo_id + (f"@{revision}" if revision else "")
    offline = constants.HF_HUB_OFFLINE or local_only
    try:
        local = snapshot_download(
            repo_id,
            repo_type=repo_type,
            revision=revision,
            local_files_only=offline,
            allow_patterns=MODEL_FILES if repo_type == "model" else None,
        )
    except GatedRepoError:
        raise ValueError(
            f"{field}: the Hub {kind} {name} is gated: accept its conditions on its Hub page, "
            "then set HF_TOKEN to a token of that account"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"{field}: the Hub {kind} {repo_id} has no revision {revision!r}") from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{field}: {name} is not a local path, and the Hub has no {kind} repository {repo_id} (a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError:
        why = (
            "HF_HUB_OFFLINE is set"
            if constants.HF_HUB_OFFLINE
            else "another process was to download it"
            if local_only
            else "the Hub could not be reached"
        )
        raise ValueError(f"{field}: the Hub {kind} {name} is not in the cache {constants.HF_HUB_CACHE}, and {why}") from None
    _fetched[key] = local
    return local


def fetch_once_per_node(fetch: Callable[[bool], list[str]], local_rank: int) -> list[str]:
    """Run `fetch(local_only)` so that local rank 0 of each node downloads while the other ranks
    wait, then read what it fetched from the cache. Every rank fails if any node's download did."""
    from colocate import dist

    error, result = None, None
    if local_rank == 0:
        try:
            result = fetch(False)
        except ValueError as e:
            error = e
    failed = dist.all_reduce_max(int(error is not None))  # also the barrier the other ranks wait at
    if error is not None:
        raise error
    if failed:
        raise ValueError("the download from the Hugging Face Hub failed on another process (its error says why)")
    return result if result is not None else fetch(True)
