"""The public API for your own scripts: `dist = mpiddp.init()` gives a typed Dist with the process group up.

Under `python -m mpiddp run script.py` it reuses the runner's bootstrap (one rendezvous, one store, the runner's
failure handling). Under a plain `mpirun python script.py` it bootstraps itself and ends the job the way `run`
does: an unhandled exception or `sys.exit(N)` with N != 0 on any rank ends every rank at once; a rank whose
script ends (or calls `sys.exit(0)`) waits, asleep, for the others, and a rank still running `finish_timeout_s`
after another finished shows its stacks and ends the job.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

from mpiddp.errors import ScriptExit
from mpiddp.job.collective import Dist, Rendezvous, set_current
from mpiddp.job.failfast import FailFast, flush_logs
from mpiddp.job.finishwatch import FinishWatch
from mpiddp.job.flags import BACKENDS, DEVICES, MASTER_ADDR_ENV, SCRIPT_HANG_TIMEOUT_S, DistSettings

if TYPE_CHECKING:
    from mpiddp.elastic.grow import LateJoin
    from mpiddp.job.bootstrap import _Store


@dataclass
class Session:
    """A bootstrapped job whose process group is not up yet: MPI, topology, rendezvous store, thread share."""

    dist: Dist
    rendezvous: Rendezvous
    store: _Store
    num_threads: int
    guard: FailFast | None = None  # set when mpiddp.init() bootstrapped the job itself (plain mpirun)
    watch: FinishWatch | None = None
    joining: LateJoin | None = None  # grows the job back: joins at its first step (mpiddp.elastic.grow.LateJoin)


@dataclass(frozen=True)
class InitSettings:
    """What `init` asks of the bootstrap: the network settings training and `run` have too (DistSettings), and how
    long a rank may run on after another's script ended."""

    dist: DistSettings = field(default_factory=DistSettings)
    finish_timeout_s: float = 600.0
    hang_timeout_s: float = SCRIPT_HANG_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.dist.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.dist.device!r}")
        if self.dist.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.dist.backend!r}")
        if self.dist.collective_timeout_s <= 0:
            raise ValueError(f"collective_timeout_s must be positive, got {self.dist.collective_timeout_s}")
        if self.finish_timeout_s < 0:
            raise ValueError(f"finish_timeout_s must be 0 (wait forever) or positive, got {self.finish_timeout_s}")
        if not self.hang_timeout_s >= 0:  # NaN too: it would turn the watchdog off
            raise ValueError(f"hang_timeout_s must be 0 (off) or positive, got {self.hang_timeout_s}")


_session: Session | None = None  # set by `mpiddp run` while the script runs
_initialised: Dist | None = None


def attach(session: Session) -> None:
    """`mpiddp run` hands its bootstrap to the script's `init()` (internal)."""
    global _session
    _session = session
    set_current(session.dist)


def detach() -> None:
    global _session, _initialised
    _session = _initialised = None
    set_current(None)


def init(device: str = "auto", backend: str = "auto", collective_timeout_s: float = 600.0,
         finish_timeout_s: float = 600.0, hang_timeout_s: float = SCRIPT_HANG_TIMEOUT_S) -> Dist:
    """Collective, on every rank: bootstrap the job once and start torch's default process group.

    device: "auto" (cuda:<local rank> when CUDA is available, else cpu), "cuda" or "cpu".
    backend: "auto" (nccl on CUDA, gloo on CPU), "gloo", "nccl" or "mpi".
    Returns the Dist: rank, local_rank, world_size, is_main, topology (hosts), device, and cross-rank helpers
    (reduce, allgather, gather, barrier, agree, from_main). Calling it again returns the same Dist. Exported
    environment: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT and friends.
    finish_timeout_s (plain mpirun; `mpiddp run` has --finish-timeout): seconds a rank may keep running after
    another rank's script ended before the job ends with its stacks (status 4); 0 waits forever.
    hang_timeout_s (plain mpirun; `mpiddp run` has --hang-timeout): under in-job recovery, seconds a rank may wait on
    the others in a step's all-reduce or agreement before the ranks behind are named and ended; 0: off.
    """
    global _initialised
    if _initialised is not None:
        return _initialised
    from mpiddp.elastic.api import OwnJob
    from mpiddp.job.bootstrap import start_process_group
    from mpiddp.script import recovery

    settings = InitSettings(DistSettings(device, backend, master_addr=os.environ.get(MASTER_ADDR_ENV),
                                         collective_timeout_s=collective_timeout_s), finish_timeout_s=finish_timeout_s,
                            hang_timeout_s=hang_timeout_s)
    session = _session or _bootstrap(settings)
    if session.joining is not None:  # a grow spawned this process: it joined, on the survivors' device and backend
        _initialised = session.dist
    else:
        _initialised = start_process_group(settings.dist, session.dist, session.rendezvous, session.store,
                                           session.num_threads)
    set_current(_initialised)
    if _session is None:  # in-job recovery (mpiddp.run_recoverable) follows this bootstrap onto the survivors
        dists = [_initialised] if session.joining is not None else [_initialised, session.dist]
        recovery.adopt(OwnJob(dists, session.guard, session.watch, collective_timeout_s, settings.hang_timeout_s,
                              [sys.executable, *sys.argv], session.joining))
    elif _initialised is not session.dist:  # under `mpiddp run`: its job, with the Dist the script holds first
        recovery.hold(_initialised)
    return _initialised


