"""From mpirun to a torch process group: agreement on errors, rendezvous, device, set-up/teardown, abort on failure."""

from __future__ import annotations

import logging
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

from mpiddp.config import Config, HelpRequested
from mpiddp.errors import AgreedError, UserError
from mpiddp.netif import choose_network, local_interfaces
from mpiddp.stopping import Stopped
from mpiddp.topology import LauncherMismatch, Topology

log = logging.getLogger(__name__)
T = TypeVar("T")

EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_STOPPED = 3  # a stop signal: every rank saved a snapshot at the same step; --resume continues
EXIT_INTERRUPTED = 130


def agree(comm: Any, attempt: Callable[[], T]) -> T:
    """Collective: run `attempt` on every rank; if a user error hits any rank, every rank raises AgreedError.

    Only errors the user can fix are agreed on; anything else propagates and aborts the job.
    """
    problem: tuple[str, str] | None = None
    try:
        result = attempt()
    except AgreedError:
        raise  # already raised on every rank
    except HelpRequested as exc:
        result, problem = None, ("help", exc.text)  # type: ignore[assignment]
    except UserError as exc:
        result, problem = None, ("error", str(exc))  # type: ignore[assignment]
    problems = comm.allgather(problem)
    failed = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not failed:
        return result
    if all(kind == "help" for _, (kind, _) in failed):
        raise AgreedError(failed[0][1][1], 0, to_stdout=True)
    errors = [(rank, text) for rank, (kind, text) in failed if kind == "error"]
    texts = {text for _, text in errors}
    if len(texts) == 1 and len(errors) == comm.Get_size():
        raise AgreedError(f"error: {errors[0][1]}", EXIT_USER_ERROR)
    lines = [f"error on rank {rank}: {text}" for rank, text in errors]
    raise AgreedError("\n".join(lines), EXIT_USER_ERROR)


class FailFast:
    """Turns any failure on any rank into the end of the whole job, with one report from the failing rank.

    A rank that raises (or calls sys.exit, even with 0) while its peers may sit in a collective would leave
    them blocked forever; MPI_Abort is the only way out that works whatever the peers are doing.
    """

    def __init__(self) -> None:
        self.comm: Any = None
        self.topology: Topology | None = None
        # Once the rendezvous store exists: True for the first failing rank only, so one full report is printed.
        self.claim_report: Callable[[], bool] | None = None

    def __enter__(self) -> FailFast:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            return False
        if isinstance(exc, AgreedError):
            self._exit_agreed(exc)
        self._abort(exc)
        return False  # not reached: both paths end the process

    def _world_size(self) -> int:
        return 1 if self.comm is None else self.comm.Get_size()

    def _rank(self) -> int:
        return 0 if self.comm is None else self.comm.Get_rank()

    def _first_to_report(self) -> bool:
        if self.claim_report is None:
            return True
        try:
            return self.claim_report()
        except Exception:
            # The store died with rank 0: that failure is the root cause (mpirun names it); this one follows.
            return False

    def _exit_agreed(self, exc: AgreedError) -> None:
        if self._rank() == 0 and exc.message:
            stream = sys.stdout if exc.to_stdout else sys.stderr
            prefix = "" if exc.to_stdout else "mpiddp: "
            stream.write(f"{prefix}{exc.message.rstrip()}\n")
            stream.flush()
        _flush_logs()
        raise SystemExit(exc.exit_code)

    def _abort(self, exc: BaseException) -> None:
        if isinstance(exc, LauncherMismatch):
            # Each process is alone in its world: let the launcher's rank 0 alone explain.
            if exc.launcher_rank == 0:
                _report(f"mpiddp: error: {exc}")
            raise SystemExit(EXIT_USER_ERROR)
        where = self.topology.label if self.topology is not None else f"rank {self._rank()} on {_hostname()}"
        if isinstance(exc, UserError):
            code, text = EXIT_USER_ERROR, f"mpiddp: error on {where}: {exc}"
        elif isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) and exc.code != 0 else EXIT_CRASH
            text = (
                f"mpiddp: {where} exited early (status {exc.code}) while the other ranks may be waiting "
                f"for it; ending the job"
            )
        elif isinstance(exc, KeyboardInterrupt):
            code, text = EXIT_INTERRUPTED, f"mpiddp: {where} interrupted; ending the job"
        elif self._first_to_report():
            formatted = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()
            code, text = EXIT_CRASH, f"mpiddp: {where} failed; ending the job.\n{formatted}"
        else:
            code, text = EXIT_CRASH, f"mpiddp: {where} also failed: {type(exc).__name__}: {exc}"
        _report(text)
        if self._world_size() > 1:
            self.comm.Abort(code)
        raise SystemExit(code)


