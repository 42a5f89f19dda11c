"""Why an attempt failed, from evidence only: every rank's failure record, the launcher's own report, the exit status.

The rules, in order:
1. A record that names a lost peer or a timed-out collective (gloo/NCCL/MPI) is a WITNESS: its rank waited for a
   peer that failed or stalled. It never blames its own rank or host.
2. The job's own accounts of the whole job come first: a host fault (rank 0 names the hosts that cannot run their
   ranks) and a hang (the watchdog names the ranks behind: a stale rank, or the one that never reached the
   collective the others wait in).
3. Otherwise the oldest record that is not a witness is the failure; the ranks that recorded the same failure
   (kind, exception type, exit status) are its ranks. A host is blamed only when its ranks failed that way and the
   ranks of other hosts did not: the same failure on every host, or on every rank, blames no host (a bug, a bad
   input, a shared filesystem), whatever its kind. A failing rank waits briefly for its peers' records before it
   ends the job (mpiddp.job.failfast), so "every rank alike" is seen, not guessed.
4. The same non-zero exit on every rank, none of which made progress in the attempt (a `run` script's argparse
   error, a script that exits 1 before its first collective), is the user's error (user_error: never retried).
5. Without a record that names a culprit, the launcher's report: ranks it saw die by a signal (a SIGKILLed rank
   writes nothing; its peers then fail too, as witnesses), else a host whose daemon it could not start
   (unreachable: ssh refused, a host down). Launchers kill every other rank once one fails (srun
   --kill-on-bad-exit reports them `Terminated`, Hydra prints `KILLED BY SIGNAL: 9` for each), so their text
   is never preferred to a record that names the culprit. srun lines after `Terminating StepId` / `CANCELLED`
   are that clean-up: ignored.
6. Witnesses alone: the failure is theirs, with no host blamed. Nothing at all: the exit status.
The launcher's output reaches this module through OutputKeeper: every line that may be evidence is kept wherever it
appears, with the last lines for context, so a thousand ranks' "also failed" lines cannot push it out.
"""

from __future__ import annotations

import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from mpiddp.errors import EXIT_HANG, EXIT_INTERRUPTED, EXIT_STOPPED, EXIT_USER_ERROR  # noqa: F401 - re-exported
from mpiddp.failure import FailureRecord


# Open MPI 5: "prterun noticed that process rank 1 with PID 1234 on node nodeb exited on signal 9 (Killed)."
OPENMPI_SIGNAL = re.compile(r"process rank (\d+) with PID \d+ on node (\S+?)\.? exited on\s+signal (\d+)")
# Open MPI, when a survivor's MPI noticed first (its abort may then be all prterun reports):
# "An MPI communication peer process has unexpectedly disconnected. ... Local host: nodea ... Peer host: nodeb"
OPENMPI_PEER_LOST = re.compile(r"peer process has unexpectedly disconnected.*?Peer host:\s*(\S+)", re.DOTALL)
# MPICH/Hydra: "=   RANK 1 PID 1234 RUNNING AT nodeb" then "=   KILLED BY SIGNAL: 9 (Killed)"
HYDRA_SIGNAL = re.compile(r"RANK (\d+) PID \d+ RUNNING AT (\S+)\s*\n=?\s*KILLED BY SIGNAL: (\d+)")
# MPICH 4+/Hydra names the host and PID of the first process that ended badly, not its rank:
# "=   PID 1234 RUNNING AT nodeb" / "=   EXIT CODE: 9"; when mpiexec itself survives the clean-up it adds
# "EXIT STRING: Killed (signal 9)" (a lost remote rank makes it abort first: then the exit code is the signal)
HYDRA_BAD_TERMINATION = re.compile(r"BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\s*\n=?\s*"
                                   r"PID \d+ RUNNING AT (\S+)\s*\n=?\s*EXIT CODE: (\d+)")
