"""`mpirun ... python -m mpiddp check [training flags]`: is this job healthy before a long run?

Topology, fingerprints, MPI latency and bandwidth, all-reduce bandwidth, a write test of the run directory
on every host, and wandb. Every rank takes part; rank 0 prints one report; every rank returns the same status.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
import numpy as np

from mpiddp.elastic.decide import in_job_recovery_refusal, job_refusal
from mpiddp.elastic.membership import mpi_facts, nccl_abort_available
from mpiddp.job import preflight
from mpiddp.job.collective import Dist
from mpiddp.job.topology import Topology
from mpiddp.trainer.config import Config, OutputSettings, wandb_mode

ALLREDUCE_SIZES = tuple(4 ** k * 1024 for k in range(0, 7))  # bytes per rank: 1 KiB .. 4 MiB
MPI_BANDWIDTH_BYTES = 4 * 1024 * 1024


def bus_bandwidth(algorithm_bandwidth: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth for all-reduce: what each link carries, comparable across world sizes."""
    return algorithm_bandwidth * 2 * (world_size - 1) / world_size if world_size > 1 else algorithm_bandwidth


def allreduce_bandwidth(dist: Dist, nbytes: int, repeats: int = 5) -> dict[str, float]:
    """Collective: torch.distributed all-reduce of `nbytes` float32; the slowest rank's median time."""
    import torch
    import torch.distributed as tdist

    device = dist.device
    tensor = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    for _ in range(2):
        tdist.all_reduce(tensor)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        tdist.all_reduce(tensor)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    (seconds,) = dist.reduce([float(np.median(times))], "max")
    algbw = nbytes / seconds
    return {"bytes": nbytes, "time_s": seconds, "algbw_GBps": algbw / 1e9,
            "busbw_GBps": bus_bandwidth(algbw, dist.world_size) / 1e9}


def write_test(directory: Path, topo: Topology) -> str | None:
    """On each host's local rank 0: create, write, read back and remove a file in `directory`."""
    if topo.local_rank != 0:
        return None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        payload = os.urandom(1024)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=f".mpiddp-check-{topo.hostname}-") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
            if Path(handle.name).read_bytes() != payload:
                return f"{topo.hostname}: {directory} returned different bytes than were written"
    except OSError as exc:
        return f"{topo.hostname}: cannot write to {directory} ({exc.strerror or exc})"
    return None


def wandb_status(outputs: OutputSettings) -> tuple[str, str | None]:
    """(what wandb would do, a problem or None); rank 0 only, and without starting a run."""
    mode = wandb_mode(outputs.wandb, dict(os.environ), Path.home() / ".netrc")
    if mode == "disabled":
        return "disabled", None
    try:
        import wandb
    except ImportError:
        return mode, "wandb is not installed (pip install wandb) but --wandb is not 'disabled'"
    return f"{mode} (wandb {wandb.__version__})", None


def device_names(dist: Dist) -> str:
    import torch

    if dist.device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(dist.device)
    return f"{dist.device} {props.name} GPU-{props.uuid}"


def settings_refusal(cfg: Config, dist: Dist) -> str | None:
    """Why this job's settings rule out in-job recovery (PowerSGD; on GPUs, torch or its NCCL error handling)."""
    import torch

    return job_refusal(dist.device.type, dist.backend, cfg.training.grad_compression, nccl_abort_available(),
                       torch.__version__, os.environ)


def in_job_recovery_line(env: Mapping[str, str] | None = None, settings: str | None = None) -> str:
    """`check`'s one line on in-job recovery, for this process (every rank of a job gives the same answer).
    `settings`: why this job's own settings rule it out (decide.job_refusal), None when they do not."""
    import torch
    from torch.distributed import distributed_c10d

    library, has_api, mpi4py_version = mpi_facts()
    refusal = in_job_recovery_refusal(library, os.environ if env is None else env, has_api,
                                      torch.__version__, hasattr(distributed_c10d, "_update_default_pg"))
    if refusal is None and settings is not None:
        refusal = f"{settings}: a failure ends the job and `launch` relaunches it"
    if refusal is not None:
        return f"in-job recovery: no: {refusal}"
    return (f"in-job recovery: yes ({library.split(',')[0]} with ULFM, started with --with-ft ulfm; mpi4py "
            f"{mpi4py_version}; torch {torch.__version__})")


