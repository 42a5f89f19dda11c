"""The supervisor: run the launcher, watch it, and after a failure relaunch without the bad host until done.

It runs outside MPI (never imports mpi4py or torch.distributed) and talks to the job through three things only:
the exit status, what the job records in RUN_DIR/failures/ (every failing rank's record, and where every rank ran:
placement.json), and the launcher's own output (its evidence lines, wherever they appear).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

from mpiddp import failure
from mpiddp.errors import EXIT_USER_ERROR
from mpiddp.failure import ATTEMPTS_FILE
from mpiddp.launch.command import build_command
from mpiddp.launch.diagnose import EXIT_STOPPED, Failure, OutputKeeper, diagnose
from mpiddp.launch.hosts import Host, place
from mpiddp.launch.policy import blamed, decide, same_host

FAILURE_FILE_ENV = "MPIDDP_FAILURE_FILE"  # the records' directory; read by the job's topology only
RESTART_COUNT_ENV = "MPIDDP_RESTART_COUNT"  # the job exports it to scripts as TORCHELASTIC_RESTART_COUNT
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)
KILL_AFTER_INTERRUPTS = 3  # the third Ctrl-C kills the launcher's process group: no snapshot
CHECKPOINT_OPTIONS = ("--checkpoint-dir", "--model_dir")
OUTPUT_TAIL_LINES = 400  # the launcher's last lines, kept with every evidence line before them (OutputKeeper)


@dataclass(frozen=True)
class Plan:
    """What the user asked for, resolved: every attempt is built from it."""

    mode: str  # "train" or "run"
    inner: list[str]  # what follows `python -m mpiddp`, with the run dir made explicit for training
    run_dir: Path
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


@dataclass
class Attempt:
    number: int
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
    ranks_recorded: int | None = None  # how many ranks left a failure record (RUN_DIR/failures)
    witness_ranks: list[int] = field(default_factory=list)  # ranks that only saw a peer fail or time out
    blamed_hosts: list[str] = field(default_factory=list)  # the hosts this failure counted against


def inner_for(plan: Plan, number: int, latest_at_start: str | None) -> list[str]:
    """The job's arguments for attempt `number`: training resumes from the newest snapshot after a failure.
    A `--resume PATH` of the user's (a rollback) stays until a snapshot has been saved since the launch began
    (`latest` changed from `latest_at_start`): before that, `latest` still names the abandoned newer snapshot."""
    if plan.mode != "train" or number == 0:
        return list(plan.inner)
    given = resume_value(plan.inner)
    if given not in (None, "auto") and latest_pointer(plan) == latest_at_start:
        return list(plan.inner)
    return [*drop_option(plan.inner, "--resume"), "--resume", "auto"]


def resume_value(argv: list[str]) -> str | None:
    """--resume's value in argv: None without it, "auto" when bare."""
    value = None
    for index, arg in enumerate(argv):
        if arg.startswith("--resume="):
            value = arg.split("=", 1)[1]
        elif arg == "--resume":
            following = argv[index + 1] if index + 1 < len(argv) else "-"
            value = "auto" if following.startswith("-") else following
    return value


def latest_pointer(plan: Plan) -> str | None:
    """The content of the training's CHECKPOINT_DIR/latest (which snapshot `--resume auto` takes), or None."""
    directory = plan.run_dir / "checkpoints"  # the job's default, as mpiddp.main
    for index, arg in enumerate(plan.inner):
        for name in CHECKPOINT_OPTIONS:
            if arg == name and index + 1 < len(plan.inner):
                directory = Path(plan.inner[index + 1])
            elif arg.startswith(name + "="):
                directory = Path(arg.split("=", 1)[1])
    try:
        return (directory / "latest").read_text()
    except OSError:
        return None


def drop_option(argv: list[str], name: str) -> list[str]:
    """argv without `name VALUE`, `name=VALUE` or a bare `name` (--resume's value is optional)."""
    out, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("-"):
            skip = False
            continue
        skip = arg == name
        if not skip and not arg.startswith(name + "="):
            out.append(arg)
    return out


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


def last_logged_step(run_dir: Path) -> int | None:
    """The last training step in metrics.jsonl: where a rank that wrote no record had got to, at least."""
    steps = [r["step"] for r in failure.read_metrics(run_dir) if r.get("kind") != "start"]
    return steps[-1] if steps else None


def start_step(run_dir: Path, since: float) -> int | None:
    """The step a training attempt that began at `since` started from (its `start` record in metrics.jsonl)."""
    steps = [r["step"] for r in failure.read_metrics(run_dir) if r.get("kind") == "start" and r.get("time", 0) >= since]
    return steps[-1] if steps else None


