"""From mpirun to a torch process group: MPI and topology, device, rendezvous, set-up and teardown.

Together with topology and collective, the only module that touches MPI and launcher variables; it hands
everything else one typed `Dist`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

from mpiddp.errors import AgreedError, HostFault, UserError
from mpiddp.failure import ATTEMPTS_FILE, write_placement
from mpiddp.job import storekeys
from mpiddp.job.collective import Dist, MpiTransport, Rendezvous, agree_on
from mpiddp.job.failfast import FailFast
from mpiddp.job.flags import DistSettings
from mpiddp.job.flightrec import TRACE_PREFIX
from mpiddp.job.netif import (Interface, Reach, choose_network, interfaces_toward, local_interfaces, master_address,
                          reach, resolve_ipv4)
from mpiddp.job.mpistart import init_mpi
from mpiddp.job.stopping import Stopped
from mpiddp.job.storeload import add_within
from mpiddp.job.topology import (Topology, build_topology, check_launcher, gather_records, launcher_restarts,
                             supervisor_settings)

log = logging.getLogger(__name__)

REPORT_CLAIM_S = 2.0  # the most a failing rank waits for the store to say whether its report is the first


def connect(guard: FailFast | None = None) -> Dist:
    """Collective: initialise MPI, check the launcher and learn the job's layout. Every rank raises the same
    AgreedError when the layout cannot work; `guard` learns the Dist so it can abort the whole job."""
    comm, mpi_settings = init_mpi()
    transport = MpiTransport(comm)
    if guard is not None:
        guard.dist = Dist(_provisional_topology(transport), transport)
    check_launcher(comm)
    records, mpi_library = gather_records(comm)
    topology = agree_on(transport, lambda: build_topology(transport.rank, records, mpi_library))
    # Rank 0's view of the launcher's restart count is the job's (every rank must decide alike).
    (restarts, restarted_by), supervised = transport.bcast((launcher_restarts(os.environ),
                                                            supervisor_settings(os.environ)))
    dist = Dist(dataclasses.replace(topology, restarts=restarts, restarted_by=restarted_by, mpi_settings=mpi_settings,
                                    **supervised), transport)
    if guard is not None:
        guard.dist = dist
    if dist.topology.failure_file and dist.is_main:  # a local write, no collective: launch maps ranks to hosts by it
        write_placement(Path(dist.topology.failure_file), [(name, list(ranks)) for name, ranks in topology.hosts])
        blind = launch_blind(dist.topology.launch_run_dir, dist.topology.hostname)
        if blind:
            log.warning("%s", blind)
    return dist


def launch_blind(launch_run_dir: str, host: str) -> str:
    """Rank 0 under `launch`: a warning when launch's run dir (where launch listed this attempt before starting it)
    is not there on this host: launch then reads none of this job's records (its start, its failures, its end)."""
    if not launch_run_dir or (Path(launch_run_dir) / ATTEMPTS_FILE).exists():
        return ""
    return (f"mpiddp: launch's run dir {launch_run_dir} is not on {host}, rank 0's host: launch cannot read this "
            "job's records (its start, its failures, its end), and ends it after its --startup-timeout; give "
            "launch a --run-dir on a filesystem every host shares")


def _provisional_topology(transport: MpiTransport) -> Topology:
    """Enough of a topology to report and abort with before the real one is known."""
    host = socket.gethostname()
    return Topology(transport.rank, transport.size, 0, 1, 0, 1, host, ((host, (transport.rank,)),))


def _any_device(device_type: str) -> None:
    """What start_process_group's caller asks of the device by default: nothing."""


