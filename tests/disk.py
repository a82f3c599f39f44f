"""What a directory tree holds, to assert that a failed command changed nothing on disk."""

from __future__ import annotations

import hashlib
from pathlib import Path


def snapshot(root: str | Path) -> dict[str, str]:
    """Relative path -> sha256 of a file's bytes (or "dir") for everything under root."""
    root = Path(root)
    return {
        p.relative_to(root).as_posix(): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }
