"""FailFast: any failure on any rank ends the whole job with one report (the exit statuses live in mpiddp.errors)."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

# The exit statuses are re-exported here, where callers have always found them.
from mpiddp.errors import (EXIT_CRASH, EXIT_HANG, EXIT_INTERRUPTED, EXIT_OK, EXIT_STOPPED, EXIT_USER_ERROR,  # noqa: F401
                           AgreedError, EndDecided, LostAfterFinish, PeersLost, ScriptError, ScriptExit, UserError)
from mpiddp.failure import FailureRecord, records_dir, write_rank
from mpiddp.job.log import flush_logs
from mpiddp.job.topology import LauncherMismatch

if TYPE_CHECKING:
    from mpiddp.job.collective import Dist

# How long a failing rank waits, after writing its own record and before it aborts the job, for the other ranks to
# record theirs: the abort kills ranks that have not written yet, and "every rank failed alike" (a bug, a bad
# argument: no host's fault) can only be told from every rank's record. Long enough for ranks that fail at the same
# step on a loaded machine, short against a relaunch; a rank alone in failing waits it out once.
PEER_RECORDS_WAIT_S = 3.0


class FailFast:
    """Turns any failure on any rank into the end of the whole job, with one report from the failing rank.

    A rank that raises (or calls sys.exit, even with 0) while its peers may sit in a collective would leave
    them blocked forever; MPI_Abort is the only way out that works whatever the peers are doing. Errors
    raised on every rank together (AgreedError) end the job cleanly instead, rank 0 speaking for all.
    Each failing rank first leaves its own record (RUN_DIR/failures/rank-N.json) and, before the abort, waits
    PEER_RECORDS_WAIT_S at most for the other ranks' records, so that a failure every rank shares is seen as such.
    """

    def __init__(self) -> None:
        self.dist: Dist | None = None  # set by the bootstrap as soon as MPI is up
        # Once the rendezvous store exists: True for the first failing rank only, so one full report is printed.
        self.claim_report: Callable[[], bool] | None = None
        self.run_dir: Path | None = None  # where the failure record goes once known (set_run_dir)
        # Once the rendezvous store exists: adds to the job's count of ranks that recorded a failure, returns it.
        self.tally: Callable[[int], int] | None = None
        # Set by the loop (or `run`): (the last completed step or None, whether this job made progress yet)
        self.progress: Callable[[], tuple[int | None, bool]] | None = None
        self.reported_first = True  # False once another rank claimed the one full report before this one

    def set_run_dir(self, run_dir: Path) -> None:
        """From now on a failure leaves RUN_DIR/failures/rank-N.json (unless the supervisor named the directory)."""
        self.run_dir = run_dir

    def __enter__(self) -> FailFast:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        code, text = self.decide(exc)
        written = self.write_record(exc, code)
        if text:
            _report(text, to_stdout=isinstance(exc, AgreedError) and exc.to_stdout)
        if isinstance(exc, EndDecided):
            # the deciding rank's abort (or its exit) ends the job; a second MPI_Abort racing it can make Open
            # MPI's mpirun --with-ft ulfm exit 0, and MPI_Finalize could hang after a peer's exit
            flush_logs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        if not isinstance(exc, (AgreedError, LauncherMismatch)) and self.dist is not None and self.dist.world_size > 1:
            if written:
                self._await_peer_records(self.dist.world_size)
            if not self.reported_first and self._failed_peers():
                # Under MPI fault tolerance a second MPI_Abort racing the first can make Open MPI's mpirun exit
                # 0 (seen in 2 of 4 runs on fake hosts): a rank that follows the first report leaves alone, the
                # first one's abort ends the rest (MPI_Finalize could hang after a failure, so no normal exit).
                flush_logs()
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            self.dist.abort(code)
        raise SystemExit(code)

    def decide(self, exc: BaseException) -> tuple[int, str]:
        """(exit status, what this rank prints: empty for nothing). Pure apart from claiming the report."""
        rank = 0 if self.dist is None else self.dist.rank
        if isinstance(exc, AgreedError):
            if rank != 0 or not exc.message:
                return exc.exit_code, ""
            return exc.exit_code, ("" if exc.to_stdout else "mpiddp: ") + exc.message.rstrip()
        if isinstance(exc, LauncherMismatch):
            # Each process is alone in its world: let the launcher's rank 0 alone explain.
            return EXIT_USER_ERROR, f"mpiddp: error: {exc}" if exc.launcher_rank == 0 else ""
        where = self.dist.label if self.dist is not None else f"rank {rank} on {socket.gethostname()}"
        if isinstance(exc, EndDecided):
            return exc.status, f"mpiddp: {where}: {exc}"
        if isinstance(exc, LostAfterFinish):  # every survivor saw it: one line, from the first
            return EXIT_CRASH, f"mpiddp: {where}: {exc}" if self._first_to_report() else ""
        if isinstance(exc, UserError):
            return EXIT_USER_ERROR, f"mpiddp: error on {where}: {exc}"
        if isinstance(exc, ScriptExit):
            return exc.status, f"mpiddp: {where}: {exc}; ending the job"
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) and exc.code != 0 else EXIT_CRASH
            return code, (f"mpiddp: {where} exited early (status {exc.code}) while the other ranks may be "
                          f"waiting for it; ending the job")
        if isinstance(exc, KeyboardInterrupt):
            return EXIT_INTERRUPTED, f"mpiddp: {where} interrupted; ending the job"
        if isinstance(exc, ScriptError):
            if self._first_to_report():
                return EXIT_CRASH, f"mpiddp: {where}: {exc.script} failed; ending the job.\n{exc.report}"
            return EXIT_CRASH, f"mpiddp: {where}: {exc.script} also failed: {exc}"
        if self._first_to_report():
            formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            return EXIT_CRASH, f"mpiddp: {where} failed; ending the job.\n{formatted}"
        return EXIT_CRASH, f"mpiddp: {where} also failed: {type(exc).__name__}: {exc}"

    def record(self, exc: BaseException, code: int) -> FailureRecord | None:
        """The failure record this rank would leave, or None (help, or an agreed error off rank 0). Pure apart
        from asking the loop where it is."""
        if isinstance(exc, EndDecided):  # a peer's record decided the end: it stands alone
            return None
        rank = 0 if self.dist is None else self.dist.rank
        host = self.dist.topology.hostname if self.dist is not None else socket.gethostname()
        message = (str(exc).strip() or type(exc).__name__).splitlines()[0][:500]
        step, progressed = self._where()
        known = {"step": step, "rank": rank, "status": code, "progressed": progressed}
        if isinstance(exc, AgreedError) and exc.faulty_ranks:
            if rank != 0:
                return None
            hosts = list(dict.fromkeys(self.dist.topology.host_of(r) for r in exc.faulty_ranks)) \
                if self.dist is not None else []
            return FailureRecord("host_fault", list(exc.faulty_ranks), hosts, message, **known)
        if isinstance(exc, (AgreedError, LauncherMismatch)):
            if code == EXIT_OK or rank != 0:  # every rank raised it together: rank 0 speaks, and no host is at fault
                return None
            return FailureRecord("user_error" if code == EXIT_USER_ERROR else "exit", [], [], message, **known)
        if isinstance(exc, UserError):
            kind = "user_error"
        elif isinstance(exc, (ScriptExit, SystemExit)):
            kind = "exit"
        elif isinstance(exc, KeyboardInterrupt):
            kind = "stopped"
        else:
            kind = "exception"
            message = f"{type(exc).__name__}: {message}"
            refused = _peers_lost(exc)
            if refused is not None:
                return self._refused(refused, known)
            lost = self._failed_peers()
            if lost:
                return self._peers_failed(lost, rank, type(exc).__name__, known)
        return FailureRecord(kind, [rank], [host], message, **known)

    def _failed_peers(self) -> tuple[int, ...]:
        """Peers MPI's fault tolerance reports failed (ULFM, under mpirun --with-ft ulfm), else nothing."""
        if self.dist is None:
            return ()
        try:
            return tuple(r for r in self.dist.failed_ranks() if r != self.dist.rank)
        except Exception:  # never let the record's detail cost the record
            return ()

    def _peers_failed(self, lost: tuple[int, ...], rank: int, seen: str, known: dict) -> FailureRecord:
        """Under MPI fault tolerance the launcher says nothing of a rank that died (mpirun --with-ft ulfm does not
        report it), so the survivor that MPI told names it: a record that blames the dead, not a witness's."""
        assert self.dist is not None
        hosts = list(dict.fromkeys(self.dist.topology.host_of(r) for r in lost))
        said = f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} on {', '.join(hosts)}"
        return FailureRecord("killed", list(lost), hosts, f"{said} died (MPI's fault tolerance reports "
                             f"{'them' if len(lost) > 1 else 'it'} failed; rank {rank} saw {seen})", **known)

    def _refused(self, exc: PeersLost, known: dict) -> FailureRecord:
        """The survivors refused an in-job recovery and end the job: the ranks they lost (and their hosts, which
        they know from the placement) are the failure, whatever MPI tells this rank now (after a shrink: nothing).
        Every survivor's record starts alike ("lost in the job:"), so launch takes them as one failure and blames
        the hosts any of them names."""
        ranks = ", ".join(map(str, exc.ranks))
        said = f"rank{'s' if len(exc.ranks) > 1 else ''} {ranks}" if ranks else "ranks"
        message = f"lost in the job: {said} on {', '.join(exc.hosts)}; {str(exc).splitlines()[0]}"[:500]
        return FailureRecord("killed", list(exc.ranks), list(exc.hosts), message, **known)

    def _where(self) -> tuple[int | None, bool | None]:
        if self.progress is None:  # the loop (or the script) has not started: nothing done yet
            return None, False
        try:
            return self.progress()
        except Exception:  # never let the record's detail cost the record
            return None, None

    def write_record(self, exc: BaseException, code: int) -> bool:
        """Leave this rank's own failure record for the supervisor (a file only, never a message to a peer);
        True when written."""
        directory = records_dir(self.dist.topology.failure_file if self.dist is not None else "", self.run_dir)
        record = self.record(exc, code) if directory is not None else None
        if directory is None or record is None:
            return False
        return write_rank(directory, 0 if self.dist is None else self.dist.rank, record)

    def _await_peer_records(self, world_size: int) -> None:
        """Count this rank's record, then wait (PEER_RECORDS_WAIT_S at most) until every rank has recorded one;
        through the store, which works whatever the peers are doing. A dead store: no wait."""
        if self.tally is None:
            return
        try:
            deadline = time.monotonic() + PEER_RECORDS_WAIT_S
            failed = self.tally(1)
            while failed < world_size and time.monotonic() < deadline:
                time.sleep(0.05)  # polling with a deadline: a healthy peer never records anything
                failed = self.tally(0)
        except Exception:
            pass

    def _first_to_report(self) -> bool:
        """Whether this rank writes the one full report (the first to claim it; remembered in reported_first)."""
        if self.claim_report is None:
            self.reported_first = True
            return True
        try:
            self.reported_first = bool(self.claim_report())
        except Exception:
            # The store died with rank 0: that failure is the root cause (mpirun names it); this one follows.
            self.reported_first = False
        return self.reported_first


def _peers_lost(exc: BaseException) -> PeersLost | None:
    """The refused recovery behind `exc`, naming hosts: `exc` itself, or the one it was raised from or while
    handling (a `run` script's ScriptError hides its cause)."""
    seen: set[int] = set()
    each: BaseException | None = exc
    while each is not None and id(each) not in seen:
        seen.add(id(each))
        if isinstance(each, PeersLost) and each.hosts:
            return each
        each = each.__cause__ or each.__context__
    return None


def _report(text: str, to_stdout: bool = False) -> None:
    flush_logs()
    stream = sys.stdout if to_stdout else sys.stderr
    stream.write(text + "\n")
    stream.flush()