HYDRA_EXIT_SIGNAL = re.compile(r"EXIT STRING: [^\n]*\(signal (\d+)\)")
# srun: "srun: error: nodeb: task 1: Killed" or "tasks 2-3: Segmentation fault"
SRUN_SIGNAL = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (Killed|Segmentation fault|Aborted|Bus error|Terminated)")
SRUN_SIGNALS = {"Killed": 9, "Segmentation fault": 11, "Aborted": 6, "Bus error": 7, "Terminated": 15}
# srun's clean-up of the step after the first task failed: the tasks it reports dead after this, it killed itself
SRUN_CLEANUP = re.compile(r"Terminating StepId|CANCELLED")
# Open MPI could not start its daemon on a host (ssh refused, host down): "A daemon failed to report back after
# being spawned. ... Local host: nodea / Remote host: nodeb / Daemon exit status: 255" (Open MPI 5.0, reproduced
# with the rsh agent refusing nodeb)
OPENMPI_UNREACHABLE = re.compile(r"daemon failed to report back.*?Remote host:\s*(\S+)", re.DOTALL)
# Open MPI 5 lost the connection to a host's daemon after the job started (the host went silent: power, kernel,
# network; noticed by keepalive, see command.NODE_LOSS_ARGS) and ends the whole job, even with --with-ft ulfm:
# "PRTE has lost communication with a remote daemon. ... Remote daemon: [prterun-nodea-8007@0,1] on node nodeb"
# (Open MPI 5.0.11, reproduced on fake hosts by stopping a host's processes and taking its link down)
OPENMPI_DAEMON_LOST = re.compile(r"lost communication with a remote daemon.*?Remote daemon:\s*\S+ on node (\S+)",
                                 re.DOTALL)
# ssh's own words (any launcher that uses it): "ssh: connect to host nodeb port 22: Connection refused", "ssh:
# Could not resolve hostname nodeb: ...". MPICH 5.0.2's Hydra adds only "Launch proxy failed." and no host name
# (reproduced on fake hosts), so for Hydra ssh's line is the evidence. Older Hydra: "HYDU_sock_connect (...): unable
# to connect from "nodea" to "nodeb" (Connection refused)"; srun: "Task launch for StepId=5.0 failed on node nodeb:"
SSH_UNREACHABLE = re.compile(r"ssh: connect to host (\S+?) port|ssh: Could not resolve hostname (\S+?):"
                             r"|unable to connect from \S+ to \"?([^\s\"]+)\"?|Task launch for \S+ failed on node (\S+?):"
                             r"|mpiddp agent: could not reach (\S+?):")  # launch's own agent wrapper (relay.py)
# launch's own lines where it ended an attempt whose job never started (Supervisor._not_started): a host whose
# daemon came up and ended before every rank started (under the relay layout mpirun says nothing and waits for
# it), or a start-up past --startup-timeout (a daemon or a rank stuck in it: nobody to blame)
ENDED_BEFORE_START = "the daemon on {host} ended before the job started ({why})"
STARTUP_OVERDUE_PREFIX = "not every rank came through MPI's start-up within"
STARTUP_OVERDUE = (STARTUP_OVERDUE_PREFIX + " --startup-timeout {seconds:g} s (the job "
                   "recorded no placement in {failures}: a host's daemon or a rank stuck there, e.g. on a hung "
                   "filesystem or a blocked port; or that directory is not shared with rank 0's host)")
_ENDED_BEFORE_START = re.compile(r"the daemon on (\S+?) ended before the job started \((.*?)\)(?:; |:)")
_STARTUP_OVERDUE = re.compile(r"mpiddp launch: (" + re.escape(STARTUP_OVERDUE_PREFIX) + r" .*)")
# An exception about a lost peer or a collective that timed out waiting for one: the rank that raised it is a
# witness, not the culprit (gloo, NCCL, MPI, plain sockets)
LOST_PEER = re.compile(r"connection reset|connection closed|connection refused|broken pipe|socket closed"
                       r"|peer process has unexpectedly disconnected|remote process exited|got 0 bytes"
                       r"|DistNetworkError|ncclRemoteError|NCCL communicator was aborted"
                       r"|MPI_ERR_PROC_FAILED|MPI_ERR_REVOKED"
                       # a collective or the store timed out waiting for a peer (gloo: "Timed out waiting 8000ms for
                       # recv"; NCCL's watchdog; the store's "Socket Timeout"), never any "timed out" (a GPU's "the
                       # launch timed out", a loader's own timeout are the raising rank's own fault)
                       r"|timed out waiting|collective operation timeout|socket timeout|wait timeout"
                       r"|DistBackendError", re.IGNORECASE)
