"""A new run directory named after the time: stdlib only, so the launch layer (outside MPI) names runs as the job does."""

from __future__ import annotations

import time
from pathlib import Path

from mpiddp.errors import UserError

DEFAULT_RUNS_ROOT = "runs"  # training's --runs-root default, and launch's


def new_timestamped_dir(runs_root: Path) -> Path:
    """A new directory named after the time; mkdir without exist_ok, so two jobs in one second never share one."""
    runs_root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for suffix in range(1000):
        path = runs_root / (stamp if suffix == 0 else f"{stamp}-{suffix}")
        try:
            path.mkdir()
            return path
        except FileExistsError:
            continue
    raise UserError(f"{runs_root} has 1000 run directories named {stamp}*: give --run-dir")
