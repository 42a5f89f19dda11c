"""`python -m mpiddp run [options] SCRIPT|-m MODULE [args]`: the user's own training script on every rank.

The script runs as `python SCRIPT` would run it (`sys.argv`, `__main__`, `sys.path[0]`), with torchrun's
environment, so `init_process_group()` with env:// connects to mpiddp's rendezvous store. mpiddp keeps its
start-up checks (launcher, topology, interface, fingerprints with the script's hash) and its shutdown
guarantees: a failure on any rank ends the job; a rank that finishes waits for the others.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import multiprocessing
import os
import runpy
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

from mpiddp.contract import mark_finished
from mpiddp.errors import ScriptError, ScriptExit, UserError
from mpiddp.job import preflight
from mpiddp.job.failfast import FailFast
from mpiddp.job.finishwatch import FinishWatch
from mpiddp.job.helper_signals import mark_helper_parent, prepare_forkserver
from mpiddp.job.flags import (LOG_LEVELS, MASTER_ADDR_ENV, SCRIPT_HANG_TIMEOUT_S, START_METHODS, DistSettings,
                              check_address, check_declared, flag_fields, flat_values, option, parse_into, parser_for,
                              section)
from mpiddp.job.topology import Topology

if TYPE_CHECKING:
    from mpiddp.elastic.api import OwnJob
    from mpiddp.elastic.grow import Arrival, LateJoin
    from mpiddp.job.collective import Dist

log = logging.getLogger(__name__)

RUN = "run"
USAGE = "python -m mpiddp run [options] SCRIPT [script args]  or  python -m mpiddp run [options] -m MODULE [args]"


@dataclass(frozen=True)
class RunConfig:
    """mpiddp's own options for `run`; they go before the script name, everything after belongs to the script."""

    finish_timeout_s: float = option(
        600.0, "--finish-timeout", group=RUN, parse=float, at_least=0,
        help="seconds a rank may keep running after another rank's script finished before mpiddp shows where "
        "it is and ends the job (a rank that ends early leaves the others waiting in collectives); 0: wait forever")
    hang_timeout_s: float = option(
        SCRIPT_HANG_TIMEOUT_S, "--hang-timeout", group=RUN, parse=float, at_least=0,
        help="under in-job recovery: seconds a rank may wait on the others in a step's all-reduce or agreement "
        "before mpiddp names the ranks behind (every rank's stacks in a hang report) and ends them so that the "
        "others go on; below torch's own collective timeout (NCCL's: 600 s); 0: off")
    log_level: str = option("info", "--log-level", group=RUN, choices=LOG_LEVELS, help="rank 0's level; others log warnings")
    start_method: str = option(
        "forkserver", "--start-method", group=RUN, choices=START_METHODS,
        help="multiprocessing's default start method for the script (DataLoader workers), unless the script sets "
        "one: fork after MPI_Init is unsafe with InfiniBand; forkserver and spawn need the script's "
        "`if __name__ == '__main__':` guard")
    # the network settings (DistSettings, declared once in flags.py); the rest of them are the process group's,
    # which the script starts itself
    dist: DistSettings = section(DistSettings, flags=("master_addr", "iface", "rendezvous_timeout_s", "num_threads"), help={
        "master_addr": f"address rank 0 advertises for the rendezvous (env {MASTER_ADDR_ENV})",
        "iface": "network interface for the rendezvous and gloo/NCCL on every host",
        "num_threads": "torch/OpenMP threads per rank (default: OMP_NUM_THREADS if set, else a fair share of the "
        "host's cores)"})

    def __post_init__(self) -> None:
        check_declared(self)
        check_declared(self.dist)  # DistSettings is checked by its holder
        if self.dist.rendezvous_timeout_s <= 0:
            raise ValueError("--rendezvous-timeout must be positive seconds")
        check_address(self.dist)


@dataclass(frozen=True)
class Target:
    """What to run: a script path or a module name, and the arguments that belong to it."""

    script: str | None
    module: str | None
    args: tuple[str, ...]

    @property
    def name(self) -> str:
        return self.script if self.script is not None else f"-m {self.module}"

    def source(self) -> Path:
        """The file that will run; a UserError when there is none (every rank checks its own filesystem)."""
        if self.script is not None:
            path = Path(self.script)
            if not path.is_file():
                raise UserError(f"script {self.script!r} not found (working directory {os.getcwd()}): "
                                f"give a path to a Python file, or -m MODULE")
            if not os.access(path, os.R_OK):
                raise UserError(f"script {self.script!r} is not readable: check its permissions")
            return path
        assert self.module is not None
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError) as exc:
            raise UserError(f"cannot import module {self.module!r} ({type(exc).__name__}: {exc})") from None
        if spec is not None and spec.submodule_search_locations is not None:  # a package runs its __main__
            spec = importlib.util.find_spec(f"{self.module}.__main__")
        if spec is None or spec.origin is None or not Path(spec.origin).is_file():
            raise UserError(f"no module named {self.module!r} on sys.path (working directory {os.getcwd()}); "
                            f"a package needs a __main__.py")
        return Path(spec.origin)

    def digest(self) -> str:
        """A hash of the file to run, so a host with another version of the script is caught before it starts."""
        return hashlib.sha256(self.source().read_bytes()).hexdigest()[:16]


