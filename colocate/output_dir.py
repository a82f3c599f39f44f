"""The one rule every writer follows (export, save_pretrained, the toy; for files, generate --out
and data prepare).

The directory is filled under a temporary sibling and renamed into place, so a reader never sees
half of it and a failed write leaves what was there before. An existing OUT is replaced only when
it is empty, holds the marker file that an earlier colocate writer left in it, or the caller asks
to overwrite; never when it is, contains or lies inside a directory being read (a checkpoint), nor
when it holds the working directory.
"""

from __future__ import annotations

import os
import secrets
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

MARKER = ".colocate-output"
"""Written into every directory a colocate writer produces; its content names the writer."""


def check_output_dir(out: str | Path, *, overwrite: bool = False, reading: Iterable[str | Path] = ()) -> None:
    """Raise ValueError, naming `out`, unless writing the whole of `out` is safe."""
    out = Path(out)
    target = out.resolve()
    for source in reading:
        source = Path(source).resolve()
        if target == source or target in source.parents or source in target.parents:
            raise ValueError(f"output {out} must not be, contain or lie inside {source}, which it is read from")
    cwd = Path.cwd().resolve()
    if target == cwd or target in cwd.parents:
        raise ValueError(f"output {out} is or contains the working directory: choose a new directory")
    if overwrite or not (out.exists() or out.is_symlink()):
        return
    if not out.is_dir():
        raise ValueError(f"output {out} exists and is not a directory: choose another path, or replace it with --overwrite")
    if (out / MARKER).is_file() or not any(out.iterdir()):
        return
    raise ValueError(
        f"output {out} is not empty and was not written by colocate: choose a new directory, or replace it with --overwrite"
    )


@contextmanager
def replacing_dir(out: str | Path, writer: str, *, overwrite: bool = False, reading: Iterable[str | Path] = ()) -> Iterator[Path]:
    """Yield an empty temporary sibling of `out` to fill; on success it becomes `out` (with the
    marker naming `writer`), on an error it is removed and `out` is left as it was."""
    out = Path(out)
    reading = list(reading)
    check_output_dir(out, overwrite=overwrite, reading=reading)
    out.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its mode 0700 would become the output's; this one follows the umask.
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        yield tmp
        (tmp / MARKER).write_text(writer + "\n")
        # Checked again: another process may have put something at `out` meanwhile.
        check_output_dir(out, overwrite=overwrite, reading=reading)
        _swap_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _swap_into_place(tmp: Path, out: Path) -> None:
    if not (out.exists() or out.is_symlink()):
        os.replace(tmp, out)
        return
    old = out.parent / f".{out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    old.mkdir()
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except OSError:
        os.replace(old / out.name, out)
        old.rmdir()
        raise
    shutil.rmtree(old)


def check_output_file(out: str | Path, *, overwrite: bool = False, reading: Iterable[str | Path] = ()) -> None:
    """Raise ValueError, naming `out`, unless writing the file `out` is safe."""
    out = Path(out)
    for source in reading:
        if out.resolve() == Path(source).resolve():
            raise ValueError(f"output {out} is also an input: choose another path")
    if out.is_dir():
        raise ValueError(f"output {out} is a directory: name a file")
    if (out.exists() or out.is_symlink()) and not overwrite:
        raise ValueError(f"output {out} exists: choose another path, or replace it with --overwrite")


@contextmanager
def replacing_file(out: str | Path, *, overwrite: bool = False, reading: Iterable[str | Path] = ()) -> Iterator[Path]:
    """The file version of `replacing_dir`: yield a temporary sibling of `out` to write; on success
    it becomes `out`. An existing `out` is replaced only with `overwrite`, and never when it is a
    file being read."""
    out = Path(out)
    check_output_file(out, overwrite=overwrite, reading=reading)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        yield tmp
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
