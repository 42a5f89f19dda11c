"""The one watcher base (mpiddp/job/watch.py) and its two uses: the finish watch here, in memory; the hang
watchdog in test_launch_record, test_evidence, test_flightrec and test_scale."""

import os
import time
from pathlib import Path
from types import SimpleNamespace

from mpiddp.errors import EXIT_HANG
from mpiddp.job import storekeys
from mpiddp.job.finishwatch import FinishWatch
from mpiddp.job.watch import Watcher
from mpiddp.job.watchdog import Watchdog
from test_launch_record import DictStore


def rank(number, aborted, world_size=2):
    return SimpleNamespace(rank=number, world_size=world_size, label=f"rank {number}/{world_size}",
                           abort_from_thread=aborted.append)


def wait_for(condition, seconds=30.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_both_watchers_are_one_watcher_with_their_own_pace():
    assert issubclass(Watchdog, Watcher) and issubclass(FinishWatch, Watcher)
    store = DictStore()
    # a tenth of the timeout, within each one's bounds, as before the two shared a base
    assert FinishWatch(600, rank(0, []), store).interval == 2.0 and FinishWatch(1, rank(0, []), store).interval == 0.2
    assert Watchdog(600, 0, 2, "r", store, print).interval == 5.0
    assert Watchdog(1, 0, 2, "r", store, print).interval == 0.5
    assert not FinishWatch(0, rank(0, []), store).active and not FinishWatch(60, rank(0, []), None).active


def test_a_rank_still_running_after_another_finished_ends_the_job_with_its_stacks(capsys):
    store, aborted = DictStore(), []
    done = FinishWatch(0.5, rank(0, aborted), store)
    late = FinishWatch(0.5, rank(1, aborted), store, setting="mpiddp.init(finish_timeout_s={})")
    done.interval = late.interval = 0.02
    done.start().finished()
    late.start()
    try:
        assert wait_for(lambda: aborted == [EXIT_HANG])
        late.thread.join(30)
    finally:
        done.stop()
    assert store.check([storekeys.finished(0)]) and not store.check([storekeys.finished(1)])
    err = capsys.readouterr().err
    assert "mpiddp: rank 1/2 is still running" in err and "after the script finished on rank(s) 0 " \
        "(mpiddp.init(finish_timeout_s=0.5))" in err
    assert "Python stacks of rank 1/2:\n" in err and "in _fire" in err
    assert done.store is None  # stopped: it let go of the rank's connection


def test_a_store_gone_at_the_end_of_the_job_ends_the_watch_quietly():
    class ClosedStore:
        def __getattr__(self, name):
            def request(*args, **kwargs):
                raise RuntimeError("Connection reset by peer")
            return request

    aborted = []
    watch = FinishWatch(60, rank(1, aborted), ClosedStore())
    watch.interval = 0.01
    watch.start().finished()
    watch.thread.join(30)
    assert not watch.thread.is_alive() and aborted == []


class MuteStore:
    """Rank 0's store as a client sees it while rank 0 is stopped: the connection stays open and no request is
    ever answered (each blocks until the test lets go)."""

    def __init__(self):
        import threading

        self.release = threading.Event()

    def __getattr__(self, name):
        def request(*args, **kwargs):
            self.release.wait()
            raise RuntimeError("Connection reset by peer")
        return request


def test_a_mute_store_never_blocks_the_finish_watch_nor_ends_the_job_on_its_own():
    """A stopped rank 0 holds its store's sockets open: the finish watch's requests have a deadline, so its thread
    keeps its pace (and stops when asked) instead of waiting in recv; the mute store alone ends nothing (this rank's
    main thread may hold the shared connection in a long wait)."""
    store, aborted = MuteStore(), []
    watch = FinishWatch(0.4, rank(1, aborted), store)
    watch.interval = 0.02
    watch.start().finished()
    try:
        assert wait_for(lambda: watch.store.unanswered_since is not None, seconds=30)
        time.sleep(1.0)  # well past the timeout: nothing ended (asserting an absence needs a wait)
        assert aborted == []
        watch.stopped.set()
        watch.thread.join(10)
        assert not watch.thread.is_alive()  # never blocked on the mute store
    finally:
        store.release.set()


def test_rank_0s_pid_is_known_from_the_first_step_not_only_after_the_watchs_first_round():
    """A rank 0 stopped within the watch's first interval answers no store request: its pid, needed to end it for
    in-job recovery, is read at the first beat (rank 0 published it as its watchdog started)."""
    store = DictStore()
    Watchdog(600, 0, 2, "rank 0/2", store, print).starting()
    watch = Watchdog(600, 1, 2, "rank 1/2", store, print)  # its thread never started: no round read it
    assert watch.rank_0_pid is None
    watch.beat("step", 1)
    assert watch.rank_0_pid == os.getpid()
    watch.rank_0_pid = None
    watch.beat("step", 2)  # asked once, not a store request every step
    assert watch.rank_0_pid is None


STOOD_STILL = r'''
import os, sys, threading, time
sys.path.insert(0, sys.argv[1])
from mpiddp.job.watchdog import Watchdog
from test_launch_record import DictStore

polls = threading.Semaphore(0)

class Counted(Watchdog):
    def poll(self):
        try:
            return super().poll()
        finally:
            polls.release()

def fired(status):
    print("fired", flush=True)
    os._exit(status)

watch = Counted(3.0, 0, 1, "rank 0/1", DictStore(), fired)
watch.interval = 0.1
watch.start()
watch.beat("step", 1)
print("ready", flush=True)
sys.stdin.readline()  # the test stops this process, holds it, resumes it, then writes a line
for _ in range(2):  # two rounds of the watchdog after the resume, with no beat of this thread meanwhile
    if not polls.acquire(timeout=20):
        print("no round", flush=True)
        os._exit(5)
print("alive", flush=True)
'''


def test_a_process_that_stood_still_does_not_take_the_stop_for_a_hang(tmp_path):
    """SIGSTOP (a test holding ranks, a suspended job) stops the training thread and the watchdog together; at the
    resume the watchdog wakes long past its interval and must leave the stop out of the idle time, not end a job
    that was only held. The main thread does not beat after the resume: only the watchdog's own accounting can
    keep it from firing on the 7 s (> the 3 s timeout) that passed."""
    import signal
    import subprocess
    import sys

    import test_launch_record
    from conftest import REPO

    program = tmp_path / "stood_still.py"
    program.write_text(STOOD_STILL)
    child = subprocess.Popen([sys.executable, str(program), str(Path(test_launch_record.__file__).parent)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout.readline().strip() == "ready"
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(7)  # the stimulus: the process stands still longer than the hang timeout (not a synchronisation)
        os.kill(child.pid, signal.SIGCONT)
        out, _ = child.communicate("go\n", timeout=60)
    finally:
        child.kill()
    assert out.strip() == "alive" and child.returncode == 0, out


def test_a_late_wake_counts_as_a_stop_only_where_the_process_burnt_no_cpu_meanwhile(monkeypatch):
    """A main thread spinning in C code that holds the GIL makes the watcher as late as a SIGSTOP does, but burns
    CPU meanwhile: a hang to find, never a stop to leave out of the idle time."""
    from mpiddp.job import watch as watch_module

    class Clock:
        def __init__(self, cpu_per_wait):
            self.wall = self.cpu = 0.0
            self.cpu_per_wait = cpu_per_wait
            self.reads = 0

        def monotonic(self):
            self.reads += 1
            if self.reads % 2 == 0:  # the read after each wait: 10 s past the interval
                self.wall += 10.2
                self.cpu += self.cpu_per_wait
            return self.wall

        def process_time(self):
            return self.cpu

    class OneRound(Watcher):
        def poll(self):
            self.stopped.set()

        def resumed(self, seconds):
            credited.append(round(seconds, 1))

    for cpu_per_wait, expected in ((0.0, [10.0]), (10.2, [])):  # stopped; spinning with the GIL
        credited = []
        monkeypatch.setattr(watch_module, "time", Clock(cpu_per_wait))
        watcher = OneRound(2.0, 0, 1, "rank 0/1", DictStore(), print)
        watcher.interval = 0.2
        watcher._watch()
        assert credited == expected, cpu_per_wait