def choose_device(cfg: DistSettings, topo: Topology,
                  fits: Callable[[str], None] = _any_device) -> tuple[str, str, int | None]:
    """(device type, backend, CUDA device index) for this rank; a UserError when the flags cannot work here.
    `fits(device type)`: the caller's own checks of the device (training's --amp, --sync-bn), raising UserError.

    GPU binding: when a rank sees at least as many GPUs as its host runs ranks, it takes cuda:<local rank>;
    when it sees exactly one (Slurm's --gpus-per-task=1, a per-rank CUDA_VISIBLE_DEVICES), it takes cuda:0.
    """
    import torch

    has_cuda = torch.cuda.is_available()
    device = cfg.device if cfg.device != "auto" else ("cuda" if has_cuda else "cpu")
    index = None
    if device == "cuda":
        if not has_cuda:
            raise HostFault(f"--device cuda, but {topo.hostname} has no usable CUDA GPU: use --device cpu")
        num_gpus = torch.cuda.device_count()
        if num_gpus >= topo.local_world_size:
            index = topo.local_rank
        elif num_gpus == 1:
            index = 0
        else:
            raise HostFault(
                f"{topo.hostname} runs {topo.local_world_size} ranks but has {num_gpus} GPUs: start at most "
                f"{num_gpus} ranks on it (e.g. -H {topo.hostname}:{num_gpus}), give each rank one GPU "
                f"(CUDA_VISIBLE_DEVICES), or use --device cpu"
            )
    fits(device)
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        raise UserError("--backend nccl needs CUDA devices: use --backend gloo on CPU")
    if backend == "mpi" and not torch.distributed.is_mpi_available():
        raise UserError(
            "--backend mpi needs a torch built with MPI support, and this one was not: use --backend gloo "
            "(CPU) or nccl (GPU); mpiddp uses MPI for start-up and metrics either way"
        )
    return device, backend, index


def same_device_everywhere(asked: str, devices: list[str], topo: Topology) -> None:
    """With --device auto, a host that lost its GPUs (driver gone, devices fallen off the bus) would pick the CPU
    while the others pick CUDA: refuse it on that host's ranks, so the job ends with the host named."""
    if asked == "auto" and devices[topo.rank] == "cpu" and "cuda" in devices:
        raise HostFault(f"{topo.hostname} has no usable CUDA GPU while other hosts have: fix or leave out "
                        f"{topo.hostname}, or use --device cpu everywhere")


def shared_gpus(placements: list[tuple[str, str | None]]) -> None:
    """Refuse two ranks of one host on one GPU (each rank's host and GPU UUID, in rank order)."""
    owner: dict[tuple[str, str], int] = {}
    for rank, (host, uuid) in enumerate(placements):
        if uuid is None:
            continue
        if (host, uuid) in owner:
            raise UserError(
                f"ranks {owner[(host, uuid)]} and {rank} on {host} both use GPU {uuid}: each rank needs its own "
                f"GPU (start one rank per GPU, or give each rank its own CUDA_VISIBLE_DEVICES)"
            )
        owner[(host, uuid)] = rank


