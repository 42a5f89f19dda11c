"""Growing back after an in-job recovery: the decisions, in-process (no MPI, no spawn)."""

import copy
from types import SimpleNamespace

import pytest

from mpiddp.elastic.decide import GrowPlan, format_spare_hosts, grow_due, parse_spare_hosts, plan_growth
from mpiddp.recoveries import count_line, describe
from mpiddp.elastic.decide import GROW_PHASES, StepTimes, grow_record, split_for_growth, stand_still
from mpiddp.elastic.decide import Resplit, resplit


def test_spare_hosts_are_read_with_their_slots():
    assert parse_spare_hosts("noded, nodee:2,") == [("noded", 1), ("nodee", 2)]
    assert parse_spare_hosts("") == []
    assert format_spare_hosts([("noded", 1), ("nodee", 2)]) == "noded,nodee:2"
    for bad in ("noded:0", "noded:x", ":2"):
        with pytest.raises(ValueError, match="MPIDDP_SPARE_HOSTS"):
            parse_spare_hosts(bad)


def test_the_plan_fills_the_missing_ranks_from_the_free_spare_slots():
    assert plan_growth(2, 3, [("noded", 1)], {}) == GrowPlan(("noded",))
    assert plan_growth(1, 4, [("noded", 2), ("nodee", 4)], {}) == GrowPlan(("noded", "noded", "nodee"))
    assert plan_growth(2, 4, [("noded", 1), ("nodee", 1)], {"noded": 1}) == GrowPlan(("nodee",))  # partial
    assert plan_growth(3, 3, [("noded", 1)], {}) == "the job runs at full size"


def test_no_spare_slot_says_why_and_how_to_give_one():
    for spares, used in (([], {}), ([("noded", 1)], {"noded": 1})):
        reason = plan_growth(2, 3, spares, used)
        assert isinstance(reason, str) and "no spare slot" in reason and "MPIDDP_SPARE_HOSTS" in reason


def test_the_job_grows_after_a_step_at_reduced_size_and_only_below_full_size():
    assert grow_due(True, 2, 3, False)
    assert not grow_due(False, 2, 3, False)  # the recovery's first step is not done yet
    assert not grow_due(True, 3, 3, False)  # full size
    assert not grow_due(True, 2, 3, True)  # growing was found impossible (said once)


def config(batch: int, accumulation: int) -> SimpleNamespace:
    return SimpleNamespace(training=SimpleNamespace(batch_size=batch, grad_accum=accumulation))


def test_growing_goes_back_to_the_first_per_rank_batch_at_the_same_sample():
    # 3 ranks x 16 lost one: 2 x 12 x 2 accumulation; 12 micro-batches done on 2 ranks = sample 288 = 6 x 48
    assert split_for_growth(config(12, 2), config(16, 1), 2, 3, 12) == (Resplit(16, 1, 6), None)
    # without the first batch as the cap the per-rank batch would stay at 12 and split into 8 x 2
    assert resplit(12, 2, 2, 3, 12) == Resplit(8, 2, 12)
    assert resplit(12, 2, 2, 3, 12, max_per_rank=16) == Resplit(16, 1, 6)


def test_a_position_off_the_new_batch_waits_for_the_epoch_start_and_a_batch_that_cannot_split_never_grows():
    # 2 x 12 x 2: 13 micro-batches = sample 312, not a multiple of 48: wait (an epoch's start always fits)
    assert split_for_growth(config(12, 2), config(16, 1), 2, 3, 13) == (None, None)
    # a global batch of 14 (2 x 7) splits over 3 ranks unevenly (5, 5, 4): the grow need not wait
    assert split_for_growth(config(7, 1), config(7, 1), 2, 3, 4) == (Resplit(5, 1, 4, 14), None)
    # a global batch the ranks cannot share (5 over 4 ranks of at most 1 a micro-batch) never grows
    split, never = split_for_growth(config(1, 1), config(1, 1), 4, 4, 0, global_batch=5, position=0)
    assert split is None and "empty micro-batch" in never


def test_a_grow_is_recorded_and_told_next_to_the_recoveries():
    record = grow_record(6, [2], ["noded"], 2, 3, {"spawn": 0.2, "merge": 0.05, "process_group": 1.3,
                                                     "state_transfer": 0.03, "ddp": 0.8})
    assert record["cause"] == "grew" and record["ranks_added"] == [2] and record["hosts_added"] == ["noded"]
    assert list(record["phases"]) == list(GROW_PHASES) and record["phases"]["first_step"] is None
    line = describe(record)
    assert line.startswith("grew at step 6: rank 2 on noded added, 2 -> 3 ranks"), line
    assert "spawn 0.20" in line and "down 2.38 s" in line, line
    assert count_line([record]) == "1 grow (rank 2 on noded added, down 2.38 s)"
    assert record["survivors_stall"] is None and "stood still" not in line  # unknown until the next step ended
    assert describe({**record, "survivors_stall": 2.61}).endswith(", survivors stood still 2.61 s")
    assert describe({**record, "survivors_stall": 0.18, "ordinary_step": 0.15}).endswith(
        ", survivors stood still 0.18 s beyond a 0.15 s step")


