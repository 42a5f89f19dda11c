"""The supervisor: run the launcher, watch it, and after a failure relaunch without the bad host until done.

It runs outside MPI (never imports mpi4py or torch.distributed) and never parses the job's flags. It talks to the
job through the environment it sets (mpiddp.contract), the exit status, the records the job writes (RUN_DIR/job.json:
where training writes and its global batch; RUN_DIR/failures/: every failing rank's record, and where every rank ran,
placement.json), and the launcher's own output (its evidence lines, wherever they appear).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from mpiddp import failure, recoveries, supervision
from mpiddp.atomicfile import write_text_atomic
from mpiddp.contract import (FAILURE_FILE_ENV, GLOBAL_BATCH_ENV, HOST_RELAYS_ENV, JOB_RECORD_ENV, JOB_RECORD_FILE,
                             LAUNCH_ID_ENV, MIN_NP_ENV, RESTART_COUNT_ENV, RUN_DIR_ENV, SPARE_RANKS_ENV, JobRecord,
                             finished_since, read_job_record)
from mpiddp.errors import EXIT_CRASH, EXIT_HANG, EXIT_USER_ERROR
from mpiddp.failure import ATTEMPTS_FILE
from mpiddp.launch.command import InJobRecovery, build_command, growth_hosts, hot_spare_ranks
from mpiddp.launch.ender import Ender, end_daemons, end_session, host_agent, host_command, kill_group
from mpiddp.launch.diagnose import (CRASH_TAKES_S, ENDED_BEFORE_START, EXIT_STOPPED, STARTUP_OVERDUE, Failure,
                                    OutputKeeper, after_spawn, diagnose, during_spawn)
from mpiddp.launch.hosts import Host, HostListError, place
from mpiddp.launch.policy import (Decision, blamed, contradicted_by_records, decide, same_host,
                                  strike_lost_in_job)
from mpiddp.launch.probe import PROBE_TIMEOUT_S, hosts_to_probe, probe_command, probe_hosts, remote_hosts, weigh
from mpiddp.launch.relay import (NO_RELAYS, RelayLayout, agent_failures, decide_layout, hosts_ended,
                                 remove_layout, without_agent, write_layout)

# launch's exit status after a failure it ended the launcher for, by the failure's cause (else EXIT_CRASH)
CAUSE_STATUS = {"hang": EXIT_HANG, "stopped": EXIT_STOPPED, "user_error": EXIT_USER_ERROR}
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
KILL_AFTER_INTERRUPTS = 3  # the third Ctrl-C kills the launcher's process group: no snapshot
OUTPUT_TAIL_LINES = 400  # the launcher's last lines, kept with every evidence line before them (OutputKeeper)
# After the launcher exits, its output is passed on for at most this much longer (a process that left its
# session may write on); what the relays have not passed on by then is still in the run dir's attemptN.out/.err.
RELAY_DRAIN_S = 10.0
# How long the launcher may outlive the job's own account of its end before launch ends it: the finished mark
# (under MPI fault tolerance), or a failure record from every rank (each writes it as its process ends): a process
# that lingers after that (Open MPI's runtime stuck in its abort, its mpirun in its teardown) must not hold an
# unwatched run forever.
FINISHED_LINGER_S = 60.0
# The same after a job that lost a host in the job (its records say which): Open MPI's mpirun then waits for that
# host's ranks forever, so it is ended once it had a moment to end by itself. Also how long a daemon may have
# ended before the job started (no placement yet) until launch ends the attempt: under the relay layout its relay
# carries on and mpirun waits for that host's ranks forever (Supervisor._not_started)
LOST_HOST_LINGER_S = 5.0
RELAY_POLL_S = 0.1  # how often a relay looks for new output
# How long an attempt may run before every rank came through MPI's start-up (the job's placement: --startup-timeout,
# 0 never): a daemon or a rank stuck there (a hung filesystem, a blocked port) holds mpirun forever, silently.
# Python's imports from a shared filesystem at thousands of ranks take minutes; a stuck start never ends.
STARTUP_TIMEOUT_S = 600.0
# A stop (SIGTERM, SIGUSR1, Ctrl-C) lets the ranks save a snapshot; a job still running this long after it (a rank
# stopped or wedged holds the others in the stop's collectives) is ended whole, as the third Ctrl-C ends it
STOP_GRACE_S = 120.0
STOP_GRACE_ENV = "MPIDDP_STOP_GRACE_S"  # another grace, in seconds (tests)


@dataclass(frozen=True)
class Plan:
    """What the user asked for, resolved: every attempt is built from it."""

    mode: str  # "train" or "run"
    inner: list[str]  # what follows `python -m mpiddp`, as the user gave it (never parsed)
    run_dir: Path  # launch's records; training's outputs too, unless its job record names another directory
    num_ranks: int
    hosts: list[Host]  # every host known, spares included (empty: the launcher places the ranks)
    excluded: list[str]
    max_restarts: int
    launcher: str
    program: str
    flavour: str
    extra: list[str] = field(default_factory=list)
    min_np: int | None = None  # with no spare left, continue on fewer ranks, down to this many
    global_batch: tuple[int, int] | None = None  # training with --min-np: (samples per step, largest per-rank batch)
    host_strikes: int = 1  # a host is left out on its N-th blamed failure
    made_run_dir: bool = False  # launch created run_dir: removed if training writes elsewhere and leaves it empty
    in_job_recovery: InJobRecovery = InJobRecovery(False, "in-job recovery is off")  # decided once per launch
    node_loss_args: tuple[str, ...] = ()  # so a silent host ends the attempt in seconds (command.node_loss_args)
    relay_layout: RelayLayout = NO_RELAYS  # a crashed host recovered in the job (launch.relay), when asked for
    startup_timeout_s: float = STARTUP_TIMEOUT_S  # an attempt whose job never started is ended after it (0: never)


@dataclass
class Attempt:
    number: int  # within its launch
    hosts: list[str]
    command: list[str]
    started_at: float
    ended_at: float = 0.0
    status: int | None = None
    cause: str | None = None  # a failure-record kind; None for success
    cause_source: str = ""
    message: str = ""
    failed_ranks: list[int] = field(default_factory=list)
    failed_hosts: list[str] = field(default_factory=list)
    failed_at_step: int | None = None
    excluded_hosts: list[str] = field(default_factory=list)  # after this attempt
    decision: str = ""
    resumed_at_step: int | None = None  # where the next attempt resumed (training)
    steps_lost: int | None = None  # failed_at_step - resumed_at_step (a lower bound when no rank named its step)
    num_ranks: int = 0  # this attempt's ranks: fewer than -np after a shrink (--min-np)
    last_step_at: float | None = None  # when training last made progress (metrics.jsonl), else the failure's time
    downtime_s: float | None = None  # last_step_at -> the next attempt's first finished step (training)
    downtime_phases: dict[str, float] = field(default_factory=dict)  # those seconds per failure.DOWNTIME_PHASES
    launch: int = 0  # which `launch` in this run dir made it: a requeue or a resubmission adds its attempts after
    ranks_recorded: int | None = None  # how many ranks left a failure record (RUN_DIR/failures)
    witness_ranks: list[int] = field(default_factory=list)  # ranks that only saw a peer fail or time out
    blamed_hosts: list[str] = field(default_factory=list)  # the hosts this failure counted against
    in_job_recovery: bool = False  # the job ran with MPI fault tolerance (its survivors may recover in the job)
    in_job_recovery_off: str = ""  # why not, in one line, when off
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # in-job recoveries (the job's summary.json)
    launcher_crash: str = ""  # when the launcher itself failed: during a spawn, or after the job marked its end
    probed: dict[str, str] = field(default_factory=dict)  # after a start that failed: host -> "" answered, or why not


def job_exports(plan: Plan, number: int, launch_id: str) -> dict[str, str]:
    """What attempt `number` tells the job through the environment (names in mpiddp.contract); the launcher
    forwards them to every host. Training takes its run dir from here unless its own flags name another."""
    # absolute paths: a rank may run in another directory (--wdir, srun --chdir, $HOME on a host without this one)
    exports = {FAILURE_FILE_ENV: str(plan.run_dir.resolve() / failure.FAILURES_DIR), RESTART_COUNT_ENV: str(number),
               LAUNCH_ID_ENV: launch_id, RUN_DIR_ENV: str(plan.run_dir.resolve())}  # a script's finished mark too
    if plan.mode == "train":
        exports[JOB_RECORD_ENV] = str(plan.run_dir.resolve() / JOB_RECORD_FILE)
        if plan.min_np is not None and plan.global_batch is not None:  # the job derives its split on fewer ranks
            exports[GLOBAL_BATCH_ENV] = str(plan.global_batch[0])
    if plan.min_np is not None:  # in-job recovery goes on with no fewer ranks than a relaunch would
        exports[MIN_NP_ENV] = str(plan.min_np)
    return exports


def follow_job(plan: Plan, record: JobRecord | None) -> Plan:
    """The plan after the job said where it writes and what its global batch is (a failure then reads that run dir)."""
    if record is None:
        return plan
    batch = (record.global_batch, record.max_per_rank_batch) if plan.min_np is not None else plan.global_batch
    return replace(plan, run_dir=Path(record.run_dir), global_batch=batch)


def earlier_launches(run_dir: Path) -> tuple[list[dict[str, Any]], int]:
    """(the attempts of earlier launches in `run_dir`'s attempts.json, this launch's number)."""
    try:
        data = json.loads((run_dir / ATTEMPTS_FILE).read_text())
    except (OSError, ValueError):
        return [], 0
    attempts = data.get("attempts") if isinstance(data, dict) else None
    if not isinstance(attempts, list):
        return [], 0
    earlier = [a for a in attempts if isinstance(a, dict)]
    numbers = [a.get("launch", 0) for a in earlier]
    return earlier, max([n for n in numbers if isinstance(n, int)], default=-1) + 1


def placement_of(recorded: dict[int, str] | None, hosts: list[Host], num_ranks: int) -> dict[int, str]:
    """rank -> host-list name for an attempt: where the job recorded each rank ran (its host names matched to the
    host list's by short name), else, when it recorded nothing (it failed before start-up), ranks filling each
    host's slots in order (--map-by slot, srun's block). A recorded name that matches no host of the list (a
    host list of IP addresses) cannot be mapped: then the slot order too."""
    if recorded is not None:
        mapped = {rank: next((h.name for h in hosts if same_host(h.name, name)), None) for rank, name in recorded.items()}
        if not hosts:  # no host list: the launcher placed the ranks, and the job's names are the only ones
            return dict(recorded)
        if all(name is not None for name in mapped.values()):
            return {rank: name for rank, name in mapped.items() if name is not None}
    placement, rank = {}, 0
    for host in hosts:
        for _ in range(host.slots):
            if rank < num_ranks:
                placement[rank] = host.name
                rank += 1
    return placement


def ranks_on(hosts: list[Host], names: tuple[str, ...]) -> tuple[int, ...]:
    """The world ranks on hosts `names`, when ranks fill each host's slots in list order (--map-by slot, srun's block)."""
    ranks, first = [], 0
    for host in hosts:
        if any(same_host(host.name, name) for name in names):
            ranks.extend(range(first, first + host.slots))
        first += host.slots
    return tuple(ranks)


def status_under_fault_tolerance(status: int, records: list[failure.FailureRecord]) -> int:
    """The attempt's status when the launcher ran with MPI fault tolerance: Open MPI's mpirun --with-ft ulfm exits 0
    when a rank died and a survivor then aborted the job (reproduced with Open MPI 5.0.11), so a 0 with failure
    records of this attempt is a failure after all: the status the ranks recorded, else 1. A job whose survivors
    recovered in the job leaves no record."""
    if status != 0 or not records:
        return status
    return next((r.status for r in records if r.status), 1)


def last_logged_step(records: list[dict[str, Any]]) -> int | None:
    """The last training step in metrics.jsonl's `records`: where a rank that wrote no record had got to, at least."""
    steps = [r["step"] for r in records if r.get("kind") != "start"]
    return steps[-1] if steps else None