def fair_thread_count(cfg: DistSettings, topo: Topology, env: Mapping[str, str] | None = None) -> int:
    """Threads per rank: --num-threads, else the user's OMP_NUM_THREADS, else the rank's share of the host's
    cores, so co-located ranks do not oversubscribe the CPU."""
    if cfg.num_threads is not None:
        return cfg.num_threads
    users = user_thread_count(os.environ if env is None else env)
    if users is not None:
        return users
    cores = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores
    return max(1, min(allowed, cores // topo.local_world_size))


def user_thread_count(env: Mapping[str, str]) -> int | None:
    """OMP_NUM_THREADS as the user set it (OpenMP's nested form `4,2`: the outer level); None when unset or
    not a positive number."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def choose_address(cfg: DistSettings, topo: Topology, per_host: list[list[Interface]],
                   toward_master: tuple[str, list[Reach]] | None = None) -> tuple[str, dict[str, str]]:
    """The address rank 0 advertises, and the interface gloo/NCCL should use on each host.

    `per_host` holds every host's interfaces, in host order; with --master-addr, `toward_master` holds the
    address it stands for and how each host reaches it. Pure: every rank computes the same answer.
    """
    host_names = [name for name, _ in topo.hosts]
    if cfg.iface:
        missing = [host for host, found in zip(host_names, per_host) if cfg.iface not in {i.name for i in found}]
        if missing:
            raise UserError(f"--iface {cfg.iface} has no IPv4 address on {', '.join(missing)}")
    if cfg.master_addr:
        assert toward_master is not None
        address, reach_per_host = toward_master
        # gloo left to itself uses the address its host's name resolves to: 127.0.1.1 on Debian and Ubuntu.
        toward = interfaces_toward(address, cfg.master_addr, reach_per_host, per_host, host_names)
        return address, {host: cfg.iface or name for host, name in zip(host_names, toward)}
    if cfg.iface:
        return next(i.address for i in per_host[0] if i.name == cfg.iface), {host: cfg.iface for host in host_names}
    choice = choose_network(per_host, host_names)
    return choice.master_addr, dict(zip(host_names, choice.interface_per_host))


def socket_interfaces(chosen_here: str, user_chose: bool, env: dict[str, str]) -> dict[str, str]:
    """The interface variables to set on this host (never one the user set). gloo always uses the network of
    the rendezvous; NCCL keeps its own choice (it skips docker and loopback, and may use several NICs) unless
    the user named the interface with --iface."""
    wanted = {"GLOO_SOCKET_IFNAME": chosen_here}
    if user_chose:
        wanted["NCCL_SOCKET_IFNAME"] = chosen_here
    return {name: value for name, value in wanted.items() if name not in env}


def _agree_on_address(cfg: DistSettings, dist: Dist) -> tuple[str, dict[str, str]]:
    """Collective: gather each host's interfaces, agree on the address and the interface per host, and point
    gloo (and, with --iface, NCCL) at it, so collectives use the network of the rendezvous."""
    topo = dist.topology
    probes = topo.local_rank == 0  # one rank per host looks at the host's network
    given = cfg.master_addr
    gathered = dist.allgather((local_interfaces(), resolve_ipv4(given) if given else []) if probes else None)
    per_host = [gathered[ranks[0]][0] for _, ranks in topo.hosts]  # type: ignore[index]
    host_names = [name for name, _ in topo.hosts]
    toward_master = None
    if given:
        resolved_per_host = [gathered[ranks[0]][1] for _, ranks in topo.hosts]  # type: ignore[index]
        master = dist.agree(lambda: master_address(given, resolved_per_host, per_host, host_names))
        reached = dist.allgather(reach(master, per_host[topo.host_index]) if probes else None)
        toward_master = (master, [reached[ranks[0]] for _, ranks in topo.hosts])
    address, chosen = dist.agree(lambda: choose_address(cfg, topo, per_host, toward_master))
    os.environ.update(socket_interfaces(chosen[topo.hostname], bool(cfg.iface), dict(os.environ)))
    log.info("rendezvous on %s%s; gloo interface per host: %s; NCCL: %s", address,
             f" (--master-addr {given})" if given and given != address else "", chosen,
             os.environ.get("NCCL_SOCKET_IFNAME", "its own choice (set --iface or NCCL_SOCKET_IFNAME to fix it)"))
    return address, chosen


def _store_adopts_sockets(torch_version: str) -> bool:
    """torch 2.8 and newer: the (libuv) TCPStore server can listen on a socket it is handed."""
    try:
        major, minor = (int(part) for part in torch_version.split("+")[0].split(".")[:2])
    except ValueError:
        return True  # an unusual version string: try, and fall back on NotImplementedError
    return (major, minor) >= (2, 8)


class _Store:
    """This rank's rendezvous store: the server on rank 0, a client elsewhere (None until it is open)."""

    def __init__(self) -> None:
        self.store: object | None = None

    def open_on_main(self, address: str, world_size: int, timeout: timedelta) -> tuple[str, int]:
        import torch
        import torch.distributed as dist

        try:
            # Our own socket, bound to the chosen address only (not every interface), port picked by the kernel:
            # no free-port race.
            listener = socket.create_server((address, 0), backlog=max(128, world_size))
            try:
                if not _store_adopts_sockets(torch.__version__):
                    raise NotImplementedError  # asking would print a C++ error line before the same refusal
                self.store = dist.TCPStore(
                    address, listener.getsockname()[1], world_size, True, timeout=timeout,
                    wait_for_workers=False, master_listen_fd=listener.fileno(),
                )
                listener.detach()  # the store's server owns the socket now and closes it: one owner, one close
            except NotImplementedError:
                # torch 2.4 to 2.7: the libuv store cannot adopt a socket. It opens its own on a kernel-chosen
                # port, listening on every interface (the non-libuv store could adopt ours, but aborts the
                # process when it is closed at exit).
                listener.close()
                self.store = dist.TCPStore(address, 0, world_size, True, timeout=timeout, wait_for_workers=False)
                log.info("torch %s cannot bind the rendezvous store to %s alone: it listens on every interface "
                         "(port %d, chosen by the kernel); torch 2.8 and newer bind it to that address only",
                         torch.__version__, address, self.store.port)  # type: ignore[attr-defined]
        except Exception as exc:
            raise UserError(
                f"rank 0 on {socket.gethostname()} could not open the rendezvous store on {address}: {exc} "
                f"(use --master-addr with an address of this host)"
            ) from None
        return address, self.store.port  # type: ignore[attr-defined]

    def close(self) -> None:
        self.store = None  # the last reference: the server (rank 0) stops listening


def _rendezvous(cfg: DistSettings, dist: Dist, address: str) -> tuple[_Store, str, int]:
    """Collective: rank 0 opens a TCPStore on a kernel-chosen port and broadcasts (address, port); the others
    connect to it."""
    import torch.distributed as tdist

    timeout = timedelta(seconds=cfg.rendezvous_timeout_s)
    holder = _Store()
    address, port = dist.from_main(lambda: holder.open_on_main(address, dist.world_size, timeout))
    if holder.store is None:
        try:
            holder.store = tdist.TCPStore(address, port, dist.world_size, False, timeout=timeout)
        except Exception as exc:
            detail = str(exc).splitlines()[0] if str(exc) else ""
            raise UserError(
                f"{dist.label} could not reach rank 0's rendezvous store at {address}:{port} within "
                f"{cfg.rendezvous_timeout_s:g} s ({type(exc).__name__}: {detail}). "
                f"Check that {dist.topology.hostname} can reach {address} (firewall, wrong interface) or set --master-addr"
            ) from None
    return holder, address, port


def export_environment(topo: Topology, address: str, port: int) -> None:
    """The variables torchrun sets, for libraries and scripts that read them. With TORCHELASTIC_USE_AGENT_STORE,
    torch's env:// rendezvous connects every rank, rank 0 included, as a client of the store at
    MASTER_ADDR:MASTER_PORT (mpiddp's), instead of rank 0 trying to open a second server on that port."""
    os.environ.update(
        RANK=str(topo.rank),
        WORLD_SIZE=str(topo.world_size),
        LOCAL_RANK=str(topo.local_rank),
        LOCAL_WORLD_SIZE=str(topo.local_world_size),
        GROUP_RANK=str(topo.host_index),
        GROUP_WORLD_SIZE=str(topo.num_hosts),
        ROLE_RANK=str(topo.rank),
        ROLE_WORLD_SIZE=str(topo.world_size),
        ROLE_NAME="default",
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",
        TORCHELASTIC_RESTART_COUNT=str(topo.restarts),  # requeues and relaunches: a script that resumes itself reads this
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID=f"mpiddp-{address}-{port}",
    )
    # As torchrun: a failed or timed-out NCCL collective ends the process instead of hanging (unless set).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")


FLIGHT_RECORDER_ENTRIES = "2000"  # torch's recommended ring size: the recent history of every process group


def _torch_at_least(torch_version: str, wanted: tuple[int, int]) -> bool:
    try:
        return tuple(int(part) for part in torch_version.split("+")[0].split(".")[:2]) >= wanted
    except ValueError:
        return True  # an unusual version string (a source build): assume a recent torch


def flight_recorder_env(torch_version: str, trace_dir: Path | None, env: Mapping[str, str]) -> dict[str, str]:
    """The variables that turn on torch's NCCL flight recorder (a ring buffer of recent collectives, dumped on a
    collective timeout) with its dumps in `trace_dir` (None: torch's default place); never one the user set,
    under either of its names. torch 2.4 to 2.14 read the TORCH_NCCL_* names; 2.9 and newer also read
    TORCH_FR_BUFFER_SIZE and TORCH_FR_DUMP_TEMP_FILE, and warn that the old ones are deprecated."""
    new_names = _torch_at_least(torch_version, (2, 9))
    wanted = [
        (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"), FLIGHT_RECORDER_ENTRIES),
        (("TORCH_NCCL_DUMP_ON_TIMEOUT",), "1"),
    ]
    if trace_dir is not None:  # torch names each rank's file <prefix><rank>
        wanted.append((("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"),
                       str(trace_dir.resolve() / TRACE_PREFIX)))
    return {(names[0] if new_names else names[-1]): value for names, value in wanted
            if not any(name in env for name in names)}


def enable_flight_recorder(trace_dir: Path | None) -> dict[str, str]:
    """Before an NCCL process group starts: turn on torch's flight recorder (see flight_recorder_env) in this
    process; returns what was set."""
    import torch

    wanted = flight_recorder_env(torch.__version__, trace_dir, os.environ)
    os.environ.update(wanted)
    return wanted


def open_rendezvous(settings: DistSettings, dist: Dist, guard: FailFast | None = None) -> tuple[Rendezvous, _Store]:
    """Collective: agree on the address, open rank 0's store on a kernel-chosen port, connect every rank (one
    connection each, which the Rendezvous hands on), export torchrun's variables. `guard` gets a way to claim the
    one full failure report."""
    address, interface_per_host = _agree_on_address(settings, dist)
    store, address, port = _rendezvous(settings, dist, address)
    export_environment(dist.topology, address, port)
    rendezvous = Rendezvous(address, port, interface_per_host, store)
    if guard is not None:
        # The one connection (looked up when needed: once closed, rank 0's store must be free to go), with a
        # short wait of its own, so reporting a failure never hangs on the store.
        guard.claim_report = lambda: add_within(rendezvous.client(), storekeys.FAILURE_REPORTS, 1,
                                                REPORT_CLAIM_S) == 1
        guard.tally = lambda amount: add_within(rendezvous.client(), storekeys.FAILED_RANKS, amount,
                                                REPORT_CLAIM_S)
    return rendezvous, store


def set_threads(settings: DistSettings, topo: Topology) -> int:
    """A fair share of the host's cores for torch and OpenMP in this rank (unless the user chose)."""
    import torch

    num_threads = fair_thread_count(settings, topo)
    torch.set_num_threads(num_threads)
    return num_threads


def start_process_group(settings: DistSettings, dist: Dist, rendezvous: Rendezvous, store: _Store,
                        num_threads: int, trace_dir: Path | None = None,
                        fits: Callable[[str], None] = _any_device) -> Dist:
    """Collective: choose the device (agreed, with the caller's `fits` checks), and start torch's default process
    group on mpiddp's store. On NCCL, torch's flight recorder is on, its dumps in `trace_dir` (the run dir)."""
    import torch
    import torch.distributed as tdist

    topo = dist.topology
    device_type, backend, device_index = dist.agree(lambda: choose_device(settings, topo, fits))
    uuid = None
    if device_type == "cuda":
        torch.cuda.set_device(device_index)  # before the process group, so nothing lands on GPU 0 by accident
        uuid = f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
        log.info("%s uses cuda:%d (%s) of %d visible", topo.label, device_index, uuid, torch.cuda.device_count())
    devices = dist.allgather(device_type)
    dist.agree(lambda: same_device_everywhere(settings.device, devices, topo))
    placements = dist.allgather((topo.hostname, uuid))
    dist.agree(lambda: shared_gpus(placements))
    placed = dist.placed(device_type, device_index, backend, rendezvous, num_threads)
    if backend == "nccl" and trace_dir is not None:  # read when the process group starts
        enable_flight_recorder(trace_dir)
    tdist.init_process_group(
        backend=backend,
        store=store.store,
        rank=topo.rank,
        world_size=topo.world_size,
        timeout=timedelta(seconds=settings.collective_timeout_s),
        device_id=placed.device if device_type == "cuda" else None,
    )
    log.info(
        "process group ready: %s on %s, %d ranks on %d hosts, rendezvous %s:%d, %d CPU threads per rank",
        backend, device_type, topo.world_size, topo.num_hosts, rendezvous.master_addr, rendezvous.master_port,
        num_threads,
    )
    return placed


@contextmanager
def distributed(cfg: DistSettings, dist: Dist, guard: FailFast | None = None, trace_dir: Path | None = None,
                fits: Callable[[str], None] = _any_device) -> Iterator[Dist]:
    """Collective: set up the torch process group and yield the Dist placed on its device (on NCCL, with the
    flight recorder's dumps in `trace_dir`; `fits`: see choose_device). Tear it down on a clean exit, or when
    every rank raised together (AgreedError, Stopped). After any other exception there is no teardown: FailFast
    aborts the whole job, the only safe end when peers may be blocked in a collective.
    """
    num_threads = set_threads(cfg, dist.topology)
    rendezvous, store = open_rendezvous(cfg, dist, guard)
    placed = start_process_group(cfg, dist, rendezvous, store, num_threads, trace_dir, fits)
    try:
        yield placed
    except (AgreedError, Stopped):
        teardown(dist, store)  # raised on every rank at the same point: a clean teardown is safe
        raise
    teardown(dist, store)


def teardown(dist: Dist, store: _Store) -> None:
    """Collective: every rank arrives, then the process group (if any) and rank 0's listening socket go."""
    import torch.distributed as tdist

    # Wait for every rank before tearing down, so a fast rank never destroys the group (or finalises MPI)
    # while a slow one still talks to it.
    dist.barrier()
    if tdist.is_initialized():
        tdist.destroy_process_group()
    store.close()