# Lines of the launcher's output that may be evidence (kept wherever they appear, with EVIDENCE_CONTEXT lines after
# each, since several of the reports above span lines)
EVIDENCE = re.compile(r"process rank \d+ with PID|peer process has unexpectedly disconnected|RUNNING AT"
                      r"|BAD TERMINATION|EXIT STRING|KILLED BY SIGNAL|srun: error:|Terminating StepId|CANCELLED"
                      r"|daemon failed to report back|ssh: |HYDU_sock_connect|unable to connect from|Task launch for"
                      r"|lost communication with a remote daemon")
EVIDENCE_CONTEXT = 12


@dataclass(frozen=True)
class Failure:
    """One failed attempt, as the policy sees it."""

    kind: str  # a failure-record kind (mpiddp.failure.KINDS)
    status: int
    ranks: tuple[int, ...] = ()
    hosts: tuple[str, ...] = ()
    message: str = ""
    step: int | None = None
    source: str = "exit status"  # failure record(s), launcher output, or exit status
    recorded: int = 0  # how many ranks left a failure record
    witnesses: tuple[int, ...] = ()  # ranks whose record names a lost peer or a timeout (never blamed)


class OutputKeeper:
    """The launcher's output as evidence: every line that may name a dead rank or an unreachable host (with the
    lines after it), wherever it appears, plus the last `tail` lines. Fed line by line from two relay threads
    (append), read as text when the launcher has exited (iteration, in order)."""

    def __init__(self, tail: int) -> None:
        self.tail = tail
        self.kept: list[tuple[int, str]] = []  # (line number, line): evidence and its context
        self.last: list[tuple[int, str]] = []
        self.count = 0
        self.context_until = -1
        self.lock = threading.Lock()

    def append(self, line: str) -> None:
        with self.lock:
            number, self.count = self.count, self.count + 1
            if EVIDENCE.search(line):
                self.context_until = number + EVIDENCE_CONTEXT
            if number <= self.context_until:
                self.kept.append((number, line))
            self.last.append((number, line))
            if len(self.last) > 2 * self.tail:  # trimmed in halves: appends stay cheap
                del self.last[:-self.tail]

    def __iter__(self) -> Iterator[str]:
        with self.lock:
            last = self.last[-self.tail:]
            first_of_tail = last[0][0] if last else self.count
            lines = [line for number, line in self.kept if number < first_of_tail] + [line for _, line in last]
        return iter(lines)


def killed_by_signal(output: str) -> tuple[tuple[int, ...], tuple[str, ...], int] | None:
    """(ranks, hosts, signal) of ranks the launcher reports dead by a signal, or None."""
    found: list[tuple[int, str, int]] = []
    for match in OPENMPI_SIGNAL.finditer(output):
        found.append((int(match.group(1)), match.group(2), int(match.group(3))))
    for match in HYDRA_SIGNAL.finditer(output):
        found.append((int(match.group(1)), match.group(2), int(match.group(3))))
    cleanup = SRUN_CLEANUP.search(output)
    for match in SRUN_SIGNAL.finditer(output, 0, cleanup.start() if cleanup else len(output)):
        for rank in _task_ranks(match.group(2)):
            found.append((rank, match.group(1), SRUN_SIGNALS[match.group(3)]))
    if not found:
        hydra = HYDRA_BAD_TERMINATION.search(output)
        if hydra is not None:  # the host only: the supervisor finds its ranks through the placement
            exit_signal = HYDRA_EXIT_SIGNAL.search(output, hydra.end())
            return (), (hydra.group(1),), int(exit_signal.group(1) if exit_signal else hydra.group(2))
        lost = list(dict.fromkeys(match.group(1) for match in OPENMPI_PEER_LOST.finditer(output)))
        return ((), tuple(lost), signal.SIGKILL) if lost else None
    ranks = tuple(sorted({rank for rank, _, _ in found}))
    hosts = tuple(dict.fromkeys(host for _, host, _ in found))
    return ranks, hosts, found[0][2]


def _task_ranks(text: str) -> list[int]:
    ranks = []
    for item in text.split(","):
        low, _, high = item.partition("-")
        ranks.extend(range(int(low), int(high or low) + 1))
    return ranks


def lost_peer(record: FailureRecord) -> bool:
    """Whether the record is a witness's: an exception about a lost peer or a collective that timed out."""
    return record.kind == "exception" and LOST_PEER.search(record.message) is not None


def unreachable(output: str) -> tuple[str, ...]:
    """The hosts the launcher reports it could not reach (its daemon never started there)."""
    hosts = [match.group(1) for match in OPENMPI_UNREACHABLE.finditer(output)]
    hosts += [next(group for group in match.groups() if group) for match in SSH_UNREACHABLE.finditer(output)]
    return tuple(dict.fromkeys(hosts))


