"""Dist: the one typed object every module uses to talk across ranks, and its single-process twin.

Only this module, mpistart and topology import mpi4py in the job layer (mpistart hands MPI to the modules that call
it without importing it: spares, and the elastic layer's spawning), and mpiddp.elastic.membership above it: four in
the package (tests/common/test_package.py). Everything else calls `Dist` methods: reduce numbers, gather values,
barrier, agree on user errors, let global rank 0 do file work, agree on a stop signal. MPI's fault tolerance (ULFM) is
the elastic layer's alone: this module learns which peers failed only through the query it installs
(set_failed_ranks_query).

The rule that keeps `agree` and `from_main` deadlock-free: the attempt they run must not communicate. If one
rank raised a user error before a collective inside the attempt while another entered it, the job would hang.
So collectives are refused (an AssertionError, which aborts the job with a traceback) while an attempt runs:
do the communication first, then agree on a purely local computation.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, NoReturn, Protocol, TypeVar

import numpy as np

from mpiddp.errors import EXIT_CRASH, EXIT_USER_ERROR, AgreedError, HelpRequested, HostFault, UserError
from mpiddp.job.abort import abort_within
from mpiddp.job.log import flush_logs
from mpiddp.job.spares import abort_with_spares
from mpiddp.job.topology import RankRecord, Topology, build_topology

if TYPE_CHECKING:
    import torch

T = TypeVar("T")
ReduceOp = Literal["sum", "min", "max", "mean"]


class Transport(Protocol):
    """The few MPI operations mpiddp needs; `MpiTransport` and `SoloTransport` implement them."""

    rank: int
    size: int

    def allgather(self, value: T) -> list[T]: ...
    def gather(self, value: T) -> list[T] | None: ...
    def bcast(self, value: T) -> T: ...
    def scatter(self, values: list[T] | None) -> T: ...
    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray: ...
    def barrier(self) -> None: ...
    def idle_barrier(self, poll_s: float) -> None: ...
    def abort(self, code: int) -> NoReturn: ...
    def failed_ranks(self) -> tuple[int, ...]: ...
    def pingpong(self, peer: int, nbytes: int, repeats: int) -> float: ...
    def allreduce_inplace(self, values: object, sum_as: HalfFloat | None = None) -> None: ...
    def gradient_support(self) -> GradientSupport: ...


# Every rank's third number in the per-step stop agreement. Under MPI fault tolerance (ULFM) a reduction cut short by
# a peer's failure was seen to return on a survivor, without an error, numbers that were not the agreement's (they
# asked for a save, which in-job recovery then refused as "a failure during a save"): a result without the mark is
# not trusted.
AGREEMENT_MARK = 0.5
HalfFloat = Literal["float16", "bfloat16"]
THREAD_LEVELS = ("single", "funneled", "serialized", "multiple")  # MPI_THREAD_*, in increasing order


@dataclass(frozen=True)
class GradientSupport:
    """What this rank's MPI allows for carrying gradients: the thread level MPI was started with, whether the
    calling thread is MPI's main thread, and whether the library says it is CUDA-aware."""

    thread_level: str
    on_main_thread: bool
    cuda_aware: bool

    def refusal(self, device_type: str) -> str | None:
        """Why MPI cannot carry this job's gradients from the calling thread (None: it can)."""
        if device_type == "cuda" and not self.cuda_aware:
            return ("--grad-transport mpi on GPUs needs a CUDA-aware MPI, and this MPI library does not say it is "
                    "one (MPIX_Query_cuda_support): use --grad-transport nccl (or auto)")
        level = THREAD_LEVELS.index(self.thread_level)
        if level < THREAD_LEVELS.index("serialized") and not self.on_main_thread:
            # DDP runs the hook on autograd's thread: the caller's thread on CPU, a device thread on GPUs
            return (f"--grad-transport mpi: DDP runs its hook outside MPI's main thread here, and MPI was started "
                    f"with thread level {self.thread_level} (only the main thread may call MPI): use --grad-transport "
                    f"{'nccl' if device_type == 'cuda' else 'gloo'} (or auto)")
        return None


def _cuda_aware_mpi() -> bool:
    """Open MPI (and MVAPICH) say whether they were built and run CUDA-aware; other libraries do not say."""
    import ctypes

    from mpiddp.job.mpistart import _loaded_library_dir

    library_dir = _loaded_library_dir("libmpi.so")
    # The process's global symbols, then the libmpi mpi4py loaded (it may be loaded without RTLD_GLOBAL).
    for name in [None] + ([str(path) for path in sorted(library_dir.glob("libmpi.so*"))] if library_dir else []):
        try:
            return bool(ctypes.CDLL(name).MPIX_Query_cuda_support())
        except (AttributeError, OSError):
            continue
    return False


