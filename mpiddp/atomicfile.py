"""The one write-then-rename of mpiddp, stdlib only: a reader (and a crash) sees the old file or the new one, never
half of one. Every record, report, dump, summary and checkpoint that mpiddp writes goes through here."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


UMASK = _current_umask()  # read once, at import, before any thread exists (os.umask sets while it reads)


def _write_temporary(path: Path, write: Callable[[BinaryIO], None], durable: bool) -> str:
    """A complete temporary file beside `path` (removed again when writing it fails): its name."""
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(handle, 0o666 & ~UMASK)  # mkstemp makes 0600; teammates on a shared filesystem read these files
        with os.fdopen(handle, "wb") as out:
            write(out)
            out.flush()
            if durable:
                os.fsync(out.fileno())
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return temporary


def _sync_folder(folder: Path) -> None:
    directory = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_atomic(path: Path, write: Callable[[BinaryIO], None], durable: bool = False) -> None:
    """`write(file)` into a temporary file beside `path`, then rename it to `path` (replacing what was there).
    `durable`: fsync the file and its folder too, so that the new file survives a crash of the host (checkpoints,
    summaries). Raises OSError, and whatever `write` raises; no temporary file stays behind."""
    temporary = _write_temporary(path, write, durable)
    try:
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    if durable:
        _sync_folder(path.parent)


def write_bytes_atomic(path: Path, data: bytes, durable: bool = False) -> None:
    write_atomic(path, lambda out: out.write(data), durable)


def write_text_atomic(path: Path, text: str, durable: bool = False) -> None:
    data = text.encode()  # encode first: a text that cannot be encoded leaves no file behind
    write_atomic(path, lambda out: out.write(data), durable)


def write_new(path: Path, text: str) -> bool:
    """Write `text` to `path` unless a file is there already: True when written, False when one was there (the
    first complete file stays, atomically, however many processes race). Raises OSError otherwise."""
    data = text.encode()
    temporary = _write_temporary(path, lambda out: out.write(data), durable=False)
    try:
        os.link(temporary, path)  # fails if the file exists, unlike a rename
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)
    return True


def move(source: Path, destination: Path) -> None:
    """Rename `source` to `destination`, replacing a file there, in one step. Raises OSError (FileNotFoundError
    when there is no `source`)."""
    os.replace(source, destination)
