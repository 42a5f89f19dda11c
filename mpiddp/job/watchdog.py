"""Hang watchdog: when a rank makes no progress for --hang-timeout seconds, show where every rank is and abort.

It is a watcher (mpiddp.job.watch): a daemon thread that talks through the rendezvous store, not through MPI or
gloo/NCCL, so it works while the main thread is stuck inside a collective. The first rank to fire asks every
other rank's watchdog for its stacks and, on NCCL, its flight-recorder dump, and writes what they show into one
hang file.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpiddp.atomicfile import write_text_atomic
from mpiddp.failure import FailureRecord, ask_to_end, records_dir, write_rank
from mpiddp.job.collective import Dist
from mpiddp.job.failfast import EXIT_HANG
from mpiddp.job.flightrec import TRACE_PREFIX, describe_traces, load_trace, nccl_trace, slim, trace_path, write_trace
from mpiddp.job.silenthost import SILENT_HOST_S, QuietHosts, cut_connections, host_addresses, kernel_answers
from mpiddp.job.storeload import StoreUnanswered, answered_within, paced_interval, store_rate
from mpiddp.job.watch import Ending, Watcher, own_stacks

log = logging.getLogger(__name__)

STALE_INTERVALS = 3  # a rank whose watchdog missed this many of its reports is stopped or gone
GRACE_S = 3.0  # after firing, time for the other ranks' watchdogs to dump their stacks too
# A store request that timed out (torch: "Socket Timeout", "wait timeout"), unlike one refused or reset after the
# store closed at the end of the job
STORE_UNANSWERED = re.compile(r"time(d)? ?out", re.IGNORECASE)
READ_DUMPS_S = 30.0  # the most the hang report spends reading the ranks' flight-recorder dumps
# The phases of a training step, in the order a rank goes through them: waiting for its loader, computing, then in
# the gradient all-reduce (it waits there for every other rank). At one step, a rank in an earlier phase than the
# others never reached the collective they wait in: it is the one holding them up.
STEP_PHASES = ("data", "compute", "communication")
EXCLUDE_WAIT_MIN_S = 10.0  # in-job recovery: at least this long for a hung rank to be ended and the recovery to begin
REQUESTS_PER_INTERVAL = 3  # each watchdog's store requests per interval: advance the clock, publish, look for a request
# in-job recovery: one more, to look for silent hosts (rank 0 also reads every rank's record: two requests)
HOST_WATCH_REQUESTS = REQUESTS_PER_INTERVAL + 1
HOST_WATCH_INTERVAL_S = 2.0  # in-job recovery: reports this often (in a small job), for the silent-host watch



def write_report(path: Path, text: list[str], what: str) -> None:
    """Write a hang report atomically and say where in one line (a full disk is said, not raised: the job's end
    must not wait on it)."""
    try:
        write_text_atomic(path, "\n".join(text))
        sys.stderr.write(f"mpiddp: {what}: {path}\n")
    except OSError as exc:
        sys.stderr.write(f"mpiddp: could not write the hang report {path}: {exc}\n")
    sys.stderr.flush()

class Watchdog(Watcher):
    """beat(phase, step) from the main thread; the thread fires when beats stop for `timeout_s`. enter(phase)
    says where in a step the rank is, without counting as progress."""

    THREAD_NAME = "mpiddp-watchdog"
    INTERVAL_S = (0.5, 5.0)
    REQUESTS_PER_INTERVAL = REQUESTS_PER_INTERVAL

    def __init__(self, timeout_s: float, rank: int, world_size: int, label: str, store: Any,
                 abort: Callable[[int], None], host_of_rank: dict[int, str] | None = None,
                 failure_dir: Path | None = None, run_dir: Path | None = None,
                 trace: Callable[[], bytes] | None = None) -> None:
        super().__init__(timeout_s, rank, world_size, label, store, abort)
        if store is not None:  # never blocked on rank 0's store: a stopped rank 0 holds its sockets open
            self.store = answered_within(store, self.interval, timeout_s)
        self.rank_0_pid: int | None = None  # from rank 0's first progress record: to end it when its store is mute
        self.rank_0_pid_asked = False  # asked at the first beat (the main thread), not only by the thread's rounds
        self.run_dir = run_dir  # where the hang file goes (None: stderr only)
        self.trace = trace  # this rank's flight-recorder dump (NCCL), written to the run dir when the job hangs
        self.answered = False  # this rank gave its stacks (and dump) for the hang file
        self.host_of_rank = host_of_rank or {}
        self.failure_dir = failure_dir  # where this rank's failure record goes (None: nowhere)
        self.phase, self.step = "start", 0
        self.beats = 0  # progress in this job (a step, a save, an evaluation)
        self.last_beat = time.monotonic()
        self.own_ticks: collections.deque[int] = collections.deque(maxlen=STALE_INTERVALS + 1)
        self.recovering = False  # in-job recovery: a store that stops answering meanwhile is the failed rank's
        # In-job recovery: a hang ends the ranks behind (SIGKILL, after the hang file), so that MPI declares them
        # failed and the survivors go on, instead of ending the job
        self.exclude_hung = False
        self.excluded: set[int] = set()  # ranks of this world that a hang ends (the recovery's cause is "hang")
        self.ended: set[int] = set()  # pids this watchdog ended
        self.requests_per_interval = REQUESTS_PER_INTERVAL
        # In-job recovery: the silent-host watch (mpiddp.job.silenthost); rank 0 judges, every rank cuts
        self.addresses: list[str] = []  # this host's addresses, in the progress record: where peers connect to it
        self.quiet: QuietHosts | None = None  # rank 0's view of which hosts stopped reporting
        self.judged: set[str] = set()  # hosts rank 0 found quiet and probed (each once)
        self.cut_hosts: set[str] = set()  # hosts this rank cut its connections to
        self.silenced: set[int] = set()  # ranks of this world on the hosts cut off (the recovery's cause)
        # A script's watchdog: how long this rank has waited on the others in a watched collective (None while it
        # does not wait). Its hang clock runs only then, as a script's own phases (an evaluation, a save) are
        # unknown to mpiddp: a rank is hung when a peer keeps it waiting, never for being busy itself.
        self.waited: Callable[[], float | None] | None = None

    @classmethod
    def for_job(cls, timeout_s: float, dist: Dist, run_dir: Path | None = None, exclude_hung: bool = False,
                watch_hosts: bool = False, waited: Callable[[], float | None] | None = None) -> Watchdog:
        """A watchdog on this rank's one connection to the rendezvous store (none when it is turned off);
        `exclude_hung`: under in-job recovery, a hung rank is ended rather than the job; `watch_hosts`: a silent
        host is cut off (in-job recovery where the runtime survives a lost host: contract.HOST_RELAYS_ENV);
        `waited`: a script's (see the attribute)."""
        store = None
        if timeout_s > 0:
            assert dist.rendezvous is not None, "the watchdog starts inside the process group"
            store = dist.rendezvous.client()
        topo = dist.topology
        host_of_rank = {rank: host for host, ranks in topo.hosts for rank in ranks}
        watchdog = cls(timeout_s, dist.rank, dist.world_size, dist.label, store, dist.abort_from_thread, host_of_rank,
                       records_dir(topo.failure_file, run_dir), run_dir, nccl_trace if dist.backend == "nccl" else None)
        watchdog.exclude_hung = exclude_hung
        watchdog.waited = waited
        if watch_hosts and watchdog.active:
            watchdog.watch_hosts()
        return watchdog

    def watch_hosts(self) -> None:
        """In-job recovery: rank 0 looks for silent hosts, every rank cuts its connections to those it names, and
        every rank reports often enough for a silent host to be noticed after SILENT_HOST_S (in a big job, after
        STALE_INTERVALS of the intervals the store's pace allows)."""
        self.addresses = host_addresses()
        self.requests_per_interval = HOST_WATCH_REQUESTS
        self.interval = paced_interval(min(self.interval, HOST_WATCH_INTERVAL_S), self.world_size,
                                       HOST_WATCH_REQUESTS, self.timeout_s)
        own = self.host_of_rank.get(self.rank, "")
        if self.rank == 0 and len(set(self.host_of_rank.values())) > 1:
            self.quiet = QuietHosts(self.host_of_rank, own, max(SILENT_HOST_S, STALE_INTERVALS * self.interval))

    def starting(self) -> None:
        self._publish_now()
        if self.rank == 0:
            log.info("hang watchdog: each rank reports every %.1f s (%.0f requests/s to rank 0's store)%s",
                     self.interval, store_rate(self.world_size, self.requests_per_interval, self.interval),
                     f"; a host whose ranks stop reporting for {self.quiet.bound_s:.0f} s and whose kernel does not "
                     "answer is cut off (in-job recovery)" if self.quiet else "")

    def beat(self, phase: str, step: int) -> None:
        self.phase, self.step, self.last_beat = phase, step, time.monotonic()
        self.beats += 1
        if not self.rank_0_pid_asked:
            self.rank_0_pid_asked = True
            self._learn_rank_0_pid()

    def _learn_rank_0_pid(self) -> None:
        """Once, at the first progress after the start or a recovery: rank 0's pid from its first record (published
        as its watchdog started, before the collective this progress needed). The thread reads it too, but only one
        interval after the start: rank 0 stopped in that interval could not be ended for in-job recovery (its store
        answers no more). A request with a deadline; where it fails, the thread's rounds try again."""
        if self.rank == 0 or self.rank_0_pid is not None or self.store is None or self.recovering:
            return
        try:
            self.rank_0_pid = self.pid_of(0)
        except Exception:  # a mute or closed store: the watch's own rounds say what it means
            pass

    def enter(self, phase: str) -> None:
        """Where in the step this rank is now (one of STEP_PHASES): not progress, the clock keeps running."""
        self.phase = phase

    def idle_s(self) -> float:
        """The hang clock: seconds since the last progress; a script's, seconds waited on the others (`waited`)."""
        since_beat = time.monotonic() - self.last_beat  # `resumed` moves the beat past a stand-still
        if self.waited is None:
            return since_beat
        waited = self.waited()
        return 0.0 if waited is None else min(waited, since_beat)

    def where(self) -> str:
        """This rank's phase: a script's is "communication" while it waits on the others, else "compute" (or
        "finished")."""
        if self.waited is None or self.phase == "finished":
            return self.phase
        return "communication" if self.waited() is not None else "compute"

    def finish(self) -> None:
        """A script's rank ended its script: said in its record (a peer kept waiting for it is the finish watch's
        case, or waits as --finish-timeout 0 asks), then the watch ends."""
        self.phase = "finished"
        if self.active and not self.recovering:
            self._publish_now()
        self.stop()

    def _a_script_ended(self) -> bool:
        """Whether a rank's record says its script ended (a script's watchdog asks before it fires)."""
        return any(record.get("phase") == "finished" for record in self.progress_of_all().values())

    @property
    def progressed(self) -> bool:
        """Whether this job has done anything since it started (a step, a save, an evaluation)."""
        return self.beats > 0

    def resumed(self, seconds: float) -> None:
        """The whole process stood still (SIGSTOP, a suspended job): its main thread could not beat meanwhile, so
        that time is not idleness. A rank whose own loop hangs is still found: the time before the stop counts,
        and the others' watchdogs never stood still."""
        self.last_beat = min(time.monotonic(), self.last_beat + seconds)
        log.info("%s: this process stood still %.1f s (stopped or suspended); the hang clock leaves that out",
                 self.label, seconds)

    def suspend(self) -> None:
        """In-job recovery begins: the store may be gone with its rank; the watch waits for `follow`."""
        self.recovering = True

    def follow(self, dist: Dist, run_dir: Path | None = None) -> None:
        """In-job recovery ended: watch again, on the survivors' new store, under this rank's new number."""
        fresh = Watchdog.for_job(self.timeout_s, dist, run_dir or self.run_dir, self.exclude_hung,
                                 watch_hosts=bool(self.addresses), waited=self.waited)
        self.stopped.set()  # the old thread ends at its next wake-up (it holds the old event)
        self.interval, self.host_of_rank, self.failure_dir = fresh.interval, fresh.host_of_rank, fresh.failure_dir
        self.rank, self.world_size, self.label, self.store = fresh.rank, fresh.world_size, fresh.label, fresh.store
        self.answered, self.last_beat = False, time.monotonic()
        self.excluded = set()  # rank numbers of the old world
        self.quiet, self.judged, self.cut_hosts, self.silenced = fresh.quiet, set(), set(), set()
        self.own_ticks.clear()
        self.rank_0_pid, self.rank_0_pid_asked = None, False  # the new rank 0's, read again (also at the next beat)
        self.stopped = threading.Event()
        self.recovering = False
        self.thread = threading.Thread(target=self._watch, name=self.THREAD_NAME, daemon=True)
        if self.active:
            self._publish_now()
            self.thread.start()

    def _publish_now(self) -> None:
        """A first progress record (with this process's pid) before the first interval: a rank that stops at once
        is still named, and can be ended under in-job recovery."""
        try:
            self._publish()
        except Exception:  # the thread's first round tries again, under its guard
            pass

    def _publish(self) -> None:
        # A record that stops being refreshed: the rank's process is stopped or gone. Freshness is read off one
        # counter in the store that every publish advances, never off wall clocks, which differ across hosts.
        tick = self.advance_clock()
        record = {"phase": self.where(), "step": self.step, "idle_s": round(self.idle_s(), 1),
                  "tick": tick, "pid": os.getpid()}
        self.put_progress({**record, "addresses": self.addresses} if self.addresses else record)
        self.own_ticks.append(tick)

    def poll(self) -> Ending | None:
        if self.recovering:
            return None
        try:
            return self._poll_store()
        except StoreUnanswered:
            return self._store_mute()

    def _poll_store(self) -> Ending | None:
        self._publish()
        if self.rank_0_pid is None and self.rank != 0:
            self.rank_0_pid = self.pid_of(0)
        asked = not self.answered and self.hang_requested()
        if self.idle_s() > self.timeout_s and not (self.waited is not None and self._a_script_ended()):
            return self._fire
        if asked:  # another rank's watchdog fired: give it this rank's stacks and dump, and keep watching
            self._answer()
        elif self.exclude_hung and self.answered:  # a hang under in-job recovery: end a rank behind on this host
            self._end_here(self.exclusion(), first=False)
        if self.addresses:
            return self._watch_for_silent_hosts()
        return None

    def _watch_for_silent_hosts(self) -> Ending | None:
        """Cut this rank's connections to the hosts rank 0 named silent; rank 0 first judges the quiet ones. A
        rank of a host named silent (its link came back) ends itself: the others went on without it."""
        named = self.silent_hosts()
        here = self.host_of_rank.get(self.rank)
        if self.quiet is not None:
            progress = self.progress_of_all()
            quiet = self.quiet.observe(progress, time.monotonic())
            self.judged.intersection_update(quiet)  # a host that reported again is judged anew if it goes quiet
            for host in [h for h in quiet if h not in self.judged and h not in {e["host"] for e in named}]:
                self.judged.add(host)
                entry = self._judge(host, progress)
                if entry is not None:
                    named.append(entry)
                    self.put_silent_hosts(named)
        for entry in named:
            if entry["host"] == here:
                return lambda: self.end_job(f"mpiddp: hang watchdog: {self.label}: this host ({here}) was found "
                                            "silent and the other ranks went on without it; ending this rank\n")
            if entry["host"] not in self.cut_hosts:
                self.cut_hosts.add(entry["host"])
                self.silenced.update(int(rank) for rank in entry["ranks"])
                self._cut(entry)
        return None

    def _cut(self, entry: dict[str, Any]) -> None:
        try:
            cut_connections(entry["addresses"])
        except Exception as exc:  # never let this end the hang watchdog's thread: MPI may notice by itself
            log.warning("hang watchdog: %s: could not cut its connections to %s: %s", self.label, entry["host"], exc)

    def _judge(self, host: str, progress: dict[int, dict[str, Any]]) -> dict[str, Any] | None:
        """Rank 0: a host whose ranks all stopped reporting, named silent when its kernel answers no connection
        either (the entry for the store); None when it answers (stopped ranks: the hang watchdog's case)."""
        assert self.quiet is not None
        ranks = sorted(rank for rank, where in self.host_of_rank.items() if where == host)
        addresses = sorted({a for r in ranks for a in progress.get(r, {}).get("addresses", [])} - set(self.addresses))
        quiet_s = self.quiet.bound_s
        shown = f"host {host} (ranks {', '.join(map(str, ranks))})"
        if not addresses or kernel_answers(addresses):
            log.warning("hang watchdog: %s stopped reporting %.0f s ago, but %s: not cut off (if its ranks are "
                        "stuck, --hang-timeout ends them)", shown, quiet_s,
                        "it answers connections" if addresses else "its addresses are unknown")
            return None
        sys.stderr.write(f"mpiddp: hang watchdog: {shown} went silent: no report for {quiet_s:.0f} s and no answer "
                         f"at {', '.join(addresses)}; every rank cuts its connections to it, so that MPI declares "
                         "its ranks failed and the job goes on without it\n")
        sys.stderr.flush()
        return {"host": host, "addresses": addresses, "ranks": ranks, "quiet_s": quiet_s}

    def _kept_waiting(self) -> bool:
        """Whether this rank is held up: always, for the trainer (its loop beats); a script's rank only once it has
        waited on the others past the timeout (a rank 0 stopped while nobody waits on it holds no one up)."""
        return self.waited is None or self.idle_s() > self.timeout_s

    def store_failed(self, exc: Exception) -> None:
        if not self.recovering and STORE_UNANSWERED.search(str(exc)) and self._kept_waiting():
            self._rank_0_hung(str(exc))

    def _store_mute(self) -> Ending | None:
        """A store request is still unanswered: rank 0 (which holds the store) is stopped or wedged once that has
        lasted --hang-timeout; until then (a slow answer under load) the watch goes on."""
        since = self.store.unanswered_since
        if since is None or time.monotonic() - since < self.timeout_s or not self._kept_waiting():
            return None
        return lambda: self._rank_0_hung(f"not answered for {time.monotonic() - since:.0f} s")

    def _rank_0_hung(self, why: str) -> None:
        """Rank 0's store stopped answering: rank 0 is stopped or wedged, and nothing can be gathered through its
        store. Under in-job recovery (its pid known from its first progress record) rank 0 is ended like any hung
        rank: by a peer on its host (SIGKILL), else by `launch` (asked through a file); MPI then declares it failed
        and the survivors recover on a new store, as when rank 0 is killed. Else, or when the recovery does not
        begin within max(--hang-timeout, EXCLUDE_WAIT_MIN_S), this rank records rank 0 as behind and ends the job
        (launch relaunches without its host). The witness (rank 1) writes the hang file with its own stacks."""
        stopped = self.stopped
        host, pid = self.host_of_rank.get(0, "?"), self.rank_0_pid
        stacks = own_stacks()
        end = self.exclude_hung and pid is not None and self.world_size > 1 and 0 in self.host_of_rank
        lines = [f"mpiddp: hang watchdog: {self.label}: rank 0's store (rank 0 on {host}) stopped answering ({why}; "
                 f"--hang-timeout {self.timeout_s:g}): rank 0 is stopped or wedged",
                 "ranks behind: 0 at an unknown step (its store holds the progress of every rank)"]
        if end:
            lines.append(describe_exclusion({"ranks": {"0": {"pid": pid, "host": host}}}))
        sys.stderr.write("\n".join(lines) + f"\nmpiddp: Python stacks of {self.label}:\n{stacks}")
        sys.stderr.flush()
        hang_file = self.run_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt" if self.run_dir else None
        if hang_file is not None and self.rank == 1:
            text = [f"mpiddp hang report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", *lines, f"ranks behind: 0 on {host}",
                    "", f"==== Python stacks of {self.label} (the others' are in their own output)", stacks]
            write_report(hang_file, text, "hang report")
        if end:
            assert pid is not None
            self.excluded.add(0)  # the recovery's cause: a hang
            if self.host_of_rank.get(self.rank) == host:
                sys.stderr.write(f"mpiddp: hang watchdog: {self.label}: ending rank 0 (pid {pid}) on {host} with "
                                 "SIGKILL: in-job recovery leaves it behind\n")
                end_process(pid)
            elif not any(h == host and r != 0 for r, h in self.host_of_rank.items()) and self.failure_dir is not None:
                if ask_to_end(self.failure_dir, 0, host, pid):  # one request, whichever survivor writes it first
                    sys.stderr.write(f"mpiddp: hang watchdog: no other rank runs on {host}: asking launch to end "
                                     f"rank 0 (pid {pid})\n")
            sys.stderr.flush()
            if stopped.wait(max(self.timeout_s, EXCLUDE_WAIT_MIN_S)):
                return  # the survivors recovered on a new store: this watch is over
            self.excluded.discard(0)
        self._record({}, [0], hang_file if self.rank == 1 else None)
        self.abort(EXIT_HANG)

    def _dump_trace(self) -> None:
        """On NCCL: this rank's flight-recorder buffer into the run dir, and whether it worked, in the store."""
        if self.trace is None or self.run_dir is None:
            return
        self.put_trace_answer(write_trace(trace_path(self.run_dir, self.rank), self.trace))

    def _answer(self) -> None:
        self.answered = True
        try:
            self._dump_trace()  # before the stacks: the writer of the hang file waits for those
            idle = (f"waiting {self.idle_s():.0f} s on the others" if self.where() == "communication" else
                    "not waiting on the others") if self.waited is not None else \
                f"{time.monotonic() - self.last_beat:.0f} s after its last progress"
            self.put_stacks(f"{self.label} (its own watchdog had not fired: asked for the hang report, {idle})\n"
                            f"{own_stacks()}")
            self.count_stacks()
        except Exception:  # the store is gone: the job is ending anyway
            pass

    def _fire(self) -> None:
        stopped = self.stopped  # set when in-job recovery follows the survivors' new store, or the job ends
        plan: dict[str, Any] | None = None
        idle = self.idle_s()
        stuck = (f"waited {idle:.0f} s on the other ranks in a collective" if self.waited is not None else
                 f"made no progress for {idle:.0f} s")
        lines = [f"mpiddp: hang watchdog: {self.label} {stuck} (--hang-timeout {self.timeout_s:g}); it is in phase "
                 f"{self.where()!r} after step {self.step}"]
        stacks = own_stacks()
        first, progress, behind = False, {}, []
        hang_file = self.run_dir / f"hang-{time.strftime('%Y%m%d-%H%M%S')}.txt" if self.run_dir else None
        counted = self.answered  # asked before it fired: its stacks are in the store and counted already
        try:
            if not self.answered:
                self.answered = True
                self._dump_trace()  # before the abort, and before the stacks that the hang file's writer waits for
            # before claiming the report, so the rank that writes the hang file finds these stacks too
            self.put_stacks(f"{self.label}\n{stacks}")
            if not counted:
                self.count_stacks()
            first = self.claim_hang_report()
            if first:  # the first rank to fire describes the job, and asks every rank for its stacks and dump
                self.request_hang_report(self.label)
                progress = self.progress_of_all()
                # a rank that has not published since this watchdog's publish STALE_INTERVALS intervals ago
                quiet_since = self.own_ticks[0] if len(self.own_ticks) == self.own_ticks.maxlen else None
                behind = ranks_behind(progress, self.world_size, quiet_since)
                lines.append(describe_progress(progress, self.world_size))
                plan = self._plan_exclusion(progress, behind)
                if plan is None:  # under in-job recovery, recorded only if the hung ranks cannot be ended
                    self._record(progress, behind, hang_file)
                else:
                    self.put_exclusion(plan)  # now: every watchdog learns the recovery's cause before the end
                    self.excluded.update(map(int, plan["ranks"]))
                    lines.append(describe_exclusion(plan))
        except Exception as exc:
            lines.append(f"(progress of the other ranks unavailable: {exc})")
        sys.stderr.write("\n".join(lines) + f"\nmpiddp: Python stacks of {self.label}:\n{stacks}")
        sys.stderr.flush()
        # the other ranks' watchdogs fire within about one interval: time for them to dump their stacks too
        deadline = time.monotonic() + GRACE_S + self.interval
        if first and hang_file is not None:
            self._write_hang_file(hang_file, lines, behind, deadline)
        if stopped.wait(max(0.0, deadline - time.monotonic())):
            return  # the survivors recovered meanwhile (or the job ended): this watch is over, its store replaced
        if self.exclude_hung and self._exclude(stopped, first, plan):
            return  # the survivors recover in the job; this thread's watch is over
        if plan is not None:  # the hung ranks were not ended in time: the job ends as without in-job recovery
            self._record(progress, behind, hang_file)
        self.abort(EXIT_HANG)

    def _plan_exclusion(self, progress: dict[int, dict[str, Any]], behind: list[int]) -> dict[str, Any] | None:
        """Under in-job recovery: the ranks behind with their pids and hosts, to be ended; None where the job
        ends as today (recovery off, every rank stuck alike, a rank that never said its pid)."""
        if not self.exclude_hung or not behind or len(behind) >= self.world_size:
            return None
        ranks = {}
        for rank in behind:
            pid, host = progress.get(rank, {}).get("pid"), self.host_of_rank.get(rank)
            if not isinstance(pid, int) or host is None:
                return None
            ranks[str(rank)] = {"pid": pid, "host": host}
        return {"ranks": ranks, "end": False}

    def _exclude(self, stopped: threading.Event, first: bool, plan: dict[str, Any] | None) -> bool:
        """Under in-job recovery, once the hang file is written: end the ranks behind (the first watchdog says
        when, in the store; a watchdog on the host of a rank behind ends it; where none is, launch is asked), then
        wait for the recovery to begin. False when there is nothing to end or it did not happen in time."""
        deadline = time.monotonic() + max(self.timeout_s, EXCLUDE_WAIT_MIN_S)
        if first and plan is None:  # nothing to end (every rank stuck, a pid unknown): the job ends as today
            return False
        try:
            if first:
                plan = {**plan, "end": True}
                self.put_exclusion(plan)
            while not first and (plan is None or not plan.get("end")) and time.monotonic() < deadline:
                if stopped.is_set():  # recovered already: `self` now reads the survivors' new store
                    return True
                plan = self.exclusion()
                if plan is None:  # the first watchdog found nothing to end: the job ends as today
                    return False
                if not plan.get("end") and stopped.wait(min(self.interval, 0.5)):
                    return True
        except Exception:  # the store went away: a rank behind held it and was ended; the recovery is under way
            if not self.recovering:
                return stopped.wait(max(0.0, deadline - time.monotonic()))
            return True
        self._end_here(plan, first)
        return stopped.wait(max(0.0, deadline - time.monotonic()))

    def _end_here(self, plan: dict[str, Any] | None, first: bool) -> None:
        """Learn the ranks a hang ends; once the plan says so, SIGKILL those on this rank's host (a stopped
        process ignores SIGTERM), and (the first watchdog) ask launch to end those with no peer on their host."""
        if plan is None:
            return
        ranks = {int(rank): where for rank, where in plan["ranks"].items()}
        self.excluded.update(ranks)
        if not plan.get("end"):
            return
        here = self.host_of_rank.get(self.rank)
        for rank, where in ranks.items():
            pid, host = int(where["pid"]), str(where["host"])
            if host == here and pid not in self.ended:
                self.ended.add(pid)
                sys.stderr.write(f"mpiddp: hang watchdog: {self.label}: ending rank {rank} (pid {pid}) on {host} "
                                 "with SIGKILL: in-job recovery leaves it behind\n")
                sys.stderr.flush()
                end_process(pid)
            elif first and not any(h == host and r not in ranks for r, h in self.host_of_rank.items()) \
                    and self.failure_dir is not None:
                if ask_to_end(self.failure_dir, rank, host, pid):
                    sys.stderr.write(f"mpiddp: hang watchdog: no other rank runs on {host}: asking launch to end "
                                     f"rank {rank} (pid {pid})\n")
                    sys.stderr.flush()

    def _write_hang_file(self, path: Path, lines: list[str], behind: list[int], deadline: float) -> None:
        """One file with the ranks behind, their hosts, and every rank's stacks, gathered through the store."""
        stacks: dict[int, str] = {}
        try:
            # one counter polled with a deadline (a stopped or dead rank never answers), every rank's key read once
            while self.stacks_given() < self.world_size and time.monotonic() < deadline:
                time.sleep(0.2)
            for rank in range(self.world_size):
                given = self.stacks_of(rank)
                if given is not None:
                    stacks[rank] = given
        except Exception as exc:  # the store went away: write what arrived
            lines = [*lines, f"(gathering stacks stopped: {exc})"]
        text = [f"mpiddp hang report, {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", *lines,
                "ranks behind: " + (", ".join(f"{r} on {self.host_of_rank.get(r, '?')}" for r in behind) or "unknown"), ""]
        if self.trace is not None and self.run_dir is not None:
            text += [f"==== collectives by rank (torch's flight recorder, dumps in {self.run_dir}/{TRACE_PREFIX}<rank>)",
                     *self._describe_traces(), ""]
        for rank in range(self.world_size):
            where = f"rank {rank} on {self.host_of_rank.get(rank, '?')}"
            if rank in stacks:
                text += [f"==== Python stacks of {stacks[rank]}", ""]
            else:
                text += [f"==== {where}: no stacks (stopped, dead, or its watchdog did not fire in time)", ""]
        write_report(path, text, "hang report with every rank's stacks")

    def _describe_traces(self) -> list[str]:
        """What the dumps of the ranks that answered show (a file of an earlier job in the run dir is not read)."""
        assert self.run_dir is not None
        dumps: dict[int, dict[str, Any] | str] = {}
        give_up = time.monotonic() + READ_DUMPS_S
        for rank in range(self.world_size):
            if time.monotonic() > give_up:  # a big job's dumps: the report must still be written, the job ended
                dumps[rank] = f"not read (the hang report's {READ_DUMPS_S:g} s for reading dumps ran out)"
                continue
            try:
                failed = self.trace_answer(rank)
            except Exception as exc:  # the store went away: no word from this rank
                failed = f"its answer could not be read ({exc})"
            if failed is None:
                dumps[rank] = "no dump (stopped, dead, or its watchdog did not answer in time)"
            else:
                dumps[rank] = failed or slim(load_trace(trace_path(self.run_dir, rank)))
        try:
            return describe_traces(dumps, self.world_size)
        except Exception as exc:  # never let the analysis cost the rest of the report
            return [f"(the dumps could not be analysed: {type(exc).__name__}: {exc})"]

    def _record(self, progress: dict[int, dict[str, Any]], behind: list[int], hang_file: Path | None = None) -> None:
        """This rank's failure record for the supervisor: the ranks behind and their hosts (a file, no message to a
        peer). This rank is the witness that described the hang; the ranks it names are the culprits."""
        if self.failure_dir is None:
            return
        # every rank stuck at one step: no host stands out, so none is blamed (the supervisor retries on the same)
        blamed = behind if len(behind) < self.world_size else []
        hosts = list(dict.fromkeys(self.host_of_rank[r] for r in blamed if r in self.host_of_rank))
        steps = [p["step"] for p in progress.values()]
        write_rank(self.failure_dir, self.rank, FailureRecord(
            "hang", blamed, hosts, f"no progress for {self.timeout_s:g} s (--hang-timeout) on rank(s) "
            f"{', '.join(map(str, behind))}{f'; stacks in {hang_file}' if hang_file else ''}",
            step=min(steps) if steps else self.step, rank=self.rank, status=EXIT_HANG, progressed=self.progressed))


