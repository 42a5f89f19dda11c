"""The elastic engine (mpiddp.elastic.engine), in-process: its loop around the body, the order it asks a policy's
hooks in, its fall-backs (what NotRecovered names), and the sync from the furthest survivor over a fake
communicator of several ranks (threads). No MPI: the Membership and the policy are fakes."""

import copy
import threading
import time
from types import SimpleNamespace

import pytest

from mpiddp.elastic import engine as engine_module
from mpiddp.elastic.engine import Engine, NotRecovered, Policy, from_furthest
from mpiddp.elastic.grow import Regrown
from mpiddp.elastic.membership import MembersLost, Recovered, RecoveryFailed
from mpiddp.job.topology import RankRecord, build_topology


class MpiError(Exception):
    """MPI's exception class, as a fake Membership raises it."""


def topology(rank: int, hosts: list[str]):
    records = []
    for each, host in enumerate(hosts):
        peers = [r for r, h in enumerate(hosts) if h == host]
        records.append(RankRecord(each, host, peers[0], peers.index(each), len(peers)))
    return build_topology(rank, records)


class FakeMembers:
    """A Membership whose shrink leaves out `failed` (or fails with `shrink_fails`)."""

    def __init__(self, size: int, failed: tuple[int, ...], shrink_fails: RecoveryFailed | None = None) -> None:
        self._mpi = SimpleNamespace(Exception=MpiError)
        self.waiting_since: float | None = None
        self.size, self.failed, self.shrink_fails = size, failed, shrink_fails
        self.shrinks: list[int] = []

    def recover(self, min_size: int) -> Recovered:
        self.shrinks.append(min_size)
        if self.shrink_fails is not None:
            raise self.shrink_fails
        alive = tuple(rank for rank in range(self.size) if rank not in self.failed)
        comm = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: len(alive))
        return Recovered(comm, alive, self.failed, {"agree_and_shrink": 0.25, "process_group": 0.5}, time.time())

    def confirm(self, grace_s: float) -> tuple[int, ...] | None:
        return self.failed or None


class Dist:
    """What the engine reads of a Dist: its topology (rebound by bind_topology, faked here)."""

    def __init__(self, topology) -> None:
        self.topology = topology

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main


class RecordingPolicy(Policy):
    """A policy that notes each hook the engine asks, in order."""

    def __init__(self, refusal: str | None = None, resume_fails: Exception | None = None) -> None:
        self.asked: list[str] = []
        self.settled: list[tuple] = []
        self._refusal, self._resume_fails = refusal, resume_fails

    def alive_at(self) -> float:
        self.asked.append("alive_at")
        return time.time() - 1.0

    def records_dir(self):
        return None

    def refusal(self) -> str | None:
        self.asked.append("refusal")
        return self._refusal

    def before_shrink(self) -> None:
        self.asked.append("before_shrink")

    def after_rebind(self, dist) -> None:
        self.asked.append(f"after_rebind on {dist.world_size}")

    def regrown(self) -> None:
        self.asked.append("regrown")

    def resume(self, dist, before, failed):
        self.asked.append("resume")
        if self._resume_fails is not None:
            raise self._resume_fails
        return "ddp", ("outcome", dist.world_size)

    def settle(self, before, failed, phases, outcome) -> None:
        self.asked.append("settle")
        self.settled.append((before.world_size, failed, dict(phases), outcome))


@pytest.fixture
def job(monkeypatch):
    """(make(policy, failed): an Engine over 3 ranks on hosts a, b, c as rank 0, its Dist, its Membership)."""
    marked = []
    monkeypatch.setattr(engine_module, "mark_recovered", lambda: marked.append(True))

    def bind(dists, members, shrunk, guard, log_level, verb="goes on"):
        for each in dists:
            each.topology = shrunk

    monkeypatch.setattr(engine_module, "bind_topology", bind)

    def make(policy, failed=(1,), shrink_fails=None):
        dist = Dist(topology(0, ["a", "b", "c"]))
        members = FakeMembers(3, failed, shrink_fails)
        return Engine(members, [dist], 1, policy), dist, members

    return make