def test_a_survivors_stand_still_is_the_span_less_an_ordinary_step():
    # the span from the stopping boundary to the next step's end holds one step: the median of recent ones is off
    assert stand_still(0.33, [0.15, 0.14, 2.9, 0.16]) == {"survivors_stall": pytest.approx(0.175),
                                                          "ordinary_step": 0.155}
    # a step never shorter than nothing; no ordinary step known yet (a failure in the first steps): the whole span
    assert stand_still(0.1, [0.2]) == {"survivors_stall": 0.0, "ordinary_step": 0.2}
    assert stand_still(0.33, []) == {"survivors_stall": 0.33, "ordinary_step": None}


class MpiError(Exception):
    """MPI's exception, as a test's fake communicator raises it."""


class Request:
    """A fake of one of rank 0's receives from a new rank: per test(), "ready" (its word, warmed up in 1.5 s),
    False (nothing yet), ("failed", why), or an exception to raise (MPI's, when the rank failed); the last
    outcome repeats."""

    def __init__(self, outcomes):
        self.outcomes = list(outcomes)
        self.cancelled = False

    def test(self):
        outcome = self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        if outcome == "ready" or outcome is True:
            return True, ("ready", 1.5, True)  # warm in 1.5 s, connected to rank 0's store
        if isinstance(outcome, tuple):
            return True, outcome
        return False, None

    def Cancel(self):
        self.cancelled = True


class Merged:
    """A fake of the survivors' merged communicator during a grow."""

    def __init__(self):
        self.sent, self.revoked = [], False

    def send(self, value, dest, tag):
        self.sent.append((value, dest))

    def Revoke(self):
        self.revoked = True


def survivors(monkeypatch, said, grown):
    """(rank 0's Dist, a policy of the survivors bound to it) as GrowBack asks them."""
    from mpiddp.elastic import grow

    def fall_back(reason, ranks):
        said.append((reason, ranks))
        raise RuntimeError("fell back")

    monkeypatch.setattr(grow.mpigrow, "mpi_exception", lambda: MpiError)
    dist = SimpleNamespace(world_size=2, is_main=True, topology=SimpleNamespace(failure_file=""),
                           transport=SimpleNamespace(bcast=lambda value: value))
    recovery = SimpleNamespace(members=SimpleNamespace(_mpi=SimpleNamespace(Exception=MpiError), comm=None,
                                                       endpoint=("10.0.0.1", 29500)),
                               dists=[dist], steps_done=lambda: 7, records_dir=lambda: None,
                               pause_watch=lambda: None, follow_watch=lambda dist: None,
                               spawn_command=lambda: ["python"], grown=lambda *args: grown.append(args),
                               fall_back=fall_back, grow_split=lambda world, grown: Resplit(16, 1, 5),
                               stepped_since_change=True, engine=SimpleNamespace(initial_world=3))
    return dist, recovery


def warming(outcomes, merged=None, lost=(False,)):
    """A grow under way onto noded: rank 0's receive of the new rank's word, and of its failure (`lost`)."""
    from mpiddp.elastic.grow import Warming

    return Warming(merged or Merged(), GrowPlan(("noded",)), None, ["a", "b", "noded"], {"spawn": 0.1, "merge": 0.02},
                   0.15, [Request(outcomes)], [Request(lost)])


def test_a_new_rank_that_fails_while_joining_ends_the_job_in_one_line(monkeypatch):
    """The spawn and merge worked, the new rank said it was ready, then died: a reduction over the merged job may
    fail or return garbage (ULFM). The survivors fall back, naming the host the rank was joining on, and record
    no grow."""
    import pickle

    from mpiddp.elastic.grow import GrowBack

    said, grown = [], []
    dist, recovery = survivors(monkeypatch, said, grown)
    for error in (MpiError("MPI_ERR_PROC_FAILED: Process Failure"), pickle.UnpicklingError("invalid load key")):
        def join(*args, error=error):
            raise error
        monkeypatch.setattr(GrowBack, "_join", staticmethod(join))
        grower = GrowBack([("noded", 1)])
        grower.warming = warming([True])
        with pytest.raises(RuntimeError, match="fell back"):
            grower.at_boundary(recovery)
        reason, ranks = said.pop()
        assert reason.startswith("a new rank failed while joining on noded (") and ranks == (2,), reason
        assert "\n" not in reason and grown == []


def test_the_survivors_train_on_while_the_new_rank_warms_up_and_take_it_in_once_it_is_ready(monkeypatch):
    """Step 2 of a grow: at each boundary rank 0 looks without waiting; the survivors go on while the new rank
    warms up, and take it in (its word to join, then the merged job's collectives) at the first boundary after
    it said it is ready. Their stand-still counts step 1's too."""
    from mpiddp.elastic.grow import GrowBack, Regrown

    said, grown = [], []
    dist, recovery = survivors(monkeypatch, said, grown)
    joined = []
    monkeypatch.setattr(GrowBack, "_join", staticmethod(lambda *args: joined.append(args)))
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.warming = warming([False, False, True], merged)
    grower.at_boundary(recovery)
    grower.at_boundary(recovery)
    assert (joined, merged.sent, grower.warming is not None) == ([], [], True)  # warming: the survivors train on
    with pytest.raises(Regrown):
        grower.at_boundary(recovery)
    # the word to join says where the grown group's keys go in rank 0's store (its own, kept: no store is built)
    ((prefix, dest),) = merged.sent
    assert dest == 2 and prefix.startswith("grown-") and prefix.endswith("/")
    assert len(joined) == 1 and joined[0][-1] == prefix and grower.warming is None
    ((record, split, stalled_from),) = grown
    assert record["ranks_added"] == [2] and record["hosts_added"] == ["noded"] and record["warm_up"] == 1.5
    assert record["phases"]["spawn"] == 0.1 and split == Resplit(16, 1, 5)
    import time

    assert time.monotonic() - stalled_from >= 0.15  # step 1's stand-still is the survivors' too


