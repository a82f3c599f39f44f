"""What a checkpoint directory holds on disk and whether it is intact.

Every save ends with a manifest (manifest.json): each file of the checkpoint with its size and
CRC-32, both taken from the bytes as they were written (never read back), and whether every
floating tensor saved was finite. Two checks use it:
  `checkpoint_problem`  a stat per file, the CRC-32 of the small files (meta.json, .metadata, the
                        rng files) and the finite flag: cheap enough for every prune and every
                        listing of checkpoints;
  `checksum_problem`    the CRC-32 of every file (the DCP shards too), run before a checkpoint is
                        loaded, each rank reading its share.
Manifests of format v2 hold CRC-32s of the small files only and no finite flag; checkpoints
written before the manifest existed (format v1) are trusted as they are.
`latest_checkpoint` picks the newest one that passes the cheap check. Nothing here imports
torch.distributed.checkpoint, so a run that has nothing to resume never pays for that import.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any, BinaryIO

FORMAT = "colocate-checkpoint-v3"
_V1 = "colocate-checkpoint-v1"  # no manifest
_FORMATS = (FORMAT, "colocate-checkpoint-v2", _V1)  # v2: CRC-32 of the small files only
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
    return any(
        isinstance(doc, dict) and doc.get("format") in _FORMATS
        for doc in (_read_json(path / META_FILE), _read_json(path / MANIFEST_FILE))
    )


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            crc = zlib.crc32(chunk, crc)
    return crc


class ChecksummingStream:
    """A binary stream being written, passed through, whose size and CRC-32 are kept as the
    bytes go out (`record`), so a checkpoint's files are never read back to checksum them."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.size, self.crc = raw, 0, 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        self.crc = zlib.crc32(view, self.crc)
        self.size += len(view)
        return self.raw.write(view)

    def tell(self) -> int:
        return self.raw.tell()

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        self.raw.flush()

    def close(self) -> None:
        self.raw.close()

    def record(self) -> dict:
        """The file's manifest entry."""
        return {"size": self.size, "crc32": self.crc}


def write_recorded(path: Path, data: bytes) -> dict:
    """Write `data` to `path`; its manifest entry."""
    path.write_bytes(data)
    return {"size": len(data), "crc32": zlib.crc32(data)}


def copy_recorded(src: Path, dst: Path) -> dict:
    """Copy a file, checksummed on the way; the copy's manifest entry."""
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        out = ChecksummingStream(fout)
        shutil.copyfileobj(fin, out)
    return out.record()


def write_manifest(path: Path, files: dict[str, dict], non_finite: str | None) -> None:
    """Write the manifest of a finished checkpoint directory from the entries recorded while its
    files were written (`files`: relative name -> size and CRC-32) and the first key, if any,
    whose saved tensor held NaN or inf."""
    on_disk = sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file())
    if on_disk != sorted(files):  # an OSError, so that every rank learns of it (checkpoint._agreed)
        raise OSError(f"files written but not recorded: {sorted(set(on_disk) - set(files))}")
    doc = {"format": FORMAT, "finite": non_finite is None, "non_finite": non_finite, "files": files}
    (path / MANIFEST_FILE).write_text(json.dumps(doc, indent=1))


def _small(name: str) -> bool:
    return name in (META_FILE, ".metadata") or _RNG_FILE.fullmatch(name) is not None


def _manifest(path: Path) -> dict | None:
    manifest = _read_json(path / MANIFEST_FILE)
    if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
        return manifest
    return None


def checkpoint_problem(path: str | Path) -> str | None:
    """Why a checkpoint directory cannot be resumed from (a missing, truncated or altered small
    file, or tensors that were not all finite when saved, against its manifest), or None if it can.
    Without a manifest (format v1) only meta.json and .metadata are required."""
    path = Path(path)
    if not (path / MANIFEST_FILE).is_file():
        for name in (META_FILE, ".metadata"):
            if not (path / name).is_file():
                return f"{name} is missing"
        meta = _read_json(path / META_FILE)
        if not isinstance(meta, dict):
            return f"{META_FILE} is not a JSON object"
        return f"{MANIFEST_FILE} is missing" if meta.get("format") != _V1 else None
    manifest = _manifest(path)
    if manifest is None:
        return f"{MANIFEST_FILE} is unreadable"
    if manifest.get("finite") is False:
        return f"{manifest.get('non_finite')} held NaN or inf when saved"
    for name, saved in manifest["files"].items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != saved["size"]:
            return f"{name} has {size} bytes, {saved['size']} when saved"
        if "crc32" in saved and _small(name) and _crc32(f) != saved["crc32"]:
            return _crc_problem(name)
    return None


def _crc_problem(name: str) -> str:
    return f"{name} differs from the saved file (CRC-32)"


def checksum_problem(path: str | Path, rank: int = 0, world_size: int = 1) -> str | None:
    """The first file of this rank's share whose CRC-32 differs from its manifest's, or None.
    Files are dealt out largest first to the rank with the fewest bytes so far, so the ranks
    together read the checkpoint once; call checkpoint_problem first (sizes, missing files)."""
    manifest = _manifest(Path(path))
    if manifest is None:
        return None
    loads = [0] * world_size
    for name, saved in sorted(manifest["files"].items(), key=lambda item: (-item[1]["size"], item[0])):
        if "crc32" not in saved:
            continue
        owner = loads.index(min(loads))
        loads[owner] += saved["size"]
        if owner == rank and _crc32(Path(path) / name) != saved["crc32"]:
            return _crc_problem(name)
    return None


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be loaded as it is on disk; `problem` says why."""

    def __init__(self, path: str | Path, problem: str):
        super().__init__(f"checkpoint {path} is damaged: {problem}")
        self.problem = problem


def verify_checkpoint(path: str | Path) -> None:
    """Raise DamagedCheckpoint naming the checkpoint and its damaged file, if any (see checkpoint_problem)."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise DamagedCheckpoint(path, problem)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest checkpoint under root that passes checkpoint_problem, or None when there is none.

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