def _hostname() -> str:
    return socket.gethostname()


def _flush_logs() -> None:
    for handler in logging.getLogger().handlers:
        handler.flush()


def _report(text: str) -> None:
    _flush_logs()
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


@dataclass(frozen=True)
class DistContext:
    """What the rest of the job needs from the distributed set-up."""

    topology: Topology
    comm: Any  # the MPI communicator of the job, for barriers and metric reductions
    device: Any  # torch.device
    backend: str
    master_addr: str
    master_port: int
    num_threads: int
    interface_per_host: dict[str, str]  # the network interface gloo/NCCL use on each host (empty: left to them)


def choose_device(cfg: Config, topo: Topology) -> tuple[str, str]:
    """(device type, backend) for this rank; raises UserError when the flags cannot work on this host."""
    import torch

    has_cuda = torch.cuda.is_available()
    device = cfg.device if cfg.device != "auto" else ("cuda" if has_cuda else "cpu")
    if device == "cuda":
        if not has_cuda:
            raise UserError(f"--device cuda, but {topo.hostname} has no usable CUDA GPU: use --device cpu")
        num_gpus = torch.cuda.device_count()
        if topo.local_world_size > num_gpus:
            raise UserError(
                f"{topo.hostname} runs {topo.local_world_size} ranks but has {num_gpus} GPUs: start at most "
                f"{num_gpus} ranks on it (e.g. -H {topo.hostname}:{num_gpus}) or use --device cpu"
            )
    if cfg.sync_bn and device != "cuda":
        raise UserError("--sync-bn needs CUDA devices (torch's SyncBatchNorm is GPU-only): drop it on CPU")
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise UserError("--backend nccl needs CUDA devices: use --backend gloo on CPU")
    if backend == "mpi" and not torch.distributed.is_mpi_available():
        raise UserError(
            "--backend mpi needs a torch built with MPI support, and this one was not: use --backend gloo "
            "(CPU) or nccl (GPU); mpiddp uses MPI for start-up and metrics either way"
        )
    return device, backend