def test_a_new_rank_that_could_not_reach_rank_0s_store_is_taken_in_on_a_new_store(monkeypatch):
    """A new rank that said ready without a connection to rank 0's store (a recovery replaced it, or the network):
    rank 0 tells it no prefix, and the take-in builds a new store, as at a recovery."""
    from mpiddp.elastic.grow import GrowBack, Regrown

    said, grown = [], []
    dist, recovery = survivors(monkeypatch, said, grown)
    joined = []
    monkeypatch.setattr(GrowBack, "_join", staticmethod(lambda *args: joined.append(args)))
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.warming = warming([("ready", 1.5, False)], merged)
    with pytest.raises(Regrown):
        grower.at_boundary(recovery)
    assert merged.sent == [(None, 2)] and joined[0][-1] is None


def test_a_new_rank_that_ends_while_warming_up_leaves_the_survivors_as_they_were(monkeypatch, caplog):
    """A new rank that dies before it is ready (its host lost, an import that failed): rank 0's receive ends with
    MPI's error; the survivors give the grow up (the merged communicator revoked, the spare slot free again), say
    why once, and never grow again (no fall-back: the job goes on at reduced size)."""
    from mpiddp.elastic.grow import GrowBack

    said, grown = [], []
    dist, recovery = survivors(monkeypatch, said, grown)
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.used = {"noded": 1}  # taken at the spawn
    grower.warming = warming([MpiError("MPI_ERR_PROC_FAILED: Process Failure")], merged)
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.at_boundary(recovery)
        grower.at_boundary(recovery)  # said once
    assert merged.revoked and grower.warming is None and grower.used == {"noded": 0} and (said, grown) == ([], [])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith("not growing back: a new rank on noded ended while warming up "
                                                   "(MPI_ERR_PROC_FAILED"), lines


def test_a_survivor_lost_while_the_new_rank_warms_up_gives_the_grow_up(monkeypatch, caplog):
    """The merged communicator numbers the survivors of the world before the failure: the recovery revokes it (the
    new rank, waiting on it, leaves) and says so on rank 0; the job may grow again later from the new world."""
    from mpiddp.elastic.grow import GrowBack

    dist = SimpleNamespace(is_main=True)
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.used = {"noded": 1}
    grower.warming = warming([False], merged)
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.abandon(dist, "ranks 1 of the job failed while they warmed up")
        grower.abandon(dist, "again")  # nothing under way: nothing said
    assert merged.revoked and grower.warming is None and grower.used == {"noded": 0} and not grower.said_off
    assert [r.getMessage() for r in caplog.records] == [
        "growing back given up: ranks 1 of the job failed while they warmed up; the new ranks on noded leave"]


def test_a_script_job_that_finishes_while_a_new_rank_runs_its_start_says_why_mpirun_waits(caplog):
    """Every rank finished the script while a new rank still runs the script's start: rank 0 alone says that it
    leaves at its first step and mpirun ends then, and nothing is revoked; with no grow under way nothing is said."""
    from mpiddp.elastic.api import Manager
    from mpiddp.elastic.grow import GrowBack

    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.warming = warming([False], merged)
    waited = []
    manager = Manager()
    stopped = []  # the hang watchdog stops as the script ends, before the wait
    manager.recovery = SimpleNamespace(grower=grower, members=None, finished=lambda: stopped.append(len(waited)))
    with caplog.at_level("WARNING", logger="mpiddp"):
        manager.wait_for_every_rank(SimpleNamespace(is_main=False, wait_for_all=lambda: waited.append(1)))
        manager.wait_for_every_rank(SimpleNamespace(is_main=True, wait_for_all=lambda: waited.append(0)))
        grower.warming = None
        manager.wait_for_every_rank(SimpleNamespace(is_main=True, wait_for_all=lambda: waited.append(0)))
    assert waited == [1, 0, 0] and stopped == [0, 1, 2] and not merged.revoked
    assert [r.getMessage() for r in caplog.records] == [
        "the job finished while the new ranks on noded still warm up (the script's start): they leave when they "
        "come to join, and mpirun ends then"]


@pytest.mark.parametrize("job_ends, then", [(False, "the hot spares on noded wait again"),
                                             (True, "the hot spares on noded leave with the job")])
def test_a_hot_spares_grow_given_up_says_whether_they_wait_again_or_leave_with_the_job(monkeypatch, caplog,
                                                                                       job_ends, then):
    """Given up after a failure, the hot spares wait again for the next grow; given up at the job's end (the
    trainer's end while they warm up), they leave with it: the line says which."""
    from mpiddp.elastic.grow import GrowBack

    monkeypatch.setattr("mpiddp.elastic.grow.mpigrow.spares_of", lambda merged, count: [7] * count)
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.hot, grower.used, grower.warming = True, {"noded": 1}, warming([False], merged)
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.abandon(SimpleNamespace(is_main=True), "training ended while they warmed up", job_ends=job_ends)
    assert merged.revoked and grower.returning == [(7, "noded")]
    assert [r.getMessage() for r in caplog.records] == [
        f"growing back given up: training ended while they warmed up; {then}"]