def _signature(record: FailureRecord) -> tuple[str, str, int | None]:
    """What makes two ranks' failures the same: the kind, the exception's type (or the message), the status."""
    message = record.message.removeprefix("ScriptError: ")  # a `run` script's exception: its own type counts
    return record.kind, message.split(":", 1)[0].strip(), record.status


def _hosts_named(record: FailureRecord, host_of: dict[int, str]) -> list[str]:
    """The hosts a record blames: its ranks' in the attempt's placement, where it knows every one of them; else the
    record's own names (a record's hosts are listed once each, not once per rank; and survivors that refused a
    recovery after the shrink name the lost ranks' hosts only, the placement already numbering the survivors)."""
    if record.ranks and all(rank in host_of for rank in record.ranks):
        return [host_of[rank] for rank in record.ranks]
    return list(record.hosts)


def from_records(records: list[FailureRecord], status: int, world_size: int,
                 host_of: dict[int, str] | None = None) -> Failure | None:
    """The failure every rank's record shows together (rules 1 to 4 and 6 of the module docstring), or None
    when no rank recorded one. `host_of`: rank -> host of the attempt, as far as known."""
    if not records:
        return None
    host_of = host_of or {}
    witnesses = tuple(sorted({r.rank for r in records if lost_peer(r) and r.rank is not None}))
    named = [r for r in records if not lost_peer(r)]
    common = {"status": status, "source": "failure record", "recorded": len(records), "witnesses": witnesses}
    if not named:
        first = records[0]
        return Failure(first.kind, message=f"{first.message} (rank(s) {', '.join(map(str, witnesses))} waited for a "
                       f"peer that failed or stalled; none named the culprit)", step=first.step, **common)
    accounts = [r for r in named if r.kind in ("host_fault", "hang")]
    primary = accounts[0] if accounts else named[0]
    if accounts:
        return Failure(primary.kind, ranks=tuple(primary.ranks), hosts=tuple(primary.hosts), message=primary.message,
                       step=primary.step, **common)
    alike = [r for r in named if _signature(r) == _signature(primary)]
    ranks = tuple(sorted({rank for r in alike for rank in r.ranks}))
    hosts = tuple(dict.fromkeys(host for r in alike for host in _hosts_named(r, host_of)))
    every_rank = {r.rank for r in alike} >= set(range(world_size)) and world_size > 0
    known_hosts = set(host_of.values())
    every_host = len(known_hosts) > 1 and set(hosts) >= known_hosts
    kind, message = primary.kind, primary.message
    if every_rank and kind == "exit" and all(r.progressed is False for r in alike) and (primary.status or 0) > 0:
        kind, message = "user_error", (f"{message}, on every rank before any progress: the script's own error, "
                                       f"not a host's")
    if every_rank or every_host:
        what = "every rank" if every_rank else "every host"
        return Failure(kind, message=f"{message} (the same on {what}: no host to blame)", step=primary.step, **common)
    return Failure(kind, ranks=ranks, hosts=hosts, message=message, step=primary.step, **common)


def during_spawn(found: Failure, spawning: list[str]) -> tuple[Failure, str]:
    """(the failure, what the launcher crashed during or ''): a launcher that reports it lost (or saw die) hosts
    while the job was spawning onto `spawning` (the job's spawn mark, mpiddp.failure.SPAWNING_FILE) failed in its
    own bookkeeping of the spawn (Open MPI 5.0.11's prterun: "PMIX ERROR ... pmix_server_dyn.c", then "lost
    communication with a remote daemon" naming the spare, or a survivor's host: both seen), which is no evidence
    against any host: the failure then blames none. A host that is really down fails the relaunch's start ("daemon
    failed to report back") and is left out then. A launcher that dies in the spawn naming no host and with no
    rank's record ("double free or corruption", exit 134: seen) blames none already; the crash is still named."""
    if not spawning:
        return found, ""
    crash = f"during the job's spawn onto {', '.join(spawning)}"
    if found.kind == "exit" and not found.hosts and not found.recorded:
        return found, crash
    if found.source != "launcher output" or found.kind not in ("unreachable", "killed") or not found.hosts:
        return found, ""
    hosts = ", ".join(found.hosts)
    message = (f"the launcher failed {crash} ({found.message}); a launcher's failure during a spawn is not held "
               f"against {hosts}")
    return Failure("exit", found.status, message=message, step=found.step, source="launcher output",
                   recorded=found.recorded, witnesses=found.witnesses), crash


