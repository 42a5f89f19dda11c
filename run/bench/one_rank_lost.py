"""One lost rank under `launch`'s defaults, counted (issue 33): does the run finish, is a healthy host ever left
out, is anything left running, and how often did the launcher itself crash on the way. Not timed: counts.

Scenarios, on fake hosts (network namespaces, tests/fakehosts.py; needs root), each --repeats times:
  kill-3-hosts  -H nodea:1,nodeb:1,nodec:1 -np 2: rank 1 (nodeb) SIGKILLs itself at step 30 (--inject-fault)
  kill-4-hosts  -H nodea..noded:1 -np 3: the same, noded the spare
  stop-ssh-agent  3 hosts -np 2, the agent given only as PRTE_MCA_plm_ssh_agent (as Open MPI 5 reads it):
                rank 1 SIGSTOPped after the epoch-2 snapshot, --hang-timeout 8
A run counts as finished when launch exits 0 with the job's summary.json; a healthy host is any host but nodeb
in an attempt's excluded_hosts; leftovers are processes still in any fake host once launch has exited.
Launcher crashes: attempts.json's `launcher_crash` (during a spawn, after the job's end mark) and attempts Open
MPI's launcher lost before any rank started (status 213).

usage: python run/bench/one_rank_lost.py [--repeats 10] [--only kill-3-hosts,...]
Writes run/bench/results/one-rank-lost.json (one line per run, and the counts).
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
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
from fakehosts import SUBNET, FakeHosts, running_fake_hosts  # noqa: E402

OUT = REPO / "run" / "bench" / "results" / "one-rank-lost.json"
FAST = ["--no-progress", "--wandb", "disabled"]
SCENARIOS = ("kill-3-hosts", "kill-4-hosts", "stop-ssh-agent")
LAUNCHER_NEVER_STARTED_STATUS = 213
TIMEOUT_S = 600


def environment() -> dict[str, str]:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", PYTHONUNBUFFERED="1")
    env.pop("MPIDDP_MASTER_ADDR", None)
    return env


def rank_pid(run_dir: Path, rank: int) -> int | None:
    found = subprocess.run(["pgrep", "-f", f"mpiddp --run-dir {run_dir}"], capture_output=True, text=True).stdout
    for pid in found.split():
        try:
            if f"OMPI_COMM_WORLD_RANK={rank}".encode() in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                return int(pid)
        except OSError:
            continue
    return None


def command_line(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:200]
    except OSError:
        return f"pid {pid} (gone)"


def one_run(hosts: FakeHosts, scenario: str, work: Path) -> dict[str, Any]:
    run_dir = work / "run"
    env = environment()
    names = hosts.names
    host_list = ",".join(f"{name}:1" for name in names)
    np = len(names) - 1
    transport = f"--mca btl_tcp_if_include {SUBNET}.0/24"
    flags = ["--epochs", "3", "--inject-fault", "kill:1:30"]
    if scenario == "stop-ssh-agent":
        env["PRTE_MCA_plm_ssh_agent"] = str(hosts.agent)
        flags = ["--epochs", "6", "--hang-timeout", "8", "--collective-timeout", "8", "--grad-transport", "gloo"]
    else:
        transport += f" --mca plm_rsh_agent {hosts.agent}"
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", host_list, "-np", str(np), "--launcher-args",
               transport, "--", "--run-dir", str(run_dir), *FAST, *flags]
    started = time.monotonic()
    process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    stopped = threading.Event()

    def read() -> None:
        for line in process.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if scenario == "stop-ssh-agent" and not stopped.is_set() and "snapshot-epoch0002.pt" in line \
                    and "saved " in line:
                pid = rank_pid(run_dir, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGSTOP)
                    stopped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        status = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        status = -9
    reader.join(30)
    wall = time.monotonic() - started
    left = [f"{name}: {command_line(pid)}" for name in names
            for pid in subprocess.run(["ip", "netns", "pids", hosts.prefix + name], capture_output=True,
                                      text=True).stdout.split()]
    try:
        attempts = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        attempts = []
    healthy_out = sorted({h for a in attempts for h in a.get("excluded_hosts", []) if h != "nodeb"})
    crashes = [a.get("launcher_crash") for a in attempts if a.get("launcher_crash")]
    never_started = sum(1 for a in attempts if a.get("status") == LAUNCHER_NEVER_STARTED_STATUS
                        and not a.get("failed_hosts"))
    return {"scenario": scenario, "status": status, "finished": status == 0 and (run_dir / "summary.json").exists(),
            "healthy_hosts_left_out": healthy_out, "left_running": len(left), "left": left, "attempts": len(attempts),
            "launcher_crashes": crashes, "launcher_never_started": never_started,
            "stopped_rank": stopped.is_set() if scenario == "stop-ssh-agent" else None,
            "wall_s": round(wall, 1), "last_lines": "".join(lines[-15:]) if status != 0 else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--only", default=",".join(SCENARIOS))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("one_rank_lost.py needs root (fake hosts are network namespaces)")
    runs: list[dict[str, Any]] = []
    for scenario in args.only.split(","):
        names = ["nodea", "nodeb", "nodec", "noded"] if scenario == "kill-4-hosts" else ["nodea", "nodeb", "nodec"]
        for repeat in range(args.repeats):
            with tempfile.TemporaryDirectory() as folder:
                work = Path(folder)
                (work / "fakehosts").mkdir()
                with running_fake_hosts(FakeHosts(names, work / "fakehosts", tag="x")) as hosts:
                    result = one_run(hosts, scenario, work)
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "last_lines"}), flush=True)
    counts = {}
    for scenario in dict.fromkeys(r["scenario"] for r in runs):
        mine = [r for r in runs if r["scenario"] == scenario]
        counts[scenario] = {"runs": len(mine), "finished": sum(r["finished"] for r in mine),
                            "healthy_host_left_out": sum(bool(r["healthy_hosts_left_out"]) for r in mine),
                            "left_running": sum(r["left_running"] > 0 for r in mine),
                            "launcher_crashes": sum(len(r["launcher_crashes"]) for r in mine),
                            "launcher_never_started": sum(r["launcher_never_started"] for r in mine)}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"counts": counts, "runs": runs, "cores": os.cpu_count()}, indent=1) + "\n")
    print(json.dumps(counts, indent=1))


if __name__ == "__main__":
    main()
