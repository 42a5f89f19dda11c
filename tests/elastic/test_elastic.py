"""In-job recovery for scripts (mpiddp.elastic.api), in-process: the State's commit and restore, which survivor the
others take their state from, the sync itself over a fake three-rank communicator, where recovery refuses, and
the API without a recovering job. The runs on fake hosts are in test_script_recovery_e2e.py."""

import copy
import threading

import pytest
import torch

import mpiddp
from mpiddp.elastic import api as elastic
from mpiddp.elastic.api import State, sync
from mpiddp.elastic.decide import furthest
from mpiddp.elastic.decide import script_refusal as refusal
from mpiddp.job import collective


def model_and_optimizer(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()


def test_entries_are_attributes_and_objects_are_told_from_values():
    model, optimizer = model_and_optimizer(0)
    state = State(model=model, optimizer=optimizer, epoch=0, sample=0)
    state.epoch += 1
    assert (state.model, state.optimizer, state.epoch, state.sample, state.commits) == (model, optimizer, 1, 0, 0)
    with pytest.raises(AttributeError, match="no entry 'step'"):
        state.step = 3
    with pytest.raises(AttributeError, match="object entry"):
        state.model = model
    with pytest.raises(AttributeError, match="no entry 'nothing'"):
        state.nothing  # noqa: B018


@pytest.mark.parametrize("entries, says", [({"commit": 1}, "not a name"), ({"_hidden": 1}, "not a name")])
def test_names_that_would_hide_the_state_s_own_are_refused(entries, says):
    with pytest.raises(ValueError, match=says):
        State(**entries)


def test_a_ddp_wrapper_is_refused_in_one_line_naming_the_module_instead():
    class DistributedDataParallel(torch.nn.Module):  # what the check sees of torch's (no process group here)
        pass

    with pytest.raises(ValueError, match=r"register the module itself \(ddp.module\)") as raised:
        State(model=DistributedDataParallel())
    assert "\n" not in str(raised.value)


def test_a_recovery_takes_the_values_back_to_the_last_commit_and_leaves_the_objects_alone():
    model, optimizer = model_and_optimizer(0)
    state = State(model=model, optimizer=optimizer, step=0, losses=[])
    train_step(model, optimizer)
    state.step += 1
    state.losses.append(0.5)  # mutated in place: the commit copies, so the restore still undoes later changes
    state.commit()
    weights = copy.deepcopy(model.state_dict())
    state.step += 1
    state.losses.append(0.25)
    state.restore()
    assert (state.step, state.losses, state.commits) == (1, [0.5], 1)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def test_the_furthest_survivor_gives_its_state_and_equal_ones_give_none():
    same = (3, "a")
    assert furthest([same, same, same]) is None
    assert furthest([(3, "a"), (4, "b"), (4, "b")]) == 1  # the most commits, the lowest rank among them
    assert furthest([(3, "a"), (3, "b")]) == 0  # the same count, other values: one of them, the same on all


class ThreadWorld:
    """`size` ranks as threads: allgather and bcast (pickled, as MPI sends them) over a barrier."""

    def __init__(self, size: int) -> None:
        self.size, self.barrier, self.slots, self.bcasts = size, threading.Barrier(size, timeout=30), [None] * size, 0

    def comm(self, rank: int) -> "ThreadComm":
        return ThreadComm(self, rank)


class ThreadComm:
    def __init__(self, world: ThreadWorld, rank: int) -> None:
        self.world, self.rank = world, rank

    def allgather(self, value):
        self.world.slots[self.rank] = value
        self.world.barrier.wait()
        out = list(self.world.slots)
        self.world.barrier.wait()
        return copy.deepcopy(out)

    def bcast(self, value, root: int):
        if self.rank == root:
            self.world.slots[0], self.world.bcasts = value, self.world.bcasts + 1
        self.world.barrier.wait()
        out = copy.deepcopy(self.world.slots[0])
        self.world.barrier.wait()
        return out


def run_sync(states: list[State]) -> tuple[list[int | None], int]:
    world = ThreadWorld(len(states))
    leaders: list[int | None] = [None] * len(states)

    def one(rank: int) -> None:
        leaders[rank] = sync(states[rank], world.comm(rank))

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(len(states))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return leaders, world.bcasts


def survivors(num: int) -> list[State]:
    """`num` ranks that trained two steps alike (DDP keeps replicas equal), and committed them."""
    states = []
    for _ in range(num):
        model, optimizer = model_and_optimizer(0)
        state = State(model=model, optimizer=optimizer, step=0)
        for _ in range(2):
            train_step(model, optimizer)
            state.step += 1
            state.commit()
        states.append(state)
    return states


def test_a_survivor_that_finished_the_interrupted_step_gives_the_others_its_model_optimizer_and_values():
    states = survivors(3)
    ahead = states[1]  # its all-reduce of step 3 completed; the others' failed, their gradients half made
    train_step(ahead.model, ahead.optimizer)
    ahead.step += 1
    ahead.commit()
    for behind in (states[0], states[2]):
        behind.model(torch.ones(3, 4)).sum().backward()
        behind.step += 1  # counted before the commit: undone by the restore
    leaders, bcasts = run_sync(states)
    assert leaders == [1, 1, 1] and bcasts == 1
    for state in states:
        assert (state.step, state.commits) == (3, 3)
        assert all(torch.equal(a, b) for a, b in zip(state.model.parameters(), ahead.model.parameters()))
        momentum = [state.optimizer.state[p]["momentum_buffer"] for p in state.model.parameters()]
        assert all(torch.equal(m, ahead.optimizer.state[p]["momentum_buffer"])
                   for m, p in zip(momentum, ahead.model.parameters()))
        assert all(p.grad is None for p in state.model.parameters())  # the interrupted step's gradients dropped


def test_survivors_at_the_same_commit_send_nothing_and_drop_the_interrupted_step():
    states = survivors(2)
    for state in states:
        state.model(torch.ones(3, 4)).sum().backward()
        state.step += 1
    leaders, bcasts = run_sync(states)
    assert leaders == [None, None] and bcasts == 0
    assert [state.step for state in states] == [2, 2]
    assert all(p.grad is None for state in states for p in state.model.parameters())


@pytest.mark.parametrize("own, ulfm, device, backend, can_abort, env, says", [
    (False, None, "cpu", "gloo", True, {}, "needs mpiddp's job"),
    (True, "in-job recovery needs mpirun --with-ft ulfm (...)", "cpu", "gloo", True, {}, "--with-ft ulfm"),
    (True, None, "cuda", "nccl", False, {}, "_abort_process_group (torch 2.5 or newer)"),
    (True, None, "cuda", "nccl", True, {}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=3 makes torch end a rank"),
    (True, None, "cpu", "mpi", True, {}, "this job runs mpi on cpu"),
    (True, None, "cuda", "gloo", True, {}, "this job runs gloo on cuda"),
])
def test_where_a_script_cannot_recover_it_says_why_in_one_line(own, ulfm, device, backend, can_abort, env, says):
    reason = refusal(own, ulfm, device, backend, can_abort, "2.4.1", env)
    assert reason is not None and says in reason and "\n" not in reason


def test_a_script_on_cpu_with_ulfm_and_its_own_bootstrap_can_recover():
    assert refusal(True, None, "cpu", "gloo") is None


def test_a_script_on_nccl_can_recover_where_torch_aborts_nccl_and_errors_do_not_end_the_survivors():
    assert refusal(True, None, "cuda", "nccl", True, "2.11.0", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}) is None


@pytest.fixture
def fresh(monkeypatch):
    """A process of its own, as far as in-job recovery goes: a new Manager behind mpiddp's public names."""
    from mpiddp.script import recovery

    manager = elastic.Manager()
    monkeypatch.setattr(recovery, "_manager", manager)
    yield manager
    collective.set_current(None)


def test_run_recoverable_needs_init_first(fresh):
    with pytest.raises(RuntimeError, match=r"call mpiddp.init\(\) first"):
        mpiddp.run_recoverable(lambda state: None, State(step=0))
    with pytest.raises(TypeError, match="mpiddp.State"):
        mpiddp.run_recoverable(lambda state: None, {"step": 0})  # type: ignore[arg-type]
    assert not fresh.decided  # nothing was decided: a later call, after init(), decides


def test_where_it_cannot_recover_the_function_runs_once_as_without_it(fresh, caplog):
    collective.set_current(collective.solo_dist())  # not init()'s own bootstrap: as under `mpiddp run`
    calls = []
    result = mpiddp.run_recoverable(lambda state: calls.append(state.step) or "done", State(step=7))
    assert (result, calls) == ("done", [7])
    assert fresh.decided and fresh.active() is None  # decided once, on the process's Manager: no recovery
    assert "in-job recovery for scripts needs mpiddp's job" in caplog.text

    class Work:
        waited = False

        def wait(self) -> None:
            self.waited = True

    work = Work()
    mpiddp.wait(work)  # no recovery: the work's own wait
    assert work.waited


def test_watch_gradients_refuses_an_unknown_compression(fresh):
    with pytest.raises(ValueError, match="compression must be one of"):
        mpiddp.watch_gradients(object(), "powersgd")  # type: ignore[arg-type]
    assert fresh.wrappers == []


def test_each_process_s_callbacks_live_on_its_own_manager(fresh):
    """mpiddp.on_membership_change registers on the process's Manager; another Manager (another process, or a
    test's) has none of them."""
    @mpiddp.on_membership_change
    def rescale(change: elastic.MembershipChange) -> None:
        pass

    assert fresh.callbacks == [rescale] and elastic.Manager().callbacks == []


# ---- what follows the survivors: the finish watch, the failure report -------------------------------------------

def test_the_finish_watch_follows_the_survivors_onto_their_new_store_under_the_new_rank():
    from types import SimpleNamespace

    from mpiddp.job import storekeys
    from mpiddp.job.finishwatch import FinishWatch
    from test_launch_record import DictStore
    from test_watch import rank, wait_for

    old_store, new_store, aborted = DictStore(), DictStore(), []
    watch = FinishWatch(60, rank(2, aborted, world_size=3), old_store).start()
    old_thread = watch.thread
    survivor = rank(1, aborted, world_size=2)
    survivor.rendezvous = SimpleNamespace(client=lambda: new_store)
    watch.follow(survivor)
    try:
        assert (watch.rank, watch.world_size, watch.store.inner) == (1, 2, new_store)  # each request with a deadline
        assert watch.thread is not old_thread and watch.thread.is_alive()
        watch.interval = 0.02
        watch.finished()
        assert wait_for(lambda: new_store.check([storekeys.finished(1)]))
        old_thread.join(90)  # it wakes once per old interval, sees its stop event, and ends
        assert not old_thread.is_alive() and not old_store.check([storekeys.finished(2)])
    finally:
        watch.stop()
    assert aborted == []


def test_a_rank_that_follows_another_s_report_while_mpi_reports_failed_peers_leaves_the_abort_to_it():
    from types import SimpleNamespace

    from mpiddp.script.api import _follows_first_report
    from mpiddp.job.failfast import FailFast

    guard = FailFast()
    guard.dist = SimpleNamespace(rank=0, failed_ranks=lambda: (1,))
    assert not _follows_first_report(guard)  # the first to report aborts the job
    guard.reported_first = False
    assert _follows_first_report(guard)
    guard.dist = SimpleNamespace(rank=0, failed_ranks=lambda: ())
    assert not _follows_first_report(guard)  # no failed peer (no fault tolerance): every rank aborts, as before


def test_survivors_at_the_same_step_whose_values_differ_take_the_values_only():
    """A value only some ranks changed (a best loss rank 0 tracks) moves; the model and optimizer do not: survivors
    that completed as many steps hold the same ones (DDP)."""
    states = survivors(2)
    states[0]._values["step"] = 99  # as a rank that changed a shared value alone, then committed
    states[0].commit()
    states[1].commit()
    loaded = []
    states[1].model.load_state_dict = lambda *a, **k: loaded.append("model")  # type: ignore[method-assign]
    leaders, bcasts = run_sync(states)
    assert leaders == [0, 0] and bcasts == 1
    assert states[1].step == 99 and loaded == []


def test_a_per_rank_value_stays_each_survivors_own_through_a_sync():
    model, optimizer = model_and_optimizer(0)
    ahead = State(model=model, optimizer=optimizer, step=0, cursor=10, per_rank=["cursor"])
    model2, optimizer2 = model_and_optimizer(0)
    behind = State(model=model2, optimizer=optimizer2, step=0, cursor=20, per_rank=["cursor"])
    ahead.step += 1
    ahead.commit()
    assert ahead.digests().keys() == {"step"}  # per-rank values stay out of the comparison
    leaders, _ = run_sync([ahead, behind])
    assert leaders == [0, 0] and (behind.step, behind.cursor, ahead.cursor) == (1, 20, 10)


def test_the_shared_values_that_differ_across_ranks_are_named():
    assert elastic.diverging([{"step": "a", "best": "x"}, {"step": "a", "best": "y"}]) == ["best"]
    assert elastic.diverging([{"step": "a"}, {"step": "a"}]) == []


def test_the_check_runs_inside_the_first_commit_only():
    model, optimizer = model_and_optimizer(0)
    state = State(model=model, optimizer=optimizer, step=0)
    seen = []
    state.check_at_first_commit(lambda s: seen.append(s.commits))
    state.commit()
    state.commit()
    assert seen == [1]


@pytest.mark.parametrize("entries, says", [
    ({"step": 0, "per_rank": ["cursor"]}, "'cursor' is not an entry"),
    ({"optimizer": "model", "per_rank": ["model"]}, "only plain values can be per rank"),
])
def test_per_rank_names_plain_values_of_the_state(entries, says):
    model, optimizer = model_and_optimizer(0)
    objects = {"model": model, "optimizer": optimizer}
    with pytest.raises(ValueError, match=says):
        State(**{**objects, **{k: v for k, v in entries.items() if k not in objects and k != "optimizer"}})


def test_a_recovery_is_on_record_for_this_process_and_not_for_the_processes_it_starts(monkeypatch):
    """survivors.mark_recovered (the engine's, a joining rank's) is read where the process ends (the trainer's, the
    script's exit): the record is this process's own, kept with its MPI life; a process it starts does not have it
    (it would end without MPI_Finalize)."""
    import os
    import subprocess
    import sys

    from mpiddp.elastic import survivors
    from mpiddp.job import mpistart

    monkeypatch.setattr(mpistart, "_world_failed", False)  # restored after the test
    assert not survivors.recovered_in_this_process()
    survivors.mark_recovered()
    assert survivors.recovered_in_this_process() and mpistart.world_failed()
    code = "from mpiddp.elastic.survivors import recovered_in_this_process; print(recovered_in_this_process())"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.stdout.strip() == "False"