# how a launcher that crashed ends (launch's status: 128 + the signal): SIGABRT (glibc's "corrupted size vs.
# prev_size", "double free or corruption"), SIGBUS, SIGSEGV
CRASH_STATUSES = (128 + 6, 128 + 7, 128 + 11)
# how long before a crashed launcher's end the losses it caused are recorded: the ranks on its host end with it
# and the survivors elsewhere recover from them within a second or two (seen: the same second); a loss earlier
# than this, after the spawn, is a loss of its own
CRASH_TAKES_S = 10.0


def after_spawn(found: Failure, spawned: list[str]) -> str:
    """What the launcher crashed after, or '': a launcher that crashed (CRASH_STATUSES) naming no host and with
    no rank's record, in an attempt whose job had spawned onto `spawned` (mpiddp.failure.last_spawn: the spawn
    ended, its new ranks joined). Open MPI 5.0.11's prterun corrupts its memory in a spawn and can abort well
    after it returned (seen in CI: "corrupted size vs. prev_size" once the new rank had joined); the ranks on its
    host end with it, and a survivor elsewhere then records an in-job recovery from their loss, which is the
    launcher's doing, not their host's (the supervisor holds none recorded CRASH_TAKES_S before the crash)."""
    if not spawned or found.kind != "exit" or found.hosts or found.recorded or found.status not in CRASH_STATUSES:
        return ""
    return f"after the job's spawn onto {', '.join(spawned)} (exit status {found.status})"


def diagnose(status: int, record: FailureRecord | list[FailureRecord] | None, output: str, world_size: int = 0,
             host_of: dict[int, str] | None = None) -> Failure:
    """Combine the exit status, every rank's record and the launcher's output into one Failure (see the module
    docstring for the rules). `record`: the ranks' records (one record alone is accepted as a list of one)."""
    records = [record] if isinstance(record, FailureRecord) else list(record or [])
    found = from_records(records, status, world_size, host_of)
    if found is not None and any(not lost_peer(r) for r in records):  # a record that names the failure
        return found
    killed = killed_by_signal(output)
    step = found.step if found is not None else None
    evidence = {"recorded": found.recorded, "witnesses": found.witnesses} if found is not None else {}
    if killed is not None:
        ranks, hosts, signum = killed
        name = signal.Signals(signum).name if signum in set(signal.Signals) else f"signal {signum}"
        who = f"rank {', '.join(map(str, ranks))} on " if ranks else "a rank on "
        return Failure("killed", status, ranks, hosts, f"{who}{', '.join(hosts)} died ({name} or lost)", step,
                       "launcher output", **evidence)
    lost = unreachable(output)
    if lost:
        return Failure("unreachable", status, (), lost, f"the launcher could not reach {', '.join(lost)}", step,
                       "launcher output", **evidence)
    ended = {match.group(1): match.group(2) for match in _ENDED_BEFORE_START.finditer(output)}
    if ended:
        hosts = tuple(ended)
        return Failure("unreachable", status, (), hosts, "; ".join(f"the daemon on {host} ended before the job "
                       f"started ({why})" for host, why in ended.items()) + " (the host went down, or Open MPI's "
                       "start-up failed there)", step, "launcher output", **evidence)
    overdue = _STARTUP_OVERDUE.search(output)
    if overdue:  # what records there are tell of lost peers only (a record that names a failure returned above)
        return Failure("hang", status, message=overdue.group(1).removesuffix("; ending the attempt"), step=step,
                       source="launcher output", **evidence)
    silent = tuple(dict.fromkeys(match.group(1) for match in OPENMPI_DAEMON_LOST.finditer(output)))
    if silent:
        return Failure("unreachable", status, (), silent, f"the launcher lost {', '.join(silent)} while the job ran "
                       f"(the host stopped answering: power, kernel or network)", step, "launcher output", **evidence)
    if found is not None:
        return found
    kind = {EXIT_USER_ERROR: "user_error", EXIT_STOPPED: "stopped", EXIT_INTERRUPTED: "stopped",
            EXIT_HANG: "hang"}.get(status, "exit")
    return Failure(kind, status, message=f"the launcher exited with status {status} and no failure record")