FailedRanksQuery = Callable[[object], tuple[int, ...]]  # a communicator -> its ranks MPI reports failed (local)

# How the job layer learns which peers failed (a failing rank's record blames them: FailFast): MPI's fault tolerance
# is the elastic layer's, which installs its query when loaded (mpiddp.elastic.membership); none, nothing is known.
_failed_ranks_query: FailedRanksQuery | None = None


def set_failed_ranks_query(query: FailedRanksQuery | None) -> None:
    """Install how MpiTransport.failed_ranks asks MPI which ranks of its communicator failed (None: it knows none)."""
    global _failed_ranks_query
    _failed_ranks_query = query


# How a helper thread ends the whole job where this rank's own exit would not: under in-job recovery MPI's fault
# tolerance takes one rank's exit for a failure the others recover from (the elastic engine installs an MPI_Abort
# over the job's communicator); None: the exit ends the job (the launcher ends every other rank).
_end_everyone: Callable[[int], None] | None = None


def set_end_everyone(end: Callable[[int], None] | None) -> None:
    """Install how Dist.abort_from_thread ends every rank of the job before this process exits (see above)."""
    global _end_everyone
    _end_everyone = end


class MpiTransport:
    """An MPI communicator (COMM_WORLD): pickled objects for values, buffers for numbers."""

    def __init__(self, comm: object) -> None:
        from mpi4py import MPI
        from mpi4py.util import pkl5

        self.comm = comm
        self.large = pkl5.Intracomm(comm)  # pickles over 2 GiB (snapshots of big models) need pkl5
        self.ops = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self.rank, self.size = comm.Get_rank(), comm.Get_size()  # type: ignore[attr-defined]

    def allgather(self, value: T) -> list[T]:
        return self.comm.allgather(value)  # type: ignore[attr-defined]

    def gather(self, value: T) -> list[T] | None:
        return self.large.gather(value, root=0)  # PowerSGD's per-rank state in snapshots can be large

    def bcast(self, value: T) -> T:
        return self.large.bcast(value, root=0)

    def scatter(self, values: list[T] | None) -> T:
        return self.large.scatter(values, root=0)

    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        out = np.empty_like(values)
        self.comm.Allreduce(values, out, op=self.ops[op])  # type: ignore[attr-defined]
        return out

    def barrier(self) -> None:
        self.comm.Barrier()  # type: ignore[attr-defined]

    def idle_barrier(self, poll_s: float) -> None:
        # MPI_Barrier spins a core per waiting rank; a rank that may wait minutes for the others sleeps instead.
        request = self.comm.Ibarrier()  # type: ignore[attr-defined]
        while not request.Test():
            time.sleep(poll_s)

    def abort(self, code: int) -> NoReturn:
        abort_within(self.comm, code)

    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks of this communicator MPI knows have failed; local, never a message. Empty unless the elastic layer
        installed its query (MPI's fault tolerance: set_failed_ranks_query), or when MPI knows of none."""
        query = _failed_ranks_query
        return () if query is None else query(self.comm)

    def pingpong(self, peer: int, nbytes: int, repeats: int) -> float:
        """Median one-way time (s) of `nbytes` between rank 0 and `peer`; every rank returns rank 0's value."""
        buffer = np.zeros(max(1, nbytes), dtype=np.uint8)
        times = []
        self.barrier()
        for _ in range(repeats):
            started = time.perf_counter()
            if self.rank == 0:
                self.comm.Send(buffer, dest=peer)  # type: ignore[attr-defined]
                self.comm.Recv(buffer, source=peer)  # type: ignore[attr-defined]
            elif self.rank == peer:
                self.comm.Recv(buffer, source=0)  # type: ignore[attr-defined]
                self.comm.Send(buffer, dest=0)  # type: ignore[attr-defined]
            times.append((time.perf_counter() - started) / 2)
        return float(self.comm.bcast(np.median(times), root=0))  # type: ignore[attr-defined]

    def allreduce_inplace(self, values: object, sum_as: HalfFloat | None = None) -> None:
        """Sum `values` (a contiguous numpy array, or a CUDA tensor where MPI is CUDA-aware) over every rank, in
        place. 16-bit floats travel as int16 words (MPI has no half-precision sum) and `sum_as` names how a
        user-defined MPI operation adds them: as torch adds them (in fp32, rounded once), half the bytes of fp32."""
        from mpi4py import MPI

        op = self.ops["sum"] if sum_as is None else self._half_sum(sum_as)
        self.comm.Allreduce(MPI.IN_PLACE, values, op=op)  # type: ignore[attr-defined]

    def _half_sum(self, dtype_name: HalfFloat) -> object:
        if dtype_name not in self.ops:
            from mpi4py import MPI

            import torch

            dtype = getattr(torch, dtype_name)

            def add(inbuf: object, inoutbuf: object, datatype: object) -> None:
                incoming = np.frombuffer(inbuf, dtype=np.int16)  # type: ignore[call-overload]
                if incoming.size:
                    accumulated = torch.from_numpy(np.frombuffer(inoutbuf, dtype=np.int16))  # type: ignore[call-overload]
                    accumulated.view(dtype).add_(torch.from_numpy(incoming).view(dtype))

            self.ops[dtype_name] = MPI.Op.Create(add, commute=True)
        return self.ops[dtype_name]

    def gradient_support(self) -> GradientSupport:
        from mpi4py import MPI

        levels = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled", MPI.THREAD_SERIALIZED: "serialized",
                  MPI.THREAD_MULTIPLE: "multiple"}
        return GradientSupport(levels[MPI.Query_thread()], bool(MPI.Is_thread_main()), _cuda_aware_mpi())