@pytest.mark.parametrize("noticed", ["before connecting to rank 0's store", "waiting for the word to join"])
def test_a_new_rank_whose_grow_was_given_up_leaves_without_joining(monkeypatch, caplog, noticed):
    """The survivors revoked the merged communicator (or rank 0 ended) while the new rank warmed up: it connects to
    no store (a recovery replaced rank 0's; a stopped rank 0 would hold the connect for its bound), its word that it
    is ready, or its wait for the word to join, ends with MPI's error; it frees the merged communicator
    (MPI_Finalize then returns at once) and raises Abandoned, on which the process ends with status 0."""
    from mpiddp.elastic import grow

    freed, connected = [], []
    revoked = MpiError("MPI_ERR_REVOKED: Communication Object Revoked")

    class Revoked:
        def Is_revoked(self):
            return noticed.startswith("before")

        def send(self, value, dest, tag):
            pass

        def recv(self, source, tag):
            raise revoked

        def Free(self):
            freed.append(True)

    monkeypatch.setattr(grow.mpigrow, "mpi_exception", lambda: MpiError)
    monkeypatch.setattr(grow, "connect_store", lambda arrival: connected.append(True))
    arrival = grow.Arrival(Revoked(), {}, None, ["a", "b", "c"], None, 0.0)
    with caplog.at_level("WARNING", logger="mpiddp"), \
            pytest.raises(grow.Abandoned, match="gave up this rank's grow before it joined .MPI_ERR_REVOKED"):
        grow.enter(arrival)
    assert freed == [True] and connected == ([] if noticed.startswith("before") else [True])
    warm = caplog.records[0].getMessage()  # known revoked: it does not say it will be taken in
    assert warm.endswith("; the job gave this grow up meanwhile" if noticed.startswith("before") else
                         "; the job takes this rank in at its next step boundary"), warm


@pytest.mark.parametrize("ended, said", [
    ("raised", "ValueError: no data at /data/train.bin"),
    ("exited", "the script ended before its first step (status 2)"),
    ("returned", "the script ended before its first step"),
])
def test_a_script_that_fails_or_ends_before_its_first_step_tells_rank_0_and_ends_this_rank_alone(monkeypatch, ended,
                                                                                                said):
    """A new rank runs the script's start before it joins (grow.LateJoin): where that raises (as `mpiddp run`
    reports it: a ScriptError over the script's own exception), exits or returns, rank 0 hears the script's own
    reason, the merged communicator is freed and the process ends with status 0 (the job goes on without it)."""
    from mpiddp.elastic import grow
    from mpiddp.errors import ScriptError, ScriptExit

    sent, freed, ended_with = [], [], []

    class Merged:
        def send(self, value, dest, tag):
            sent.append((value, dest, tag))

        def Free(self):
            freed.append(True)

    late = grow.LateJoin(grow.Arrival(Merged(), {}, None, ["a", "b", "c"], None, 0.0))
    monkeypatch.setattr(late, "_end_now", ended_with.append)
    if ended == "raised":
        try:
            try:
                raise ValueError("no data at /data/train.bin")
            except ValueError:
                raise ScriptError("train.py", "Traceback ...", "ValueError: no data at /data/train.bin") from None
        except ScriptError as exc:
            late.end(exc)
    else:
        late.end(ScriptExit("train.py", 2) if ended == "exited" else None)
    assert sent == [(("failed", said), 0, grow.READY_TAG)] and freed == [True] and ended_with == [0]
    assert not late.joined


