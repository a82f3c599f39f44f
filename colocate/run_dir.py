"""An output directory belongs to one run.

`RunDir.claim` (every rank calls it; rank 0 does the work and its verdict reaches all ranks):
- takes a lock on OUTPUT_DIR/.lock for the run's lifetime, so two runs never share a directory;
- refuses to start a fresh run over another run's metrics (unless `overwrite`, which replaces that
  run's metrics and log) and over another run's checkpoints (with `overwrite`, or when resume is
  off): a checkpoint is never deleted;
- drops a torn last line of metrics.jsonl (a run killed mid-write) before a resumed run appends.
`save_config` writes config.yaml atomically, once the run's inputs and models have loaded, so a
launch that fails leaves the previous run's config.yaml as it was.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from colocate import dist
from colocate.config import Config
from colocate.config_loading import save_yaml
from colocate.metrics import LOG_FILE, METRICS_FILE, WANDB_ID_FILE

LOCK_FILE = ".lock"
CONFIG_FILE = "config.yaml"


def drop_torn_line(path: Path) -> bool:
    """Cut a last line that has no newline (a write the process did not finish); True if it did."""
    if not path.is_file():
        return False
    with open(path, "rb+") as f:
        data = f.read()
        if not data or data.endswith(b"\n"):
            return False
        f.truncate(data.rfind(b"\n") + 1)
    return True


class RunDir:
    def __init__(self, path: Path, lock_fd: int | None):
        self.path, self._lock_fd = path, lock_fd

    @classmethod
    def claim(cls, cfg: Config, info: dist.DistInfo) -> "RunDir":
        path = Path(cfg.output_dir)
        error, lock_fd = None, None
        if info.is_main:
            try:
                lock_fd = _lock(path)
                _check_owner(path, cfg)
            except ValueError as e:
                error = str(e)
                if lock_fd is not None:
                    os.close(lock_fd)
                    lock_fd = None
        error = dist.broadcast_from_main(error)
        if error is not None:
            raise ValueError(error)
        return cls(path, lock_fd)

    def save_config(self, cfg: Config) -> None:
        """config.yaml, written to a temporary file and renamed (rank 0 only)."""
        if self._lock_fd is None:
            return
        tmp = self.path / f".{CONFIG_FILE}.tmp"
        save_yaml(cfg, tmp)
        os.replace(tmp, self.path / CONFIG_FILE)

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _lock(path: Path) -> int:
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"output_dir {path}: cannot be written ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ValueError(
            f"output_dir {path} is in use by another run (process {holder}): wait for it, or choose another output_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_owner(path: Path, cfg: Config) -> None:
    from colocate.checkpoint_manifest import latest_checkpoint

    ckpt_dir = cfg.checkpoint_dir
    has_checkpoint = latest_checkpoint(ckpt_dir) is not None
    if has_checkpoint and cfg.overwrite:
        # A fresh run would resume from them, and overwrite never deletes a checkpoint.
        raise ValueError(
            f"--overwrite starts a fresh run, but {ckpt_dir} holds checkpoints: drop --overwrite "
            "to resume from them, or choose another output_dir or checkpoint.dir"
        )
    if has_checkpoint and not cfg.checkpoint.resume:
        raise ValueError(
            f"{ckpt_dir} holds another run's checkpoints and checkpoint.resume is off: "
            "resume that run, or choose another output_dir or checkpoint.dir"
        )
    metrics = path / METRICS_FILE
    if has_checkpoint:
        for name in (metrics, *path.glob("memory_rank*.jsonl")):
            drop_torn_line(name)  # this run continues the one that wrote it
        return
    earlier = metrics.is_file() and metrics.stat().st_size > 0
    if earlier and not cfg.overwrite:
        raise ValueError(
            f"output_dir {path} holds another run's {METRICS_FILE} and no checkpoint to "
            "resume from: choose another output_dir, or pass --overwrite True to replace "
            "that run's metrics and log"
        )
    if earlier:
        for name in (METRICS_FILE, LOG_FILE, WANDB_ID_FILE):
            (path / name).unlink(missing_ok=True)
        for ledger in path.glob("memory_rank*.jsonl"):
            ledger.unlink()