def test_the_body_runs_again_on_the_survivors_after_a_member_is_lost(job):
    policy = RecordingPolicy()
    engine, dist, members = job(policy)
    calls = []

    def body():
        calls.append(dist.world_size)
        if len(calls) == 1:
            raise MembersLost((1,), time.time())
        return "done"

    assert engine.run(body) == "done"
    assert calls == [3, 2]  # the second run sees the shrunk job
    assert policy.asked == ["alive_at", "refusal", "before_shrink", "after_rebind on 2", "resume", "settle"]
    (before, failed, phases, outcome), = policy.settled
    assert (before, failed, outcome) == (3, (1,), ("outcome", 2))
    assert list(phases) == ["detect", "agree_and_shrink", "process_group", "ddp"]
    assert phases["detect"] >= 0.9 and phases["agree_and_shrink"] == 0.25  # detect runs from alive_at
    assert members.shrinks == [1] and engine.lost_in is None  # back outside a recovery


def test_an_error_that_is_no_lost_member_is_raised_as_it_was_and_nothing_recovers(job):
    policy = RecordingPolicy()
    engine, _, members = job(policy)
    error = ValueError("a bug in the body")

    def body():
        raise error

    with pytest.raises(ValueError) as raised:
        engine.run(body)
    assert raised.value is error and policy.asked == [] and members.shrinks == []


def test_new_ranks_joining_run_the_body_again_without_a_recovery(job):
    policy = RecordingPolicy()
    engine, _, members = job(policy)
    calls = []

    def body():
        calls.append(len(calls))
        if len(calls) < 3:
            raise Regrown()
        return len(calls)

    assert engine.run(body) == 3
    assert policy.asked == ["regrown", "regrown"] and members.shrinks == []


def test_a_refused_recovery_ends_the_job_naming_the_lost_ranks_and_their_hosts_before_any_shrink(job, caplog):
    policy = RecordingPolicy(refusal="the failure came before the first training step")
    engine, _, members = job(policy, failed=(1, 2))

    with pytest.raises(NotRecovered) as raised:
        engine.run(lambda: (_ for _ in ()).throw(MembersLost((1, 2), time.time())))
    assert str(raised.value) == ("in-job recovery not possible: the failure came before the first training step "
                                 "(MPI_ERR_PROC_FAILED: ranks 1, 2 failed)")
    # the placement still numbers the old world: ranks and hosts both go on record
    assert raised.value.ranks == (1, 2) and raised.value.hosts == ("b", "c")
    assert members.shrinks == [] and "before_shrink" not in policy.asked
    assert "ending the job" in caplog.text


def test_a_shrink_that_fails_falls_back_with_its_own_account_of_who_failed(job):
    policy = RecordingPolicy()
    engine, _, _ = job(policy, shrink_fails=RecoveryFailed("1 of 3 ranks are left, fewer than the 2", (1, 2)))

    with pytest.raises(NotRecovered) as raised:
        engine.recover(MembersLost((1,), time.time()))
    assert "1 of 3 ranks are left" in str(raised.value) and "ranks 1, 2 failed" in str(raised.value)
    assert raised.value.ranks == (1, 2) and raised.value.hosts == ("b", "c")


@pytest.mark.parametrize("hide_cause", [False, True])
def test_a_second_failure_while_resuming_ends_the_job_naming_the_lost_hosts_only(job, hide_cause):
    """After the shrink the new rank 0 rewrites the placement: the lost ranks (of the old world) are named by their
    hosts only. A script's report (hide_cause) leaves out the exception the fall-back was raised in."""
    policy = RecordingPolicy(resume_fails=RuntimeError("gloo: connection reset by peer"))
    policy.hide_cause = hide_cause
    engine, _, _ = job(policy)

    with pytest.raises(NotRecovered) as raised:
        engine.recover(MembersLost((1,), time.time()))
    assert "a second failure during recovery (gloo: connection reset by peer)" in str(raised.value)
    assert raised.value.ranks == () and raised.value.hosts == ("b",)
    assert raised.value.__suppress_context__ is hide_cause
    assert isinstance(raised.value.__context__, RuntimeError)
    assert policy.settled == []


def test_a_not_recovered_raised_by_the_policy_itself_goes_through_unchanged(job):
    refused = NotRecovered("in-job recovery not possible: the batch does not split", (1,), ("b",))
    policy = RecordingPolicy(resume_fails=refused)
    engine, _, _ = job(policy)

    with pytest.raises(NotRecovered) as raised:
        engine.recover(MembersLost((1,), time.time()))
    assert raised.value is refused


def test_a_grow_under_way_hears_of_the_loss_before_the_shrink(job):
    policy = RecordingPolicy()
    heard = []
    policy.grower = SimpleNamespace(members_lost=lambda dist, lost, records: heard.append((dist.world_size, lost)))
    engine, _, _ = job(policy)

    engine.recover(MembersLost((1,), time.time()))
    assert heard == [(3, (1,))]  # in the old world, which its merged communicator numbers