@pytest.mark.parametrize("hot_spare", [True, False])
def test_a_hot_spare_whose_grow_was_given_up_during_the_scripts_start_waits_again_and_joins_the_next_grow(
        monkeypatch, hot_spare):
    """A rank failed while the new rank ran the script's start: the survivors gave that grow up, and the new rank
    learns it at its first step. A hot spare is healthy and warm (its script cannot run twice): it waits again with
    its start done and joins at the next grow, at the place that grow gives it. It ended there before, and the job
    never grew again. A spawned rank ends, as before (GivenUp raised, for LateJoin.end)."""
    from mpiddp.elastic import grow

    first, second = (grow.Arrival(f"merged{n}", {}, None, [], None, 0.0) for n in (1, 2))
    entered, waited = [], []

    def enter(arrival):
        entered.append(arrival)
        if arrival is first:
            raise grow.GivenUp("the job gave up this rank's grow before it joined")
        return "joined over merged2"

    monkeypatch.setattr(grow, "enter", enter)
    monkeypatch.setattr(grow.mpigrow, "is_hot_spare", lambda: hot_spare)
    monkeypatch.setattr(grow.mpigrow, "back_to_waiting", lambda: waited.append("back"))
    monkeypatch.setattr(grow, "arrive", lambda: (waited.append("woken"), second)[1])
    late = grow.LateJoin(first)
    monkeypatch.setattr(late._group, "remove", lambda: None)
    if not hot_spare:
        with pytest.raises(grow.GivenUp):
            late.enter()
        assert entered == [first] and waited == [] and not late.joined
        return
    assert late.enter() == "joined over merged2" and late.joined
    assert entered == [first, second] and waited == ["back", "woken"] and late.arrival is second
    assert late.enter() == "joined over merged2" and len(entered) == 2  # once joined, a step enters nothing


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_joining_rank_builds_its_process_group_on_the_survivors_backend(monkeypatch, backend):
    """The survivors adopt the merged job on their own backend: a new rank on gloo beside NCCL survivors would
    never meet them (it did: the joining side always built gloo on the CPU)."""
    import torch

    from mpiddp.elastic import grow
    from mpiddp.elastic.survivors import topology_over

    template = topology_over(SimpleNamespace(mpi_library="openmpi", mpi_settings={}, restarts=0, restarted_by="",
                                             failure_file="", launch_id="", launch_run_dir="", job_record=""),
                             ["a", "b"], 0)
    server = torch.distributed.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    server.set("survivors", "here")
    hello = {"topology": template, "backend": backend, "interface_per_host": {}, "collective_timeout_s": 60.0,
             "store": ("127.0.0.1", server.port)}

    class Merged:
        def bcast(self, value, root):
            return hello

        def allgather(self, value):
            return ["a", "b", value]

        def Get_rank(self):
            return 2

        def send(self, value, dest, tag):
            pass

        def recv(self, source, tag):
            return "grown-1a2b/"  # rank 0's word to join: where the group's keys go in its store

        def Is_revoked(self):  # the grow still stands
            return False

        def Iprobe(self, source, tag):
            return False

    built = []

    class Members:
        def __init__(self, comm, timeout, backend="gloo", device=None, spanning=None, prepared=None):
            # a spawned rank's duplicates are made at the take-in, not as it arrived: an MPI_Comm_idup across two
            # MPI jobs that fails corrupts Open MPI 5.0.11's heap (grow.prepared_dups)
            assert prepared is None
            built.append((backend, device))

        def start_process_group(self, joined=None):
            built.append(joined)

    monkeypatch.setattr(grow.mpigrow, "merge_with_parent", Merged)
    monkeypatch.setattr(grow, "Membership", Members)
    monkeypatch.setattr(grow.mpigrow, "spanning_of_joined", lambda merged: None)  # no MPI parent here
    monkeypatch.setattr(grow, "own_host", lambda: "c")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as the binding asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    joined = grow.enter(grow.arrive())
    expected = torch.device("cuda", 0) if backend == "nccl" else None
    (made, joined_store) = built
    assert made == (backend, expected)
    # its process group goes on rank 0's store, which it connected to before saying ready, under rank 0's prefix
    assert joined_store.prefix == "grown-1a2b/" and joined_store.endpoint == ("127.0.0.1", server.port)
    assert joined_store.store.get("survivors") == b"here"
    assert joined.device == (expected or torch.device("cpu"))
    assert (joined.topology.rank, joined.topology.world_size, joined.added[0]) == (2, 3, [2])


def test_a_spawn_that_never_returns_ends_the_process_after_its_bound_with_a_record_that_blames_no_host(tmp_path,
                                                                                                      capsys):
    import threading

    from mpiddp import failure
    from mpiddp.elastic.grow import bounded, spawn_stuck

    ended = threading.Event()
    with bounded(0.05, ended.set):  # a block that outlives the bound: the helper thread acts
        assert ended.wait(30)
    quick = threading.Event()
    with bounded(0.5, quick.set):
        pass
    assert not quick.wait(1.0)  # a block that ended in time: nothing happens, ever

    statuses = []
    dist = SimpleNamespace(is_main=True, rank=0, abort_from_thread=statuses.append)
    spawn_stuck(dist, "MPI_Comm_spawn onto nodec", tmp_path, 31)
    assert statuses == [4]  # EXIT_HANG: the process ends (nothing can interrupt the MPI call)
    (record,) = failure.read_all(tmp_path)
    assert (record.kind, record.ranks, record.hosts, record.step) == ("hang", [], [], 31)  # no host blamed
    assert "MPI_Comm_spawn onto nodec has not returned after 60 s" in capsys.readouterr().err


def test_after_a_rank_lost_in_a_grown_job_open_mpi_5_0_grows_no_more():
    """Open MPI 5.0's launcher fails to spawn into a job that lost a rank after it grew
    (tests/elastic/test_grow_e2e.py): refused there, with the library named; not before the job grew, and not with
    another MPI."""
    from mpiddp.elastic.decide import regrow_refusal

    version = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11"
    assert regrow_refusal(version, lost_after_grow=False) is None
    assert regrow_refusal(version, lost_after_grow=True).startswith(
        "Open MPI v5.0.11 cannot spawn again into a job that lost a rank after it grew")
    assert regrow_refusal("Open MPI v6.0.0, package: Open MPI", lost_after_grow=True) is None


