"""Logging with a rank prefix, and rank 0's progress bar (a do-nothing bar elsewhere, so call sites never branch)."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import TextIO

from mpiddp.job.topology import Topology


def flush_logs() -> None:
    """Write out what the log handlers hold, before a report or an exit that must follow the log lines."""
    for handler in logging.getLogger().handlers:
        handler.flush()


_chosen_level: str | None = None  # the level of the last setup_logging with a topology (a recovery keeps it)


def chosen_level() -> str | None:
    """The level the job's logging was set up with (None: never set up for a rank)."""
    return _chosen_level


def setup_logging(topo: Topology | None, level: str = "info") -> None:
    """Rank 0 logs at `level`; the other ranks only warnings and errors, each line naming its rank."""
    global _chosen_level
    if topo is not None:
        _chosen_level = level
    if topo is None:
        prefix, chosen = "mpiddp", logging.WARNING
    else:
        prefix = f"mpiddp r{topo.rank}/{topo.world_size} {topo.hostname}"
        chosen = getattr(logging, level.upper()) if topo.is_main else logging.WARNING
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [{prefix}] %(levelname)s %(message)s", "%H:%M:%S"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(chosen)


class ProgressBar:
    """A one-line bar redrawn at most every `min_interval` seconds."""

    def __init__(self, total: int, desc: str, stream: TextIO | None = None, min_interval: float = 0.25) -> None:
        self.total, self.desc, self.count = total, desc, 0
        self.stream = stream or sys.stdout
        self.drawn = -1
        self.min_interval = min_interval
        self.started = self.last_draw = time.perf_counter()
        self.postfix = ""

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        self.count += n
        if postfix is not None:
            self.postfix = postfix
        now = time.perf_counter()
        if now - self.last_draw >= self.min_interval or self.count >= self.total:
            self.last_draw = now
            self._draw(now)

    def _draw(self, now: float) -> None:
        self.drawn = self.count
        width = 24
        filled = int(width * min(self.count, self.total) / max(self.total, 1))
        rate = self.count / max(now - self.started, 1e-9)
        line = f"{self.desc} |{'#' * filled}{'.' * (width - filled)}| {self.count}/{self.total} {rate:.1f} it/s"
        self.stream.write(f"\r{line} {self.postfix}".rstrip() + " ")
        self.stream.flush()

    def close(self) -> None:
        if self.drawn != self.count:
            self._draw(time.perf_counter())
        self.stream.write("\n")
        self.stream.flush()


class NullProgress:
    """Stands in for the bar on ranks that do not draw one."""

    def update(self, n: int = 1, postfix: str | None = None) -> None:
        pass

    def close(self) -> None:
        pass


# Processes that start ranks and relay their output (Open MPI, MPICH's Hydra, Slurm).
LAUNCHERS = frozenset({"mpirun", "mpiexec", "prterun", "orterun", "prted", "orted", "hydra_pmi_proxy",
                       "mpiexec.hydra", "srun", "slurmstepd"})


def launcher_output_is_terminal(proc: Path = Path("/proc")) -> bool:
    """Whether the nearest launcher above this process writes to a terminal. Open MPI hands its ranks a
    pseudo-terminal even when mpirun's own output goes to a file, so the rank's isatty() cannot tell."""
    pid = os.getppid()
    for _ in range(8):
        try:
            stat = (proc / str(pid) / "stat").read_text()
        except OSError:
            return True  # no /proc to look at: trust isatty()
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name in LAUNCHERS:
            try:
                return os.readlink(proc / str(pid) / "fd" / "1").startswith(("/dev/pts/", "/dev/tty"))
            except OSError:
                return True
        pid = int(fields[1])
        if pid <= 1:
            return True
    return True


def progress_wanted(setting: str) -> bool:
    """`auto` draws the bar only where someone is watching: a terminal (the launcher's too), and not CI."""
    if setting == "auto":
        return sys.stdout.isatty() and not os.environ.get("CI") and launcher_output_is_terminal()
    return setting == "on"


def make_progress(enabled: bool, total: int, desc: str) -> ProgressBar | NullProgress:
    return ProgressBar(total, desc) if enabled else NullProgress()