def run_check(cfg: Config, dist: Dist, run_root: Path) -> tuple[int, str]:
    """Collective: (exit status, report). Every rank returns the same status; rank 0's report is the one to print."""
    topo = dist.topology
    rendezvous = dist.rendezvous
    assert rendezvous is not None, "check runs inside the process group"
    problems: list[str] = []

    prints = dist.allgather(preflight.fingerprint(cfg.to_dict(), topo))
    problems += preflight.differences(prints, topo)
    devices = dist.allgather(device_names(dist))
    lines = ["mpiddp check", "", f"{'host':<16} {'world ranks':<14} {'local':<8} device"]
    for host, ranks in topo.hosts:
        for local_rank, rank in enumerate(ranks):
            first = host if local_rank == 0 else ""
            lines.append(f"{first:<16} {rank:<14} {local_rank:<8} {devices[rank]}")
    lines += ["", f"MPI: {topo.mpi_description}", f"backend: {dist.backend} on {dist.device.type}; rendezvous "
              f"{rendezvous.master_addr}:{rendezvous.master_port}; interfaces "
              f"{rendezvous.interface_per_host or 'left to gloo/NCCL'}"]
    versions = {k: v for k, v in prints[0].items() if not k.startswith("_")}
    lines.append(f"fingerprint: {'same on every rank' if not problems else 'DIFFERS'}: {versions}")
    # not a problem when off: the job then fails fast and launch relaunches
    lines.append(in_job_recovery_line(settings=settings_refusal(cfg, dist)))

    if topo.world_size > 1:
        latency = dist.pingpong(topo.world_size - 1, 8, 200)
        big = dist.pingpong(topo.world_size - 1, MPI_BANDWIDTH_BYTES, 10)
        lines.append(f"MPI rank 0 <-> rank {topo.world_size - 1}: latency {latency * 1e6:.1f} us, "
                     f"bandwidth {MPI_BANDWIDTH_BYTES / big / 1e9:.2f} GB/s")
    # also on one rank: NCCL's errors often show only at the first collective, so a one-GPU check runs one
    lines += ["", f"{dist.backend} all-reduce (float32, {topo.world_size} ranks)"
              + (": one rank, no link crossed (this proves the backend runs, not the network)" if topo.world_size == 1 else ""),
              f"{'bytes':>10} {'time us':>10} {'algbw GB/s':>11} {'busbw GB/s':>11}"]
    for nbytes in ALLREDUCE_SIZES:
        row = allreduce_bandwidth(dist, nbytes)
        lines.append(f"{nbytes:>10} {row['time_s'] * 1e6:>10.1f} {row['algbw_GBps']:>11.3f} {row['busbw_GBps']:>11.3f}")

    failures = [f for f in dist.allgather(write_test(run_root, topo)) if f]
    problems += failures
    lines.append("")
    lines.append(f"run directory {run_root}: " + ("writable on every host" if not failures else "NOT writable"))

    wandb_line, wandb_problem = dist.from_main(lambda: wandb_status(cfg.outputs))
    lines.append(f"wandb: {wandb_line}")
    if wandb_problem:
        problems.append(wandb_problem)

    lines.append("")
    if problems:
        lines.append("PROBLEMS:")
        lines += [f"  - {p}" for p in problems]
        return 1, "\n".join(lines)
    lines.append(f"all good: {topo.world_size} ranks on {topo.num_hosts} hosts ({socket.gethostname()} reporting)")
    return 0, "\n".join(lines)