class Supervisor:
    def __init__(self, plan: Plan, env: dict[str, str] | None = None) -> None:
        self.plan = plan
        self.env = dict(os.environ if env is None else env)
        self.attempts: list[Attempt] = []
        self.child: subprocess.Popen[str] | None = None
        self.stop_signal = 0
        self.interrupts = 0
        # what CHECKPOINT_DIR/latest held when the launch began: a user's --resume PATH holds until it moves
        self.latest_at_start = latest_pointer(plan)
        self.num_ranks = plan.num_ranks  # the next attempt's: fewer after a shrink (--min-np)

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
            if attempt.cause_source == "supervisor":
                attempt.decision = "not relaunched: fix the launcher (--launcher-path, PATH) and launch again"
                self._save()
                say(f"attempt {number}: {attempt.message}; {attempt.decision}")
                return EXIT_USER_ERROR
            self._count_steps_lost()
            if attempt.status == 0 or self.stop_signal:
                attempt.decision = "finished" if attempt.status == 0 else (
                    f"stopped by {signal.Signals(self.stop_signal).name}: not relaunched")
                attempt.cause = None if attempt.status == 0 else "stopped"
                attempt.excluded_hosts = list(excluded)
                self._save()
                say(f"attempt {number}: exit status {attempt.status}; {attempt.decision}")
                return attempt.status or 0
            found, placement, records = self._diagnose(attempt, output, hosts_now)
            progress_at = failure.last_progress_at(failure.read_metrics(self.plan.run_dir), attempt.started_at,
                                                   attempt.ended_at)
            attempt.last_step_at = progress_at if progress_at is not None else records[0].time if records else None
            decision = decide(found, self.plan.hosts, excluded, number, self.plan.max_restarts, self.plan.num_ranks,
                              hosts_now, self.plan.min_np, self.plan.global_batch, strikes, self.plan.host_strikes,
                              placement)
            attempt.cause, attempt.cause_source, attempt.message = found.kind, found.source, found.message
            attempt.failed_ranks, attempt.failed_hosts = list(found.ranks), list(found.hosts)
            attempt.ranks_recorded, attempt.witness_ranks = found.recorded, list(found.witnesses)
            attempt.blamed_hosts = blamed(found, self.plan.hosts, hosts_now, placement)
            attempt.failed_at_step, attempt.excluded_hosts, attempt.decision = found.step, decision.excluded, decision.reason
            self._save()
            say(f"attempt {number} failed (exit status {attempt.status}): {found.kind} per the {found.source}"
                f"{': ' + found.message.splitlines()[0] if found.message else ''}; {decision.reason}")
            if not decision.retry:
                return attempt.status or 1
            hosts_now, excluded, strikes = decision.hosts, decision.excluded, decision.strikes
            self.num_ranks = decision.num_ranks
        raise AssertionError("the policy stops once --max-restarts is spent")

    def _diagnose(self, attempt: Attempt, output: str,
                  hosts_now: list[Host]) -> tuple[Failure, dict[int, str], list[failure.FailureRecord]]:
        """(the failure, rank -> host of the attempt, every rank's record): from the records the job left, the
        placement it recorded (else the slot order), and the launcher's evidence (mpiddp.launch.diagnose)."""
        records = failure.read_all(self.failure_file)
        num_ranks = attempt.num_ranks or self.num_ranks
        placement = placement_of(failure.read_placement(self.failure_file), hosts_now, num_ranks)
        found = diagnose(attempt.status or 1, records, output, num_ranks, placement)
        if found.step is None:
            found = Failure(**{**asdict(found), "step": last_logged_step(self.plan.run_dir)})
        if found.hosts and not found.ranks and found.kind != "unreachable":
            # the launcher named the host only: its ranks follow from the placement
            ranks = tuple(r for r, name in placement.items() if any(same_host(name, h) for h in found.hosts))
            found = Failure(**{**asdict(found), "ranks": ranks or ranks_on(hosts_now, found.hosts)})
        return found, placement, records

    def _first_hosts(self) -> list[Host]:
        remaining = [h for h in self.plan.hosts if h.name not in self.plan.excluded]
        return place(remaining, self.plan.num_ranks)[0] if self.plan.hosts else []

    def _attempt(self, number: int, hosts: list[Host], excluded: list[str]) -> tuple[Attempt, str]:
        num_ranks = self.num_ranks
        exports = {FAILURE_FILE_ENV: str(self.failure_file), RESTART_COUNT_ENV: str(number)}
        env = {**self.env, **exports}
        command = build_command(self.plan.launcher, self.plan.program, self.plan.flavour, hosts, num_ranks,
                                inner_for(self.plan, number, self.latest_at_start), exports, excluded, self.plan.extra)
        failure.clear(self.failure_file)  # records from an earlier attempt must not explain this one
        attempt = Attempt(number, [h.name for h in hosts], command, time.time(), num_ranks=num_ranks,
                          excluded_hosts=list(excluded))
        self.attempts.append(attempt)
        self._save()  # listed as it starts: the job reads when it was launched (its downtime) and the restarts
        say(f"attempt {number} on {', '.join(attempt.hosts) or 'the default hosts'}: {' '.join(command)}")
        tail = OutputKeeper(OUTPUT_TAIL_LINES)  # evidence lines wherever they appear, and the last lines
        # Its own session: a Ctrl-C in the terminal (or its hang-up) reaches the supervisor only, which hands a
        # stop on as `child_stop`.
        # Both streams are read: Hydra prints which process died on stdout. Each is passed on to its own stream.
        try:
            self.child = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
        except OSError as exc:  # not there (any more), not executable: nothing ran, a relaunch would fail alike
            attempt.status, attempt.ended_at, attempt.cause_source = EXIT_USER_ERROR, time.time(), "supervisor"
            attempt.cause, attempt.message = "user_error", f"cannot start {command[0]}: {exc.strerror or exc}"
            return attempt, ""
        if self.stop_signal:  # a signal that came before the launcher existed (not counted again as a Ctrl-C)
            os.kill(self.child.pid, self.child_stop)
        assert self.child.stdout is not None and self.child.stderr is not None
        stdout_relay = threading.Thread(target=_relay, args=(self.child.stdout, sys.stdout, tail), daemon=True)
        stdout_relay.start()
        _relay(self.child.stderr, sys.stderr, tail)
        stdout_relay.join()
        status = self.child.wait()
        self.child = None
        attempt.status = 128 - status if status < 0 else status
        attempt.ended_at = time.time()
        return attempt, "".join(tail)

    def _forward(self, signum: int, frame: FrameType | None) -> None:
        self.stop_signal = self.stop_signal or signum
        running = self.child is not None and self.child.poll() is None
        if signum == signal.SIGINT:
            self.interrupts += 1
            if self.interrupts == 1:
                _say_now("stopping: the ranks save a snapshot; Ctrl-C twice more kills the job without saving")
            elif self.interrupts >= KILL_AFTER_INTERRUPTS and running:
                _say_now("killing the job (SIGKILL to the launcher's process group): no snapshot")
                assert self.child is not None
                os.killpg(self.child.pid, signal.SIGKILL)  # its own session: the group id is its pid
                return
        if running:
            assert self.child is not None
            os.kill(self.child.pid, self.child_stop)  # srun and mpirun hand it on to every rank

    def _count_steps_lost(self) -> None:
        """Now that the latest attempt has run, the one before it learns where training resumed, and how long
        training stood still (until the latest attempt's first step)."""
        if len(self.attempts) < 2 or self.plan.mode != "train":
            return
        before, latest = self.attempts[-2], self.attempts[-1]
        before.resumed_at_step = start_step(self.plan.run_dir, latest.started_at)
        if before.resumed_at_step is not None and before.failed_at_step is not None:
            before.steps_lost = max(0, before.failed_at_step - before.resumed_at_step)
        before.downtime_s, before.downtime_phases = failure.downtime(
            before.last_step_at, before.ended_at, latest.started_at, failure.read_metrics(self.plan.run_dir))

    def _save(self) -> None:
        write_attempts(self.plan.run_dir / ATTEMPTS_FILE, self.attempts)


def write_attempts(path: Path, attempts: list[Attempt]) -> bool:
    """Write attempts.json; a failure to write is a warning (False), never the end of supervision."""
    data: dict[str, Any] = {
        "restarts": max(0, len(attempts) - 1),
        "excluded_hosts": attempts[-1].excluded_hosts if attempts else [],
        "attempts": [asdict(a) for a in attempts],
    }
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        temporary.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(temporary, path)
    except OSError as exc:
        say(f"warning: cannot write {path} ({exc.strerror or exc}); the attempts go unrecorded")
        return False
    return True


def _relay(source: TextIO, target: TextIO, tail: OutputKeeper) -> None:
    """Pass the launcher's lines on as they come, keeping the evidence and the last ones (thread-safe appends)."""
    for line in source:
        try:
            target.write(line)
            target.flush()
        except OSError:  # the terminal is gone (an ssh disconnect): keep supervising
            pass
        tail.append(line)


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