def start_step(records: list[dict[str, Any]], since: float) -> int | None:
    """The step a training attempt that began at `since` started from (its `start` record in metrics.jsonl)."""
    steps = [r["step"] for r in records if r.get("kind") == "start" and r.get("time", 0) >= since]
    return steps[-1] if steps else None


class Supervisor:
    def __init__(self, plan: Plan, env: dict[str, str] | None = None) -> None:
        self.plan = plan
        self.env = dict(os.environ if env is None else env)
        self.attempts: list[Attempt] = []
        self.child: subprocess.Popen[str] | None = None
        self.stop_signal = 0
        self.interrupts = 0
        self.stopped_at: float | None = None  # time.monotonic() of the first stop signal
        self.killed_at: float | None = None  # time.time() when launch ended the job itself after a stop
        # A relaunch resumes by itself (its restart count); with the user's --resume PATH, the job prefers the
        # snapshots this launch saved, which record this id.
        self.launch_id = uuid.uuid4().hex[:12]
        self.earlier, self.launch = earlier_launches(plan.run_dir)
        self.num_ranks = plan.num_ranks  # the next attempt's: fewer after a shrink (--min-np)
        self.ended_after_loss = False  # launch ended a launcher that waited for a lost host's ranks
        self.not_started = ""  # why launch ended an attempt whose job never started ("" when it did not)
        self.ended_launcher = False  # launch ended the attempt's launcher itself (its status is launch's SIGKILL)
        self._ended_seen: float | None = None  # when a host's daemon was first seen ended before the job started
        self._started: bool = False  # the attempt's job recorded its placement: its start is never judged again
        self._started_at = 0.0  # the attempt's start, on the monotonic clock
        self._daemon_hosts: list[str] = []  # the attempt's hosts, spares included: where its launcher starts daemons
        self.kept_once: set[str] = set()  # hosts kept once after a start that failed there (mpiddp.launch.probe)

    @property
    def child_stop(self) -> signal.Signals:
        """What a stop becomes for the ranks. Training: SIGUSR1, every rank saves at the same step and exits 3
        (Open MPI's mpirun would kill the ranks at once on SIGINT/SIGTERM, with no snapshot). A script: SIGTERM,
        as torchrun sends, since a user's script has no SIGUSR1 handler and would die of it."""
        return signal.SIGUSR1 if self.plan.mode == "train" else signal.SIGTERM

    @property
    def failure_file(self) -> Path:
        """The directory of every rank's failure record and the job's placement (MPIDDP_FAILURE_FILE)."""
        return self.plan.run_dir / failure.FAILURES_DIR

    def run(self) -> int:
        for signum in FORWARDED:
            signal.signal(signum, self._forward)
        # An ssh disconnect must not end the supervisor: the launcher (its own session) keeps running, and a job
        # left without its supervisor would never be relaunched. Stopping is SIGTERM/SIGUSR1/Ctrl-C. A handler
        # that does nothing, not SIG_IGN, which the launcher and its ranks would inherit across exec.
        signal.signal(signal.SIGHUP, _ignore_hangup)
        hosts_now, excluded = self._first_hosts(), list(self.plan.excluded)
        strikes: dict[str, int] = {}
        for number in range(self.plan.max_restarts + 1):
            if self.stop_signal:  # a stop between attempts: start nothing more
                stopped = f"stopped by {signal.Signals(self.stop_signal).name}: not relaunched"
                if self.attempts:
                    self.attempts[-1].decision = stopped
                    self._save()
                say(stopped)
                return EXIT_STOPPED
            attempt, output = self._attempt(number, hosts_now, excluded)
            self._follow_job()
            if attempt.cause_source == "supervisor":
                attempt.decision = "not relaunched: fix the launcher (--launcher-path, PATH) and launch again"
                self._save()
                say(f"attempt {number}: {attempt.message}; {attempt.decision}")
                return EXIT_USER_ERROR
            metrics = failure.read_metrics(self.plan.run_dir)  # once per attempt (it grows with the run): used below
            self._count_steps_lost(metrics)
            # a "recovery" from launch's own end of the job after a stop (a rank killed before its peers) is none
            attempt.recoveries = [item for item in recoveries.of_attempt(self.plan.run_dir, self.failure_file,
                                                                         attempt.started_at)
                                  if self.killed_at is None or float(item.get("time", 0.0)) < self.killed_at]
            attempt.status = self._job_status(attempt)
            within = recoveries.count_line(attempt.recoveries)
            if attempt.status == 0 or self.stop_signal:
                attempt.decision = "finished" if attempt.status == 0 else (
                    f"stopped by {signal.Signals(self.stop_signal).name}: not relaunched")
                attempt.cause = None if attempt.status == 0 else "stopped"
                attempt.excluded_hosts = list(excluded)
                self._save()
                say(f"attempt {number}: exit status {attempt.status}; {attempt.decision}"
                    + (f" after {within}" if within else ""))
                return attempt.status or 0
            found, placement, records = self._diagnose(attempt, output, hosts_now, metrics)
            found, spawn_failed_at = self._failed_in_a_spawn(attempt, found)
            progress_at = failure.last_progress_at(metrics, attempt.started_at, attempt.ended_at)
            attempt.last_step_at = progress_at if progress_at is not None else records[0].time if records else None
            decision = self._decide(attempt, found, placement, hosts_now, excluded, strikes, records, spawn_failed_at)
            attempt.cause, attempt.cause_source, attempt.message = found.kind, found.source, found.message
            attempt.failed_ranks, attempt.failed_hosts = list(found.ranks), list(found.hosts)
            attempt.ranks_recorded, attempt.witness_ranks = found.recorded, list(found.witnesses)
            attempt.blamed_hosts = blamed(found, self.plan.hosts, hosts_now, placement)
            attempt.failed_at_step, attempt.excluded_hosts, attempt.decision = found.step, decision.excluded, decision.reason
            self._save()
            say(f"attempt {number} failed (exit status {attempt.status}"
                f"{', after ' + within if within else ''}): {found.kind} per the {found.source}"
                f"{': ' + found.message.splitlines()[0] if found.message else ''}; {decision.reason}")
            if not decision.retry:
                return self._exit_status(attempt)
            hosts_now, excluded, strikes = decision.hosts, decision.excluded, decision.strikes
            self.num_ranks = decision.num_ranks
        raise AssertionError("the policy stops once --max-restarts is spent")

    def _exit_status(self, attempt: Attempt) -> int:
        """launch's own exit status after a failed attempt it does not relaunch: the launcher's, except where launch
        ended the launcher itself (its SIGKILL: 137, which reads as the OOM killer's): then the status of the
        failure's cause (mpiddp.errors: a hang 4, a stop 3, a user error 2), else 1."""
        if self.ended_launcher and attempt.status == 128 + signal.SIGKILL:
            return CAUSE_STATUS.get(attempt.cause or "", EXIT_CRASH)
        return attempt.status or EXIT_CRASH

    def _failed_in_a_spawn(self, attempt: Attempt, found: Failure) -> tuple[Failure, float | None]:
        """(the failure, from when no recovery is held against a host) where the launcher failed during the job's
        spawn (from the spawn's start) or crashed after one (from CRASH_TAKES_S before it ended: the ranks its crash
        took, not a loss earlier after the spawn); attempt.launcher_crash says which. Else (the failure, None)."""
        spawn = failure.spawning(self.failure_file, at=attempt.ended_at)
        found, attempt.launcher_crash = during_spawn(found, spawn[0] if spawn else [])
        if attempt.launcher_crash:
            return found, spawn[1]
        spawn = failure.last_spawn(self.failure_file)
        attempt.launcher_crash = after_spawn(found, spawn[0] if spawn else [])
        if not attempt.launcher_crash:
            return found, None
        return found, max(spawn[1], attempt.ended_at - CRASH_TAKES_S)

    def _decide(self, attempt: Attempt, found: Failure, placement: dict[int, str], hosts_now: list[Host],
                excluded: list[str], strikes: dict[str, int], records: list[failure.FailureRecord],
                spawn_failed_at: float | None = None) -> Decision:
        """The policy's decision on a failed attempt. A host the job lost and recovered from in the job before the
        failure that ended it failed too: the same evidence, so it is left out as well (per --host-strikes),
        unless the job's failure records contradict that recovery (it came after the end was decided)."""
        standing, contradicted = contradicted_by_records(attempt.recoveries, records, spawn_failed_at,
                                                         attempt.launcher_crash)
        lost, strikes = strike_lost_in_job(standing, self.plan.hosts, excluded, strikes,
                                           self.plan.host_strikes, hosts_now)
        decision = decide(found, self.plan.hosts, [*excluded, *lost], attempt.number, self.plan.max_restarts,
                          self.plan.num_ranks, hosts_now, self.plan.min_np, self.plan.global_batch, strikes,
                          self.plan.host_strikes, placement)
        reason = decision.reason
        if lost:
            reason += f"; without {', '.join(lost)} too (lost in the job earlier, recovered from in the job)"
        if contradicted:
            reason += f"; not held against any host: {'; '.join(contradicted)}"
        return replace(decision, reason=reason)

    def _diagnose(self, attempt: Attempt, output: str, hosts_now: list[Host],
                  metrics: list[dict[str, Any]]) -> tuple[Failure, dict[int, str], list[failure.FailureRecord]]:
        """(the failure, rank -> host of the attempt, every rank's record): from the records the job left, the
        placement it recorded (else the slot order), and the launcher's evidence (mpiddp.launch.diagnose)."""
        records = failure.read_all(self.failure_file)
        num_ranks = attempt.num_ranks or self.num_ranks
        recorded = failure.read_placement(self.failure_file)
        placement = placement_of(recorded, hosts_now, num_ranks)
        found = diagnose(attempt.status or 1, records, output, num_ranks, placement)
        if found.step is None:
            found = Failure(**{**asdict(found), "step": last_logged_step(metrics)})
        if found.hosts and not found.ranks and found.kind != "unreachable":
            # the launcher named the host only: its ranks follow from the placement. A host the job's recorded
            # placement has no rank on (its ranks lost in a refused recovery, the placement already the survivors')
            # keeps no ranks: the slot order would number another host's survivors
            ranks = tuple(r for r, name in placement.items() if any(same_host(name, h) for h in found.hosts))
            if not ranks and recorded is None:
                ranks = ranks_on(hosts_now, found.hosts)
            found = Failure(**{**asdict(found), "ranks": ranks})
        if recorded is None:  # the job never started: the hosts in question are asked to answer
            found = self._probe_start(attempt, found)
        return found, placement, records

    def _probe_start(self, attempt: Attempt, found: Failure) -> Failure:
        """A failure of an attempt whose job recorded no placement (it never started), weighed with what the hosts
        in question answer when asked through the launcher's agent (mpiddp.launch.probe); as it is under srun, or
        with no relaunch left for the answers to change."""
        if self.plan.launcher == "srun" or attempt.number >= self.plan.max_restarts:
            return found
        may_keep = self.plan.host_strikes == 1 and not self._replaceable(attempt, found.hosts)
        asked = remote_hosts(hosts_to_probe(found, self._daemon_hosts, self.kept_once, may_keep))
        if not asked:
            return found
        agent = host_command(self.plan.extra, self.env, self.plan.flavour)
        say(f"attempt {attempt.number}: the job never started; asking {', '.join(asked)} to answer "
            f"({' '.join(probe_command(agent, 'HOST'))}, {PROBE_TIMEOUT_S:g} s at most)")
        attempt.probed = probe_hosts(agent, asked)
        found, kept = weigh(found, attempt.probed, self.kept_once)
        self.kept_once.update(kept)
        return found

    def _replaceable(self, attempt: Attempt, hosts: tuple[str, ...]) -> bool:
        """Whether the hosts left, without `hosts` and those left out already, still hold the attempt's ranks (a
        spare takes their place); True without a host list (the launcher places the ranks: none is left out)."""
        if not self.plan.hosts:
            return True
        remaining = [h for h in self.plan.hosts if h.name not in attempt.excluded_hosts
                     and not any(same_host(h.name, name) for name in hosts)]
        try:
            place(remaining, attempt.num_ranks or self.num_ranks)
        except HostListError:
            return False
        return True

    def _first_hosts(self) -> list[Host]:
        remaining = [h for h in self.plan.hosts if h.name not in self.plan.excluded]
        return place(remaining, self.plan.num_ranks)[0] if self.plan.hosts else []

    def _attempt(self, number: int, hosts: list[Host], excluded: list[str]) -> tuple[Attempt, str]:
        num_ranks = self.num_ranks
        exports = {**job_exports(self.plan, number, self.launch_id), supervision.SUPERVISOR_ENV: supervision.identity()}
        spares = growth_hosts(self.plan.hosts, hosts, excluded, self.plan.in_job_recovery.on)
        if spares:  # what the job grows back onto after an in-job recovery (mpiddp.elastic.grow)
            exports[SPARE_RANKS_ENV] = str(hot_spare_ranks(spares))
        placed, extra, layout_args = [*hosts, *spares], self.plan.extra, self._relay_args([*hosts, *spares])
        self._daemon_hosts = [h.name for h in placed]
        if layout_args:  # the hostfile with the relays, and the agent wrapper over the user's agent
            placed, extra = [], without_agent(extra)
            exports[HOST_RELAYS_ENV] = "1"  # the job may cut a silent host off: its daemon's loss is survived
        # launch alone decides the hot spares (a value left in this shell would reach only this host's ranks)
        env = {**{k: v for k, v in self.env.items() if k != SPARE_RANKS_ENV}, **exports}
        command = build_command(self.plan.launcher, self.plan.program, self.plan.flavour, placed,
                                num_ranks + hot_spare_ranks(spares),
                                list(self.plan.inner), exports, excluded, extra,
                                ft_args=(*self.plan.in_job_recovery.add_args, *self.plan.node_loss_args,
                                         *layout_args))
        failure.clear(self.failure_file)  # records from an earlier attempt must not explain this one
        (self.plan.run_dir / JOB_RECORD_FILE).unlink(missing_ok=True)  # nor an earlier job's record describe it
        recovery = self.plan.in_job_recovery
        attempt = Attempt(number, [h.name for h in hosts], command, time.time(), num_ranks=num_ranks,
                          excluded_hosts=list(excluded), launch=self.launch, in_job_recovery=recovery.on,
                          in_job_recovery_off="" if recovery.on else recovery.why)
        self.attempts.append(attempt)
        self._save()  # listed as it starts: the job reads when it was launched (its downtime) and the restarts
        say(f"attempt {number} on {', '.join(attempt.hosts) or 'the default hosts'}: {' '.join(command)}")
        try:
            self.child = self._start(command, env, number)
        except OSError as exc:  # not there (any more), not executable: nothing ran, a relaunch would fail alike
            attempt.status, attempt.ended_at, attempt.cause_source = EXIT_USER_ERROR, time.time(), "supervisor"
            attempt.cause, attempt.message = "user_error", f"cannot start {command[0]}: {exc.strerror or exc}"
            return attempt, ""
        if self.stop_signal:  # a signal that came before the launcher existed (not counted again as a Ctrl-C)
            os.kill(self.child.pid, self.child_stop)
        # Under the relays a host the job lost was lost whole (its daemon too): mpirun waits for its ranks forever,
        # and nothing is left there to end. Elsewhere a lost rank's host keeps its daemon, which may need ending.
        lost_whole = (lambda: self._lost_hosts(attempt)) if layout_args else list
        self._ended_seen, self._started, self._started_at = None, False, time.monotonic()
        with self._ender(attempt):  # under in-job recovery: hung ranks the job asks launch to end
            status, output = self._follow(self.child, self._output_paths(number),
                                          lambda: self._end_accounted(attempt), lost_whole,
                                          lambda: self._not_started(attempt, bool(layout_args)))
        if layout_args:  # a host the agent could not reach: mpirun says nothing of it under the relays
            output += agent_failures(self.plan.run_dir)
        output += f"mpiddp launch: {self.not_started}\n" if self.not_started else ""  # what diagnose reads
        if self.plan.flavour == "openmpi" and status < 0:  # the launcher itself died by a signal: its daemons may not
            lost = lost_whole()  # a crashed host would not answer
            end_daemons(host_command(self.plan.extra, self.env, self.plan.flavour),
                        [h.name for h in [*hosts, *spares] if not any(same_host(h.name, x) for x in lost)],
                        self.child.pid)
        self.child = None
        attempt.status = 128 - status if status < 0 else status
        attempt.ended_at = time.time()
        if attempt.in_job_recovery:
            attempt.status = status_under_fault_tolerance(attempt.status, failure.read_all(self.failure_file))
        return attempt, output

    def _relay_args(self, hosts: list[Host]) -> tuple[str, ...]:
        """The launcher arguments of the relay layout for an attempt on `hosts` (none when it is off, or when the
        attempt's hosts no longer need it); its hostfile and agent wrapper are written into the run dir."""
        plan = self.plan
        if not plan.relay_layout.on:
            return ()
        # the launcher passed make_plan's checks (relay_layout.on): only the attempt's hosts are judged again
        layout = decide_layout(plan.in_job_recovery.on, plan.launcher, plan.flavour, "(Open MPI) 5.0.", hosts,
                               socket.gethostname(), plan.extra)
        if not layout.on:
            return ()
        return write_layout(plan.run_dir, host_agent(plan.extra, self.env), socket.gethostname(), hosts,
                            layout.num_relays)

    def _ender(self, attempt: Attempt) -> contextlib.AbstractContextManager[Any]:
        """While the attempt runs under in-job recovery: ends the hung ranks the job names (mpiddp.launch.ender)."""
        if not attempt.in_job_recovery:
            return contextlib.nullcontext()
        return Ender(self.failure_file, host_command(self.plan.extra, self.env, self.plan.flavour), say)

    def _finished(self, attempt: Attempt) -> bool:
        """Whether a 0 from the launcher means the job finished: always without MPI fault tolerance; with it (where
        Open MPI's mpirun exits 0 even when every rank was killed) only when the job marked its end (training, or
        `mpiddp run` once every rank finished the script)."""
        if not attempt.in_job_recovery:
            return True
        return finished_since(self.plan.run_dir, attempt.started_at)

    def _marked(self, attempt: Attempt) -> bool:
        """Under MPI fault tolerance: whether the job marked the end of this attempt (while the attempt runs, in the
        run dir its job record names: launch's records follow it there only afterwards)."""
        return attempt.in_job_recovery and finished_since(self._job_run_dir(), attempt.started_at)

    def _lingering(self, attempt: Attempt) -> bool:
        """Whether the launcher may be ended FINISHED_LINGER_S after the job's finished mark: training's, whose
        mark comes after its last write; never a script's, whose own exit handlers run after the mark."""
        return self.plan.mode == "train" and self._marked(attempt)

    def _end_accounted(self, attempt: Attempt) -> str:
        """The job's own account that it ended, after which the launcher may linger only FINISHED_LINGER_S:
        what it says (the finished mark, a spawn given up, every rank's failure record), or "" while there is none."""
        if self._lingering(attempt) or self._gave_up_spawning(attempt):
            return "the job marked its end"
        if self._every_rank_recorded(attempt):
            return "every rank recorded its failure and ended"
        return ""

    def _every_rank_recorded(self, attempt: Attempt) -> bool:
        """Whether every rank of the attempt's job (its world after its last in-job recovery or grow, if any) left
        a failure record: a rank writes it as its process ends (mpiddp.job.failfast), so a launcher still running
        long after waits for nothing of the job. Ranks a peer's record ended write none: then this never holds."""
        recorded = {record.rank for record in failure.read_all(self.failure_file)}
        if not recorded:
            return False
        found = recoveries.of_attempt(self._job_run_dir(), self.failure_file, attempt.started_at)
        world = next((item["world_after"] for item in reversed(found) if isinstance(item.get("world_after"), int)),
                     attempt.num_ranks)
        return recorded >= set(range(world))

    def _gave_up_spawning(self, attempt: Attempt) -> bool:
        """Under MPI fault tolerance: whether the job ended itself during a spawn that never returned (its spawn
        mark, then a failure record after it: mpiddp.elastic.grow.spawn_stuck); mpirun then waits for the spawn
        forever, and is ended as after the finished mark."""
        mark = failure.spawning(self.failure_file) if attempt.in_job_recovery else None
        return mark is not None and any((r.time or 0) >= mark[1] for r in failure.read_all(self.failure_file))

    def _not_started(self, attempt: Attempt, relays: bool) -> str:
        """While the job has recorded no placement (rank 0 writes it once every rank came through MPI's start-up;
        the attempt cleared the last): why launch ends the attempt now, or "". Under the relay layout, hosts whose
        daemon's connection came up and ended LOST_HOST_LINGER_S ago (their relay carries on: mpirun would wait for
        their ranks forever); with any launcher, --startup-timeout passed since the attempt started."""
        if self._started or failure.read_placement(self.failure_file) is not None:
            self._started = True  # latched: a read that fails later (NFS) must not end a job that runs
            return ""
        ended = hosts_ended(self.plan.run_dir) if relays else []
        now = time.monotonic()
        self._ended_seen = (self._ended_seen or now) if ended else None
        if ended and now - self._ended_seen > LOST_HOST_LINGER_S:
            return "; ".join(ENDED_BEFORE_START.format(host=host, why=why) for host, why in ended) + (
                ": mpirun waits for their ranks forever under the relay layout")
        timeout = self.plan.startup_timeout_s
        if timeout and now - self._started_at > timeout:
            return STARTUP_OVERDUE.format(seconds=timeout, failures=self.failure_file)
        return ""

    def _job_run_dir(self) -> Path:
        """Where training writes its outputs: the run dir its job record names, else launch's own."""
        record = read_job_record(self.plan.run_dir / JOB_RECORD_FILE)
        return Path(record.run_dir) if record is not None else self.plan.run_dir

    def _lost_hosts(self, attempt: Attempt) -> list[str]:
        """The hosts the job lost in this attempt and recovered from in the job, from its records."""
        found = recoveries.of_attempt(self._job_run_dir(), self.failure_file, attempt.started_at)
        return list(dict.fromkeys(host for item in found if not recoveries.is_grow(item)
                                  for host in item.get("hosts_lost") or [] if isinstance(host, str)))

    def _job_status(self, attempt: Attempt) -> int | None:
        """The attempt's status as the job's evidence tells it. Under MPI fault tolerance a 0 counts only with
        training's mark that it ended (mpirun --with-ft ulfm exits 0 when every rank was killed), and the mark
        makes a non-zero status from the launcher after it a finished job (Open MPI 5.0.11's mpirun can crash
        after a job that grew back has finished)."""
        if attempt.status == 0 and not self._finished(attempt):
            return EXIT_CRASH
        if attempt.status not in (0, None) and not self.stop_signal and self._marked(attempt):
            if self.ended_after_loss:  # launch ended it: not a crash of the launcher
                return 0
            attempt.launcher_crash = f"after the job marked its end (exit status {attempt.status})"
            done = "every rank finished and wrote its results" if self.plan.mode == "train" else \
                "every rank finished the script"
            say(f"attempt {attempt.number}: the launcher exited {attempt.status} after the job marked its end "
                f"({done}): taken as finished")
            return 0
        return attempt.status

    def _output_paths(self, number: int) -> tuple[Path, Path]:
        """Where attempt `number`'s launcher writes its stdout and stderr."""
        # a requeue or a resubmission in the same run dir (launch 1, 2, ...) keeps the earlier launches' output
        stem = f"attempt{number}" if self.launch == 0 else f"launch{self.launch}-attempt{number}"
        return self.plan.run_dir / f"{stem}.out", self.plan.run_dir / f"{stem}.err"

    def _start(self, command: list[str], env: dict[str, str], number: int) -> subprocess.Popen[bytes]:
        """Start the launcher. Its own session: a Ctrl-C in the terminal (or its hang-up) reaches the supervisor
        only, which hands a stop on as `child_stop`. It hears of the supervisor's death as `child_stop` too: the
        job then stops with a snapshot and records why, instead of training on unsupervised. Its output goes to
        files in the run dir, not to pipes: a dead supervisor's pipes would make each write fail (Open MPI's
        mpirun aborts the job after 10 failed writes, during the very save), and a process that outlives the
        launcher cannot hold a file open against anyone."""
        out_path, err_path = self._output_paths(number)
        with out_path.open("wb") as out, err_path.open("wb") as err:
            return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True, preexec_fn=supervision.launcher_preexec(self.child_stop))

    def _follow(self, child: subprocess.Popen[bytes], paths: tuple[Path, Path],
                marked: Callable[[], str] = lambda: "",
                lost: Callable[[], list[str]] = list,
                not_started: Callable[[], str] = lambda: "") -> tuple[int, str]:
        """Pass the launcher's output on as it comes (both streams: Hydra prints which process died on stdout),
        until the launcher itself exits, or FINISHED_LINGER_S after the job `marked` its end (what marked it, or
        ""; LOST_HOST_LINGER_S
        when the job's records say it `lost` a host: the launcher waits for that host's ranks; then it is ended),
        or at once when launch finds the job `not_started` (self.not_started says why);
        then kill what is left of its session, so nothing of the attempt stays.
        (launcher's status, the last lines of its output)."""
        tail = OutputKeeper(OUTPUT_TAIL_LINES)  # evidence lines wherever they appear, and the last lines
        done = threading.Event()
        relays = [threading.Thread(target=_relay, args=(path, target, tail, done), daemon=True)
                  for path, target in zip(paths, (sys.stdout, sys.stderr))]
        for relay in relays:
            relay.start()
        self.ended_after_loss = False
        status, self.not_started, ended = _wait_unless_lingering(child, marked, lost, self._stop_overdue, not_started)
        self.ended_launcher = ended and status == -signal.SIGKILL
        self.ended_after_loss = self.ended_launcher and bool(lost()) and bool(marked())
        end_session(child.pid)
        done.set()  # the relays read to the end of what was written, then stop
        deadline = time.monotonic() + RELAY_DRAIN_S
        for relay in relays:
            relay.join(max(0.0, deadline - time.monotonic()))
        return status, "".join(tail)

    def _stop_overdue(self) -> bool:
        """Whether the job outlived a stop's grace (STOP_GRACE_S): launch then ends it whole."""
        if self.stopped_at is None:
            return False
        grace = stop_grace(self.env)
        if time.monotonic() - self.stopped_at < grace:
            return False
        say(f"the job still runs {grace:g} s after the stop (a rank stopped or wedged holds the others): ending it "
            "without a snapshot")
        self.killed_at = time.time()
        return True

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = self.stop_signal or signum
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        running = self.child is not None and self.child.poll() is None
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts == 1:
                _say_now("stopping: the ranks save a snapshot; Ctrl-C twice more kills the job without saving")
            elif self.interrupts >= KILL_AFTER_INTERRUPTS and running:
                _say_now("killing the job (SIGKILL to the launcher's process group): no snapshot")
                assert self.child is not None
                self.killed_at = time.time()
                kill_group(self.child.pid)  # its own session: the group id is its pid
                return
        if running:
            assert self.child is not None
            # The launcher may have exited and been reaped by the wait this handler interrupted (poll() cannot tell
            # while wait() holds Popen's lock): then there is nobody left to tell (srun after a scancel).
            try:
                os.kill(self.child.pid, self.child_stop)  # srun and mpirun hand it on to every rank
            except ProcessLookupError:
                pass

    def _count_steps_lost(self, records: list[dict[str, Any]]) -> None:
        """Now that the latest attempt has run, the one before it learns where training resumed, and how long
        training stood still (until the latest attempt's first step), from metrics.jsonl's `records`."""
        if len(self.attempts) < 2 or self.plan.mode != "train":
            return
        before, latest = self.attempts[-2], self.attempts[-1]
        if before.last_step_at is None:  # it never ran a rank (Open MPI's start-up race): the stand-still of the
            # attempt before it lasts until this one's first step
            before = next((a for a in reversed(self.attempts[:-2]) if a.last_step_at is not None), before)
        before.resumed_at_step = start_step(records, latest.started_at)
        if before.resumed_at_step is not None and before.failed_at_step is not None:
            before.steps_lost = max(0, before.failed_at_step - before.resumed_at_step)
        before.downtime_s, before.downtime_phases = failure.downtime(
            before.last_step_at, before.ended_at, latest.started_at, records)

    def _follow_job(self) -> None:
        """Read the job record the attempt wrote: a training whose own flags named another run dir moves launch's
        records there (this attempt's failure record included), and --min-np learns the global batch."""
        before = self.plan.run_dir
        self.plan = follow_job(self.plan, read_job_record(before / JOB_RECORD_FILE))
        if self.plan.run_dir.resolve() == before.resolve():
            return
        say(f"training writes to {self.plan.run_dir} (its own flags): launch's records follow it there")
        supervision.move_records(before, self.plan.run_dir)
        self.earlier, self.launch = earlier_launches(self.plan.run_dir)
        for attempt in self.attempts:
            attempt.launch = self.launch
        self._save()
        (before / ATTEMPTS_FILE).unlink(missing_ok=True)
        remove_layout(before)  # the relay layout's files: the next attempt writes them where the records are now
        if self.plan.made_run_dir:
            try:
                before.rmdir()  # only when empty: nothing else of the job's is ever deleted
            except OSError:
                pass

    def _save(self) -> None:
        write_attempts(self.plan.run_dir / ATTEMPTS_FILE, self.attempts, self.earlier)