def fair_thread_count(cfg: Config, topo: Topology) -> int:
    """Each rank's share of the host's cores, so co-located ranks do not oversubscribe the CPU."""
    if cfg.num_threads is not None:
        return cfg.num_threads
    cores = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(1, min(allowed, cores // topo.local_world_size))


def _choose_address(cfg: Config, topo: Topology, comm: Any) -> tuple[str, dict[str, str]]:
    """Collective: the address rank 0 advertises, and the interface gloo/NCCL should use on each host.

    Unless the user set them, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are pointed at that interface on every
    host, so the collectives use the same network as the rendezvous.
    """
    interfaces = local_interfaces() if topo.local_rank == 0 else None
    gathered = comm.allgather(interfaces)
    host_names = [name for name, _ in topo.hosts]
    per_host = [gathered[ranks[0]] for _, ranks in topo.hosts]
    if cfg.iface:
        missing = [host for host, found in zip(host_names, per_host) if cfg.iface not in {i.name for i in found}]
        if missing:
            raise UserError(f"--iface {cfg.iface} has no IPv4 address on {', '.join(missing)}")
        address = next(i.address for i in per_host[0] if i.name == cfg.iface)
        chosen = {host: cfg.iface for host in host_names}
    elif cfg.master_addr:
        return cfg.master_addr, {}
    else:
        choice = choose_network(per_host, host_names)
        address, chosen = choice.master_addr, dict(zip(host_names, choice.interface_per_host))
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        os.environ.setdefault(variable, chosen[topo.hostname])
    log.info("rendezvous on %s; gloo/NCCL interface per host: %s", cfg.master_addr or address, chosen)
    return cfg.master_addr or address, chosen


def _rendezvous(cfg: Config, topo: Topology, comm: Any, address: str) -> tuple[tuple[Any, Any], str, int]:
    """Rank 0 opens a TCPStore on a kernel-chosen port and broadcasts (address, port); the others connect."""
    import torch.distributed as dist

    timeout = timedelta(seconds=cfg.rendezvous_timeout_s)
    store = listener = None
    opened: tuple[str, int] | str
    if topo.is_main:
        try:
            # Our own socket, bound to the chosen address only (not every interface), port picked by the kernel.
            listener = socket.create_server((address, 0), backlog=max(128, topo.world_size))
            store = dist.TCPStore(
                address, listener.getsockname()[1], topo.world_size, True, timeout=timeout,
                wait_for_workers=False, master_listen_fd=listener.fileno(),
            )
            opened = (address, store.port)
        except Exception as exc:  # reported on every rank below, so nobody waits for a store that never opened
            opened = f"rank 0 on {topo.hostname} could not open the rendezvous store on {address}: {exc}"
    else:
        opened = ""
    opened = comm.bcast(opened, root=0)
    if isinstance(opened, str):
        raise UserError(opened + " (use --master-addr with an address of this host)")
    address, port = opened
    if store is None:
        try:
            store = dist.TCPStore(address, port, topo.world_size, False, timeout=timeout)
        except Exception as exc:
            raise UserError(
                f"{topo.label} could not reach rank 0's rendezvous store at {address}:{port} within "
                f"{cfg.rendezvous_timeout_s:g} s ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). "
                f"Check that {topo.hostname} can reach {address} (firewall, wrong interface) or set --master-addr"
            ) from None
    return (store, listener), address, port


def export_environment(topo: Topology, address: str, port: int) -> None:
    """The variables torchrun would set, for libraries that read them."""
    os.environ.update(
        RANK=str(topo.rank),
        WORLD_SIZE=str(topo.world_size),
        LOCAL_RANK=str(topo.local_rank),
        LOCAL_WORLD_SIZE=str(topo.local_world_size),
        GROUP_RANK=str(topo.host_index),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
    )


@contextmanager
def distributed(cfg: Config, topo: Topology, comm: Any, guard: FailFast | None = None) -> Iterator[DistContext]:
    """Set up the torch process group for this job; tear it down on a clean exit, or when every rank raised
    together (AgreedError, Stopped). After any other exception there is no teardown: FailFast aborts the whole
    job, the only safe end when peers may be blocked in a collective.
    """
    import torch
    import torch.distributed as dist

    device_type, backend = agree(comm, lambda: choose_device(cfg, topo))
    if device_type == "cuda":
        device = torch.device("cuda", topo.local_rank)
        torch.cuda.set_device(device)  # before the process group, so nothing lands on GPU 0 by accident
    else:
        device = torch.device("cpu")
    num_threads = fair_thread_count(cfg, topo)
    torch.set_num_threads(num_threads)

    address, interface_per_host = agree(comm, lambda: _choose_address(cfg, topo, comm))
    (store, listener), address, port = _rendezvous(cfg, topo, comm, address)
    export_environment(topo, address, port)
    if guard is not None:
        # A separate client with a short timeout, so reporting a failure can never hang on the store.
        reporter = dist.TCPStore(address, port, topo.world_size, False, timeout=timedelta(seconds=2))
        guard.claim_report = lambda: reporter.add("mpiddp/failures", 1) == 1
    dist.init_process_group(
        backend=backend,
        store=store,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timedelta(seconds=cfg.collective_timeout_s),
        device_id=device if device_type == "cuda" else None,
    )
    log.info(
        "process group ready: %s on %s, %d ranks on %d hosts, rendezvous %s:%d, %d CPU threads per rank",
        backend, device_type, topo.world_size, topo.num_hosts, address, port, num_threads,
    )
    try:
        yield DistContext(topo, comm, device, backend, address, port, num_threads, interface_per_host)
    except (AgreedError, Stopped):
        _teardown(comm, listener)  # raised on every rank at the same point: a clean teardown is safe
        raise
    _teardown(comm, listener)


def _teardown(comm: Any, listener: socket.socket | None) -> None:
    import torch.distributed as dist

    # Wait for every rank before tearing down, so a fast rank never destroys the group (or finalises MPI)
    # while a slow one still talks to it.
    comm.Barrier()
    dist.destroy_process_group()
    if listener is not None:
        listener.close()