def test_a_recovery_gives_up_a_grow_under_way_said_by_the_next_rank_0_and_remembered(tmp_path, caplog):
    """Old rank 0 lost while the new rank warms up: the survivor that becomes rank 0 says so, and the job counts as
    one that lost a rank after it spawned (regrow_refusal). That survivor has the spawn mark (rank 0 wrote it, and
    may be the one gone) stand SPAWN_MARK_HOLD_S more, then no longer count: prterun can lose a survivor's daemon in
    the spawn and end the job just after, and launch must not blame that host; a later failure is its own."""
    import time

    from mpiddp import failure
    from mpiddp.elastic.grow import SPAWN_MARK_HOLD_S, GrowBack

    grower = GrowBack([("noded", 2)])
    grower.members_lost(SimpleNamespace(rank=1, world_size=3), (0,), tmp_path)
    assert not grower.lost_after_grow  # lost before any grow: the job may grow
    failure.mark_spawning(tmp_path, ["noded"])
    grower.used, merged = {"noded": 1}, Merged()
    grower.warming = warming([False], merged)
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.members_lost(SimpleNamespace(rank=2, world_size=3), (0,), tmp_path)  # not the next rank 0: quiet
    assert caplog.records == [] and grower.lost_after_grow and merged.revoked and grower.used == {"noded": 0}
    assert "until" not in (tmp_path / failure.SPAWNING_FILE).read_text()  # not the next rank 0: left as it was
    grower.warming = warming([False])
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.members_lost(SimpleNamespace(rank=1, world_size=3), (0,), tmp_path)
    assert [r.getMessage() for r in caplog.records] == [
        "growing back given up: ranks 0 of the job failed while they warmed up; the new ranks on noded leave"]
    now = time.time()
    assert failure.spawning(tmp_path) is not None  # a launcher that ends the job now failed in the spawn
    assert failure.spawning(tmp_path, at=now + SPAWN_MARK_HOLD_S - 1)[0] == ["noded"]
    assert failure.spawning(tmp_path, at=now + SPAWN_MARK_HOLD_S + 1) is None  # a later failure is its own
    failure.mark_spawning(tmp_path, ["noded"])  # a new grow's mark counts again, without a hold
    assert failure.spawning(tmp_path, at=now + 10 * SPAWN_MARK_HOLD_S) is not None
    began = failure.last_spawn(tmp_path)[1]
    failure.spawned(tmp_path)  # the new rank joined: no spawn under way, but the attempt's job did spawn
    assert failure.spawning(tmp_path) is None and failure.last_spawn(tmp_path) == (["noded"], began)
    failure.hold_spawning(tmp_path, SPAWN_MARK_HOLD_S)  # an ended spawn is not held under way again
    assert failure.spawning(tmp_path) is None
    failure.clear(tmp_path)  # a new attempt: no spawn of its own yet
    assert failure.last_spawn(tmp_path) is None


def test_a_new_rank_lost_after_it_said_ready_or_that_could_not_warm_up_is_given_up_not_fatal(monkeypatch, caplog):
    """The trainer takes a ready rank in only where the split allows (else at the next epoch's start): a new rank
    that dies meanwhile is seen by rank 0's receive on LOST_TAG, and one whose warm-up failed says why; either
    way the survivors go on at reduced size, saying why once (no fall-back, no collective over the merged job)."""
    from mpiddp.elastic.grow import GrowBack

    said, grown = [], []
    dist, recovery = survivors(monkeypatch, said, grown)
    recovery.grow_split = lambda world, grown: None  # not at this position
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.used = {"noded": 1}
    grower.warming = warming(["ready"], merged, lost=[False, MpiError("MPI_ERR_PROC_FAILED: Process Failure")])
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.at_boundary(recovery)  # ready, but the split waits
        assert grower.warming is not None and merged.sent == []
        grower.at_boundary(recovery)  # the ready rank died meanwhile
    assert grower.warming is None and merged.revoked and merged.sent == [] and (said, grown) == ([], [])
    assert [r.getMessage() for r in caplog.records] == [
        "not growing back: a new rank on noded ended while warming up (MPI_ERR_PROC_FAILED: Process Failure); the "
        "job goes on with 2 ranks"]
    grower, merged = GrowBack([("noded", 1)]), Merged()
    grower.used = {"noded": 1}
    grower.warming = warming([("failed", "FileNotFoundError: /data/cifar10")], merged)
    caplog.clear()
    with caplog.at_level("WARNING", logger="mpiddp"):
        grower.at_boundary(recovery)
    assert merged.revoked and [r.getMessage() for r in caplog.records] == [
        "not growing back: a new rank on noded could not warm up (FileNotFoundError: /data/cifar10); the job goes "
        "on with 2 ranks"]


def test_a_rank_that_joined_by_a_grow_follows_rank_0s_view_of_growing(monkeypatch):
    """A joined rank's own GrowBack starts from the survivors' (hello's "grower": the spare slots taken, whether
    a rank was lost after a grow), and every rank follows rank 0's broadcast decision, the refusal too: a joined
    rank that decided alone would enter a collective rank 0 skips."""
    from mpiddp.elastic import grow
    from mpiddp.elastic.grow import GrowBack

    survivors_side = GrowBack([("noded", 2)])
    survivors_side.used = {"noded": 1}
    hello = survivors_side.hello(SimpleNamespace(topology=None, rendezvous=None), SimpleNamespace(
        members=SimpleNamespace(backend="gloo", collective_timeout_s=60.0, endpoint=None), engine=SimpleNamespace(
            initial_world=3, min_size=1)), GrowPlan(("noded",)))
    assert hello["grower"] == {"used": {"noded": 2}, "lost_after_grow": False}
    joined = GrowBack([("noded", 2)])
    joined.joined({**hello["grower"], "lost_after_grow": True})
    assert joined.used == {"noded": 2} and joined.grew and joined.lost_after_grow
    monkeypatch.setattr(grow.mpigrow, "library_version", lambda: "Open MPI v5.0.11, package: Open MPI")
    assert joined.plan(SimpleNamespace(world_size=2), 3).startswith("Open MPI v5.0.11 cannot spawn again")
    broadcast = []
    dist = SimpleNamespace(world_size=2, is_main=False, transport=SimpleNamespace(
        bcast=lambda value: broadcast.append(value) or "no spare slot to grow onto"))
    recovery = SimpleNamespace(dists=[dist], stepped_since_change=True, engine=SimpleNamespace(initial_world=3))
    joined.at_boundary(recovery)  # not rank 0: it takes part in the broadcast and follows the word
    assert broadcast == [None] and joined.said_off