def test_the_policy_s_fall_back_is_the_engine_s(job):
    policy = RecordingPolicy()
    engine, _, _ = job(policy)
    engine.lost_in = engine.dists[0].topology

    with pytest.raises(NotRecovered) as raised:
        policy.fall_back("the global batch does not split over 2 ranks", (2,))
    assert raised.value.ranks == (2,) and raised.value.hosts == ("c",)


# ---- the sync from the furthest survivor ---------------------------------------------------------------------------

class ThreadComm:
    """One rank of `size` threads: allgather and bcast (copied, as MPI pickles them) over a barrier."""

    def __init__(self, shared: dict, rank: int) -> None:
        self.shared, self.rank = shared, rank

    def allgather(self, value):
        self.shared["slots"][self.rank] = value
        self.shared["barrier"].wait()
        out = copy.deepcopy(self.shared["slots"])
        self.shared["barrier"].wait()
        return out

    def bcast(self, value, root: int):
        if self.rank == root:
            self.shared["sent"].append(root)
            self.shared["root"] = value
        self.shared["barrier"].wait()
        out = copy.deepcopy(self.shared["root"])
        self.shared["barrier"].wait()
        return out


def sync_all(positions: list[tuple], states: list[dict]) -> tuple[list, list]:
    """from_furthest on every rank at once: (each rank's answer, the roots that sent)."""
    size = len(positions)
    shared = {"slots": [None] * size, "barrier": threading.Barrier(size, timeout=30), "sent": [], "root": None}
    leaders: list = [None] * size
    errors: list[BaseException] = []

    def one(rank: int) -> None:
        def load(payload):
            states[rank].update(payload, loaded_by=rank)

        try:
            leaders[rank] = from_furthest(ThreadComm(shared, rank), positions[rank], lambda: dict(states[rank]), load)
        except BaseException as exc:  # noqa: BLE001 - the test's thread: the test reports it
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=one, args=(rank,)) for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    return leaders, shared["sent"]


def test_every_survivor_takes_the_state_of_the_one_furthest_ahead():
    positions = [(5, 0, 3), (6, 0, 4), (6, 0, 4), (4, 0, 2)]  # ranks 1 and 2 finished the interrupted step
    states = [{"weights": rank} for rank in range(4)]

    leaders, sent = sync_all(positions, states)
    assert leaders == [1, 1, 1, 1] and sent == [1]  # the lowest rank among the furthest, once
    assert states[1] == {"weights": 1}  # the leader loads nothing
    assert [state["weights"] for state in states] == [1, 1, 1, 1]
    assert [state.get("loaded_by") for state in states] == [0, None, 2, 3]


def test_survivors_at_the_same_position_send_nothing():
    states = [{"weights": rank} for rank in range(3)]

    leaders, sent = sync_all([(6, "abc")] * 3, states)
    assert leaders == [None, None, None] and sent == []
    assert states == [{"weights": rank} for rank in range(3)]


def test_a_second_failure_with_a_long_message_is_said_by_its_first_line_in_whole_brackets(job):
    policy = RecordingPolicy(resume_fails=RuntimeError("gloo: connection reset by peer\nat a.cpp:12\nat b.cpp:3"))
    engine, _, _ = job(policy)
    with pytest.raises(NotRecovered) as raised:
        engine.recover(MembersLost((1,), time.time()))
    assert "a second failure during recovery (gloo: connection reset by peer)" in str(raised.value)
    assert "a.cpp" not in str(raised.value)


def test_under_in_job_recovery_a_helper_threads_end_of_the_job_aborts_every_rank(job, monkeypatch):
    """Found by the outside review: a watch that ends the job from its thread (the finish watch, a hang's fallback)
    only exited its own process, which MPI's fault tolerance takes for a failure to recover from: another rank began
    a recovery that a finished rank never joined, and the job hung. With an engine, the thread's end is an MPI_Abort
    over the job's communicator of the moment, with the status given, before the process's own exit."""
    from mpiddp.job import collective

    aborted, exited = [], []
    monkeypatch.setattr(engine_module, "abort_within", lambda comm, code: aborted.append((comm, code)))
    monkeypatch.setattr(collective.os, "_exit", exited.append)
    dist = collective.solo_dist()
    dist.abort_from_thread(4)
    assert (aborted, exited) == ([], [4])  # no engine: this exit ends the job (the launcher ends the others)
    _, _, members = job(Policy())
    members.comm = "the shrunk communicator"  # the one of the moment, read when the job ends
    dist.abort_from_thread(4)
    assert (aborted, exited) == ([("the shrunk communicator", 4)], [4, 4])
