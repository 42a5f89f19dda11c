"""In-job recovery (mpiddp/elastic/membership.py) on one host: a rank SIGKILLed while its peers wait in a gloo
all-reduce, timed from the kill to the first all-reduce completed on the shrunk group, with its phases; and
what the failure watch costs when nothing fails (async all-reduce + polling against plain blocking ones,
interleaved). Writes run/bench/results/only-recovery.json.

With --trainer: the built-in trainer (python -m mpiddp, digits) on three fake hosts, one rank each, a rank held
with --inject-fault stall-data:RANK:5 and SIGKILLed while its peers wait in the gradient all-reduce; downtime is
from the kill to the survivors' next completed step (its record in metrics.jsonl), with the phases the job
recorded, for the MPI and the gloo gradient transports. Writes run/bench/results/only-recovery-trainer.json.

With --trainer-sizes 3,4,8,16: the same at several world sizes on four fake hosts (N/4 ranks each, more ranks
than cores), to show how each phase grows with the world. Writes run/bench/results/only-recovery-trainer-sizes.json.

usage: python run/bench/recovery.py [--repeats 5] [--sizes 3,4] [--steps 400]
       python run/bench/recovery.py --trainer [--repeats 5]   (root: fake hosts are network namespaces)
       python run/bench/recovery.py --trainer-sizes 3,4,8,16 [--repeats 3] [--transport gloo]
Every run is `mpirun --with-ft ulfm` of tests/programs/membership_loop.py; ranks are oversubscribed when the
host has fewer cores than ranks (the JSON says how many cores there were).
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
PROGRAM = REPO / "tests" / "programs" / "membership_loop.py"
RESULT = REPO / "run" / "bench" / "results" / "only-recovery.json"


def mpirun() -> str:
    beside = Path(sys.executable).parent / "mpirun"
    return str(beside) if beside.exists() else "mpirun"


def environment() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
               PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    return env


def launch(out_dir: Path, np: int, steps: int, victim: int, at_step: int, *extra: str) -> subprocess.Popen:
    out_dir.mkdir(parents=True)
    command = [mpirun(), "-np", str(np), "--with-ft", "ulfm", sys.executable, str(PROGRAM), str(out_dir),
               str(steps), str(victim), str(at_step), *extra]
    return subprocess.Popen(command, cwd=REPO, env=environment(), stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def lines(out_dir: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out_dir / f"rank{rank}.jsonl").read_text().splitlines()]


def one_recovery(work: Path, np: int, victim: int = 1, at_step: int = 20) -> dict:
    """Kill `victim` once every peer waits in the all-reduce; seconds from the kill to each milestone."""
    job = launch(work, np, at_step + 10, victim, at_step)
    peers = [rank for rank in range(np) if rank != victim]
    deadline = time.monotonic() + 180
    while not ((work / "victim").exists() and all((work / f"waiting.{r}").exists() for r in peers)):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise RuntimeError(f"no kill point reached:\n{job.communicate()[0][-2000:]}")
        time.sleep(0.002)
    killed = time.time()
    os.kill(int((work / "victim").read_text()), signal.SIGKILL)
    status = finished(job, work, peers)
    recoveries, firsts = [], []
    for rank in peers:
        records = lines(work, rank)
        recoveries.append(next(r for r in records if r.get("recovered")))
        firsts.append(next(r["at"] for r in records if r.get("pid") and r["step"] == at_step))
    return {
        "detect_s": max(r["detected_at"] for r in recoveries) - killed,  # the last survivor to learn it
        "agree_and_shrink_s": max(r["phases"]["agree_and_shrink"] for r in recoveries),
        "process_group_s": max(r["phases"]["process_group"] for r in recoveries),
        "kill_to_first_allreduce_s": max(firsts) - killed,
        "mpirun_exit": status,
    }


def finished(job: subprocess.Popen, work: Path, peers: list[int]) -> int | str:
    """mpirun's exit status once every survivor wrote its last record; when the survivors then hang in
    MPI_Finalize (Open MPI's ULFM waits on the dead rank in the finalize fence now and then, open-mpi/ompi#11404)
    the job is ended and that is what the run records."""
    deadline = time.monotonic() + 120
    while not all((work / f"rank{r}.jsonl").exists() and '"done"' in (work / f"rank{r}.jsonl").read_text()
                  for r in peers):
        if job.poll() is not None or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        output = job.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        job.terminate()  # mpirun forwards it to its ranks
        try:
            job.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            job.kill()
            job.communicate()
        return "hung in MPI_Finalize (open-mpi/ompi#11404): ended"
    if job.returncode != 0:
        raise RuntimeError(f"mpirun exited {job.returncode}:\n{output[-2000:]}")
    return job.returncode


def no_failure_cost(work: Path, np: int, steps: int, pairs: int, numel: int) -> dict:
    """Seconds per all-reduce, async+watch (two poll caps) vs blocking, runs interleaved (a, b, c, a, b, c...)."""
    variants = {"blocking": ("--no-async",), "async_watched": (), "async_watched_poll_100us": ("--poll-s=0.0001",)}
    per_step: dict[str, list[float]] = {name: [] for name in variants}
    for pair in range(pairs):
        for name, extra in variants.items():
            out = work / f"{name}-{numel}-{pair}"
            job = launch(out, np, steps, -1, -1, f"--numel={numel}", *extra)
            output = job.communicate(timeout=300)[0]
            if job.returncode != 0:
                raise RuntimeError(f"mpirun exited {job.returncode}:\n{output[-2000:]}")
            times = [r["at"] for r in lines(out, 0) if r.get("pid")]
            per_step[name].append((times[-1] - times[steps // 10]) / (len(times) - 1 - steps // 10))  # no warm-up
    medians = {name: statistics.median(values) for name, values in per_step.items()}
    return {"numel": numel, "ranks": np, "steps": steps, "pairs": pairs,
            "seconds_per_allreduce": medians, "runs": per_step,
            "overhead_pct": {name: 100 * (medians[name] / medians["blocking"] - 1) for name in variants}}


TRAINER_RESULT = REPO / "run" / "bench" / "results" / "only-recovery-trainer.json"
FAKE_HOSTS = "nodea:1,nodeb:1,nodec:1"


def trainer_env() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", PYTHONUNBUFFERED="1")
    env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)  # slots come from -H
    return env


def pid_of_rank(run_dir: Path, rank: int) -> int | None:
    found = subprocess.run(["pgrep", "-f", f"mpiddp --run-dir {run_dir}"], capture_output=True, text=True).stdout
    for pid in found.split():
        try:
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
        except OSError:
            continue
    return None


def trainer_recovery(hosts, out_dir: Path, transport: str, victim: int, np: int = 3, host_list: str = FAKE_HOSTS,
                     batch: int = 16, epochs: int = 1, at_step: int = 5) -> dict:
    """One run: the trainer on fake hosts, `victim` killed while its peers wait in the all-reduce after step
    `at_step` (the victim stalls in its data wait there)."""
    run_dir, log = out_dir / "run", out_dir / "job.log"
    out_dir.mkdir(parents=True)
    command = [mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", str(np), "-H", host_list, sys.executable,
               "-m", "mpiddp", "--run-dir", str(run_dir), "--dataset", "digits", "--epochs", str(epochs),
               "--batch-size", str(batch), "--log-every", "1", "--no-progress", "--wandb", "disabled",
               "--grad-transport", transport, "--inject-fault", f"stall-data:{victim}:{at_step}"]
    with log.open("w") as output:
        job = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=trainer_env(),
                               stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while "injecting fault 'stall-data'" not in log.read_text(errors="replace"):
        if job.poll() is not None or time.monotonic() > deadline:
            job.kill()
            raise RuntimeError(f"no stall:\n{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.05)  # polling a condition with a deadline
    pid = pid_of_rank(run_dir, victim)
    killed_at = time.time()
    os.kill(pid, signal.SIGKILL)
    status = job.wait(timeout=240)
    if status != 0:
        raise RuntimeError(f"mpirun exited {status}:\n{log.read_text(errors='replace')[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    next_step = min(r["time"] for r in records if r["kind"] == "step" and r["time"] > killed_at)
    (recovery,) = json.loads((run_dir / "summary.json").read_text())["recoveries"]
    assert recovery["world_after"] == np - 1, recovery
    return {"downtime_s": next_step - killed_at, **{f"{k}_s": v for k, v in recovery["phases"].items()},
            "steps_lost": recovery["steps_lost"]}


def trainer_main(repeats: int) -> None:
    sys.path.insert(0, str(REPO / "tests"))
    from fakehosts import FakeHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"fake hosts unavailable: {reason}")
    result: dict = {"host": platform.node(), "cores": os.cpu_count(), "ranks": 3, "hosts": 3, "runs": {},
                    "note": "three fake hosts (network namespaces) on one machine's cores; digits, 16 per rank; "
                            "the victim stalls before step 6 and is SIGKILLed while its peers wait in the gradient "
                            "all-reduce; downtime: kill -> the survivors' next step record (same clock)"}
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec"], Path(tmp), tag="b")
        hosts.up()
        try:
            for index in range(repeats):  # interleaved: transports and victims alternate
                for transport, victim in (("mpi", 1), ("gloo", 1), ("mpi", 0), ("gloo", 0)):
                    run = trainer_recovery(hosts, Path(tmp) / f"{transport}-{victim}-{index}", transport, victim)
                    result["runs"].setdefault(f"{transport}, rank {victim} killed", []).append(run)
                    print(transport, victim, json.dumps(run), flush=True)
        finally:
            hosts.down()
    result["median"] = {name: {key: statistics.median(run[key] for run in runs if run[key] is not None)
                               for key in runs[0]} for name, runs in result["runs"].items()}
    TRAINER_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))
    print(f"wrote {TRAINER_RESULT}")


SCALING_RESULT = REPO / "run" / "bench" / "results" / "only-recovery-trainer-sizes.json"
SCALING_HOSTS = ["nodea", "nodeb", "nodec", "noded"]
DIGITS_TRAIN = 1437  # the digits training split: 80% of 1,797


def scaling_plan(np: int) -> dict:
    """N ranks on four fake hosts (N/4 slots each; 3 ranks: one each on three): the victim is the first rank of the
    second host; N-1 images per rank, so the global batch N(N-1) splits over the N-1 survivors (N per rank)."""
    slots = max(1, np // len(SCALING_HOSTS))
    hosts = SCALING_HOSTS[:3] if np == 3 else SCALING_HOSTS
    global_batch = np * (np - 1)
    epochs = 1 if DIGITS_TRAIN // global_batch >= 8 else 2
    return {"host_list": ",".join(f"{name}:{slots}" for name in hosts), "victim": slots, "batch": np - 1,
            "epochs": epochs, "at_step": 3}


def scaling_main(sizes: list[int], repeats: int, transport: str) -> None:
    """The trainer's recovery at 3, 4, 8, 16 ranks (oversubscribed on this machine's cores), interleaved by size."""
    sys.path.insert(0, str(REPO / "tests"))
    from fakehosts import FakeHosts, unavailable_reason

    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"fake hosts unavailable: {reason}")
    result: dict = {"host": platform.node(), "cores": os.cpu_count(), "transport": transport, "runs": {},
                    "mca": {k: v for k, v in os.environ.items() if k.startswith(("OMPI_MCA_", "PRTE_MCA_"))},
                    "note": "N ranks on four fake hosts (network namespaces) sharing this machine's cores; digits, "
                            "N-1 images per rank; the first rank of the second host stalls before step 4 and is "
                            "SIGKILLed while its peers wait in the gradient all-reduce; downtime: kill -> the "
                            "survivors' next step record; phases: the slowest survivor's (detect: the earliest)"}
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(SCALING_HOSTS, Path(tmp), tag="s")
        hosts.up()
        try:
            for index in range(repeats):
                for np in sizes:
                    plan = scaling_plan(np)
                    run = trainer_recovery(hosts, Path(tmp) / f"{np}-{index}", transport, plan.pop("victim"), np,
                                           **plan)
                    result["runs"].setdefault(str(np), []).append(run)
                    print(np, "ranks:", json.dumps(run), flush=True)
        finally:
            hosts.down()
    result["median"] = {np: {key: statistics.median(run[key] for run in runs if run[key] is not None)
                             for key in runs[0]} for np, runs in result["runs"].items()}
    SCALING_RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result["median"], indent=1))
    print(f"wrote {SCALING_RESULT}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--sizes", default="3,4")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--trainer", action="store_true", help="the built-in trainer on three fake hosts")
    parser.add_argument("--trainer-sizes", default=None,
                        help="the built-in trainer at these world sizes (e.g. 3,4,8,16) on four fake hosts")
    parser.add_argument("--transport", default="gloo", help="with --trainer-sizes: the gradient transport")
    args = parser.parse_args(argv)
    if args.trainer_sizes:
        scaling_main([int(n) for n in args.trainer_sizes.split(",")], args.repeats, args.transport)
        return
    if args.trainer:
        trainer_main(args.repeats)
        return
    result: dict = {"host": platform.node(), "cores": os.cpu_count(), "recovery": {}, "no_failure": [],
                    "note": "one host, ranks oversubscribed on the cores given; kill -> first all-reduce on the "
                            "shrunk group measured from the killer's clock (same host)"}
    with tempfile.TemporaryDirectory() as tmp:
        for np in (int(n) for n in args.sizes.split(",")):
            runs = [one_recovery(Path(tmp) / f"kill-{np}-{i}", np) for i in range(args.repeats)]
            result["recovery"][str(np)] = {
                "runs": runs,
                "median": {key: statistics.median(run[key] for run in runs) for key in runs[0] if key.endswith("_s")},
                "finalize_hangs": sum(run["mpirun_exit"] != 0 for run in runs),
            }
            print(np, "ranks:", json.dumps(result["recovery"][str(np)]["median"]), flush=True)
        for numel in (1024, 1 << 20):
            result["no_failure"].append(no_failure_cost(Path(tmp), 3, args.steps, args.pairs, numel))
            print(json.dumps(result["no_failure"][-1]["seconds_per_allreduce"]), flush=True)
    RESULT.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {RESULT}")


if __name__ == "__main__":
    main()
