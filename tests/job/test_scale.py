"""Scale: what rank 0 carries grows by one store connection per rank, never by several.

Every rank talks to rank 0's rendezvous store over one connection, shared by the process group, the hang
watchdog, the finish watch and the failure report. Measured on a real 8-rank job while its watchdogs run: a
second connection per rank (2 x 8) would be far past the bound of one per rank and a few (8 + 3).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, job_env, rank_pid, rank_pids

WORLD = 8  # enough ranks that a second connection per rank shows (16 > 8 + SLACK); each costs start-up (16: 42 s, 8: 30 s)
SLACK = 3  # rank 0's own client and the accepted end of it, and the listening socket
PORT = re.compile(r"process group ready: .* rendezvous [^ ]+:(\d+),")


def tcp_sockets(pid: int) -> list[tuple[int, int, int]]:
    """(local port, remote port, state) of every TCP socket the process holds open (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed while we looked
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{table}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                local, remote = (int(part.rsplit(":", 1)[1], 16) for part in fields[1:3])
                found.append((local, remote, int(fields[3], 16)))
    return found


def read_until(process: subprocess.Popen, pattern: re.Pattern[str] | str, seen: list[str]) -> re.Match[str] | str:
    assert process.stdout is not None
    for line in process.stdout:
        seen.append(line)
        match = pattern.search(line) if isinstance(pattern, re.Pattern) else (pattern if pattern in line else None)
        if match:
            return match
    pytest.fail(f"the job ended before {pattern!r}:\n{''.join(seen)[-4000:]}")


@pytest.mark.mpi
def test_rank_0_holds_one_store_connection_per_rank_while_the_watchdogs_run(mpirun, tmp_path):
    run_dir = tmp_path / "run"
    # 5 steps an epoch (1438 images, 32 per rank x 8 ranks); rank 1 stalls in step 8, in epoch 2, so the job stands
    # still with every watchdog on, and ends itself with the hang report 10 s later
    command = [mpirun, "-np", str(WORLD), sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), "--epochs", "3",
               "--batch-size", "32", "--eval-batch-size", "64", "--no-progress", "--wandb", "disabled",
               "--inject-fault", "stall:1:8", "--hang-timeout", "10"]
    process = subprocess.Popen(command, cwd=REPO, env=job_env(OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen: list[str] = []
    try:
        port = int(read_until(process, PORT, seen).group(1))  # type: ignore[union-attr]
        read_until(process, "epoch 1/3 |", seen)  # every rank is training: its watchdog and every connection are up
        sockets = tcp_sockets(rank_pid(run_dir, 0))
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            for pid in rank_pids(run_dir).values():
                os.kill(pid, signal.SIGKILL)
            process.wait()
    output = "".join(seen) + output
    on_store = [s for s in sockets if port in s[:2]]
    print(f"rank 0 of {WORLD} holds {len(on_store)} TCP sockets on the store, {len(sockets)} in all")
    assert len(on_store) <= WORLD + SLACK, (len(on_store), len(sockets))
    # besides the store: gloo's full mesh on CPU (one connection to each peer, and its listener; NCCL has no
    # such mesh) and the launcher's own (PMIx); measured 18 on the store and 19 besides it at 16 ranks
    # (the store's count grows by one a rank)
    assert len(sockets) - len(on_store) <= WORLD + 2 * SLACK, (len(on_store), len(sockets))
    # the watchdogs still tell who hangs, through the one shared connection
    assert process.returncode == 4, output[-4000:]
    from mpiddp import failure

    hangs = [r for r in failure.read_all(run_dir / failure.FAILURES_DIR) if r.kind == "hang"]
    assert hangs and all(r.ranks == [1] for r in hangs), (hangs, output[-4000:])
    deadline = time.monotonic() + 30
    while rank_pids(run_dir):
        assert time.monotonic() < deadline, "a rank outlived the job"
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising


# ---- in-process: the shared connection, the pace of the watchers, the hang writer's reads ----------------------

class CountingStore:
    """The store calls the watchdog makes, in memory, counting each request by kind."""

    def __init__(self):
        self.data, self.counters, self.requests = {}, {}, []

    def set(self, key, value):
        self.requests.append(("set", key))
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, amount):
        self.requests.append(("add", key))
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]

    def check(self, keys):
        self.requests.append(("check", tuple(keys)))
        return all(k in self.data for k in keys)

    def get(self, key):
        self.requests.append(("get", key))
        return self.data[key]

    def multi_get(self, keys):
        self.requests.append(("multi_get", tuple(keys)))
        return [self.data[k] for k in keys]


@pytest.mark.floor  # torch's own property that the shared connection relies on: check it on the oldest torch too
def test_one_store_connection_serves_several_threads_at_once():
    import threading
    from datetime import timedelta

    import torch.distributed as tdist

    store = tdist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    client = tdist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))
    errors = []

    def hammer(name):
        try:
            for i in range(300):
                client.set(f"{name}/{i}", f"{name}-{i}")
                client.add("counter", 1)
                assert client.check([f"{name}/{i}"])
                assert client.get(f"{name}/{i}") == f"{name}-{i}".encode()
        except Exception as exc:  # handed to the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=hammer, args=(f"t{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert client.add("counter", 0) == 4 * 300  # no request lost or answered to the wrong thread