def write_attempts(path: Path, attempts: list[Attempt], earlier: list[dict[str, Any]] | None = None) -> bool:
    """Write attempts.json: the attempts of earlier launches in this run dir (a requeue, a resubmission), then
    this launch's. A failure to write is a warning (False), never the end of supervision."""
    listed = [*(earlier or []), *(asdict(a) for a in attempts)]
    data: dict[str, Any] = {
        "restarts": max(0, len(listed) - 1),
        "excluded_hosts": attempts[-1].excluded_hosts if attempts else [],
        "attempts": listed,
    }
    try:
        write_text_atomic(path, json.dumps(data, indent=1) + "\n")
    except OSError as exc:
        say(f"warning: cannot write {path} ({exc.strerror or exc}); the attempts go unrecorded")
        return False
    return True


def _relay(path: Path, target: TextIO, tail: OutputKeeper, done: threading.Event) -> None:
    """Pass the lines written to `path` on as they come, keeping the evidence and the last ones (thread-safe),
    until `done` (the launcher exited) and the end of what was written."""
    pending = ""
    with path.open(encoding="utf-8", errors="replace") as source:
        while True:
            finished = done.is_set()  # before reading: what was written before `done` is all read
            chunk = source.readline()
            if chunk:
                pending += chunk
                if pending.endswith("\n"):
                    _pass_on(pending, target, tail)
                    pending = ""
            elif finished:
                if pending:
                    _pass_on(pending, target, tail)
                return
            else:
                time.sleep(RELAY_POLL_S)  # following a growing file: nothing new yet


