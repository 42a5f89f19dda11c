"""The restart decision, pure: given how an attempt failed and the hosts, relaunch on which hosts, or stop and why."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mpiddp.failure import FailureRecord
from mpiddp.globalbatch import GlobalBatchError, split
from mpiddp.launch.diagnose import Failure
from mpiddp.launch.hosts import Host, HostListError, place

NEVER_RETRIED = {"user_error": "a user error (exit 2, or the same exit on every rank before any progress) fails the "
                               "same way again: fix it and launch again",
                 "stopped": "a graceful stop (exit 3) or interrupt: continue with --resume (a Slurm requeue resumes by itself)"}


@dataclass(frozen=True)
class Decision:
    retry: bool
    hosts: list[Host]  # the next attempt's hosts (empty when stopping)
    excluded: list[str]  # every host left out so far, this failure's included
    reason: str
    num_ranks: int = 0  # the next attempt's ranks: -np, or fewer (at least --min-np) when no spare is left
    strikes: dict[str, int] = field(default_factory=dict)  # failures blamed on each host so far, this one's included


def short_name(name: str) -> str:
    """A host name before its first dot (nodea.cluster.org: nodea); an IP address as it is."""
    if ":" in name or name.replace(".", "").isdigit():
        return name
    return name.split(".", 1)[0]


def same_host(a: str, b: str) -> bool:
    """Whether two names of hosts name the same host, as far as names tell (FQDN or short name)."""
    return a == b or short_name(a) == short_name(b)


def hosts_of(placed: list[Host], ranks: tuple[int, ...], placement: dict[int, str] | None = None) -> list[str]:
    """The hosts (as the host list names them) that ranks ran on: from `placement` (rank -> host, as the job
    recorded it), else assuming ranks fill each host's slots in order."""
    if placement:
        return list(dict.fromkeys(placement[rank] for rank in sorted(ranks) if rank in placement))
    names, first = [], 0
    for host in placed:
        if any(first <= rank < first + host.slots for rank in ranks):
            names.append(host.name)
        first += host.slots
    return names


def blamed(failure: Failure, hosts: list[Host], placed: list[Host], placement: dict[int, str] | None = None) -> list[str]:
    """The host-list names of the hosts the failure blames. The job's records carry socket.gethostname() (often
    an FQDN) where the host list may have a short name or an IP, so its ranks are mapped through the attempt's own
    placement (the one the job recorded, else the slot order); without ranks (or placement), names are compared
    by short name."""
    by_rank = hosts_of(placed, failure.ranks, placement) if failure.ranks else []
    num_hosts = len(set(placement.values())) if placement else len(placed)
    if num_hosts > 1 and len(by_rank) == num_hosts:
        return []  # every host failed alike (the same crash everywhere, a job-wide hang): none stands out
    if by_rank:
        return by_rank
    return [h.name for h in hosts if any(same_host(h.name, name) for name in failure.hosts)]


def ranks_lost_at_start(recoveries: list[dict[str, Any]]) -> tuple[int, ...] | None:
    """The attempt's own rank numbers of the ranks its in-job recoveries lost (each recovery numbers the world it
    shrank; survivors keep their order), or None when the records do not chain (a field missing or odd)."""
    try:
        alive = list(range(int(recoveries[0]["world_before"])))
        lost = []
        for item in recoveries:
            if int(item["world_before"]) != len(alive):
                return None
            gone = {int(rank) for rank in item["ranks_lost"]}
            lost += [alive[rank] for rank in sorted(gone)]
            alive = [rank for index, rank in enumerate(alive) if index not in gone]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return tuple(lost)


