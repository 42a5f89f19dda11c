"""The finish watch: ends the job when a rank is still running `timeout_s` after another rank's script finished.

A rank whose script ends (even with status 0) while the others wait for it in a collective would leave them
blocked until torch's collective timeout; the watch, a watcher thread talking through the rendezvous store,
shows where the late rank is and aborts instead. `mpiddp run` and `mpiddp.init()` under plain mpirun use it.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from mpiddp.job.collective import Dist, Rendezvous
from mpiddp.job.storeload import StoreUnanswered, answered_within
from mpiddp.job.watch import Ending, Watcher, own_stacks


def _shown(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")


class FinishWatch(Watcher):
    """finished() when this rank's script is done; the thread tells the other ranks, and watches for them."""

    THREAD_NAME = "mpiddp-finish-watch"
    INTERVAL_S = (0.2, 2.0)
    REQUESTS_PER_INTERVAL = 1  # one request per interval from every rank

    def __init__(self, timeout_s: float, dist: Dist, store: Any | None, setting: str = "--finish-timeout {}") -> None:
        super().__init__(timeout_s, dist.rank, dist.world_size, dist.label, store, dist.abort_from_thread)
        if store is not None:  # never blocked on rank 0's store: a stopped rank 0 holds its sockets open
            self.store = answered_within(store, self.interval, timeout_s)
        self.setting = setting.format(f"{timeout_s:g}")  # how the user changes the timeout, for the messages
        self.done = threading.Event()
        self.first_seen: float | None = None  # when this rank first saw another rank finished
        self.reported: float | None = None  # when this rank told the others it finished

    @classmethod
    def for_job(cls, timeout_s: float, dist: Dist, rendezvous: Rendezvous,
                setting: str = "--finish-timeout {}") -> FinishWatch:
        """A watch on this rank's one connection to the rendezvous store (none when it is turned off)."""
        store = rendezvous.client() if timeout_s > 0 and dist.world_size > 1 else None
        return cls(timeout_s, dist, store, setting)

    def follow(self, dist: Dist) -> None:
        """In-job recovery ended (a script's run_recoverable): watch the survivors on their new store, under this
        rank's new number. The old thread ends at its next wake-up (it holds the old stop event)."""
        fresh = FinishWatch.for_job(self.timeout_s, dist, dist.rendezvous, "{}") if dist.rendezvous else None
        self.stopped.set()
        if fresh is None:
            return
        self.rank, self.world_size, self.label, self.store = fresh.rank, fresh.world_size, fresh.label, fresh.store
        self.interval, self.abort = fresh.interval, fresh.abort
        self.first_seen = self.reported = None
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name=self.THREAD_NAME, daemon=True)
        self.start()

    def finished(self) -> None:
        """This rank's script is done: tell the other ranks' watches (from the watch's own thread)."""
        self.done.set()

    def stop(self) -> None:
        super().stop()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        if not self.thread.is_alive():  # let go of the rank's one connection (rank 0: the store), so teardown closes it
            self.store = None

    def poll(self) -> Ending | None:
        try:
            return self._poll_store()
        except StoreUnanswered:  # rank 0's store did not answer in time: the watch goes on without blocking. A
            # mute store alone ends nothing: this rank's main thread may hold the one shared connection in a long
            # store wait (a new group waiting for a late peer); a stopped rank 0 is the hang watchdog's to find
            return None

    def _poll_store(self) -> Ending | None:
        now = time.monotonic()
        if self.done.is_set():
            if self.reported is None:
                self.report_finished()
                self.reported = now
            elif now - self.reported > 2 * self.timeout_s + 10:
                # The late ranks' own watches fire after timeout_s; this one only when they cannot (a rank stuck
                # holding the GIL), so a finished rank never waits forever. Under the store's guard: a store gone
                # meanwhile (every rank finished, rank 0 closed it) ends the watch quietly.
                finished = set(self.finished_ranks())
                late = [rank for rank in range(self.world_size) if rank not in finished]
                return lambda: self.end_job(
                    f"mpiddp: {self.label} finished {now - self.reported:.0f} s ago, and rank(s) {_shown(late)} "
                    f"have neither finished nor ended the job ({self.setting}); ending the job\n")
            return None
        if self.finished_count() == 0:
            return None
        self.first_seen = self.first_seen or now
        if now - self.first_seen > self.timeout_s:
            waited, finished = now - self.first_seen, self.finished_ranks()
            return lambda: self._fire(waited, finished)
        return None

    def _fire(self, waited: float, finished: list[int]) -> None:
        self.end_job(
            f"mpiddp: {self.label} is still running {waited:.0f} s after the script finished on rank(s) "
            f"{_shown(finished)} ({self.setting}). If it waits in a collective for them, it would never "
            f"return: every rank must make the same collective calls. Ending the job; Python stacks of "
            f"{self.label}:\n{own_stacks()}")
