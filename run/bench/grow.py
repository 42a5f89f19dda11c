"""Growing back after an in-job recovery (mpiddp/elastic/grow.py), measured on four fake hosts: the built-in
trainer (digits) under `mpirun --with-ft ulfm` with three ranks on nodea-nodec and noded as the spare, grown onto
two ways, interleaved: `spawn` (MPIDDP_SPARE_HOSTS=noded: MPI_Comm_spawn after the loss) and `hot` (-np 4 with
MPIDDP_SPARE_RANKS=1: a hot spare waits on noded from the start, mpiddp/job/spares.py); `control` is the hot job
with nothing killed, its throughput read over the same windows (what after / before reads with no grow). The rank on nodeb is held
at step KILL_AT (--inject-fault stall-data) and SIGKILLed, the survivors recover, train a step on 2 ranks, and
grow. Per run: the grow's phases as the job recorded them, the survivors' stand-still (`survivors_stall`), the new
rank's warm-up, whether the launcher failed (a status other than 0) and took the crashing connect path (prterun's
"PMIX ERROR" in the output), and the throughput (images/s per step, from metrics.jsonl) before the failure
against after the grow (from SETTLE steps after it). Writes run/bench/results/only-grow-hot.json (or --out).

usage: sudo python run/bench/grow.py [--repeats 10] [--transport gloo] [--modes spawn,hot[,control]] [--kill-at 20]
       [--job-flags '...']   (root: fake hosts are network namespaces)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
RESULT = REPO / "run" / "bench" / "results" / "only-grow-hot.json"
KILL_AT = 20  # steps at full size before the failure (30 steps an epoch on 3 ranks)
SETTLE = 5  # steps after the grow left out of its throughput (warm-up of the new rank's caches)
CONTROL_GROW_AFTER = 18  # `control`: steps from KILL_AT to where its "after" window starts (a hot grow's median)


def start_job(hosts, work: Path, mode: str, transport: str, kill_at: int, extra: tuple[str, ...]):
    """The job, started, and once its rank 1 holds the others up, that rank SIGKILLed (`control`: the hot job,
    nothing killed)."""
    from conftest import rank_pids
    from test_grow_e2e import GrowJob
    from test_hot_spares import hot_job

    flags = ("--grad-transport", transport, "--inject-fault", f"stall-data:1:{kill_at}", "--epochs", "3",
             "--save-every", "100", *extra)
    if mode == "control":
        return hot_job(hosts, work, *(flag for flag in flags if not flag.startswith("stall-data")
                                      and flag != "--inject-fault"))
    if mode == "spawn":
        job = GrowJob(hosts, work, *flags)
        job.kill_when_stalled(1)
        return job
    job = hot_job(hosts, work, *flags)
    pids = job.wait_for("four processes", lambda: (found := rank_pids(job.run_dir)) and len(found) == 4 and found)
    job.wait_for("the stall", lambda: "injecting fault 'stall-data'" in job.output())
    os.kill(pids[1], 9)
    return job


def one_run(hosts, work: Path, mode: str, transport: str, kill_at: int = KILL_AT, extra: tuple[str, ...] = ()) -> dict:
    from test_leftovers import processes_of

    job = start_job(hosts, work, mode, transport, kill_at, extra)
    status = job.finish(timeout=400)
    deadline = time.monotonic() + 30
    while processes_of(job.mark) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition with a deadline: the job's processes end after mpirun
    output = job.output()
    tail = [line for line in output.splitlines() if "hostname of the client" not in line][-25:]
    launcher = {"mode": mode, "transport": transport, "status": status, "pmix_errors": output.count("PMIX ERROR"),
                "launcher_failed": status != 0, "left_running": len(processes_of(job.mark))}
    if not (job.run_dir / "summary.json").exists():
        return {**launcher, "failed": True, "output_tail": tail}
    summary = json.loads((job.run_dir / "summary.json").read_text())
    steps = [r for r in (json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    before = [r["images_per_second"] for r in steps if min(SETTLE, kill_at) <= r["step"] <= kill_at]  # warm-up out
    if mode == "control":  # the same windows with nothing lost: what after / before reads without a grow
        after = [r["images_per_second"] for r in steps if r["step"] > kill_at + CONTROL_GROW_AFTER + SETTLE]
        if not after:
            return {**launcher, "failed": True, "error": f"{len(steps)} steps: none after the window's start"}
        return {**launcher, "images_per_second_before_failure": statistics.median(before),
                "images_per_second_after_grow": statistics.median(after),
                "after_vs_before": statistics.median(after) / statistics.median(before), "steps": len(steps),
                "images_per_second_by_step": [round(r["images_per_second"], 1) for r in steps]}
    grew = next((r for r in summary["recoveries"] if r["cause"] == "grew"), None)
    if grew is None:
        return {**launcher, "failed": True, "output_tail": tail}
    after = [r["images_per_second"] for r in steps if r["step"] > grew["step"] + SETTLE]
    phases = grew["phases"]
    return {**launcher, "grow_step": grew["step"], "phases_s": phases,
            "grow_downtime_s": sum(v for v in phases.values() if v is not None),
            # from the boundary to the next step's end, less an ordinary step at full size (its median before)
            "survivors_stall_s": grew.get("survivors_stall"), "ordinary_step_s": grew.get("ordinary_step"),
            "warm_up_s": grew.get("warm_up"),
            "images_per_second_before_failure": statistics.median(before),
            "images_per_second_after_grow": statistics.median(after) if after else None,
            "after_vs_before": statistics.median(after) / statistics.median(before) if after else None,
            "steps": len(steps), "world_size_at_end": summary["world_size"],
            "images_per_second_by_step": [round(r["images_per_second"], 1) for r in steps],
            "output_tail": tail if status != 0 else []}


def main() -> None:
    from _pytest.outcomes import OutcomeException
    from fakehosts import FakeHosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--modes", default="spawn,hot", help="how the job grows, interleaved (default: %(default)s)")
    parser.add_argument("--kill-at", type=int, default=KILL_AT, help="the step rank 1 is killed after")
    parser.add_argument("--job-flags", default="", help="more training flags (throughput: a longer run, e.g. "
                        "'--dataset synthetic --arch resnet18 --image-size 32 --steps-per-epoch 150 --epochs 2')")
    parser.add_argument("--transport", default="gloo", choices=("gloo", "mpi"))
    parser.add_argument("--out", type=Path, default=RESULT, help="where the results go (default: %(default)s)")
    parser.add_argument("--keep", type=Path, help="copy each run's metrics.jsonl, summary.json and log here "
                        "(DIR/MODE-REPEAT/): per-epoch step, data-wait and compute times per rank")
    args = parser.parse_args()
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec", "noded"], Path(tmp), tag="b").up()
        try:
            for repeat in range(args.repeats):
                for mode in args.modes.split(","):  # interleaved
                    work = Path(tmp) / f"{mode}{repeat}"
                    work.mkdir()
                    try:
                        runs.append(one_run(hosts, work, mode, args.transport, args.kill_at,
                                            tuple(args.job_flags.split())))
                        if args.keep:
                            keep(work, args.keep / f"{mode}-{repeat}")
                    except (Exception, OutcomeException) as exc:  # a run that never got so far (the tests' pytest.fail)
                        runs.append({"mode": mode, "transport": args.transport, "status": None, "pmix_errors": 0,
                                     "launcher_failed": True, "failed": True, "error": str(exc)[-3000:]})
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            hosts.down()
    table = {mode: summarise([r for r in runs if r["mode"] == mode]) for mode in args.modes.split(",")}
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                                    "python": platform.python_version(), "kill_at_step": args.kill_at,
                                    "job_flags": args.job_flags, "settle_steps": SETTLE, "transport": args.transport,
                                    "summary": table,
                                    "runs": runs}, indent=1) + "\n")
    print(json.dumps(table, indent=1))


def keep(work: Path, into: Path) -> None:
    import shutil

    into.mkdir(parents=True, exist_ok=True)
    for source in (work / "run" / "metrics.jsonl", work / "run" / "summary.json", work / "job.log"):
        if source.exists():
            shutil.copy(source, into / source.name)


def summarise(runs: list[dict]) -> dict:
    """One mode's runs: how many grew and ended clean, how many the launcher failed in, and the medians."""
    grown = [r for r in runs if not r.get("failed")]
    ratios = [r["after_vs_before"] for r in grown if r["after_vs_before"] is not None]
    table = {"runs": len(runs), "grew": len(grown), "exit_0": sum(1 for r in runs if r["status"] == 0),
             "launcher_failed": sum(1 for r in runs if r["launcher_failed"]),
             "runs_with_pmix_error": sum(1 for r in runs if r["pmix_errors"]),
             "left_running": sum(r.get("left_running", 0) for r in runs)}
    stalls = [r["survivors_stall_s"] for r in grown if r.get("survivors_stall_s") is not None]
    ordinary = [r["ordinary_step_s"] for r in grown if r.get("ordinary_step_s") is not None]
    if grown and grown[0]["mode"] == "control":
        table.update(after_vs_before_median=statistics.median(ratios))
    elif grown:
        table.update(
            survivors_stall_s_median=statistics.median(stalls) if stalls else None,
            survivors_stall_s_max=max(stalls) if stalls else None,
            ordinary_step_s_median=statistics.median(ordinary) if ordinary else None,
            phases_s_median={name: statistics.median(r["phases_s"][name] or 0.0 for r in grown)
                             for name in grown[0]["phases_s"]},
            after_vs_before_median=statistics.median(ratios) if ratios else None)
    return table


if __name__ == "__main__":
    main()