def contradicted_by_records(recoveries: list[dict[str, Any]], records: list[FailureRecord],
                            spawn_failed_at: float | None = None, launcher_crash: str = "during the job's spawn",
                            ) -> tuple[list[dict[str, Any]], list[str]]:
    """(the in-job recoveries the job's failure records leave standing, why each other one does not stand).

    A rank records a failure only as it ends the job (a fatal error, the hang fallback, a stop), so a recovery
    from its exit is a consequence of that end, not a host's fault: mpirun's teardown resumes a stopped rank
    (SIGCONT, then SIGTERM), which then "recovers" from the rank that ended the job. Such a recovery is
    contradicted when it came at or after the oldest record (its `time`), or when a rank it lost wrote a record
    itself (the first recovery only: later ones number the survivors' world; records without times). Likewise
    a recovery at or after `spawn_failed_at`, when a spawn began that the launcher failed during (or shortly
    before a launcher crashed after a spawn: `launcher_crash` says which): the launcher's failure took that rank."""
    if not recoveries or (not records and spawn_failed_at is None):
        return list(recoveries), []
    decided = min(records, key=lambda r: r.time) if records else None
    recorders = {r.rank: r for r in records if r.rank is not None}
    kept, why = [], []
    for index, item in enumerate(recoveries):
        if item.get("cause") == "grew":
            kept.append(item)
            continue
        at = item.get("time")
        lost = [r for r in item.get("ranks_lost") or [] if isinstance(r, int)]
        own = [recorders[r] for r in lost if r in recorders and index == 0]
        said = f"the in-job recovery that lost {', '.join(map(str, item.get('hosts_lost') or [])) or 'a host'}"
        timed = isinstance(at, (int, float))
        if decided is not None and timed and at >= decided.time:
            who = f"rank {decided.rank if decided.rank is not None else '?'}"
            why.append(f"{said} came after {who} recorded the end of the job ({decided.kind})")
        elif own:
            why.append(f"{said} lost rank {own[0].rank}, which recorded its own end ({own[0].kind}): it left on purpose")
        elif spawn_failed_at is not None and timed and at >= spawn_failed_at:
            why.append(f"{said} came as the launcher failed {launcher_crash}")
        else:
            kept.append(item)
    return kept, why


def strike_lost_in_job(recoveries: list[dict[str, Any]], hosts: list[Host], excluded: list[str],
                       strikes: dict[str, int], host_strikes: int = 1, placed: list[Host] | None = None,
                       ) -> tuple[list[str], dict[str, int]]:
    """The hosts an attempt lost and recovered from in the job (its `recoveries`) before a later failure ended
    it: each loss is a failure blamed on its host, like the attempt's own. The job names hosts as the host sees
    itself (socket.gethostname()), which a host list may call otherwise (localhost, a short name, an IP), so
    the lost ranks are mapped through the attempt's slot order (`placed`) where the records chain from its
    start; else `hosts_lost` is compared by name. Returns (host-list names to leave out now, strikes)."""
    strikes = dict(strikes)
    ranks = ranks_lost_at_start(recoveries) if recoveries and placed else None
    if ranks is not None and placed and int(recoveries[0]["world_before"]) == sum(h.slots for h in placed):
        names = hosts_of(placed, ranks)
    else:
        said = [str(name) for item in recoveries for name in (item.get("hosts_lost") or [])]
        names = [host.name for host in hosts if any(same_host(host.name, name) for name in said)]
    left_out = []
    for host in hosts:
        if host.name in excluded or host.name not in names:
            continue
        strikes[host.name] = strikes.get(host.name, 0) + 1
        if strikes[host.name] >= host_strikes:
            left_out.append(host.name)
    return left_out, strikes


