"""One watcher: a daemon thread that polls the rendezvous store every interval and ends the job when what it
watches for does not happen in time (nvidia-resiliency-ext's monitor thread with its StoreMixin is the model).

The hang watchdog (mpiddp.job.watchdog) and the finish watch (mpiddp.job.finishwatch) are its two uses. It talks
through the store, not through MPI or gloo/NCCL, so it works while the main thread is stuck inside a collective;
its requests are paced by the world's size (mpiddp.job.storeload) and every key comes from mpiddp.job.storekeys.
"""

from __future__ import annotations

import faulthandler
import json
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # typing.Self is Python 3.11's; the floor runs 3.10
    from typing_extensions import Self

from mpiddp.errors import EXIT_HANG
from mpiddp.job import storekeys
from mpiddp.job.storeload import paced_interval

# A watcher's wake-up later than this beyond its interval (and than one more interval) means this whole process
# stood still: a thread waiting on an event is not that late on a machine that is only busy.
SUSPENDED_S = 5.0

Ending = Callable[[], None]  # what a watcher does when it stops watching to end the job


def own_stacks() -> str:
    """Every thread's Python stack in this process, as faulthandler writes it (it needs a real file)."""
    with tempfile.TemporaryFile("w+") as out:
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.seek(0)
        return out.read()


class StoreMixin:
    """The store requests of mpiddp's watchers, one method each: rank 0's store serves every rank, so what each
    costs is visible here (one request per line)."""

    store: Any
    rank: int
    world_size: int

    # the hang watchdog
    def advance_clock(self) -> int:
        return int(self.store.add(storekeys.PROGRESS_CLOCK, 1))

    def put_progress(self, record: dict[str, Any]) -> None:
        self.store.set(storekeys.progress(self.rank), json.dumps(record))

    def progress_of_all(self) -> dict[int, dict[str, Any]]:
        keys = [storekeys.progress(rank) for rank in range(self.world_size)]
        # one request when every rank reported (as a running job's have), else one per key
        present = keys if self.store.check(keys) else [key for key in keys if self.store.check([key])]
        values = self.store.multi_get(present) if present else []
        return {storekeys.rank_of_progress(key): json.loads(value) for key, value in zip(present, values)}

    def pid_of(self, rank: int) -> int | None:
        """The pid in `rank`'s progress record, None before it published one."""
        key = storekeys.progress(rank)
        pid = json.loads(self.store.get(key)).get("pid") if self.store.check([key]) else None
        return pid if isinstance(pid, int) else None

    def hang_requested(self) -> bool:
        return bool(self.store.check([storekeys.HANG_REQUEST]))

    def request_hang_report(self, label: str) -> None:
        self.store.set(storekeys.HANG_REQUEST, label)

    def claim_hang_report(self) -> bool:
        """True for the first rank to ask: it describes the hang."""
        return bool(self.store.add(storekeys.HANG_REPORTS, 1) == 1)

    def put_stacks(self, text: str) -> None:
        self.store.set(storekeys.stacks(self.rank), text)

    def count_stacks(self) -> None:
        self.store.add(storekeys.STACKS_GIVEN, 1)

    def stacks_given(self) -> int:
        return int(self.store.add(storekeys.STACKS_GIVEN, 0))

    def stacks_of(self, rank: int) -> str | None:
        key = storekeys.stacks(rank)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    def put_exclusion(self, plan: dict[str, Any]) -> None:
        self.store.set(storekeys.HANG_EXCLUDE, json.dumps(plan))

    def exclusion(self) -> dict[str, Any] | None:
        """The first watchdog's plan for the ranks behind (in-job recovery), or None when there is none."""
        key = storekeys.HANG_EXCLUDE
        return json.loads(self.store.get(key)) if self.store.check([key]) else None

    def put_silent_hosts(self, hosts: list[dict[str, Any]]) -> None:
        self.store.set(storekeys.SILENT_HOSTS, json.dumps(hosts))

    def silent_hosts(self) -> list[dict[str, Any]]:
        """The hosts rank 0's watchdog found silent (in-job recovery), each with its addresses and ranks."""
        key = storekeys.SILENT_HOSTS
        return json.loads(self.store.get(key)) if self.store.check([key]) else []

    def put_trace_answer(self, failed: str | None) -> None:
        self.store.set(storekeys.trace(self.rank), failed or "")

    def trace_answer(self, rank: int) -> str | None:
        """"" when the rank's dump is in the run dir, why not otherwise; None when it did not answer."""
        key = storekeys.trace(rank)
        return self.store.get(key).decode(errors="replace") if self.store.check([key]) else None

    # the finish watch
    def report_finished(self) -> None:
        self.store.set(storekeys.finished(self.rank), "1")
        self.store.add(storekeys.FINISHED, 1)

    def finished_count(self) -> int:
        return int(self.store.add(storekeys.FINISHED, 0))

    def finished_ranks(self) -> list[int]:
        return [rank for rank in range(self.world_size) if self.store.check([storekeys.finished(rank)])]


