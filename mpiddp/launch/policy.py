"""The restart decision, pure: given how an attempt failed and the hosts, relaunch on which hosts, or stop and why."""

from __future__ import annotations

from dataclasses import dataclass

from mpiddp.launch.diagnose import Failure
from mpiddp.launch.hosts import Host, HostListError, place

NEVER_RETRIED = {"user_error": "a user error (exit 2) fails the same way again: fix it and launch again",
                 "stopped": "a graceful stop (exit 3) or interrupt: continue with the same launch command"}


@dataclass(frozen=True)
class Decision:
    retry: bool
    hosts: list[Host]  # the next attempt's hosts (empty when stopping)
    excluded: list[str]  # every host left out so far, this failure's included
    reason: str


def decide(failure: Failure, hosts: list[Host], excluded: list[str], restarts_used: int, max_restarts: int,
           num_ranks: int) -> Decision:
    """`hosts`: every host known (in use and spare), `excluded`: those already left out."""
    if failure.status == 0:
        return Decision(False, [], list(excluded), "finished")
    if failure.kind in NEVER_RETRIED:
        return Decision(False, [], list(excluded), NEVER_RETRIED[failure.kind])
    known = {h.name for h in hosts}
    newly = [name for name in failure.hosts if name in known and name not in excluded]
    now_excluded = [*excluded, *newly]
    if restarts_used >= max_restarts:
        return Decision(False, [], now_excluded, f"--max-restarts {max_restarts} spent")
    if not hosts:  # no host list: the launcher places the ranks itself, here or in the allocation
        return Decision(True, [], now_excluded, f"relaunching ({failure.kind})")
    remaining = [h for h in hosts if h.name not in now_excluded]
    try:
        used, _spares = place(remaining, num_ranks)
    except HostListError as exc:
        return Decision(False, [], now_excluded, f"cannot relaunch without {', '.join(now_excluded)}: {exc}")
    if newly:
        reason = f"relaunching without {', '.join(newly)} ({failure.kind})"
    else:
        reason = f"relaunching on the same hosts ({failure.kind}; no host to blame)"
    return Decision(True, used, now_excluded, reason)