def decide(failure: Failure, hosts: list[Host], excluded: list[str], restarts_used: int, max_restarts: int,
           num_ranks: int, placed: list[Host] | None = None, min_np: int | None = None,
           global_batch: tuple[int, int] | None = None, strikes: dict[str, int] | None = None,
           host_strikes: int = 1, placement: dict[int, str] | None = None) -> Decision:
    """`hosts`: every host known (in use and spare), `excluded`: those already left out, `placed`: the hosts the
    failed attempt ran on, in rank order, `placement`: rank -> host of the failed attempt as the job recorded it.

    A host is left out on its `host_strikes`-th blamed failure (`strikes`: the failures blamed on each host before
    this one); until then the relaunch keeps it. 1 (the default) leaves a host out at once, which spare hosts make
    cheap; more lets a host without a replacement (the one node of an allocation, an OOM kill that says nothing
    against the host) be tried again. With `min_np`, when the hosts left cannot hold `num_ranks` (no spare),
    relaunch on every slot left if that is at least `min_np`; `global_batch` (samples per step, largest per-rank
    batch) must then split exactly over the fewer ranks, else the decision stops and says why."""
    assert host_strikes >= 1
    strikes = dict(strikes or {})

    def stop(reason: str, left_out: list[str]) -> Decision:
        return Decision(False, [], left_out, reason, strikes=strikes)

    if failure.status == 0:
        return stop("finished", list(excluded))
    if failure.kind in NEVER_RETRIED:
        return stop(NEVER_RETRIED[failure.kind], list(excluded))
    blamed_now = [name for name in blamed(failure, hosts, placed or [], placement) if name not in excluded]
    for name in blamed_now:
        strikes[name] = strikes.get(name, 0) + 1
    newly = [name for name in blamed_now if strikes[name] >= host_strikes]
    kept = [name for name in blamed_now if name not in newly]
    now_excluded = [*excluded, *newly]
    if restarts_used >= max_restarts:
        return stop(f"--max-restarts {max_restarts} spent", now_excluded)
    if not hosts:  # no host list: the launcher places the ranks itself, here or in the allocation
        return Decision(True, [], now_excluded, f"relaunching ({failure.kind})", num_ranks, strikes)
    remaining = [h for h in hosts if h.name not in now_excluded]
    without = f"without {', '.join(newly)} " if newly else ""
    try:
        used, _spares = place(remaining, num_ranks)
    except HostListError as exc:
        slots = sum(h.slots for h in remaining)
        if min_np is None or slots < 1:
            hint = "" if host_strikes > 1 else (
                "; --host-strikes 2 tries a failed host once more when no spare can replace it")
            return stop(f"cannot relaunch without {', '.join(now_excluded)}: {exc}{hint}", now_excluded)
        if slots < min_np:
            return stop(f"cannot relaunch without {', '.join(now_excluded)}: {slots} slots left, fewer than "
                        f"--min-np {min_np}", now_excluded)
        try:
            ranks, kept_batch = _fewer_ranks(slots, min_np, global_batch)
        except GlobalBatchError as refusal:
            return stop(f"cannot continue on {slots} ranks: {refusal}", now_excluded)
        shrunk = (f"relaunching on {ranks} of {num_ranks} ranks {without}({failure.kind}; no spare host, "
                  f"--min-np {min_np}){kept_batch}")
        return Decision(True, place(remaining, ranks)[0], now_excluded, shrunk, ranks, strikes)
    reason = f"relaunching {without}({failure.kind})" if newly else _same_hosts(failure, kept, strikes, host_strikes)
    return Decision(True, used, now_excluded, reason, num_ranks, strikes)


def _fewer_ranks(slots: int, min_np: int, global_batch: tuple[int, int] | None) -> tuple[int, str]:
    """The ranks of a shrunk relaunch: every slot left, or with `global_batch` (samples per step, largest per-rank
    batch) the most ranks, from every slot left down to --min-np, over which it splits exactly; and how it is
    split, for the reason. Raises the last GlobalBatchError when it splits over none."""
    if global_batch is None:
        return slots, ""
    total, largest = global_batch
    refusal: GlobalBatchError | None = None
    for ranks in range(slots, min_np - 1, -1):
        try:
            per_rank, accumulation = split(total, ranks, largest)
        except GlobalBatchError as error:
            refusal = error
            continue
        return ranks, f" at the same global batch {total} ({per_rank} per rank x {accumulation} accumulation)"
    assert refusal is not None, "slots >= min_np: at least one count was tried"
    raise refusal


def _same_hosts(failure: Failure, kept: list[str], strikes: dict[str, int], host_strikes: int) -> str:
    """Why a relaunch keeps its hosts: some were blamed but have strikes left, or none was blamed."""
    if kept:
        counts = ", ".join(f"{name}: failure {strikes[name]} of --host-strikes {host_strikes}" for name in kept)
        return f"relaunching on the same hosts ({failure.kind}; {counts})"
    return f"relaunching on the same hosts ({failure.kind}; no host to blame)"