def split_argv(argv: list[str]) -> tuple[list[str], Target]:
    """(mpiddp's options, the target): options end at the script name or at `-m MODULE`."""
    takes_value = {name for _, meta in flag_fields(RunConfig) for name in meta["names"]}
    own: list[str] = []
    index = 0
    while index < len(argv):
        token = argv[index]
        if token == "-m":
            if index + 1 >= len(argv):
                raise UserError(f"-m needs a module name: {USAGE}")
            return own, Target(None, argv[index + 1], tuple(argv[index + 2:]))
        if token == "--":
            index += 1
            break
        if not token.startswith("-"):
            break
        own.append(token)
        if token in takes_value and token not in ("-h", "--help", "--version"):
            if index + 1 >= len(argv):
                raise UserError(f"{token} needs a value (see python -m mpiddp run --help)")
            own.append(argv[index + 1])
            index += 1
        index += 1
    if index >= len(argv):
        if any(flag in own for flag in ("-h", "--help", "--version")):
            return own, Target(None, None, ())
        raise UserError(f"run needs a script to run: {USAGE}")
    return own, Target(argv[index], None, tuple(argv[index + 1:]))


def parse_run_args(own: list[str]) -> RunConfig:
    parser = parser_for(
        RunConfig, prog="mpirun -np N python -m mpiddp run [options] SCRIPT|-m MODULE [args]",
        description="Run your own training script on every rank mpirun started, with torchrun's environment "
        "(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...): init_process_group() with env:// just works. "
        "A failure on any rank ends the whole job with that rank's report.",
    )
    return parse_into(RunConfig, parser, own)


def check_contiguous(topo: Topology) -> None:
    """torchrun numbers the ranks of each host contiguously (RANK = GROUP_RANK * LOCAL_WORLD_SIZE + LOCAL_RANK on
    even hosts), and scripts rely on it (a host's ranks as one block, the node from RANK // LOCAL_WORLD_SIZE):
    refuse another layout (mpirun --map-by node) rather than run a script on an assumption that is false."""
    first = 0
    for host, ranks in topo.hosts:
        expected = tuple(range(first, first + len(ranks)))
        if ranks != expected:
            shown = ", ".join(map(str, ranks[:6])) + (" ..." if len(ranks) > 6 else "")
            raise UserError(
                f"{host} runs ranks {shown}, but torchrun scripts expect the ranks of each host to be contiguous "
                f"({expected[0]}-{expected[-1]}): place ranks by slot (Open MPI: --map-by slot; MPICH: -ppn N or "
                f"-hosts a:N,b:N; srun: --distribution=block)"
            )
        first += len(ranks)


def visible_gpus() -> int:
    """How many CUDA devices this rank sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def virtual_local_rank(gpus_per_rank: list[int]) -> bool:
    """Whether the script sees LOCAL_RANK=0 on every rank: when every rank sees exactly one GPU (srun
    --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES), as with torchrun's --virtual-local-rank, so that the usual
    `torch.cuda.set_device(LOCAL_RANK)` picks the rank's own GPU instead of failing on a device it cannot see."""
    return bool(gpus_per_rank) and all(count == 1 for count in gpus_per_rank)


@contextmanager
def default_start_method(method: str) -> Iterator[str | None]:
    """Make `method` multiprocessing's default while the script runs, without fixing it: a script that calls
    set_start_method itself still can (Python 3.14 makes forkserver the default the same way). Yields what was
    set; None when the start method was already chosen (a sitecustomize, a library at import), which then stays.
    Workers started by forkserver or spawn never inherit this rank's initialised MPI (fork is unsafe with
    InfiniBand's registered memory)."""
    from multiprocessing import context

    default = context._default_context
    if multiprocessing.get_start_method(allow_none=True) is not None or not hasattr(default, "_default_context"):
        yield None
        return
    before = default._default_context
    default._default_context = multiprocessing.get_context(method)  # the concrete context; nothing fixed yet
    try:
        yield method
    finally:
        default._default_context = before


