"""The run directory: created by global rank 0 and agreed on by all (collective by contract), atomic writes."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from mpiddp import atomicfile
from mpiddp.atomicfile import UMASK  # noqa: F401 - the mode of what the run dir's files get, for tests
from mpiddp.errors import UserError
from mpiddp.job.collective import Dist
from mpiddp.runname import new_timestamped_dir


def _create(run_dir: str | None, runs_root: str) -> str:
    path = Path(run_dir if run_dir is not None else runs_root)
    try:
        path = new_timestamped_dir(Path(runs_root)) if run_dir is None else Path(run_dir)
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-", delete=True)
        probe.close()
    except OSError as exc:
        raise UserError(
            f"cannot write to the run directory {str(path)!r} ({exc.strerror or exc}): "
            f"choose a writable --run-dir"
        ) from None
    return str(path.resolve())


def prepare_run_dir(run_dir: str | None, runs_root: str, dist: Dist) -> Path:
    """Collective: global rank 0 creates the directory (naming it when not given) and every rank learns it.

    Every rank raises the same AgreedError when rank 0 could not create it.
    """
    return Path(dist.from_main(lambda: _create(run_dir, runs_root)))


def write_atomic(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """`write(file)` into a temporary file beside `path`, fsync, rename, fsync the folder: readers (and a crash)
    see the old file or the new one, never half of one."""
    atomicfile.write_atomic(path, write, durable=True)


def write_json_atomic(path: Path, data: Any) -> None:
    text = json.dumps(data, indent=2, sort_keys=True) + "\n"  # serialise first: a bad value leaves no file behind
    write_atomic(path, lambda out: out.write(text.encode()))