def test_watchers_pace_themselves_so_rank_0s_store_load_stays_flat_as_the_world_grows():
    from mpiddp.job.storeload import STORE_REQUESTS_PER_S, paced_interval, store_rate
    from mpiddp.job.watchdog import REQUESTS_PER_INTERVAL, Watchdog

    assert paced_interval(5.0, 2, 3, 600) == 5.0  # a small job keeps its own rhythm
    for world in (256, 1024, 4000):  # up to 4,000 ranks with the default --hang-timeout
        watchdog = Watchdog(600, 0, world, "rank 0", None, lambda code: None)
        assert store_rate(world, REQUESTS_PER_INTERVAL, watchdog.interval) <= STORE_REQUESTS_PER_S + 1e-9
        assert watchdog.interval <= 600 / 5  # still several reports within the timeout
    for world in (2, 256, 1024, 3000):  # in-job recovery asks one more (silent hosts): up to 3,000 ranks
        watchdog = Watchdog(600, 0, world, "rank 0", object(), lambda code: None, {0: "a", 1: "b"})
        watchdog.watch_hosts()
        assert store_rate(world, watchdog.requests_per_interval, watchdog.interval) <= STORE_REQUESTS_PER_S + 1e-9
        assert watchdog.requests_per_interval == REQUESTS_PER_INTERVAL + 1 and watchdog.interval <= 600 / 5
    assert watchdog.quiet is not None and watchdog.quiet.bound_s == 3 * watchdog.interval  # a big job: its pace
    # a timeout too short for the pace: the timeout wins, so a hang is still caught and its culprit still judged
    short = Watchdog(20, 0, 4096, "rank 0", None, lambda code: None)
    assert short.interval == 20 / 5


def test_the_hang_writer_reads_each_ranks_stacks_once_and_otherwise_polls_one_counter(tmp_path, monkeypatch):
    import mpiddp.job.watchdog as watchdog_module
    from mpiddp.job.storekeys import STACKS_GIVEN as STACKS_COUNT_KEY
    from mpiddp.job.watchdog import Watchdog

    monkeypatch.setattr(watchdog_module, "GRACE_S", 1.0)  # several polls: ranks 2 to 63 never answer
    world = 64
    store = CountingStore()
    store.set("mpiddp/stacks/1", "rank 1/64\nstuck_here")
    store.add(STACKS_COUNT_KEY, 1)
    watchdog = Watchdog(0.1, 0, world, "rank 0/64", store, lambda code: None, {r: "h" for r in range(world)},
                        tmp_path / "failures", tmp_path)
    store.requests.clear()
    watchdog._fire()
    (hang_file,) = tmp_path.glob("hang-*.txt")
    assert "stuck_here" in hang_file.read_text()
    stacks_reads = [r for r in store.requests if r[0] == "check" and r[1][0].startswith("mpiddp/stacks/")]
    assert len(stacks_reads) == world  # each key once, however long the wait
    polls = [r for r in store.requests if r == ("add", STACKS_COUNT_KEY)]
    assert len(polls) >= 2  # it waited on the counter (and its own stacks counted once)


def test_a_failing_rank_waits_a_bounded_time_for_the_shared_connection():
    import threading

    from mpiddp.job.storeload import add_within

    store = CountingStore()
    assert add_within(store, "mpiddp/failures", 1, 5.0) == 1
    assert add_within(store, "mpiddp/failures", 1, 5.0) == 2
    release = threading.Event()

    class BusyStore:  # another thread's long request holds the connection (or rank 0 stopped answering)
        def add(self, key, amount):
            release.wait(60)
            return 1

    try:
        with pytest.raises(TimeoutError):
            add_within(BusyStore(), "mpiddp/failures", 1, 0.2)
    finally:
        release.set()


def test_the_watchers_use_the_ranks_one_connection(tmp_path):
    from mpiddp.job.collective import Dist, Rendezvous, SoloTransport
    from mpiddp.job.finishwatch import FinishWatch
    from mpiddp.job.topology import RankRecord, build_topology
    from mpiddp.job.watchdog import Watchdog

    class Holder:  # the bootstrap's _Store
        store = CountingStore()

    rendezvous = Rendezvous("127.0.0.1", 1234, {}, Holder())
    topo = build_topology(1, [RankRecord(r, "node", 0, r, 2) for r in range(2)])
    dist = Dist(topo, SoloTransport()).placed("cpu", None, "gloo", rendezvous, 1)
    assert Watchdog.for_job(60, dist, tmp_path).store.inner is Holder.store  # each request with a deadline
    assert FinishWatch.for_job(60, dist, rendezvous).store.inner is Holder.store
    assert Watchdog.for_job(0, dist, tmp_path).store is None  # turned off: nothing to talk to