@contextmanager
def stashed_objects_released(deadline_s: float = 10.0) -> Iterator[None]:
    """While the script runs, keep a reference to each Python object torch stashes in its thread-local state (each
    backward's contextvars.Context, torch >= 2.12); once the script has returned, wait until no thread holds a copy.
    A collective issued during a backward (DDP's all-reduce) copies that state, and the gloo worker thread that
    drops the finished work last needs the GIL to let the object go. A worker late to it (a loaded host) does so
    while the interpreter exits, where Python ends the thread inside a noexcept destructor: "terminate called
    without an active exception", SIGABRT, status 134 for a script that succeeded (seen in CI). destroy_process_group
    does not help: DDP keeps the group, and its worker threads, to the end of the process. Not where the script
    failed: its report goes first."""
    import torch
    from torch.torch_version import TorchVersion

    stash = getattr(torch._C, "_stash_obj_in_tls", None)
    # before torch 2.12 a backward stashes nothing for other threads (and its stash holds no reference of its own)
    if stash is None or not hasattr(torch._C, "_is_key_in_tls") or TorchVersion(torch.__version__) < "2.12":
        yield
        return
    kept: list[tuple[str, object]] = []

    def stash_and_keep(key: str, value: object) -> None:
        stash(key, value)
        if value is not None:
            kept[:] = [*held_by_others(kept), (key, value)]  # the released ones let go: a long run keeps few

    torch._C._stash_obj_in_tls = stash_and_keep
    try:
        yield
    finally:
        torch._C._stash_obj_in_tls = stash
    deadline = time.monotonic() + deadline_s
    while held_by_others(kept) and time.monotonic() < deadline:
        time.sleep(0.01)  # polling with a deadline: the GIL goes to the worker threads meanwhile
    if held_by_others(kept):  # a collective of the script's own still in flight, say
        log.debug("objects torch stashed for other threads are still held %.0f s after the script", deadline_s)