def ranks_behind(progress: dict[int, dict[str, Any]], world_size: int, quiet_since: int | None = None) -> list[int]:
    """The ranks at the lowest step and, of those, the ones in the earliest of STEP_PHASES (a rank still loading
    or computing while the others wait in the all-reduce); a rank that never reported, or (given `quiet_since`, a
    tick of the store's progress counter) whose watchdog has not reported since (a stopped or dead process), is
    behind everyone."""
    silent = [rank for rank in range(world_size)
              if rank not in progress or (quiet_since is not None and progress[rank].get("tick", quiet_since) < quiet_since)]
    if silent or not progress:
        return silent
    lowest = min(p["step"] for p in progress.values())
    at_lowest = {rank: p.get("phase") for rank, p in progress.items() if p["step"] == lowest}
    if all(phase in STEP_PHASES for phase in at_lowest.values()):
        earliest = min(STEP_PHASES.index(phase) for phase in at_lowest.values())
        return sorted(rank for rank, phase in at_lowest.items() if STEP_PHASES.index(phase) == earliest)
    return sorted(at_lowest)


def end_process(pid: int) -> None:
    """SIGKILL: a stopped process (SIGSTOP) ignores SIGTERM until it is continued."""
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:  # gone already, or not ours to end
        pass


def describe_exclusion(plan: dict[str, Any]) -> str:
    """The hang file's line on what in-job recovery does with the ranks behind."""
    named = ", ".join(f"rank {rank} (pid {where['pid']}) on {where['host']}" for rank, where in plan["ranks"].items())
    return (f"in-job recovery: {named} will be ended (SIGKILL) once this report is written; MPI then declares "
            f"{'them' if len(plan['ranks']) > 1 else 'it'} failed and the other ranks go on")


def describe_progress(progress: dict[int, dict[str, Any]], world_size: int | None = None) -> str:
    """Which ranks are behind, and where everyone is."""
    if not progress:
        return "no rank has reported progress"
    behind = ranks_behind(progress, world_size if world_size is not None else max(progress) + 1)
    lowest = min(p["step"] for p in progress.values())
    where = "; ".join(f"rank {rank}: step {p['step']} ({p['phase']}, idle {p['idle_s']} s)"
                      for rank, p in sorted(progress.items()))
    head = (f"ranks behind: {', '.join(map(str, behind))} at step {lowest}" if len(behind) < len(progress)
            else f"every rank is stuck at step {lowest}")
    return f"{head}. Progress by rank: {where}"
