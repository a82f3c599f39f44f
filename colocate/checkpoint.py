"""Resumable checkpoints: DCP shards of Stateful parts, per-rank RNG, and a JSON sidecar.

Layout of one checkpoint, ROOT/rollout_{id:06d}/:
  .metadata, __{rank}_{i}.distcp   torch.distributed.checkpoint (DCP) shards of every Stateful part
  rng_rank{r}.pt                   each rank's python / numpy / torch CPU / torch CUDA generator states
  meta.json                        rollout id, world size and the caller's JSON-able `extra`
  hf/                              config.json and tokenizer files, so `colocate.export` needs nothing else
  manifest.json                    every file above with its size and CRC-32, taken from the bytes as
                                   each rank wrote them (rank 0 gathers them), and whether every
                                   floating tensor saved was finite

A checkpoint is written into ROOT/.tmp-rollout_{id:06d}/ and renamed only after every rank has
finished writing, so a run killed mid-save leaves the previous complete checkpoint as the newest one;
a save that fails (a full or read-only disk) removes its temporary directory and raises OSError.
A checkpoint saved with NaN or inf in its tensors is kept but marked so in its manifest.
Loading checks the CRC-32 of every file, then that every floating tensor read is finite; a damaged
checkpoint (a missing, truncated or altered file, bytes that do not deserialise, NaN or inf) is
refused, naming the reason. `resume_newest` falls back from it, with a one-line warning, to the
newest checkpoint that loads cleanly. Pruning never counts a damaged or non-finite checkpoint among
those kept, and keeps the one this process resumed from until a usable one was saved after it.
DCP stores sharded tensors with their global shapes, so a checkpoint written by N ranks loads on M.
A LoRA actor's part holds its adapters and their optimizer state only, with the identity of its
base (path, config.json hash and a fingerprint of its weights); resuming onto another base is
refused, naming both.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from colocate import dist as cdist
from colocate.checkpoint_integrity import (
    ChecksummingWriter,
    FiniteLoadPlanner,
    FiniteSavePlanner,
    first_non_finite,
    raise_damaged,
)
from colocate.checkpoint_manifest import (
    FORMAT,
    META_FILE,
    DamagedCheckpoint,
    checkpoint_dir,
    checkpoint_dirs,
    checkpoint_problem,
    checksum_problem,
    copy_recorded,
    is_checkpoint,
    verify_checkpoint,
    write_manifest,
    write_recorded,
    written_here,
)
from colocate.lora.identity import check_same_adapters

try:
    import numpy as np
except ImportError:  # numpy is optional; its generator is saved when it is installed
    np = None

HF_DIR = "hf"
ACTOR_STATE = "model"
"""The `states` key under which the training loop saves the actor; `colocate.export` reads it."""
MODEL_KEY = "model"
"""Key of the model weights inside a `ModelOptimizerState` (so actor weights are `model.model.<HF name>`)."""

_TMP = re.compile(r"\.tmp-rollout_\d{6}(\.replaced)?")
# Weight files are the one thing of a model directory the checkpoint must not duplicate.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")
ADAPTERS_KEY = "lora"
"""Key of a LoRA actor's adapter description (JSON text) inside its `ModelOptimizerState`."""

# FSDP2 parameters are sharded DTensors: DCP saves each rank's shard and reshards on load.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# A LoRA model's state: its trained parameters only (the frozen base is the base model's files).
_ADAPTER_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


