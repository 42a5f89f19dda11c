"""DDP's bucket re-layout after the first step over a process group, run watched (compression.BucketRebuild): DDP
does it inside the next forward with a broadcast from rank 0 that nothing watches, and a survivor once waited
there for a live rank 0 gone into the recovery (CI). Here: it is done, once, where the step ends; a failure seen
meanwhile is raised (or kept) at once; and the rank that gave the rebuild up can still run a backward (DDP's
hooks, which would wait for the lock the stuck rebuild holds, are off its parameters)."""

import gc
import multiprocessing
import os
import threading

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mpiddp.elastic.membership import MembersLost
from mpiddp.job import compression
from test_compression import UsedInReverse, WatchingMembers  # a model DDP lays out again; a watch that counts


def first_step(ddp):
    ddp(torch.randn(8, 64)).sum().backward()


@pytest.mark.usefixtures("solo_group")
@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic", "static graph"])
def test_the_rebuild_runs_once_under_the_watch_and_ddps_next_forward_has_nothing_left_to_rebuild(static_graph):
    torch.manual_seed(0)
    members = WatchingMembers()
    ddp = DistributedDataParallel(UsedInReverse(), gradient_as_bucket_view=True, bucket_cap_mb=0.001,
                                  static_graph=static_graph)
    hook = compression.register(ddp, "none", backend="gloo", members=members)
    hook.rebuild_buckets()  # a commit before the first step: nothing to lay out yet, nothing waited for
    assert members.waited == 0 and hook.layout_pending()
    first_step(ddp)
    if static_graph:  # DDP lays its buckets out after its second step: the first finds nothing, and it stays due
        hook.rebuild_buckets()
        assert hook.layout_pending() and not ddp._has_rebuilt_buckets
        first_step(ddp)
    waited, grads = members.waited, [p.grad.clone() for p in ddp.parameters()]
    hook.rebuild_buckets()
    assert members.waited == waited + 1  # the rebuild, waited for under the watch
    assert ddp._has_rebuilt_buckets and not hook.layout_pending()  # laid out: by this rebuild, not DDP's
    assert all(torch.equal(before, p.grad) for before, p in zip(grads, ddp.parameters()))  # gradients kept
    assert ddp.reducer._rebuild_buckets() is False  # DDP's own, in the next forward: nothing left to do
    hook.rebuild_buckets()
    assert members.waited == waited + 1  # once per wrapper
    for _ in range(2):
        first_step(ddp)  # the next steps train on the new buckets


@pytest.mark.usefixtures("solo_group")
def test_where_ddp_never_lays_its_buckets_out_again_nothing_is_started():
    ddp = DistributedDataParallel(UsedInReverse(), find_unused_parameters=True)
    members = WatchingMembers()
    hook = compression.register(ddp, "none", backend="gloo", members=members)
    first_step(ddp)
    waited = members.waited
    assert not hook.layout_pending()
    hook.rebuild_buckets()
    assert members.waited == waited


def test_without_in_job_recovery_ddp_keeps_its_own_rebuild():
    hook = compression.GradientHook("none", [], on_ready=lambda: None)
    hook.rebuild_buckets()  # no watch, no wrapper: nothing
    assert hook.watched is None


class StuckReducer:
    """A reducer whose rebuild's broadcast never gets rank 0's data (rank 0 went into the recovery)."""

    def __init__(self):
        self.release, self.hooks_removed = threading.Event(), False

    def _rebuild_buckets(self):  # noqa: N802 - torch's name
        self.release.wait()
        raise RuntimeError("Connection closed by peer")  # as gloo says once rank 0's process ends

    def _remove_autograd_hooks(self):  # noqa: N802 - torch's name
        self.hooks_removed = True


class StuckDDP:
    def __init__(self):
        self.reducer, self.module = StuckReducer(), torch.nn.Linear(2, 2)


class LosingMembers:
    def wait(self, work):
        assert not work.is_completed()  # the rebuild is still waiting when the watch reports the failure
        raise MembersLost((0,), 0.0)


@pytest.mark.parametrize("absorb", [None, MembersLost], ids=["raised (the trainer)", "kept (the step wrappers)"])
def test_a_failure_seen_during_the_rebuild_ends_the_wait_and_takes_ddps_hooks_off(absorb):
    ddp = StuckDDP()
    watch = compression.WatchedAllReduce(LosingMembers().wait, absorb=absorb)
    try:
        if absorb is None:
            with pytest.raises(MembersLost):
                watch.rebuild_buckets(ddp)
        else:
            assert isinstance(watch.rebuild_buckets(ddp), MembersLost) and isinstance(watch.lost, MembersLost)
        assert ddp.reducer.hooks_removed
    finally:
        ddp.reducer.release.set()  # the old group's end: the thread ends


def free_port():
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _rank(rank, port, gone, result, done):
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = UsedInReverse()
    watch = WatchingMembers()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
    hook = compression.register(ddp, "none", backend="gloo", members=watch)
    first_step(ddp)
    if rank == 0:  # the broadcast's root goes into the recovery instead: it never sends
        gone.set()
        done.wait(120)  # until the test read rank 1's outcome; then this process ends
        return

    class SeesTheFailure:
        def wait(self, work):
            while not work.is_completed():
                if gone.wait(0.01):
                    raise MembersLost((0,), 0.0)
            work.wait()

    hook.watched.wait = SeesTheFailure().wait
    try:
        hook.rebuild_buckets()
        result.send("the rebuild completed without rank 0")
        return
    except MembersLost:
        pass
    del ddp, hook  # what a recovery drops: DDP's logger, destroyed, would wait for the stuck rebuild's lock
    gc.collect()
    model(torch.randn(8, 64)).sum().backward()  # DDP's hooks would wait here for the same lock
    result.send("recovered")
    result.close()
    # as a survivor ends (mpiddp.elastic.survivors.end_without_finalize): the rebuild's thread still waits in the
    # old group, whose teardown at the interpreter's exit would end the process with SIGABRT
    os._exit(0)


def test_a_rank_whose_rebuild_waits_for_a_rank_0_gone_into_the_recovery_gets_out_and_trains_on():
    context = multiprocessing.get_context("spawn")
    gone, done = context.Event(), context.Event()
    result, sent = context.Pipe(duplex=False)  # a pipe: rank 1 sends at once (a queue's feeder thread may not)
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, gone, sent, done)) for rank in (0, 1)]
    for process in ranks:
        process.start()
    try:
        # without the watched rebuild rank 1 waits for good (until gloo's timeout of 30 minutes)
        assert result.poll(120), "rank 1 never got out of the rebuild"
        assert result.recv() == "recovered"
        done.set()  # rank 0 may end
        for process in ranks:
            process.join(60)
        assert [process.exitcode for process in ranks] == [0, 0]
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