def held_by_others(kept: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """Those of `kept` that a C++ copy of torch's thread-local state still holds (this thread's own copy aside: it
    outlives the interpreter, and a copy dropped by a worker thread is then never the last)."""
    import torch

    alone = [object()]
    references = sys.getrefcount(alone[0])  # a list's, and the argument's: an object that nothing else holds
    return [kept[i] for i in range(len(kept)) if sys.getrefcount(kept[i][1]) > references
            and not (torch._C._is_key_in_tls(kept[i][0]) and torch._C._get_obj_in_tls(kept[i][0]) is kept[i][1])]


def _from_the_script(tb: TracebackType | None) -> TracebackType | None:
    """Skip the frames of mpiddp and runpy in front of the script's own, so the report starts in the user's code."""
    package = Path(__file__).resolve().parent
    while (package.parent / "__init__.py").exists():  # all of mpiddp, from whichever folder of it this file is in
        package = package.parent
    here = str(package)
    while tb is not None and tb.tb_next is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (filename.startswith(here) or filename == runpy.__file__ or "<frozen runpy>" in filename):
            break
        tb = tb.tb_next
    return tb


def execute(target: Target, source: Path) -> None:
    """Run the target in this process as `python` would; a non-zero exit becomes ScriptExit."""
    saved_argv, saved_path0 = sys.argv[:], sys.path[0]
    try:
        if target.script is not None:
            sys.argv = [target.script, *target.args]
            sys.path[0] = str(source.resolve().parent)
            runpy.run_path(target.script, run_name="__main__")
        else:
            sys.argv = [str(source), *target.args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target.module or "", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        status = exc.code
        if status is None or status == 0:
            return
        if not isinstance(status, int):  # sys.exit("message"): Python prints it and exits 1
            sys.stderr.write(f"{status}\n")
            status = 1
        raise ScriptExit(target.name, status) from None
    except Exception as exc:
        lines = traceback.format_exception(type(exc), exc, _from_the_script(exc.__traceback__))
        raise ScriptError(target.name, "".join(lines).rstrip(), lines[-1].strip()) from None
    finally:
        sys.argv, sys.path[0] = saved_argv, saved_path0


def script_progress() -> tuple[int | None, bool]:
    """(step, progressed) for a failure record: a script's steps are its own; it has made progress once it set up
    torch.distributed (a script that fails before, on its arguments say, fails alike on every relaunch)."""
    import torch.distributed as tdist

    return None, tdist.is_available() and tdist.is_initialized()


def main(args: list[str]) -> int:
    """`python -m mpiddp run ...`: the user's script on every rank, any failure ending the whole job."""
    with FailFast() as guard:
        return run_script(args, guard)


def run_script(argv: list[str], guard: FailFast) -> int:
    """Collective: bootstrap, run the target on every rank, wait for every rank to finish, tear down."""
    from mpiddp.elastic.api import OwnJob
    from mpiddp.elastic.survivors import end_without_finalize, recovered_in_this_process
    from mpiddp.script import api, recovery
    from mpiddp.job.bootstrap import enable_flight_recorder, teardown

    started = start_or_join(argv, guard)
    if started is None:  # given up before it joined: this process was never part of the job
        return 0
    dist, cfg, target, (rendezvous, store, num_threads), late = started
    os.environ["MPIDDP_LOCAL_RANK"] = str(dist.local_rank)  # the host's local rank, even where LOCAL_RANK is 0
    gpus_per_rank = dist.allgather(visible_gpus()) if late is None else [visible_gpus()]
    if any(gpus_per_rank):  # the script will use NCCL: torch's flight recorder on, unless the user chose
        failure_file = dist.topology.failure_file  # under `launch`, in its run dir: the dumps go beside it
        enable_flight_recorder(Path(failure_file).parent if failure_file else None)
    if virtual_local_rank(gpus_per_rank):
        os.environ["LOCAL_RANK"] = "0"
        if any(len(ranks) > 1 for _, ranks in dist.topology.hosts):  # else LOCAL_RANK is 0 anyway
            log.info("every rank sees one GPU: LOCAL_RANK is 0 on every rank (torchrun's --virtual-local-rank); "
                     "the host's local rank is in MPIDDP_LOCAL_RANK")
    api.attach(api.Session(dist, rendezvous, store, num_threads, joining=late))
    guard.progress = script_progress
    # a rank growing the job back has no store before it joins: its watch starts then (FinishWatch.follow)
    watch = (FinishWatch.for_job(cfg.finish_timeout_s, dist, rendezvous) if late is None else
             FinishWatch(cfg.finish_timeout_s, dist, None)).start()
    offer_in_job_recovery(OwnJob([dist], guard, watch, cfg.dist.collective_timeout_s, cfg.hang_timeout_s,
                                 [sys.executable, "-m", "mpiddp", RUN, *argv], late))
    with default_start_method(cfg.start_method) as start_method, joined_process_group(late is not None), \
            stashed_objects_released():
        # The script's loader helpers die with this rank: a forkserver that outlived a SIGKILLed rank held mpirun's
        # output open and the job never ended (its workers follow their forkserver, torch's own watch ends them).
        mark_helper_parent()
        if start_method == "forkserver":
            prepare_forkserver()
        log.info("running %s %s on %d ranks on %d hosts; torchrun's variables set, rendezvous %s:%d; "
                 "multiprocessing start method: %s", target.name, json.dumps(list(target.args)), dist.world_size,
                 dist.topology.num_hosts, rendezvous.master_addr, rendezvous.master_port,
                 start_method or f"{multiprocessing.get_start_method(allow_none=True)} (chosen before mpiddp)")
        started = time.monotonic()
        with alone_until_joined(late):
            execute(target, target.source())
    watch.finished()
    log.info("the script finished on rank 0 after %.1f s; waiting for every rank", time.monotonic() - started)
    recovery.wait_for_every_rank(dist)
    if dist.is_main and dist.topology.launch_run_dir:  # launch's evidence that the job finished: a local write
        mark_finished(Path(dist.topology.launch_run_dir))
    watch.stop()
    teardown(dist, store)
    api.detach()
    log.info("every rank finished")
    if late is not None:
        late.release()  # before MPI_Finalize, which would wait for the survivors (gone by then)
    if recovered_in_this_process():  # MPI_Finalize can wait for the failed ranks: every survivor passed the barrier
        end_without_finalize(0)
    return 0


def start_or_join(argv: list[str], guard: FailFast) -> tuple[Dist, RunConfig, Target, tuple, LateJoin | None] | None:
    """Collective: start_job, after the arrival of a rank that joins a grown job (spawned by it, or a hot spare;
    again for a hot spare whose grow was given up). None when this process was given up before it joined."""
    from mpiddp.elastic import grow

    while True:
        try:
            arrival = grow.arrive() if grow.joining() else None
            return start_job(argv, guard, arrival)
        except grow.Abandoned as exc:
            if grow.wait_again(exc):  # a hot spare whose grow was given up: the next grow may take it in
                continue
            grow.say_abandoned(exc)
            return None
        except Exception:  # a hot spare that cannot start the script's job: the survivors see it end and go on
            grow.end_if_taken_in(1, "this hot spare could not start the script's job")
            raise


def start_job(argv: list[str], guard: FailFast, arrival: Arrival | None,
              ) -> tuple[Dist, RunConfig, Target, tuple, LateJoin | None]:
    """Collective: the job's Dist, `run`'s options, the target, (rendezvous, store, thread share), and how this
    rank joins a grown job. A rank spawned by a grow (`arrival`: mpiddp.elastic.grow) runs the command line the
    survivors checked at start-up: it checks nothing with them, and runs the script while they train on stand-ins
    at its place in the grown job, joining them at its first step (grow.LateJoin), their rendezvous with it."""
    from mpiddp.elastic import grow
    from mpiddp.job.bootstrap import _Store, connect, open_rendezvous, set_threads
    from mpiddp.job.log import setup_logging

    if arrival is None:
        dist = connect(guard)
        own, target = dist.agree(lambda: split_argv(argv))
        cfg = dist.agree(lambda: parse_run_args(own))
        setup_logging(dist.topology, cfg.log_level)
        digest = dist.agree(target.digest)
        settings = {**flat_values(cfg), "target": target.name, "args": list(target.args)}
        log.info("every rank runs %s", preflight.check(settings, dist, {"script": digest}))
        dist.agree(lambda: check_contiguous(dist.topology))
    else:
        own, target = split_argv(argv)
        cfg = parse_run_args(own)
        setup_logging(arrival.topology, cfg.log_level)
    num_threads = set_threads(cfg.dist, dist.topology if arrival is None else arrival.topology)
    if cfg.dist.num_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(num_threads)
    else:
        os.environ.setdefault("OMP_NUM_THREADS", str(num_threads))  # the user's own value wins
    if arrival is not None:
        late = grow.LateJoin(arrival)
        dist = guard.dist = late.stand_in(num_threads)
        assert dist.rendezvous is not None
        return dist, cfg, target, (dist.rendezvous, _Store(), num_threads), late
    rendezvous, store = open_rendezvous(cfg.dist, dist, guard)
    # the store on the Dist, as on init()'s: a recovery hands the survivors' to every watch (survivors.bind_topology)
    dist.rebind(dist.topology, dist.transport, rendezvous)
    return dist, cfg, target, (rendezvous, store, num_threads), None


def offer_in_job_recovery(job: OwnJob) -> None:
    """A script that uses mpiddp's wrappers (or run_recoverable) recovers in the job: the runner's guard and
    finish watch follow the survivors (its `command` starts a rank that grows the job back; `joining`: this rank
    is one). Rank 0 says in one line whether that is on here, and if not, why."""
    from mpiddp.elastic.membership import check_ulfm
    from mpiddp.script import recovery

    recovery.adopt(job)
    if job.dists[0].is_main:  # a local log line, no collective
        log.info("%s", in_job_recovery_line(check_ulfm()))


@contextmanager
def alone_until_joined(late: LateJoin | None) -> Iterator[None]:
    """A rank growing the job back whose script raises or ends before its first step (it never joined) ends alone:
    rank 0 hears why and the job goes on without it (grow.LateJoin.end)."""
    try:
        yield
    except BaseException as exc:
        if late is not None and not late.joined:
            late.end(exc)
        raise
    if late is not None and not late.joined:
        late.end(None)


@contextmanager
def joined_process_group(joined: bool) -> Iterator[None]:
    """A rank that joined a grown job has its process group already (the survivors' backend, on their store): the
    script's own `init_process_group()` finds it there instead of failing on a second default group."""
    if not joined:
        yield
        return
    import torch.distributed as tdist

    original = tdist.init_process_group

    def init_process_group(*args: object, **kwargs: object) -> None:
        if not tdist.is_initialized():
            original(*args, **kwargs)  # type: ignore[arg-type]

    tdist.init_process_group = init_process_group
    try:
        yield
    finally:
        tdist.init_process_group = original


def in_job_recovery_line(ulfm: str | None) -> str:
    """What a failed rank does to this script's job, in one line (rank 0's start-up)."""
    if ulfm is not None:
        return f"in-job recovery: off ({ulfm}); a failed rank ends the job (`mpiddp launch` relaunches it)"
    return ("in-job recovery: on for a script that uses mpiddp.DistributedDataParallel with mpiddp.Optimizer (or "
            "mpiddp.run_recoverable): the survivors of a failed rank go on; a script without them keeps the restart "
            "path (the job ends, `mpiddp launch` relaunches it)")
