"""Graceful stop on SIGTERM, SIGINT, SIGUSR1 or SIGUSR2: every rank agrees on the same step, saves, exits 3.

Schedulers send more than one signal: Slurm's `scancel` and preemption signal every process of every step
*and* the batch shell, which hands the stop on as SIGUSR1 a moment later; a time limit adds its own. So any
number of these signals, in any order and in any phase (start-up, a step, evaluation, saving, teardown), mean
one thing: stop at the next agreed step with one snapshot. Only a person at a terminal escalates: the second
Ctrl-C (SIGINT) hands SIGINT back to the operating system, so the third ends the rank at once, even when it
is stuck inside a C call where Python handlers cannot run.
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from mpiddp import supervision
from mpiddp.failure import FAILURES_DIR, records_dir
from mpiddp.job.helper_signals import STOP_SIGNALS
from mpiddp.job.topology import supervisor_identity

if TYPE_CHECKING:
    from mpiddp.job.collective import Dist
    from mpiddp.job.topology import Topology

log = logging.getLogger(__name__)

# Signals a scheduler or launcher sends, possibly several times: never a reason to abort a save.
SCHEDULER_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
INTERRUPTS_TO_ABORT = 3


class Stopped(Exception):
    """Raised on every rank at the same step, after the stop snapshot is saved (or when nothing was trained
    since the last one: `saved` is False)."""

    def __init__(self, signal_name: str, step: int, saved: bool = True) -> None:
        super().__init__(f"stopped by {signal_name} at step {step}")
        self.signal_name = signal_name
        self.step = step
        self.saved = saved


class StopRequest:
    """Remembers the first stop signal; `agreed` turns one rank's signal into every rank's decision."""

    def __init__(self) -> None:
        self.signum = 0
        self.interrupts = 0

    def install(self) -> StopRequest:
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._handle)
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT:
            self.interrupts += 1
        if not self.signum:
            self.signum = signum
            # Not through logging: a handler that logs can re-enter a logging call the main thread was in.
            _say(f"received {signal.Signals(signum).name}: stopping after the current step and saving a snapshot "
                 f"(Ctrl-C {INTERRUPTS_TO_ABORT} times ends this rank at once, without saving)")
        elif signum == signal.SIGINT and self.interrupts == INTERRUPTS_TO_ABORT - 1:
            # From now on the kernel's default action handles SIGINT: the next one works even in a hung C call.
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            _say("already stopping and saving; press Ctrl-C once more to end this rank at once, without saving")

    def agreed(self, dist: Dist) -> int:
        """Collective, once per step: the signal any rank received (0 if none)."""
        return dist.agree_stop(self.signum)

    def agreed_with_save(self, dist: Dist, save_due: bool) -> tuple[int, bool]:
        """Collective, once per step, in place of `agreed`: also whether to save a snapshot now. Global rank 0's
        `save_due` decides (its clock); the other ranks' is ignored, so clocks that drift apart cannot disagree."""
        return dist.agree_step(self.signum, save_due and dist.is_main)

    def release(self) -> None:
        """The job is ending: a scheduler's late signal must not kill a rank during teardown or interpreter
        shutdown (where Python puts back the default action, which for SIGUSR1 is death, exit 138).

        After a stop (a signal received), SIGINT is ignored too: the snapshot is saved and the exit status is 3,
        which a late Ctrl-C or a launcher's forwarded SIGINT must not turn into 130 (no requeue). Only a person
        who already pressed Ctrl-C twice keeps the kernel's default, to end a hung teardown at once. Without a
        stop, SIGINT goes back to Python's default, so a person can still interrupt a teardown that hangs."""
        for signum in SCHEDULER_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)
        if not self.signum:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        elif self.interrupts < INTERRUPTS_TO_ABORT - 1:  # SIG_IGN, unlike a Python handler, outlives Python's
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # finalization, where MPI_Finalize still runs


def note_supervisor_death(topo: Topology, run_dir: Path, step: int) -> bool:
    """After an agreed stop, on every rank (no collective): when the job's supervisor (`launch`) has died, which
    is what its launcher hears as a stop, record why; True when this rank recorded it. Only a rank on the
    supervisor's host can tell, and the first of them writes; off that host nobody can, and nothing is written."""
    found = supervision.parse_identity(supervisor_identity(os.environ))
    ranks = topo.hosts_dict.get(found[0], []) if found is not None else []
    if found is None or not ranks or topo.rank != min(ranks) or supervision.is_alive(found[1]):
        return False
    path = records_dir(topo.failure_file, run_dir)
    assert path is not None  # a run dir is given
    if topo.failure_file:  # launch's records are still in its own run dir: nobody else is left to move them
        supervision.adopt_launch_records(Path(topo.failure_file).parent, run_dir)
        path = run_dir / FAILURES_DIR
    supervision.record_supervisor_death(run_dir, path, topo.rank, f"pid {found[1]} on {found[0]}", step)
    log.warning("the supervisor (pid %d on %s) died: recorded in %s; rerun the same launch command to resume",
                found[1], found[0], path)
    return True


def _say(text: str) -> None:
    os.write(2, f"mpiddp: {text}\n".encode())
