"""Growing back after an in-job recovery (mpiddp/elastic/grow.py), measured on four fake hosts: the built-in
trainer (digits) under `mpirun --with-ft ulfm -np 3` on nodea-nodec with noded as the spare
(MPIDDP_SPARE_HOSTS=noded); the rank on nodeb is held at step KILL_AT (--inject-fault stall-data) and SIGKILLed,
the survivors recover, train a step on 2 ranks, and spawn a rank on noded. Per run: the grow's phases as the job
recorded them (spawn, merge, process group, state transfer, DDP, first step) and the throughput (images/s per
step, from metrics.jsonl) before the failure against after the grow (from 5 steps after it), for the gloo and
MPI gradient transports, the survivors' stand-still and the new rank's warm-up. Writes run/bench/results/only-grow.json
(or --out).

usage: sudo python run/bench/grow.py [--repeats 3]   (root: fake hosts are network namespaces)
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
RESULT = REPO / "run" / "bench" / "results" / "only-grow.json"
KILL_AT = 20  # steps at full size before the failure (30 steps an epoch on 3 ranks)
SETTLE = 5  # steps after the grow left out of its throughput (warm-up of the new rank's caches)


def one_run(hosts, work: Path, transport: str) -> dict:
    from test_grow_e2e import GrowJob

    job = GrowJob(hosts, work, "--grad-transport", transport, "--inject-fault", f"stall-data:1:{KILL_AT}",
                  "--epochs", "3", "--save-every", "100")
    job.kill_when_stalled(1)
    status = job.finish(timeout=400)
    tail = [line for line in job.output().splitlines() if "hostname of the client" not in line][-25:]
    if not (job.run_dir / "summary.json").exists():
        return {"transport": transport, "status": status, "failed": True, "output_tail": tail}
    summary = json.loads((job.run_dir / "summary.json").read_text())
    grew = next(r for r in summary["recoveries"] if r["cause"] == "grew")
    steps = [r for r in (json.loads(line) for line in (job.run_dir / "metrics.jsonl").read_text().splitlines())
             if r["kind"] == "step"]
    before = [r["images_per_second"] for r in steps if 2 <= r["step"] <= KILL_AT]  # step 1: warm-up
    after = [r["images_per_second"] for r in steps if r["step"] > grew["step"] + SETTLE]
    phases = grew["phases"]
    return {"transport": transport, "status": status, "grow_step": grew["step"], "phases_s": phases,
            "grow_downtime_s": sum(v for v in phases.values() if v is not None),
            "survivors_stall_s": grew.get("survivors_stall"), "warm_up_s": grew.get("warm_up"),
            "images_per_second_before_failure": statistics.median(before),
            "images_per_second_after_grow": statistics.median(after),
            "after_vs_before": statistics.median(after) / statistics.median(before),
            "steps": len(steps), "world_size_at_end": summary["world_size"],
            "output_tail": tail if status != 0 else []}


def main() -> None:
    from fakehosts import FakeHosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULT, help="where the results go (default: %(default)s)")
    args = parser.parse_args()
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec", "noded"], Path(tmp), tag="b").up()
        try:
            for repeat in range(args.repeats):
                for transport in ("gloo", "mpi"):  # interleaved
                    work = Path(tmp) / f"{transport}{repeat}"
                    work.mkdir()
                    runs.append(one_run(hosts, work, transport))
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            hosts.down()
    table = {}
    for transport in ("gloo", "mpi"):
        mine = [r for r in runs if r["transport"] == transport and not r.get("failed")]
        if not mine:
            continue
        table[transport] = {
            "runs": len(mine), "exit_0": sum(1 for r in mine if r["status"] == 0),
            "failed_runs": sum(1 for r in runs if r["transport"] == transport and r.get("failed")),
            "grow_downtime_s_median": statistics.median(r["grow_downtime_s"] for r in mine),
            "survivors_stall_s_median": statistics.median(r["survivors_stall_s"] for r in mine),
            "phases_s_median": {name: statistics.median(r["phases_s"][name] for r in mine)
                                for name in mine[0]["phases_s"]},
            "after_vs_before_median": statistics.median(r["after_vs_before"] for r in mine),
        }
    args.out.write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                                  "python": platform.python_version(), "kill_at_step": KILL_AT,
                                  "settle_steps": SETTLE, "summary": table, "runs": runs}, indent=1) + "\n")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