def _bootstrap(settings: InitSettings) -> Session:
    """Plain `mpirun python script.py`: mpiddp's bootstrap, an exception hook that ends the whole job, and an
    exit handler that ends it the way `mpiddp run` does."""
    from mpiddp.elastic import grow
    from mpiddp.job.bootstrap import _Store, connect, open_rendezvous, set_threads

    guard = FailFast()
    try:
        arrival = grow.arrive_waiting() if grow.joining() else None  # a spare for a job growing back
    except grow.Abandoned as exc:  # given up before it joined: this process was never part of the job
        grow.say_abandoned(exc)
        raise SystemExit(0) from None
    late = grow.LateJoin(arrival) if arrival is not None else None
    _abort_on_unhandled_exception(guard, late)
    if late is not None:
        dist = guard.dist = late.stand_in(set_threads(settings.dist, late.arrival.topology))
        assert dist.rendezvous is not None
        num_threads, rendezvous, store = dist.num_threads, dist.rendezvous, _Store()
        atexit.register(late.release)  # after the exit handler below (atexit runs in reverse)
    else:
        dist = connect(guard)
        num_threads = set_threads(settings.dist, dist.topology)
        rendezvous, store = open_rendezvous(settings.dist, dist, guard)
    setting = "mpiddp.init(finish_timeout_s={})"  # a rank growing the job back: its watch starts as it joins
    watch = (FinishWatch.for_job(settings.finish_timeout_s, dist, rendezvous, setting=setting) if late is None else
             FinishWatch(settings.finish_timeout_s, dist, None, setting)).start()
    exit_status = _ExitStatus().install()
    atexit.register(_at_exit, guard, dist, store, watch, exit_status, late)
    return Session(dist, rendezvous, store, num_threads, guard, watch, late)


class _ExitStatus:
    """The status the script's main thread passed to `sys.exit` (or argparse did), so the exit handler knows it:
    Python runs exit handlers after a SystemExit without saying why it exits, and sys.excepthook never sees one.
    `raise SystemExit(N)` itself goes unseen and counts as the script's end (N still becomes the process status);
    a sys.exit(N) whose SystemExit the script catches and survives still counts at its end (rare; a later
    sys.exit replaces it)."""

    def __init__(self) -> None:
        self.status: int = 0

    def install(self) -> _ExitStatus:
        original = sys.exit

        def exit(status: object = None) -> None:
            if threading.current_thread() is threading.main_thread():  # elsewhere it ends only that thread
                self.status = _as_exit_code(status)
            original(status)

        sys.exit = exit
        return self


def _as_exit_code(status: object) -> int:
    """The process status Python gives a SystemExit's code: None 0, an int itself, anything else (a message) 1."""
    if status is None:
        return 0
    return int(status) if isinstance(status, int) else 1


def _at_exit(guard: FailFast, dist: Dist, store: _Store, watch: FinishWatch, exit_status: _ExitStatus,
             late: LateJoin | None = None) -> None:
    """The script ended on this rank. A non-zero sys.exit ends every rank now (the others may wait for this one
    in a collective); otherwise this rank waits, asleep and never in a blocking collective, until every rank
    ended, and the finish watches end the job when some rank does not: then the teardown, and Python's status.
    A rank growing the job back whose script ended before its first step ends alone (`late`: it never joined)."""
    from mpiddp.elastic.survivors import end_without_finalize, recovered_in_this_process
    from mpiddp.job.bootstrap import teardown
    from mpiddp.script import recovery

    if late is not None and not late.joined:
        late.end(SystemExit(exit_status.status) if exit_status.status else None)

    if exit_status.status != 0 and dist.world_size > 1:
        script = sys.argv[0] if sys.argv and sys.argv[0] else "the script"
        code, text = guard.decide(ScriptExit(script, exit_status.status))
        flush_logs()
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
        dist.abort(code)
    watch.finished()
    with guard:  # a rank lost meanwhile ends the job with one line (and the status), as `mpiddp run` does
        recovery.wait_for_every_rank(dist)
    watch.stop()
    teardown(dist, store)
    if recovered_in_this_process():  # every survivor passed the teardown's barrier
        end_without_finalize(0)


def _abort_on_unhandled_exception(guard: FailFast, late: LateJoin | None = None) -> None:
    """Like `python -m mpi4py`: an exception that reaches the top on any rank ends every rank; on a rank growing the
    job back before its first step (`late`), this rank alone (it never joined)."""
    # torch's init_process_group wraps the hook and points sys.stderr at a buffer while the wrapped hook runs,
    # printing the buffer afterwards; this hook never returns, so it writes where stderr pointed before.
    stream = sys.stderr

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if late is not None and not late.joined:
            late.end(exc)
        code, text = guard.decide(exc)
        if text:
            flush_logs()
            stream.write(text + "\n")
            stream.flush()
        if guard.dist is not None and guard.dist.world_size > 1 and not _follows_first_report(guard):
            guard.dist.abort(code)
        os._exit(code)

    sys.excepthook = hook


def _follows_first_report(guard: FailFast) -> bool:
    """Under MPI fault tolerance (a failed in-job recovery of a script) a second MPI_Abort racing the first can
    make Open MPI's mpirun exit 0: a rank that follows another's report while MPI reports failed peers leaves
    alone, and the first one's abort ends the rest (as FailFast does)."""
    return not guard.reported_first and bool(guard._failed_peers())