class SoloTransport:
    """A world of one, with no MPI initialised: for `python -m mpiddp` tests and in-process unit tests."""

    rank, size = 0, 1

    def allgather(self, value: T) -> list[T]:
        return [value]

    def gather(self, value: T) -> list[T] | None:
        return [value]

    def bcast(self, value: T) -> T:
        return value

    def scatter(self, values: list[T] | None) -> T:
        assert values is not None and len(values) == 1
        return values[0]

    def allreduce(self, values: np.ndarray, op: str) -> np.ndarray:
        return values.copy()

    def barrier(self) -> None:
        pass

    def idle_barrier(self, poll_s: float) -> None:
        pass

    def abort(self, code: int) -> NoReturn:
        raise SystemExit(code)

    def failed_ranks(self) -> tuple[int, ...]:
        return ()

    def pingpong(self, peer: int, nbytes: int, repeats: int) -> float:
        return 0.0

    def allreduce_inplace(self, values: object, sum_as: HalfFloat | None = None) -> None:
        pass  # the sum over one rank is the values themselves

    def gradient_support(self) -> GradientSupport:
        return GradientSupport("multiple", True, True)  # no MPI: nothing to refuse


class _AttemptScope:
    """Shared by a Dist and its copies: whether an agree/from_main attempt is running on this rank."""

    def __init__(self) -> None:
        self.running: str | None = None

    @contextmanager
    def attempt(self, kind: str) -> Iterator[None]:
        assert self.running is None, f"{kind} inside a {self.running} attempt: attempts must not communicate"
        self.running = kind
        try:
            yield
        finally:
            self.running = None

    def refuse_inside(self, operation: str) -> None:
        assert self.running is None, (
            f"{operation} called inside a {self.running} attempt: attempts must not communicate, or a rank "
            f"that fails before the collective deadlocks the others (see mpiddp/job/collective.py)"
        )


