"""Test drills (--inject-fault): deliberate failures, stop signals and stragglers, run as a callback of the loop."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time

from mpiddp.trainer.callbacks import Callback
from mpiddp.trainer.config import ALL_RANKS, FaultInjection

log = logging.getLogger(__name__)

STRAGGLE_S = 0.05
# A lost process, a hang, a stop: what happens once to a run, so a resumed or relaunched job (the same flags) goes
# past it. raise and exit stand for a program's own error, which every relaunch meets again (launch gives up on
# it); a straggler (slow-*) is a lasting condition.
ONCE_PER_RUN = ("kill", "kill-save", "stall", "stall-data", "stall-eval", "stall-save", "signal", "signal-eval")
FAILURES = {"step": ("raise", "exit0", "exit1", "stall", "kill"), "save": ("kill-save",)}  # inject_fault's, by point


def inject_fault(fault: FaultInjection | None, rank: int, step: int, resumed: bool = False, at: str = "step") -> None:
    """Fail on purpose (--inject-fault), to prove that one rank's failure ends the whole job (or, under in-job
    recovery, that the survivors go on). `at`: the loop's point, "step" (after step STEP) or "save" (kill-save,
    at the start of the save at step STEP)."""
    if fault is None or fault.kind not in FAILURES[at] or not fault.hits(rank, step) or \
            (fault.kind in ONCE_PER_RUN and resumed):
        return
    log.warning("injecting fault %r at step %d", fault.kind, step)
    if fault.kind in ("kill", "kill-save"):
        for handler in logging.getLogger().handlers:
            handler.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer or a lost node would: no record, no report
    if fault.kind == "raise":
        raise RuntimeError(f"injected fault on rank {rank} at step {step}")
    if fault.kind == "stall":
        threading.Event().wait()  # block forever, as a rank stuck in I/O or a deadlock would
    sys.exit(0 if fault.kind == "exit0" else 1)


def stop_drill(fault: FaultInjection | None, rank: int, step: int, phase: str) -> None:
    """A stop drill (--inject-fault signal / signal-eval): this rank sends SIGUSR1 to its whole process group,
    its loader's helper processes included, as mpirun and srun deliver a stop."""
    if fault is not None and fault.kind == ("signal-eval" if phase == "eval" else "signal") and fault.hits(rank, step):
        log.warning("stop drill: SIGUSR1 to this rank's process group at step %d (%s)", step, phase)
        os.killpg(os.getpgrp(), signal.SIGUSR1)


def straggle(fault: FaultInjection | None, rank: int, step: int, phase: str) -> None:
    """A straggler drill (--inject-fault slow-data / slow-compute): from its step on, this rank's loader or
    compute takes STRAGGLE_S longer, as a slow disk or a throttled GPU would. A stall (stall-data, stall-compute,
    stall-eval, stall-save) blocks the rank in that phase at its step."""
    if fault is not None and fault.kind == f"slow-{phase}" and fault.rank in (rank, ALL_RANKS) and step >= fault.step:
        time.sleep(STRAGGLE_S)
    if fault is not None and fault.kind == f"stall-{phase}" and fault.hits(rank, step):
        log.warning("injecting fault %r after step %d", fault.kind, step)
        threading.Event().wait()  # block forever in this phase, as a loader stuck on a dead file server would


class Drills(Callback):
    """The --inject-fault drill of this rank at its point of the loop. `resumed`: a resumed or relaunched run,
    where a drill of ONCE_PER_RUN does not fire again (so a relaunch gets past it)."""

    def __init__(self, fault: FaultInjection, rank: int, resumed: bool) -> None:
        self.fault: FaultInjection | None = None if resumed and fault.kind in ONCE_PER_RUN else fault
        self.rank, self.resumed = rank, resumed

    def on_data_wait(self, step: int) -> None:
        straggle(self.fault, self.rank, step, "data")

    def on_batch_loaded(self, step: int) -> None:
        if step == 0:  # start-up: the first batch is loaded, the loader's helpers are running
            stop_drill(self.fault, self.rank, step, "train")
        straggle(self.fault, self.rank, step, "compute")

    def on_step_end(self, step: int) -> None:
        inject_fault(self.fault, self.rank, step, self.resumed)
        stop_drill(self.fault, self.rank, step, "train")

    def on_eval_start(self, step: int) -> None:
        stop_drill(self.fault, self.rank, step, "eval")
        straggle(self.fault, self.rank, step, "eval")

    def on_save_start(self, step: int) -> None:
        straggle(self.fault, self.rank, step, "save")
        inject_fault(self.fault, self.rank, step, self.resumed, at="save")

    def on_recovered(self, rank: int) -> None:
        # The drill named a rank number, which now belongs to another process: it has fired; a straggler stays.
        self.rank = rank
        if self.fault is not None and not self.fault.kind.startswith("slow-"):
            self.fault = None


def drills_for(fault: FaultInjection | None, rank: int, resumed: bool) -> list[Callback]:
    """The drill callbacks --inject-fault asks for: none without it."""
    return [] if fault is None else [Drills(fault, rank, resumed)]
