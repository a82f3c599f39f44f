"""What a checkpoint directory holds on disk and whether it is intact.

Every save ends with a manifest (manifest.json): each file of the checkpoint with its size, and a
CRC-32 of the small files (meta.json, .metadata, the rng files) that a truncation or an edit
could damage without changing much. `checkpoint_problem` checks a directory against it in a stat
per file plus reading the small files, cheap enough to run on every resume and every prune.
Checkpoints written before the manifest existed (format v1) are trusted as they are.
`latest_checkpoint` picks the newest intact one. Nothing here imports torch.distributed.checkpoint,
so a run that has nothing to resume never pays for that import.
"""

from __future__ import annotations

import json
import re
import warnings
import zlib
from pathlib import Path
from typing import Any

FORMAT = "colocate-checkpoint-v2"
_FORMATS = (FORMAT, "colocate-checkpoint-v1")  # v1: no manifest
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
_COMPLETE = re.compile(r"rollout_(\d{6})")
_RNG_FILE = re.compile(r"rng_rank\d+\.pt")


def checkpoint_dir(root: str | Path, rollout_id: int) -> Path:
    return Path(root) / f"rollout_{rollout_id:06d}"


def is_checkpoint(path: str | Path) -> bool:
    """A complete checkpoint: our meta.json and DCP's .metadata are both present."""
    path = Path(path)
    return (path / META_FILE).is_file() and (path / ".metadata").is_file()


def checkpoint_dirs(root: Path, warn: bool) -> list[tuple[int, Path]]:
    """(rollout id, path) of the rollout_* directories under root that hold any checkpoint file,
    oldest first; others (e.g. an empty rollout_000000) are skipped, with a warning if `warn`."""
    found = []
    if not root.is_dir():
        return found
    for path in root.iterdir():
        match = _COMPLETE.fullmatch(path.name)
        if match is None or not path.is_dir():
            continue
        if any((path / name).is_file() for name in (META_FILE, ".metadata", MANIFEST_FILE)):
            found.append((int(match.group(1)), path))
        elif warn:
            warnings.warn(f"{path}: skipped, not a checkpoint (no {META_FILE} or .metadata)", stacklevel=3)
    return sorted(found)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def written_here(path: Path) -> bool:
    """Written by this module (its meta.json or manifest says so), so pruning may delete it."""
    return any(isinstance(doc, dict) and doc.get("format") in _FORMATS
               for doc in (_read_json(path / META_FILE), _read_json(path / MANIFEST_FILE)))


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


def write_manifest(path: Path) -> None:
    """Record every file of the finished checkpoint directory; checksum the small ones."""
    files = {}
    for f in sorted(path.rglob("*")):
        name = f.relative_to(path).as_posix()
        if f.is_file() and name != MANIFEST_FILE:
            files[name] = {"size": f.stat().st_size}
            if name in (META_FILE, ".metadata") or _RNG_FILE.fullmatch(name):
                files[name]["crc32"] = _crc32(f)
    (path / MANIFEST_FILE).write_text(json.dumps({"format": FORMAT, "files": files}, indent=1))


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (a missing, truncated or altered file,
    against its manifest), or None if it can. Without a manifest (format v1) only meta.json and
    .metadata are required."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        for name in (META_FILE, ".metadata"):
            if not (path / name).is_file():
                return f"{name} is missing"
        meta = _read_json(path / META_FILE)
        if not isinstance(meta, dict):
            return f"{META_FILE} is not a JSON object"
        return f"{MANIFEST_FILE} is missing" if meta.get("format") == FORMAT else None
    manifest = _read_json(path / MANIFEST_FILE)
    if not (isinstance(manifest, dict) and isinstance(manifest.get("files"), dict)):
        return f"{MANIFEST_FILE} is unreadable"
    for name, saved in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != saved["size"]:
            return f"{name} has {size} bytes, {saved['size']} when saved"
        if "crc32" in saved and _crc32(f) != saved["crc32"]:
            return f"{name} differs from the saved file (CRC-32)"
    return None


def verify_checkpoint(path: str | Path) -> None:
    """Raise ValueError naming the checkpoint and its damaged file, if any (see checkpoint_problem)."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(f"checkpoint {path} is damaged: {problem}")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under root that can be resumed from, or None when there is none.

    Temporary directories of unfinished saves are ignored; rollout_* directories holding no
    checkpoint file are skipped with a warning. A damaged checkpoint (see checkpoint_problem) is
    skipped with a warning naming the file and the next older one is tried; ValueError naming
    every damaged one when none is usable."""
    damaged = []
    for _, path in reversed(checkpoint_dirs(Path(root), warn=True)):
        problem = checkpoint_problem(path)
        if problem is None:
            return path
        warnings.warn(f"{path}: skipped, damaged: {problem}", stacklevel=2)
        damaged.append(f"{path} ({problem})")
    if damaged:
        raise ValueError(f"no usable checkpoint under {root}: {'; '.join(damaged)}")
    return None