def _pass_on(line: str, target: TextIO, tail: OutputKeeper) -> None:
    try:
        target.write(line)
        target.flush()
    except OSError:  # the terminal is gone (an ssh disconnect): keep supervising
        pass
    tail.append(line)


def stop_grace(env: dict[str, str]) -> float:
    """STOP_GRACE_S, or the seconds STOP_GRACE_ENV names."""
    try:
        return max(0.0, float(env.get(STOP_GRACE_ENV, STOP_GRACE_S)))
    except ValueError:
        return STOP_GRACE_S


def _wait_unless_lingering(child: subprocess.Popen[bytes], marked: Callable[[], str],
                           lost: Callable[[], list[str]] = list, overdue: Callable[[], bool] = lambda: False,
                           not_started: Callable[[], str] = lambda: "") -> tuple[int, str, bool]:
    """(the launcher's status once it exits, why launch ended a job that never started or "", whether launch ended
    the launcher: its status is then launch's SIGKILL, -9). If it is still
    running FINISHED_LINGER_S after the job `marked` its end (what marked it, or "": a grown rank or Open MPI's
    launcher that never exits), SIGKILL its session: its -9. After a job whose records say it `lost` a host in the
    job (Open MPI's mpirun waits for that host's ranks forever), after LOST_HOST_LINGER_S. At once where the job
    is `not_started` (why, or ""), and once `overdue` (a stop's grace ran out)."""
    mark_seen: float | None = None
    what, hosts = "", []
    while True:
        try:
            return child.wait(timeout=1.0), "", False
        except subprocess.TimeoutExpired:
            pass
        if overdue():
            end_session(child.pid)
            return child.wait(), "", True
        why = not_started()
        if why:
            say(f"{why}; ending the attempt")
            end_session(child.pid)
            return child.wait(), why, True
        if mark_seen is None:
            what = marked()
            mark_seen = time.monotonic() if what else None
            hosts = lost() if what else []
            continue
        allowed = LOST_HOST_LINGER_S if hosts else FINISHED_LINGER_S
        if time.monotonic() - mark_seen > allowed:
            if hosts:
                say(f"the job marked its end after losing {', '.join(hosts)} in the job (its records): the launcher "
                    f"waits for that host's ranks, which never end; ending it")
            else:
                say(f"the launcher still runs {FINISHED_LINGER_S:g} s after {what}: ending it")
            end_session(child.pid)
            return child.wait(), "", True


def _ignore_hangup(signum: int, frame: FrameType | None) -> None:
    """SIGHUP: the terminal went away; the supervisor keeps supervising (its output is then lost)."""


def say(text: str) -> None:
    try:
        sys.stderr.write(f"mpiddp launch: {text}\n")
        sys.stderr.flush()
    except OSError:  # the terminal is gone (an ssh disconnect)
        pass


def _say_now(text: str) -> None:
    """`say` from a signal handler: one unbuffered write, never re-entering sys.stderr's buffer."""
    try:
        os.write(2, f"mpiddp launch: {text}\n".encode())
    except OSError:
        pass
