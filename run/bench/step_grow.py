"""Growing back a loop under mpiddp's step wrappers (mpiddp.elastic.steps.StepLoop), measured on four fake hosts:
tests/programs/steps_grow.py (nanoGPT's loop shape, its position declared with mpiddp.keep) under `mpirun --with-ft
ulfm -np 4 -H nodea:1,nodeb:1,nodec:1,noded:1 -x MPIDDP_SPARE_RANKS=1 python -m mpiddp run`: the rank on nodeb kills
itself at iteration KILL_AT, the survivors recover, train, and take the hot spare on noded in. Per run, from rank
0's record of the grow (on_membership_change's phases): each phase, the survivors' stand-still (`stand_still`: from
where they stopped for the grow, its wake included, to the end of their first step after it) and that less an
ordinary step at full size (`survivors_stall_s`, the trainer's measure in run/bench/grow.py), whether the job
reached full size, ended with status 0 and the same parameters on every rank, and any process left over.
Writes run/bench/results/only-step-grow.json (or --out).

usage: sudo python run/bench/step_grow.py [--repeats 10] [--kill-at 20]   (root: fake hosts are network namespaces)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "job"))
RESULT = REPO / "run" / "bench" / "results" / "only-step-grow.json"
PROGRAM = REPO / "tests" / "programs" / "steps_grow.py"
KILL_AT, ITERATIONS = 20, 60


def one_run(hosts, work: Path, kill_at: int) -> dict:
    """One job: its status, rank 0's record of the grow, what every rank ended with, what was left running."""
    from conftest import find_mpirun
    from test_leftovers import marked_env, processes_of

    out = work / "out"
    out.mkdir()
    env, mark = marked_env(PYTHONPATH=str(REPO), MPIDDP_SPARE_RANKS="1")
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    command = hosts.command_on("nodea", [
        find_mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", "4", "-H", "nodea:1,nodeb:1,nodec:1,noded:1",
        "-x", "MPIDDP_SPARE_RANKS", sys.executable, "-m", "mpiddp", "run", str(PROGRAM), str(out), str(ITERATIONS),
        "--kill", f"1:{kill_at}", "--until-full", "3", "--after-full", "10"])
    with (work / "job.log").open("w") as log:
        status = subprocess.run(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, timeout=400).returncode
    deadline = time.monotonic() + 30
    while processes_of(mark) and time.monotonic() < deadline:
        time.sleep(0.2)  # polling a condition with a deadline: the job's processes end after mpirun
    left = len(processes_of(mark))
    lines = {path: [json.loads(line) for line in path.read_text().splitlines()] for path in out.glob("pid*.jsonl")}
    finals = [found[-1] for found in lines.values() if found and found[-1].get("done")]
    rank0 = next((found for found in lines.values() if found and found[0]["rank"] == 0 and found[0]["iter"] == 0),
                 [])
    run = {"status": status, "launcher_failed": status != 0, "left_running": left,
           "grew": any(final["world"] == 3 for final in finals) and len(finals) == 3,
           "same_parameters": len({final["checksum"] for final in finals}) == 1 and len(finals) == 3}
    grow = next((change for final in finals if final["rank"] == 0 for change in final["changes"] if change["grew"]),
                None)
    steps = [line for line in rank0 if "done" not in line]
    full = [later["time"] - earlier["time"] for earlier, later in zip(steps[5:kill_at], steps[6:kill_at])]
    if grow is None or not full:
        return {**run, "failed": True, "output_tail": (work / "job.log").read_text(errors="replace")[-3000:]}
    ordinary = statistics.median(full)
    stand_still = grow["phases"].get("stand_still")
    # what the phases do not name: the rest of the wake's stop (the hello, every host's name) and the take-in's
    # bookkeeping (the topology bound again, the lines said)
    named = sum(value for name, value in grow["phases"].items() if name != "stand_still" and value is not None)
    return {**run, "phases_s": grow["phases"], "ordinary_step_s": ordinary, "stand_still_s": stand_still,
            "survivors_stall_s": stand_still - ordinary if stand_still is not None else None,
            "unnamed_s": stand_still - named if stand_still is not None else None}


def summarise(runs: list[dict]) -> dict:
    done = [run for run in runs if not run.get("failed")]
    stalls = [run["survivors_stall_s"] for run in done if run["survivors_stall_s"] is not None]
    phases = sorted({name for run in done for name in run["phases_s"]})
    return {"runs": len(runs), "grew": sum(run["grew"] for run in runs),
            "exit_0": sum(run["status"] == 0 for run in runs),
            "launcher_failed": sum(run["launcher_failed"] for run in runs),
            "left_running": sum(run["left_running"] for run in runs),
            "same_parameters": sum(run["same_parameters"] for run in runs),
            "survivors_stall_s_median": statistics.median(stalls) if stalls else None,
            "survivors_stall_s_max": max(stalls) if stalls else None,
            "ordinary_step_s_median": statistics.median(run["ordinary_step_s"] for run in done) if done else None,
            "unnamed_s_median": statistics.median(run["unnamed_s"] for run in done) if done else None,
            "phases_s_median": {name: statistics.median(run["phases_s"][name] for run in done
                                                        if run["phases_s"].get(name) is not None)
                                for name in phases}}


def main() -> None:
    from fakehosts import FakeHosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--kill-at", type=int, default=KILL_AT, help="the iteration rank 1 kills itself in")
    parser.add_argument("--out", type=Path, default=RESULT, help="where the results go (default: %(default)s)")
    args = parser.parse_args()
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec", "noded"], Path(tmp), tag="g").up()
        try:
            for repeat in range(args.repeats):
                work = Path(tmp) / f"run{repeat}"
                work.mkdir()
                try:
                    runs.append(one_run(hosts, work, args.kill_at))
                except Exception as exc:  # a run that never got so far (a timeout): counted, not dropped
                    runs.append({"status": None, "launcher_failed": True, "left_running": 0, "grew": False,
                                 "same_parameters": False, "failed": True, "error": str(exc)[-3000:]})
                print(json.dumps(runs[-1]), flush=True)
        finally:
            hosts.down()
    summary = summarise(runs)
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                                    "python": platform.python_version(), "kill_at_iteration": args.kill_at,
                                    "summary": summary, "runs": runs}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