class Watcher(StoreMixin):
    """The thread, its stop event and its pace. A subclass says what one round does (`poll`, whose store
    requests run under the guard for a store that went away) and what ending the job means (the Ending it
    returns, run outside that guard)."""

    THREAD_NAME = "mpiddp-watcher"
    INTERVAL_S = (0.5, 5.0)  # a tenth of the timeout, within these bounds, in a small job
    REQUESTS_PER_INTERVAL = 1  # store requests of one round: the pace keeps rank 0's load flat as the world grows

    def __init__(self, timeout_s: float, rank: int, world_size: int, label: str, store: Any,
                 abort: Callable[[int], None]) -> None:
        self.timeout_s = timeout_s
        self.rank, self.world_size, self.label = rank, world_size, label
        self.store = store
        self.abort = abort  # ends every rank of the job with the status given (MPI_Abort), from this thread
        low, high = self.INTERVAL_S
        self.interval = paced_interval(min(high, max(low, timeout_s / 10)), world_size, self.REQUESTS_PER_INTERVAL,
                                       timeout_s)
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=self.THREAD_NAME, daemon=True)

    @property
    def active(self) -> bool:
        """Whether there is anything to watch (turned off: timeout 0, or no store)."""
        return self.timeout_s > 0 and self.store is not None

    def start(self) -> Self:
        if self.active:
            self.starting()
            self.thread.start()
        return self

    def starting(self) -> None:
        """Just before the thread starts (a log line)."""

    def stop(self) -> None:
        self.stopped.set()

    def poll(self) -> Ending | None:
        """One round of store requests; what to do to end the job, or None to keep watching."""
        raise NotImplementedError

    def store_failed(self, exc: Exception) -> None:
        """A store request raised while the watcher was not stopped. By default the store is gone (rank 0 closed
        it at the end of the job): the job is ending anyway, and the watcher ends quietly."""

    def resumed(self, seconds: float) -> None:
        """This process stood still `seconds` beyond the watcher's interval (stopped by SIGSTOP, or the whole job
        suspended, e.g. by a scheduler): by default nothing."""

    def _watch(self) -> None:
        stopped = self.stopped  # this thread's own: a watcher that follows a new store starts a new thread
        while True:
            waited_from, cpu_from = time.monotonic(), time.process_time()
            if stopped.wait(self.interval):
                return
            overslept = time.monotonic() - waited_from - self.interval  # the wait's own lateness, not a round's
            # far more than a busy machine's lateness, with the process's CPU time still: the whole process stood
            # still. A main thread spinning in C code that holds the GIL also makes this thread late, but burns CPU
            # meanwhile: that is a hang to find, not a stop to leave out.
            if overslept > max(SUSPENDED_S, self.interval) and time.process_time() - cpu_from < overslept / 2:
                self.resumed(overslept)
            try:
                ending = self.poll()
            except Exception as exc:
                if not stopped.is_set():
                    self.store_failed(exc)
                return
            if stopped.is_set():
                return
            if ending is not None:
                ending()
                return

    def end_job(self, text: str, status: int = EXIT_HANG) -> None:
        """Say why on stderr, then end every rank of the job."""
        sys.stderr.write(text)
        sys.stderr.flush()
        self.abort(status)
