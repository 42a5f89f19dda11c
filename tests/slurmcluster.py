"""A real one-node Slurm (Debian's slurmctld, slurmd, munge) started for the tests and stopped by PID afterwards.

Its configuration lives in a temporary folder and reaches every Slurm command through SLURM_CONF, so the
machine's own /etc/slurm is never touched.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "scontrol", "scancel", "srun", "sinfo")
GRACE_S = 60  # the preemptible partition's grace time: SIGTERM, then this long to save before the kill


def impossible_reason(env: dict[str, str] | None = None) -> str | None:
    """Why a test Slurm cannot start here (the tier then skips, saying so), or None where it should: as root with
    Slurm installed, or as root under CI (`CI=true`, where .ci/run installs it). Where it should, anything
    missing or failing is a failure (`missing_parts`, SlurmCluster.up), never a skip: the tier cannot vanish."""
    env = os.environ if env is None else env
    if os.geteuid() != 0:
        return "a test Slurm needs root (its daemons run as root here)"
    if shutil.which("slurmctld") is None and env.get("CI") != "true":
        return ("Slurm is not installed (slurmctld missing): apt-get install slurmctld slurmd slurm-client munge "
                "libpmix-dev (under CI=true this fails instead)")
    return None


def missing_parts() -> str | None:
    """What a test Slurm lacks here, where it should start: a failure, with what to do."""
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        return (f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurmctld slurmd "
                "slurm-client munge")
    if not Path("/etc/munge/munge.key").is_file():
        return "munge has no key (/etc/munge/munge.key): reinstall munge"
    return None


class SlurmCluster:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.pids: list[int] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def up(self) -> None:
        for folder in ("state", "spool", "tmp"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        host = socket.gethostname()
        self.conf.write_text("\n".join([
            "ClusterName=mpiddptest",
            f"SlurmctldHost={host}",
            "AuthType=auth/munge",
            "AuthInfo=cred_expire=5",  # a requeued job may start again 5 s after it ended (default 120)
            "SlurmUser=root",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "ReturnToService=2",
            # A step that fails (srun --kill-on-bad-exit) sends SIGTERM to its other ranks, which then wait on the
            # dead one to agree a stop: only the SIGKILL KillWait later ends them (the default 30 s was half of a
            # test's time). A plain scancel's ranks save within it: measured 0.5-0.6 s from the signal to exit 3.
            "KillWait=5",
            # Start a requeued job as soon as cred_expire allows: the main scheduling loop runs every 60 s by default
            # and the backfill loop every 30 s, and a requeued job waited for one of them.
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "MinJobAge=600",  # finished jobs stay visible to scontrol for their exit codes
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            # srun --mpi=pmix makes TmpFS/spmix_appdir_<uid>_<job>.<step>; a cluster's own TmpFS keeps one that a
            # killed job left from breaking the next test Slurm's job of the same number ("File exists").
            f"TmpFS={self.root / 'tmp'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            f"NodeName={host} CPUs={os.cpu_count() or 1} State=UNKNOWN",
            # Real preemption: a job in `high` preempts one in `low`, which gets SIGTERM, GRACE_S to save, then
            # is requeued by Slurm (or ends by itself, and must requeue itself: run/slurm.sbatch does).
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES PreemptMode=OFF",
            f"PartitionName=low Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S}",
            "PartitionName=high Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF",
            "",
        ]))
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        if subprocess.run(["pgrep", "-x", "munged"], capture_output=True).returncode != 0:
            shutil.chown("/run/munge", "munge", "munge")
            subprocess.run(["runuser", "-u", "munge", "--", "munged"], check=True, capture_output=True, text=True)
            self.pids.append(int(subprocess.run(["pgrep", "-nx", "munged"], capture_output=True, text=True).stdout))
        subprocess.run(["slurmctld", "-i", "-f", str(self.conf)], check=True, env=self.env, capture_output=True, text=True)
        subprocess.run(["slurmd", "-f", str(self.conf)], check=True, env=self.env, capture_output=True, text=True)
        for pidfile in ("slurmctld.pid", "slurmd.pid"):
            self.pids.append(self._wait_for_pid(self.root / pidfile))
        self._wait_until_idle()

    def _wait_for_pid(self, pidfile: Path, within_s: float = 30) -> int:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            if pidfile.is_file() and pidfile.read_text().strip():
                return int(pidfile.read_text())
            time.sleep(0.2)  # polling a daemon's start-up, not synchronising our own processes
        raise RuntimeError(f"{pidfile} did not appear: {self.log_tail()}")

    def _wait_until_idle(self, within_s: float = 60) -> None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%T").stdout.strip()
            if state.startswith("idle") or state.startswith("mix"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test node never became idle (sinfo: {state!r}): {self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join((self.root / name).read_text()[-1500:] for name in ("slurmctld.log", "slurmd.log")
                         if (self.root / name).is_file())

    def down(self) -> None:
        for pid in reversed(self.pids):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        # Wait until they are gone: a slurmd still stopping holds its port, and the next test Slurm's steps fail.
        deadline = time.monotonic() + 30
        while any(_alive(pid) for pid in self.pids) and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for daemons to exit
        for pid in self.pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.pids.clear()
        # A job still ending (KillWait) outlives its daemons: its slurmstepd would report to the next test Slurm,
        # which numbers jobs from 1 again, and end that cluster's job 1. Nothing of a job may survive its cluster.
        for pid in _job_processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 30
        while _job_processes() and time.monotonic() < deadline:
            time.sleep(0.2)  # waiting for killed processes to be reaped


    def run(self, *command: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(command), env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=60)

    def submit(self, *args: str, env: dict[str, str] | None = None, cwd: Path) -> int:
        done = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, cwd=cwd,
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        text = self.run("scontrol", "show", "job", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for(self, job_id: int, states: tuple[str, ...], within_s: float) -> dict[str, str]:
        deadline = time.monotonic() + within_s
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)  # polling the scheduler's state
        raise AssertionError(f"job {job_id} not in {states} within {within_s} s: {info}\n{self.log_tail()}")


def _job_processes() -> list[int]:
    """Every slurmstepd on this machine and all its descendants (only test clusters run here: tests need root)."""
    children: dict[int, list[int]] = {}
    stepds = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
        if name == "slurmstepd":
            stepds.append(int(entry.name))
    found, pending = [], list(stepds)
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (our own exited child) is gone for every purpose here
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
