"""A lost host under `launch` (mpiddp/launch/relay.py, mpiddp/job/silenthost.py), measured on three fake hosts (one
rank each, digits, the built-in trainer), interleaved per repeat:
- nothing fails, with the relay layout (training's default) and without it (--no-host-crash-relays): start-up
  (the launch's start to the first step's record) and throughput (median images/s of the steps after the first);
- nodeb crashes (every process on it SIGKILLed) after step 2, with the relays: from the kill to the survivors' next
  step record;
- nodeb goes silent (every process on it SIGSTOPped and its link down) after step 2, with the relays: from then to
  the survivors' next step record (the silent-host watch's 10 s bound is most of it).
Times are from this machine's one clock (the fake hosts share it). Writes run/bench/results/host-loss.json.

usage: sudo python run/bench/hostloss.py [--repeats 3]   (root: fake hosts are network namespaces)
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
RESULT = REPO / "run" / "bench" / "results" / "host-loss.json"
HOSTS = "nodea:1,nodeb:1,nodec:1"


def steps_of(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [r for r in (json.loads(line) for line in lines if line.strip()) if r.get("kind") == "step"]


def one_run(hosts, work: Path, variant: str, extra: tuple[str, ...] = ()) -> dict:
    """variant: relays, no-relays (nothing fails), crash or silent (nodeb lost after step 2, with the relays)."""
    from conftest import rank_pids
    from test_drill import drill_env
    from test_host_loss import last_step, wait_for
    from test_launch_e2e import FAST, attempts, launch_command
    from test_leftovers import assert_nothing_left
    from test_node_loss import go_silent, power_off

    run_dir, log = work / "run", work / "launch.log"
    relays = ("--no-host-crash-relays",) if variant == "no-relays" else ()
    epochs = "3" if variant in ("relays", "no-relays") else "2"
    command = launch_command("-H", HOSTS, "-np", "3", "--launcher", "mpirun", "--launcher-args",
                             " ".join(hosts.transport_args()), "--run-dir", str(run_dir), *relays, "--",
                             "--run-dir", str(run_dir), "--epochs", epochs, *FAST, "--log-every", "1", *extra)
    env, mark = drill_env()
    started, lost_at, stopped = time.time(), None, []
    with log.open("w") as out:
        process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=out)
    try:
        if variant in ("crash", "silent"):
            if not wait_for(lambda: len(rank_pids(run_dir)) == 3 and last_step(run_dir) >= 2, 180, process):
                raise RuntimeError(log.read_text()[-3000:])
            lost_at = time.time()
            if variant == "crash":
                hosts.kill_host("nodeb")
            else:
                stopped = go_silent(hosts, "nodeb")
        process.wait(timeout=400)
    finally:
        power_off(hosts, "nodeb", stopped)
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    steps = steps_of(run_dir)
    result = {"variant": variant, "status": process.returncode,
              "attempts": len(attempts(run_dir)["attempts"]) if (run_dir / "attempts.json").exists() else None}
    if not steps:
        return {**result, "failed": True, "output_tail": log.read_text()[-3000:]}
    if lost_at is None:
        return {**result, "startup_s": min(r["time"] for r in steps) - started,
                "images_per_second": statistics.median(r["images_per_second"] for r in steps if r["step"] >= 2)}
    after = [r["time"] for r in steps if r["time"] > lost_at]
    recovered = json.loads((run_dir / "summary.json").read_text()).get("recoveries", []) \
        if (run_dir / "summary.json").exists() else []
    return {**result, "lost_to_next_step_s": min(after) - lost_at if after else None,
            "recoveries": [{k: r.get(k) for k in ("cause", "hosts_lost", "phases")} for r in recovered]}


def summarise(runs: list[dict]) -> dict:
    def of(variant):
        return [r for r in runs if r["variant"] == variant and not r.get("failed")]

    table: dict = {}
    quiet = {v: of(v) for v in ("relays", "no-relays")}
    if quiet["relays"] and quiet["no-relays"]:
        table["nothing_fails_relays_vs_none"] = {
            "startup_ratio_median": statistics.median(r["startup_s"] for r in quiet["relays"])
            / statistics.median(r["startup_s"] for r in quiet["no-relays"]),
            "throughput_ratio_median": statistics.median(r["images_per_second"] for r in quiet["relays"])
            / statistics.median(r["images_per_second"] for r in quiet["no-relays"]),
            "startup_s": {v: [round(r["startup_s"], 2) for r in rs] for v, rs in quiet.items()},
            "images_per_second": {v: [round(r["images_per_second"], 1) for r in rs] for v, rs in quiet.items()},
        }
    for variant in ("crash", "silent"):
        mine = [r for r in of(variant) if r.get("lost_to_next_step_s") is not None]
        if mine:
            table[variant] = {"runs": len(of(variant)), "in_job": sum(1 for r in mine if r["attempts"] == 1),
                              "lost_to_next_step_s_median": statistics.median(r["lost_to_next_step_s"] for r in mine),
                              "lost_to_next_step_s": [round(r["lost_to_next_step_s"], 3) for r in mine]}
    return table


def main() -> None:
    from fakehosts import FakeHosts

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--variants", default="relays,no-relays,crash,silent", help="interleaved, in this order")
    parser.add_argument("--grad-transport", default="auto", help="training's: fix it to compare like with like")
    parser.add_argument("--out", default=str(RESULT))
    args = parser.parse_args()
    os.chdir(REPO)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        hosts = FakeHosts(["nodea", "nodeb", "nodec"], Path(tmp), tag="l").up()
        try:
            for repeat in range(args.repeats):
                for variant in args.variants.split(","):  # interleaved
                    work = Path(tmp) / f"{variant}{repeat}"
                    work.mkdir()
                    runs.append(one_run(hosts, work, variant, ("--grad-transport", args.grad_transport)))
                    print(json.dumps(runs[-1]), flush=True)
        finally:
            hosts.down()
    table = summarise(runs)
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cores": os.cpu_count(),
                                          "python": platform.python_version(), "hosts": HOSTS,
                                          "grad_transport": args.grad_transport, "summary": table, "runs": runs},
                                         indent=1) + "\n")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