def agree_on(transport: Transport, attempt: Callable[[], T], scope: _AttemptScope | None = None) -> T:
    """Collective: every rank runs `attempt`; if a user error hits any rank, every rank raises AgreedError.

    Only errors the user can fix are agreed on; anything else propagates and aborts the job.
    """
    scope = scope or _AttemptScope()
    problem: tuple[str, str] | None = None
    result: T | None = None
    try:
        with scope.attempt("agree"):
            result = attempt()
    except HelpRequested as exc:
        problem = ("help", exc.text)
    except HostFault as exc:
        problem = ("host", str(exc))
    except UserError as exc:
        problem = ("error", str(exc))
    problems = transport.allgather(problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return result  # type: ignore[return-value]
    if all(kind == "help" for _, (kind, _) in failed):
        raise AgreedError(failed[0][1][1], 0, to_stdout=True)
    errors = [(rank, text) for rank, (kind, text) in failed if kind in ("error", "host")]
    if all(kind == "host" for _, (kind, _) in failed) and len(failed) < transport.size:
        # Some hosts are broken and the others are fine: not the flags. Exit 1, and the failure record blames
        # those ranks' hosts, so `mpiddp launch` relaunches without them.
        lines = dict.fromkeys(text for _, text in errors)
        raise AgreedError("\n".join(f"error: {text}" for text in lines) + "\nthe other hosts are fine: leave this "
                          "host out (mpiddp launch does so itself)", EXIT_CRASH,
                          faulty_ranks=tuple(rank for rank, _ in errors))
    if len({text for _, text in errors}) == 1 and len(errors) == transport.size:
        raise AgreedError(f"error: {errors[0][1]}", EXIT_USER_ERROR)
    raise AgreedError("\n".join(f"error on rank {rank}: {text}" for rank, text in errors), EXIT_USER_ERROR)


@dataclass(frozen=True)
class Rendezvous:
    """Where rank 0's store listens, and the network interface gloo/NCCL use on each host (empty: their choice)."""

    master_addr: str
    master_port: int
    interface_per_host: dict[str, str] = field(default_factory=dict)
    opened: Any = field(default=None, repr=False, compare=False)  # the bootstrap's holder of this rank's store

    def client(self) -> Any:
        """This rank's one connection to rank 0's store (on rank 0, the store itself), shared by the process group
        and mpiddp's watcher threads: another connection would cost rank 0 one more socket for every rank."""
        store = getattr(self.opened, "store", None)
        assert store is not None, "the rendezvous store is not open"
        return store


@dataclass(frozen=True)
class Dist:
    """This rank's place in the job, its device once the process group is up, and every cross-rank operation."""

    topology: Topology
    transport: Transport = field(repr=False)
    device_type: str = "cpu"
    device_index: int | None = None
    backend: str = "none"  # set when the torch process group is up: gloo, nccl or mpi
    rendezvous: Rendezvous | None = None
    num_threads: int = 1
    _scope: _AttemptScope = field(default_factory=_AttemptScope, repr=False, compare=False)

    # --- who and where -------------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @property
    def label(self) -> str:
        return self.topology.label

    @property
    def device(self) -> torch.device:
        import torch

        return torch.device(self.device_type, self.device_index)

    def placed(self, device_type: str, device_index: int | None, backend: str, rendezvous: Rendezvous,
               num_threads: int) -> Dist:
        """The same job, with the device and process group the bootstrap set up."""
        return replace(self, device_type=device_type, device_index=device_index, backend=backend,
                       rendezvous=rendezvous, num_threads=num_threads)

    def rebind(self, topology: Topology, transport: Transport, rendezvous: Rendezvous | None) -> None:
        """In-job recovery (and `mpiddp run` handing its Dist the store it opened): this Dist now means the
        survivors' job, its new rank, communicator and store. The one mutation of a Dist: everything that holds it
        (the loop, the save hook, the failure guard) follows the new world without being handed a new object."""
        object.__setattr__(self, "topology", topology)
        object.__setattr__(self, "transport", transport)
        if rendezvous is not None:
            object.__setattr__(self, "rendezvous", rendezvous)

    # --- collectives: every rank calls them, in the same order ---------------------------------------------
    def reduce(self, values: Sequence[float], op: ReduceOp) -> list[float]:
        """Element-wise sum, min, max or mean of a short vector of numbers, in one call."""
        self._scope.refuse_inside("reduce")
        array = np.asarray(values, dtype=np.float64)
        out = self.transport.allreduce(array, "sum" if op == "mean" else op)
        return (out / self.world_size if op == "mean" else out).tolist()

    def allgather(self, value: T) -> list[T]:
        """Every rank's `value`, in rank order, on every rank (pickled: keep it small)."""
        self._scope.refuse_inside("allgather")
        return self.transport.allgather(value)

    def gather(self, value: T) -> list[T] | None:
        """Every rank's `value` in rank order on global rank 0; None elsewhere."""
        self._scope.refuse_inside("gather")
        gathered = self.transport.gather(value)
        return gathered if self.is_main else None

    def scatter(self, values: list[T] | None) -> T:
        """Collective: global rank 0 passes one value per rank (the others pass None); each rank gets its own."""
        self._scope.refuse_inside("scatter")
        assert not self.is_main or (values is not None and len(values) == self.world_size)
        return self.transport.scatter(values if self.is_main else None)

    def barrier(self) -> None:
        self._scope.refuse_inside("barrier")
        self.transport.barrier()

    def wait_for_all(self, poll_s: float = 0.05) -> None:
        """A barrier that sleeps while it waits (for a rank that finished before the others)."""
        self._scope.refuse_inside("wait_for_all")
        self.transport.idle_barrier(poll_s)

    def agree(self, attempt: Callable[[], T]) -> T:
        """Every rank runs `attempt` (which must not communicate); a UserError on any rank raises the same
        AgreedError on every rank, and rank 0 alone reports it. `--help` anywhere ends every rank with status 0."""
        self._scope.refuse_inside("agree")
        return agree_on(self.transport, attempt, self._scope)

    def from_main(self, attempt: Callable[[], T]) -> T:
        """Global rank 0 runs `attempt` (a file write or read; it must not communicate) and every rank returns
        its result, or raises the same AgreedError when it raised a UserError."""
        self._scope.refuse_inside("from_main")
        outcome: tuple[bool, object] | None = None
        if self.is_main:
            try:
                with self._scope.attempt("from_main"):
                    outcome = (True, attempt())
            except UserError as exc:
                outcome = (False, str(exc))
        ok, value = self.transport.bcast(outcome)  # type: ignore[misc]
        if not ok:
            raise AgreedError(f"error: {value}", EXIT_USER_ERROR)
        return value  # type: ignore[return-value]

    def agree_stop(self, signum: int) -> int:
        """Once per step: the stop signal any rank received (0 if none), so every rank stops at the same step."""
        return self.agree_step(signum, False)[0]

    def agree_step(self, signum: int, save_due: bool) -> tuple[int, bool]:
        """Once per step, in the one reduction `agree_stop` makes: (the stop signal any rank received, whether
        any rank asks for a snapshot now), so every rank stops or saves at the same step."""
        agreed, save, mark = self.reduce([signum, float(save_due), AGREEMENT_MARK], "max")
        if mark != AGREEMENT_MARK:  # never on a healthy job; in-job recovery tells a peer's failure from this error
            raise RuntimeError(f"the stop agreement returned numbers that are not its own (mark {mark!r}): a reduction "
                               "cut short by a peer's failure (MPI fault tolerance)")
        return int(agreed), save > 0

    def pingpong(self, peer: int, nbytes: int, repeats: int) -> float:
        """Collective: median one-way MPI time (s) between rank 0 and `peer`."""
        self._scope.refuse_inside("pingpong")
        return self.transport.pingpong(peer, nbytes, repeats)

    def allreduce_inplace(self, values: object, sum_as: HalfFloat | None = None) -> None:
        """Collective: sum a buffer over every rank in place through MPI (gradients: see MpiTransport). The
        caller checks `gradient_support()` first; this runs on whatever thread calls it."""
        self._scope.refuse_inside("allreduce_inplace")
        self.transport.allreduce_inplace(values, sum_as)

    def gradient_support(self) -> GradientSupport:
        """Local: MPI's thread level, whether this is MPI's main thread, whether MPI is CUDA-aware."""
        return self.transport.gradient_support()

    def abort(self, code: int) -> NoReturn:
        """End every rank of the job now (MPI_Abort), whatever the others are doing. Main thread only."""
        self.transport.abort(code)

    def failed_ranks(self) -> tuple[int, ...]:
        """Ranks MPI knows have failed (only an MPI with ULFM fault tolerance knows; local, never a message)."""
        return self.transport.failed_ranks()

    def abort_from_thread(self, code: int) -> NoReturn:
        """The same from a helper thread (watchdogs). MPI was initialised FUNNELED, so only the main thread may
        call MPI: this process exits with `code` instead, and the launcher ends every other rank of the job (where
        hot spares wait, MPI_Abort ends them too: mpiddp.job.spares.abort_with_spares; under in-job recovery, where
        this exit alone would be a failure the others recover from, the MPI_Abort set_end_everyone installed)."""
        flush_logs()
        sys.stderr.flush()
        abort_with_spares(code)
        if _end_everyone is not None:  # MPI_Abort from a helper thread ends every process (measured: spares.py)
            _end_everyone(code)
        os._exit(code)


_current: Dist | None = None  # the job's own Dist while a script runs under `mpiddp run` or after `mpiddp.init()`


def set_current(dist: Dist | None) -> None:
    """Whoever starts the job's Dist names it here (internal): helpers such as `comm_hook()` find it without
    knowing who started the job."""
    global _current
    _current = dist


def current() -> Dist | None:
    """The job's own Dist, or None outside a job."""
    return _current


def solo_topology(hostname: str = "localhost") -> Topology:
    return build_topology(0, [RankRecord(0, hostname, 0, 0, 1)], "none (single process)")


def solo_dist(hostname: str = "localhost") -> Dist:
    """A world of one without MPI: the same code paths as a real job, for in-process tests."""
    return Dist(solo_topology(hostname), SoloTransport())