def test_a_new_rank_whose_start_was_given_up_leaves_and_its_own_failed_word_wins(monkeypatch):
    """The survivors revoked the merged communicator during the hello (a survivor failed, or another new rank):
    the new rank frees it and raises Abandoned (it ends with status 0) instead of a traceback that would leave it
    waiting in MPI_Finalize. And a new rank that said why it could not warm up, then ended, is told by its word,
    not by MPI's report of its end."""
    from mpiddp.elastic import grow

    freed = []

    class Revoked:
        def bcast(self, value, root):
            raise MpiError("MPI_ERR_REVOKED: Communication Object Revoked")

        def Free(self):
            freed.append(True)

    monkeypatch.setattr(grow.mpigrow, "mpi_exception", lambda: MpiError)
    monkeypatch.setattr(grow.mpigrow, "merge_with_parent", Revoked)
    with pytest.raises(grow.Abandoned, match="gave up this rank's grow as it started .MPI_ERR_REVOKED"):
        grow.arrive()
    assert freed == [True]
    both = warming([("failed", "FileNotFoundError: /data")], lost=[MpiError("MPI_ERR_PROC_FAILED: Process Failure")])
    assert both.poll() == "a new rank on noded could not warm up (FileNotFoundError: /data)"


def test_the_ordinary_step_is_a_steps_own_time_at_that_size_never_a_first_step_or_what_lies_between():
    times = StepTimes(keep=3)
    times.ended(3, 1.0, ordinary=True)  # no start seen (the job's first boundary): nothing
    for start, end in ((10.0, 10.2), (13.0, 13.1), (20.0, 20.3)):  # an evaluation or a save between: outside
        times.started(start)
        times.ended(3, end, ordinary=True)
    times.started(30.0)
    times.ended(3, 31.5, ordinary=False)  # the first step after a recovery or grow
    times.started(40.0)
    times.ended(2, 40.4, ordinary=True)  # at another size
    assert times.at(3) == pytest.approx([0.2, 0.1, 0.3]) and times.at(2) == pytest.approx([0.4]) and times.at(4) == []
    times.started(50.0)
    times.ended(3, 50.5, ordinary=True)
    assert times.at(3) == pytest.approx([0.1, 0.3, 0.5])  # the last `keep`
    assert stand_still(1.6, times.at(3)) == pytest.approx({"survivors_stall": 1.3, "ordinary_step": 0.3})


def test_a_new_ranks_rehearsal_step_leaves_nothing_the_take_in_does_not_replace():
    """The warm-up's thrown-away step (mpiddp.trainer.join.rehearse) moves the weights, BatchNorm's running
    statistics and the optimizer's state, and fills gradients: the gradients are cleared, and rank 0's state loaded
    at the take-in puts every tensor back."""
    import torch

    from mpiddp.trainer.config import Config
    from mpiddp.trainer.data import load_datasets
    from mpiddp.trainer.join import rehearse
    from mpiddp.trainer.models import build_model, input_channels

    cfg = Config.of(device="cpu", wandb="disabled", progress="off", dataset="synthetic", arch="resnet18",
                    image_size=16, batch_size=4)
    datasets = load_datasets(cfg, lambda channels: input_channels(cfg.data.model_name, channels))
    model = build_model(cfg.data.model_name, datasets.num_classes, datasets.channels, cfg.data.input_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    survivors = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    survivors_optimizer = copy.deepcopy(optimizer.state_dict())  # rank 0's (no step taken: no momentum yet)
    rehearse(cfg, model, optimizer, datasets, torch.device("cpu"))
    assert any(not torch.equal(survivors[name], tensor) for name, tensor in model.state_dict().items())  # it ran
    assert optimizer.state  # the step ran: momentum buffers
    assert all(parameter.grad is None for parameter in model.parameters())
    model.load_state_dict(survivors)  # what restored_state does with rank 0's payload
    optimizer.load_state_dict(survivors_optimizer)
    assert all(torch.equal(survivors[name], tensor) for name, tensor in model.state_dict().items())
    assert not optimizer.state  # rank 0's state, whatever the rehearsal made


def test_a_joined_rank_keeps_the_survivors_full_epoch_end():
    """A rank that joined in a partial grow has loaders of that size's even split, whose epoch ends elsewhere than
    the first split's: it keeps the survivors' (the handover's), or after the next loss it would train a step the
    others do not (a hang)."""
    from mpiddp.trainer.elastic_policy import TrainerPolicy

    policy = TrainerPolicy()
    policy.parts = SimpleNamespace(loaders=SimpleNamespace(epoch_end=1400))
    policy.keep_full_epoch_end(1344)
    assert policy.full_epoch_end() == 1344


def test_a_hot_spare_of_a_grow_given_up_is_waited_for_and_taken_back_not_lost(monkeypatch, caplog):
    """The survivors gave a grow onto two hot spares up (a rank failed while they warmed up): the spares finish
    their warm-up and wait again. Until each waits again or has failed no grow starts (every live process of the
    spares' world takes part in a wake's shrink: it would wait); rank 0 says so once. One back is taken back
    (waiting again, on its host: the next plan may wake it); one failed is forgotten."""
    from mpiddp.elastic import grow

    took_back, answers = [], iter([([], []), ([7], []), ([], [8])])
    monkeypatch.setattr(grow.mpigrow, "returned_or_gone", lambda returning: next(answers))
    monkeypatch.setattr(grow.mpigrow, "take_back", lambda rank, host: took_back.append((rank, host)))
    grower = grow.GrowBack([("noded", 2)])
    grower.hot, grower.returning = True, [(7, "noded"), (8, "noded")]
    dist = SimpleNamespace(is_main=True, world_size=1, transport=SimpleNamespace(bcast=lambda value: value))
    with caplog.at_level("WARNING", logger="mpiddp"):
        assert grower.settle_returning(dist) is True  # neither back yet
        assert grower.settle_returning(dist) is True  # 7 back, 8 still on its way
    assert took_back == [(7, "noded")] and grower.returning == [(8, "noded")]
    assert [r.getMessage() for r in caplog.records].count(
        "growing back waits until the hot spare of the grow given up waits again (once its warm-up is over); the "
        "job goes on with 1 ranks") == 1
    assert grower.settle_returning(dist) is False  # 8 failed: forgotten, nothing to wait for
    assert took_back == [(7, "noded")] and grower.returning == []


def test_only_a_healthy_hot_spare_whose_grow_was_given_up_waits_again(monkeypatch):
    from mpiddp.elastic import grow

    back = []
    monkeypatch.setattr(grow.mpigrow, "back_to_waiting", lambda: back.append(True))
    monkeypatch.setattr(grow.mpigrow, "is_hot_spare", lambda: True)
    assert grow.wait_again(grow.GivenUp("the job gave up this rank's grow before it joined")) and back == [True]
    assert not grow.wait_again(grow.CouldNotWarmUp())  # it failed itself: it ends
    assert not grow.wait_again(grow.Abandoned("this hot spare was not needed: the job ended"))
    monkeypatch.setattr(grow.mpigrow, "is_hot_spare", lambda: False)  # a spawned rank is a job of its own: it ends
    assert not grow.wait_again(grow.GivenUp("the job gave up this rank's grow before it joined")) and back == [True]


def test_a_new_rank_whose_connect_to_rank_0s_store_gets_no_answer_gives_it_up_at_its_bound(monkeypatch, caplog):
    """Rank 0 stopped (SIGSTOP: its socket open, answering nothing): torch's client handshake would wait in recv
    whatever its timeout (measured: still waiting after 30 s of a 3 s timeout). The new rank gives the connect up
    at its bound, says so, and says ready without it (the take-in then builds a new store)."""
    import socket

    from mpiddp.elastic import grow

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)  # the kernel accepts; nobody answers
    monkeypatch.setattr(grow, "CONNECT_BOUND_S", 0.5)
    monkeypatch.setattr(grow.mpigrow, "mpi_exception", lambda: MpiError)
    standing = SimpleNamespace(Iprobe=lambda source, tag: False, Is_revoked=lambda: False)
    arrival = grow.Arrival(standing, {"store": silent.getsockname(), "collective_timeout_s": 1.0},
                           SimpleNamespace(world_size=3), [], None, 0.0)
    with caplog.at_level("WARNING", logger="mpiddp"):
        assert grow.connect_store(arrival) is None
    # torch 2.4's client gives up by itself at the same bound (its own words); later ones wait in recv (ours)
    assert "cannot be reached (" in caplog.text and "): the take-in builds a new one" in caplog.text
    silent.close()


