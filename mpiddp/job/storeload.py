"""What mpiddp's helper threads ask of rank 0's rendezvous store, kept to a load rank 0 can carry at any scale.

Every rank has one connection to the store, opened by the bootstrap and shared by the process group, the hang
watchdog, the finish watch and the failure report (torch's TCPStore client serialises the requests of several
threads on its connection, and releases the GIL while it waits). Rank 0 holds one socket per rank, not one per
use: at 1,024 ranks, 1,024 sockets instead of 3,000 to 4,000 against a common open-file limit of 1,024.

Rank 0's store answers every rank alone, so the helpers that poll it pace themselves by the world's size: all
ranks together send it at most STORE_REQUESTS_PER_S periodic requests, unless the timeout they watch for is too
short to wait that long between reports (then the timeout wins: a hang is still caught in time).
"""

from __future__ import annotations

import threading
import time
from typing import Any

STORE_REQUESTS_PER_S = 100.0  # what all ranks' watchers together ask of rank 0's store each second, at most
INTERVALS_PER_TIMEOUT = 5  # a watcher reports at least this often within the timeout it watches for
REQUEST_DEADLINE_S = 5.0  # the longest a store request may keep a watcher waiting (less with a short timeout)


def paced_interval(base_s: float, world_size: int, requests_per_interval: int, timeout_s: float) -> float:
    """Seconds between a watcher's rounds of store requests: `base_s` in a small job; in a big one, long enough
    that the world's rounds stay within STORE_REQUESTS_PER_S at rank 0, but never longer than a fifth of
    `timeout_s` (or `base_s`, if that is longer)."""
    paced = world_size * requests_per_interval / STORE_REQUESTS_PER_S
    return max(base_s, min(paced, timeout_s / INTERVALS_PER_TIMEOUT))


def store_rate(world_size: int, requests_per_interval: int, interval_s: float) -> float:
    """The periodic requests per second that rank 0's store gets from every rank's watcher."""
    return world_size * requests_per_interval / interval_s


def add_within(store: Any, key: str, amount: int, seconds: float) -> int:
    """store.add(key, amount), but give up after `seconds` with TimeoutError: the shared connection may be busy
    with a long request of another thread, or rank 0 stopped answering. The request itself is left to finish
    or fail in its own daemon thread (the caller is ending the process)."""
    result: list[int] = []
    failure: list[BaseException] = []

    def ask() -> None:
        try:
            result.append(int(store.add(key, amount)))
        except BaseException as exc:  # handed to the caller's thread
            failure.append(exc)

    asker = threading.Thread(target=ask, name="mpiddp-store-add", daemon=True)
    asker.start()
    asker.join(seconds)
    if failure:
        raise failure[0]
    if not result:
        raise TimeoutError(f"rank 0's store did not answer within {seconds:g} s")
    return result[0]


class StoreUnanswered(TimeoutError):
    """A request to rank 0's store timed out: not answered within its deadline, or sent while an earlier one
    still waits for its answer."""


class AnsweredWithin:
    """A store whose every request is answered within `seconds`, or raises StoreUnanswered: a watcher never
    blocks on rank 0's store. A stopped rank 0 holds its sockets open, so a TCPStore client would wait in recv
    for as long as the process is stopped (torch's own timeout does not cover every request). The request that
    did not answer is left to finish in its daemon thread; until it does, no other is sent (it would queue
    behind it on the one connection) and each raises at once. `unanswered_since`: when that request was sent
    (time.monotonic()), None while the store answers."""

    def __init__(self, store: Any, seconds: float) -> None:
        self.inner = store
        self.seconds = seconds
        self.unanswered_since: float | None = None
        self._pending: threading.Thread | None = None
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if not callable(attribute):
            return attribute
        return lambda *args, **kwargs: self._ask(name, attribute, args, kwargs)

    def _ask(self, name: str, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        with self._lock:
            if self._pending is not None and self._pending.is_alive():
                assert self.unanswered_since is not None
                raise StoreUnanswered(f"rank 0's store timed out: a request has waited "
                                      f"{time.monotonic() - self.unanswered_since:.0f} s for its answer")
            self._pending = None
            self.unanswered_since = None
        answer: list[Any] = []
        failure: list[BaseException] = []

        def ask() -> None:
            try:
                answer.append(request(*args, **kwargs))
            except BaseException as exc:  # handed to the caller's thread
                failure.append(exc)

        asker = threading.Thread(target=ask, name="mpiddp-store-request", daemon=True)
        sent = time.monotonic()
        asker.start()
        asker.join(self.seconds)
        if asker.is_alive():
            with self._lock:
                self._pending, self.unanswered_since = asker, sent
            raise StoreUnanswered(f"rank 0's store timed out: {name} not answered within {self.seconds:g} s")
        if failure:
            raise failure[0]
        return answer[0]


def answered_within(store: Any, interval_s: float, timeout_s: float) -> AnsweredWithin:
    """`store` for a watcher that asks every `interval_s` and watches for `timeout_s`: each request answered
    within REQUEST_DEADLINE_S, or half the timeout where that is shorter, never less than one interval."""
    return AnsweredWithin(store, max(interval_s, min(REQUEST_DEADLINE_S, timeout_s / 2)))