class ModelOptimizerState(Stateful):
    """A model (plain or FSDP2) with its optimizer and LR scheduler as one Stateful for DCP.

    Parameter and optimizer-state keys are canonical FQNs (wrapper prefixes such as `_orig_mod.`
    removed) and the optimizer state is flattened per parameter name, so a checkpoint survives a
    change of world size or of how parameters are grouped.

    `adapters` (a LoRA model: colocate.lora.identity.LoRASpec.describe) keeps the trained
    parameters only, with that description under ADAPTERS_KEY; loading checks that the
    checkpoint's adapters were trained on the same base (the SHA-256 of its config.json) with the
    same rank, alpha and target modules (load_checkpoint, before anything is read).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        adapters: dict | None = None,
    ):
        if scheduler is not None and optimizer is None:
            raise ValueError("scheduler given without its optimizer")
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.adapters = adapters
        self.options = _OPTIONS if adapters is None else _ADAPTER_OPTIONS

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            out = {MODEL_KEY: get_model_state_dict(self.model, options=self.options)}
        else:
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
            out = {MODEL_KEY: model_sd, "optimizer": optim_sd}
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        if self.adapters is not None:
            # ignore_frozen_params misses a frozen tied lm_head (a second name of the embeddings).
            trained = {n for n, p in self.model.named_parameters() if p.requires_grad}
            out[MODEL_KEY] = {n: t for n, t in out[MODEL_KEY].items() if n in trained}
            out[ADAPTERS_KEY] = json.dumps(self.adapters, sort_keys=True)
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, state_dict[MODEL_KEY], options=self.options)
            return
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state_dict[MODEL_KEY],
            optim_state_dict=state_dict["optimizer"],
            options=self.options,
        )
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])


def read_adapters(path: str | Path, state: str) -> dict | None:
    """The adapter description saved with the `state` part of a checkpoint, or None when that
    part is a whole model."""
    key = f"{state}.{ADAPTERS_KEY}"
    if key not in FileSystemReader(str(path)).read_metadata().state_dict_metadata:
        return None
    holder = {key: ""}
    with quiet_single_process():
        dcp.load(holder, checkpoint_id=path, no_dist=True)
    return json.loads(holder[key])


def _check_adapters(path: Path, states: dict[str, Stateful]) -> None:
    """A LoRA part loads only adapters of the same base and settings; a whole-model part only a
    whole model."""
    for name, state in states.items():
        if not isinstance(state, ModelOptimizerState):
            continue
        saved = read_adapters(path, name)
        if state.adapters is not None and saved is None:
            raise ValueError(
                f"checkpoint {path}: '{name}' is a whole model, not LoRA adapters (it was saved with model.lora_rank 0)"
            )
        if state.adapters is None and saved is not None:
            raise ValueError(
                f"checkpoint {path}: '{name}' holds LoRA adapters of rank {saved['rank']} "
                f"on the base {saved['base_path']}; resume it with model.lora_rank {saved['rank']}"
            )
        if saved is not None:
            check_same_adapters(saved, state.adapters)


def _rank_world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextlib.contextmanager
def quiet_single_process():
    """DCP warns on every call without a process group; a single process is a supported setup here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if np is not None:
        # Stored as a tensor so the file loads with torch.load(weights_only=True).
        kind, key, pos, has_gauss, gauss = np.random.get_state()
        state["numpy"] = (kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, gauss)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state and np is not None:
        kind, key, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((kind, key.numpy().astype(np.uint32), pos, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _copy_model_files(model_dir: Path, dest: Path) -> dict[str, dict]:
    """Copy a model directory's config and tokenizer files; their manifest entries."""
    dest.mkdir()
    records = {}
    for f in model_dir.iterdir():
        if f.is_file() and not f.name.endswith(_WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            records[f"{dest.name}/{f.name}"] = copy_recorded(f, dest / f.name)
    return records


def _publish(tmp: Path, final: Path) -> None:
    """Rename the finished temporary directory into place (a re-save of one id replaces it)."""
    if not final.exists():
        os.replace(tmp, final)
        return
    old = tmp.with_name(tmp.name + ".replaced")
    os.replace(final, old)
    try:
        os.replace(tmp, final)
    except OSError:
        os.replace(old, final)
        raise
    shutil.rmtree(old, ignore_errors=True)  # a leftover is removed by the next save


_resumed: Path | None = None
"""The checkpoint this process resumed from (resume_newest), kept by pruning until a usable one is saved."""


def _prune(root: Path, keep_last: int, newest: Path) -> None:
    """Delete our checkpoints older (by rollout id) than the `keep_last` newest usable ones; never
    `newest`, nor the one this process resumed from while no usable one was saved after it (a
    checkpoint newer by id may pass the cheap check and still fail to load). A damaged or
    non-finite checkpoint does not count as kept, so it never costs a usable one its place."""
    global _resumed
    if _resumed is not None and checkpoint_problem(newest) is None:
        _resumed = None
    num_usable = 0
    for _, path in reversed(checkpoint_dirs(root, warn=False)):
        kept = path == newest or path.resolve() == _resumed
        if num_usable >= keep_last and not kept and written_here(path):
            shutil.rmtree(path)
        elif checkpoint_problem(path) is None:
            num_usable += 1


def _rng_bytes() -> bytes:
    # Serialised in memory: a full disk then fails in the plain file write, as an OSError.
    buffer = io.BytesIO()
    torch.save(_rng_state(), buffer)
    return buffer.getvalue()


def _os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed write: the error itself, or one a rank hit inside DCP."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, CheckpointException):
        for failure in error.failures.values():
            failure = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(failure, OSError):
                return failure
    return None


def _agreed(step: Callable[[], None]) -> OSError | None:
    """Run one step of a save on this rank, then agree over ranks whether it hit an OSError
    anywhere (so no rank waits at a collective for one that failed): that error, or None."""
    error = None
    try:
        step()
    except (OSError, CheckpointException) as e:
        error = _os_error(e)
        if error is None:
            raise
    if cdist.all_reduce_max(int(error is not None)) and error is None:
        error = OSError("another rank failed to write its part")
    return error


def save_checkpoint(
    root: str | Path,
    rollout_id: int,
    states: dict[str, Stateful],
    *,
    extra: dict | None = None,
    model_dir: str | Path | None = None,
    keep_last: int = 0,
) -> Path:
    """Write a checkpoint of `states` (collective: every rank calls it) and return its directory.

    `extra` is JSON-able bookkeeping returned by `load_checkpoint` (data-source state, weight
    version, config). `model_dir` is the HF directory whose config.json and tokenizer files are
    copied in. `keep_last` > 0 deletes older complete checkpoints beyond that many usable ones; 0
    keeps all. A write that fails (a full or read-only disk) raises OSError naming the checkpoint
    on every rank, after removing the temporary directory; earlier checkpoints are untouched.
    Tensors holding NaN or inf (on any rank) are saved, with a warning, in a checkpoint marked
    non-finite, which resuming skips and pruning does not count as usable.
    """
    if rollout_id < 0:
        raise ValueError(f"rollout_id must be >= 0, got {rollout_id}")
    if keep_last < 0:
        raise ValueError(f"keep_last must be >= 0 (0 keeps all), got {keep_last}")
    if not states:
        raise ValueError("states is empty: nothing to save")
    for name in states:
        if not name or "." in name:
            raise ValueError(f"state name {name!r} must be non-empty and contain no '.'")
    if model_dir is not None and not (Path(model_dir) / "config.json").is_file():
        raise ValueError(f"model_dir {model_dir}: no config.json (expected the HF model directory)")
    rank, world = _rank_world()
    try:
        meta_text = json.dumps(
            {"format": FORMAT, "rollout_id": rollout_id, "world_size": world, "states": sorted(states), "extra": extra or {}},
            indent=2,
        )
    except (TypeError, ValueError) as e:
        raise ValueError(f"extra must be JSON-able: {e}") from e
    root = Path(root)
    tmp, final = root / f".tmp-rollout_{rollout_id:06d}", checkpoint_dir(root, rollout_id)

    writer, planner = ChecksummingWriter(tmp), FiniteSavePlanner()
    records: dict[str, dict] = {}  # this rank's files: name -> size and CRC-32
    non_finite = None

    def prepare():
        if rank == 0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_leftovers(root)
            tmp.mkdir()

    def write():
        with quiet_single_process():
            dcp.save(states, storage_writer=writer, planner=planner, no_dist=not dist.is_initialized())
        records.update(writer.fs.records)
        records[f"rng_rank{rank}.pt"] = write_recorded(tmp / f"rng_rank{rank}.pt", _rng_bytes())
        if rank == 0:
            if model_dir is not None:
                records.update(_copy_model_files(Path(model_dir), tmp / HF_DIR))
            records[META_FILE] = write_recorded(tmp / META_FILE, meta_text.encode())

    def publish():
        nonlocal non_finite
        gathered = cdist.all_gather_object((records, planner.non_finite))
        non_finite = min((key for _, key in gathered if key is not None), default=None)
        if rank == 0:
            write_manifest(tmp, {name: entry for files, _ in gathered for name, entry in files.items()}, non_finite)
            _publish(tmp, final)

    for step in (prepare, write, publish):
        error = _agreed(step)
        if error is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            raise OSError(
                f"cannot save checkpoint {final}: {error} (its temporary directory was removed; earlier checkpoints are intact)"
            ) from error
    if rank == 0 and non_finite is not None:
        warnings.warn(
            f"checkpoint {final}: {non_finite} holds NaN or inf; it is kept, but resuming skips it and pruning does not count it",
            stacklevel=2,
        )
    if rank == 0 and keep_last:
        _prune(root, keep_last, final)
    cdist.barrier()
    return final


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint directory, with clear errors for anything that is not one or is
    damaged."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not is_checkpoint(path):
        hint = " (it holds checkpoints: pass one of them, or use latest_checkpoint)" if checkpoint_dirs(path, warn=False) else ""
        raise ValueError(f"{path} is not a checkpoint: no {META_FILE} or .metadata{hint}")
    verify_checkpoint(path)
    return json.loads((path / META_FILE).read_text())


def _flat_keys(value: Any, prefix: str) -> dict[str, Any]:
    """DCP's flattened key -> leaf for a nested state dict (lists are leaves, as DCP stores them)."""
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            out.update(_flat_keys(v, f"{prefix}.{k}"))
        return out
    return {prefix: value}


def _check_compatible(path: Path, wanted: dict[str, Any]) -> None:
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing, misshapen = [], []
    for key, value in wanted.items():
        if key not in stored:
            missing.append(key)
        elif (
            isinstance(value, torch.Tensor)
            and isinstance(stored[key], TensorStorageMetadata)
            and tuple(stored[key].size) != tuple(value.shape)
        ):
            misshapen.append(f"{key} {tuple(stored[key].size)} vs {tuple(value.shape)}")
    problems = [
        f"{what} {_some(keys)}"
        for what, keys in (("missing keys", missing), ("shapes differ (saved vs given)", misshapen))
        if keys
    ]
    if problems:
        raise ValueError(f"checkpoint {path} is incompatible with the given states: {'; '.join(problems)}")


def _some(items: list[str]) -> str:
    return f"{items[:5]}{' ...' if len(items) > 5 else ''} ({len(items)} in all)"


def load_checkpoint(path: str | Path, states: dict[str, Stateful], *, load_rng: bool = True) -> dict:
    """Restore `states` in place from a checkpoint directory (collective) and return its `extra`.

    The checkpoint is checked against its manifest (every file's CRC-32, the ranks reading a share
    each), loaded, and every floating tensor read must be finite. A damaged one (a missing,
    truncated or altered file, bytes that do not load, NaN or inf) raises DamagedCheckpoint, a
    ValueError naming it and the reason, on every rank, possibly after part of `states` was
    overwritten: loading another checkpoint then overwrites all of it. `states` that do not fit
    the checkpoint (missing keys, other shapes, adapters of another base) raise ValueError.
    Each rank restores its own RNG state when the world size matches the one that saved; otherwise
    the model and optimizer are resharded by DCP and the RNG keeps its current state (with a warning).
    """
    path = Path(path)
    meta = read_meta(path)
    rank, world = _rank_world()
    raise_damaged(path, lambda: checksum_problem(path, rank, world))
    raise_damaged(path, lambda: _check_adapters(path, states))  # it reads a shard (unchecked in format v2)
    wanted = {}
    for name, state in states.items():
        wanted.update(_flat_keys(state.state_dict(), name))
    _check_compatible(path, wanted)
    planner = FiniteLoadPlanner()

    def read() -> str | None:
        with quiet_single_process():
            dcp.load(states, checkpoint_id=path, planner=planner, no_dist=not dist.is_initialized())
        if load_rng:
            _load_rng(path, meta["world_size"])
        bad = first_non_finite(planner.read)
        return None if bad is None else f"{bad} holds NaN or inf"

    raise_damaged(path, read)
    return meta["extra"]


def _load_rng(path: Path, saved_world_size: int) -> None:
    rank, world = _rank_world()
    rng_file = path / f"rng_rank{rank}.pt"
    if saved_world_size != world:
        warnings.warn(
            f"{path}: saved with world size {saved_world_size}, loading with {world}; "
            "model and optimizer are resharded, RNG state is not restored",
            stacklevel=5,
        )
    elif not rng_file.is_file():
        warnings.warn(f"{rng_file} is missing; RNG state is not restored", stacklevel=5)
    else:
        _set_rng_state(torch.load(rng_file, weights_only=True))


def _remove_leftovers(root: Path) -> None:
    """Remove the temporary directories of saves that never finished."""
    if root.is_dir():
        for path in root.iterdir():
            if _TMP.fullmatch(path.name) and path.is_dir():
                shutil.rmtree(path)


def resume_newest(root: str | Path, states: dict[str, Stateful], *, load_rng: bool = True) -> tuple[Path, dict] | None:
    """Restore `states` from the newest checkpoint under root that loads cleanly (collective) and
    return its path and `extra`; None when root holds no checkpoint.

    Temporary directories of unfinished saves are removed first. A damaged checkpoint (see
    load_checkpoint) is skipped with a one-line warning naming it and the reason, and the next
    older one is tried, whose load overwrites all that a damaged one may have written into
    `states`; ValueError naming every damaged one when none loads. A checkpoint that does not
    fit `states` raises at once: an older one would not be what the run asked for. Pruning keeps
    the checkpoint returned until a usable one is saved after it.
    """
    global _resumed
    root = Path(root)
    rank, _ = _rank_world()
    if rank == 0:
        _remove_leftovers(root)
    cdist.barrier()
    damaged = []
    for _, path in reversed(checkpoint_dirs(root, warn=rank == 0)):
        try:
            extra = load_checkpoint(path, states, load_rng=load_rng)
        except DamagedCheckpoint as e:
            if rank == 0:
                warnings.warn(f"{path}: skipped, damaged: {e.problem}", stacklevel=2)
            damaged.append(f"{path} ({e.problem})")
            continue
        _resumed = path.resolve()
        return path, extra
    if damaged:
        raise ValueError(f"no usable checkpoint under {root}: {'; '.join(damaged)}")
    return None