@pytest.mark.parametrize("mpi_says", ["rank 0 failed", "revoked"])
def test_a_new_rank_that_learns_while_connecting_that_its_grow_was_given_up_stops_at_once(monkeypatch, caplog,
                                                                                          mpi_says):
    """Rank 0 died while the new rank ran its warm-up (no MPI call then: the revoke is unheard): its store refuses,
    and torch would retry until the connect's bound (10 s of the job at reduced size, seen by a reviewer). MPI,
    asked while it connects, says the grow is given up: the connect stops at once, without a line (the ready word
    that follows says why)."""
    import threading
    import time

    import torch

    from mpiddp.elastic import grow

    refused = threading.Event()

    def retrying(*args, **kwargs):  # torch's client retrying a refused connect, until the test ends
        refused.wait(30)
        raise RuntimeError("connect refused")

    def probe(source, tag):
        if mpi_says == "rank 0 failed":
            raise MpiError("MPI_ERR_PROC_FAILED: Process Failure")
        return False

    monkeypatch.setattr(torch.distributed, "TCPStore", retrying)
    monkeypatch.setattr(grow.mpigrow, "mpi_exception", lambda: MpiError)
    merged = SimpleNamespace(Iprobe=probe, Is_revoked=lambda: mpi_says == "revoked")
    arrival = grow.Arrival(merged, {"store": ("10.0.0.1", 29500), "collective_timeout_s": 60.0},
                           SimpleNamespace(world_size=3), [], None, 0.0)
    started = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="mpiddp"):
            assert grow.connect_store(arrival) is None
        assert time.monotonic() - started < grow.CONNECT_BOUND_S and "cannot be reached" not in caplog.text
    finally:
        refused.set()


def test_only_hot_spares_start_the_merged_jobs_duplicates_as_they_arrive():
    """Both sides of a grow call prepared_dups alike: MPI_Comm_idup twice for hot spares (one MPI job), nothing for
    a spawned rank, whose merged communicator spans two jobs (a failed idup there corrupts Open MPI 5.0.11's heap:
    the take-in duplicates at once instead)."""
    from mpiddp.elastic import grow

    class Merged:
        def __init__(self):
            self.idups = 0

        def Idup(self):
            self.idups += 1
            return object(), SimpleNamespace(Test=lambda: True)

    hot, spawned = Merged(), Merged()
    prepared = grow.prepared_dups(hot, True)
    assert prepared is not None and hot.idups == 2
    assert grow.prepared_dups(spawned, False) is None and spawned.idups == 0
