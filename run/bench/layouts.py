"""In-job recovery on the layouts clusters run, under `launch`'s defaults, counted (issue 44): does the run finish
in one attempt, is a healthy host ever left out, is anything left running, is any run longer than its bound.
Not timed beyond that: counts.

Scenarios, on fake hosts (network namespaces, tests/fakehosts.py; needs root), each --repeats times:
  two-a-host         -H nodea:2,nodeb:2 -np 4: rank 3 (nodeb) SIGKILLs itself at step 20 (--inject-fault kill):
                     the global batch 128 does not split over 3, so the survivors share it unevenly
  two-a-host-spares  -H nodea:2,nodeb:2,nodec:2 -np 4: the same, nodec's two slots run hot spares; the job grows
                     back to 4
  stop-rank-0        -H nodea:1,nodeb:1,nodec:1 -np 2: rank 0 SIGSTOPped after the epoch-2 snapshot,
                     --hang-timeout 10: recovered in the job, or one relaunch without nodea
  kill-in-save       -H nodea:1,nodeb:1,nodec:1 -np 2: rank 1 (nodeb) SIGKILLs itself as the save after
                     epoch 2 (step 44) starts (--inject-fault kill-save)
A run finishes when launch exits 0 with the job's summary.json; "one attempt" counts attempts.json's entries (a
start-up race of Open MPI's launcher, status 213 before any rank ran, is counted apart); a healthy host is any
host but the one whose rank was lost in an attempt's excluded_hosts; leftovers are processes still in any fake
host once launch has exited.

usage: python run/bench/layouts.py [--repeats 10] [--only two-a-host,...]
Writes run/bench/results/layouts.json (one line per run, and the counts).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "run" / "bench"))
from fakehosts import SUBNET, FakeHosts, running_fake_hosts  # noqa: E402
from one_rank_lost import LAUNCHER_NEVER_STARTED_STATUS, command_line, environment, rank_pid  # noqa: E402

OUT = REPO / "run" / "bench" / "results" / "layouts.json"
FAST = ["--no-progress", "--wandb", "disabled"]


@dataclass(frozen=True)
class Scenario:
    hosts: tuple[str, ...]
    layout: str
    np: int
    flags: tuple[str, ...]
    lost_host: str
    bound_s: float  # the longest a run may take, start-up to exit, on this 2-core machine
    stop_rank_0_after: str = ""  # SIGSTOP rank 0 once a line holds this
    relaunch_allowed: bool = False  # a hung rank 0 the job cannot recover from in place: one relaunch without it
    grows: bool = False
    extra_env: dict[str, str] = field(default_factory=dict)


KILL = ("--epochs", "3", "--inject-fault", "kill:3:20")
SCENARIOS = {
    "two-a-host": Scenario(("nodea", "nodeb"), "nodea:2,nodeb:2", 4, KILL, "nodeb", 120),
    "two-a-host-spares": Scenario(("nodea", "nodeb", "nodec"), "nodea:2,nodeb:2,nodec:2", 4,
                                  ("--epochs", "16", "--inject-fault", "kill:3:20"), "nodeb", 150, grows=True),
    "stop-rank-0": Scenario(("nodea", "nodeb", "nodec"), "nodea:1,nodeb:1,nodec:1", 2,
                            ("--epochs", "6", "--hang-timeout", "10", "--grad-transport", "gloo"), "nodea", 240,
                            stop_rank_0_after="snapshot-epoch0002.pt", relaunch_allowed=True),
    "kill-in-save": Scenario(("nodea", "nodeb", "nodec"), "nodea:1,nodeb:1,nodec:1", 2,
                             ("--epochs", "4", "--inject-fault", "kill-save:1:44"), "nodeb", 120),
}


def one_run(hosts: FakeHosts, name: str, scenario: Scenario, work: Path) -> dict[str, Any]:
    run_dir = work / "run"
    env = {**environment(), **scenario.extra_env}
    transport = f"--mca btl_tcp_if_include {SUBNET}.0/24 --mca plm_rsh_agent {hosts.agent}"
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", scenario.layout, "-np", str(scenario.np),
               "--launcher-args", transport, "--", "--run-dir", str(run_dir), *FAST, *scenario.flags]
    started = time.monotonic()
    process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    stopped = threading.Event()

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if scenario.stop_rank_0_after and not stopped.is_set() and scenario.stop_rank_0_after in line \
                    and "saved " in line:
                pid = rank_pid(run_dir, 0)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=scenario.bound_s * 3)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
        status = -9
    reader.join(30)
    wall = time.monotonic() - started
    left = [f"{host}: {command_line(pid)}" for host in hosts.names
            for pid in subprocess.run(["ip", "netns", "pids", hosts.prefix + host], capture_output=True,
                                      text=True).stdout.split()]
    try:
        attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        attempts = []
    never_started = sum(1 for a in attempts if a.get("status") == LAUNCHER_NEVER_STARTED_STATUS
                        and not a.get("failed_hosts"))
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    causes = [r.get("cause") for r in summary.get("recoveries", [])]
    healthy_out = sorted({h for a in attempts for h in a.get("excluded_hosts", []) if h != scenario.lost_host})
    real_attempts = len(attempts) - never_started
    finished = status == 0 and bool(summary)
    in_one = real_attempts == 1 or (scenario.relaunch_allowed and real_attempts == 2
                                    and scenario.lost_host in attempts[-1].get("excluded_hosts", []))
    return {"scenario": name, "status": status, "finished": finished, "one_attempt": finished and in_one,
            "attempts": len(attempts), "launcher_never_started": never_started, "recoveries": causes,
            "grew_back": "grew" in causes, "healthy_hosts_left_out": healthy_out, "left_running": len(left),
            "left": left, "wall_s": round(wall, 1), "within_bound": wall <= scenario.bound_s,
            "stopped_rank_0": stopped.is_set() if scenario.stop_rank_0_after else None,
            "eval_accuracy": summary.get("eval_accuracy"),
            "last_lines": "".join(lines[-15:]) if not finished else "",
            "said": [line.strip()[:300] for line in lines if "grow" in line or "spare" in line][:8]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("layouts.py needs root (fake hosts are network namespaces)")
    runs: list[dict[str, Any]] = []
    names = args.only.split(",")
    for repeat in range(args.repeats):  # interleaved: the machine's drift spreads over every scenario alike
        for name in names:
            scenario = SCENARIOS[name]
            with tempfile.TemporaryDirectory() as folder:
                work = Path(folder)
                (work / "fakehosts").mkdir()
                with running_fake_hosts(FakeHosts(list(scenario.hosts), work / "fakehosts", tag="y")) as hosts:
                    result = one_run(hosts, name, scenario, work)
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "last_lines"}), flush=True)
    counts = {}
    for name in dict.fromkeys(r["scenario"] for r in runs):
        mine = [r for r in runs if r["scenario"] == name]
        counts[name] = {"runs": len(mine), "finished": sum(r["finished"] for r in mine),
                        "finished_in_one_attempt": sum(r["one_attempt"] for r in mine),
                        "grew_back": sum(r["grew_back"] for r in mine),
                        "healthy_host_left_out": sum(bool(r["healthy_hosts_left_out"]) for r in mine),
                        "left_running": sum(r["left_running"] > 0 for r in mine),
                        "over_bound": sum(not r["within_bound"] for r in mine),
                        "launcher_never_started": sum(r["launcher_never_started"] for r in mine),
                        "wall_s": sorted(r["wall_s"] for r in mine)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"counts": counts, "runs": runs, "cores": os.cpu_count()}, indent=1) + "\n")
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
