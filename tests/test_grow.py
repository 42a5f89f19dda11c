"""Growing back after an in-job recovery: the decisions, in-process (no MPI, no spawn)."""

from types import SimpleNamespace

import pytest

from mpiddp.elastic.decide import GrowPlan, format_spare_hosts, grow_due, parse_spare_hosts, plan_growth
from mpiddp.recoveries import count_line, describe
from mpiddp.elastic.decide import GROW_PHASES, grow_record, split_for_growth
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
    # a global batch of 14 (2 x 7) cannot split over 3 ranks
    split, never = split_for_growth(config(7, 1), config(7, 1), 2, 3, 4)
    assert split is None and "global batch" in never


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


def test_a_new_rank_that_fails_while_joining_ends_the_job_in_one_line(monkeypatch):
    """The spawn and merge worked, then the new rank died: a reduction over the merged job may fail or return
    garbage (ULFM). The survivors fall back, naming the host the rank was joining on, and record no grow."""
    import pickle

    from mpiddp.elastic import grow as trainer_grow
    from mpiddp.elastic.grow import GrowBack

    class MpiError(Exception):
        pass

    said = []

    def fall_back(reason, ranks):
        said.append((reason, ranks))
        raise RuntimeError("fell back")

    dist = SimpleNamespace(world_size=2, is_main=True, topology=SimpleNamespace(failure_file=""))
    grown = []
    recovery = SimpleNamespace(members=SimpleNamespace(_mpi=SimpleNamespace(Exception=MpiError), comm=None),
                               dists=[dist], steps_done=lambda: 7, records_dir=lambda: None,
                               pause_watch=lambda: None, follow_watch=lambda dist: None,
                               spawn_command=lambda: ["python"], grown=lambda *args: grown.append(args),
                               fall_back=fall_back)
    monkeypatch.setattr(trainer_grow.mpigrow, "spawn_and_merge", lambda comm, plan, command: (object(), {"spawn": 0.1}))
    for error in (MpiError("MPI_ERR_PROC_FAILED: Process Failure"), pickle.UnpicklingError("invalid load key")):
        def join(*args, error=error):
            raise error
        monkeypatch.setattr(GrowBack, "_join", staticmethod(join))
        with pytest.raises(RuntimeError, match="fell back"):
            GrowBack([("noded", 1)]).grow(recovery, GrowPlan(("noded",)), Resplit(16, 1, 5))
        reason, ranks = said.pop()
        assert reason.startswith("a new rank failed while joining on noded (") and ranks == (2,), reason
        assert "\n" not in reason and grown == []


@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_a_joining_rank_builds_its_process_group_on_the_survivors_backend(monkeypatch, backend):
    """The survivors adopt the merged job on their own backend: a new rank on gloo beside NCCL survivors would
    never meet them (it did: the joining side always built gloo on the CPU)."""
    import torch

    from mpiddp.elastic import grow
    from mpiddp.elastic.survivors import topology_over

    template = topology_over(SimpleNamespace(mpi_library="openmpi", mpi_settings={}, restarts=0, failure_file="",
                                             launch_id="", launch_run_dir="", job_record=""), ["a", "b"], 0)
    hello = {"topology": template, "backend": backend, "interface_per_host": {}, "collective_timeout_s": 60.0}

    class Merged:
        def bcast(self, value, root):
            return hello

        def allgather(self, value):
            return ["a", "b", value]

        def Get_rank(self):
            return 2

    built = []

    class Members:
        def __init__(self, comm, timeout, backend="gloo", device=None):
            built.append((backend, device))

        def start_process_group(self):
            pass

    monkeypatch.setattr(grow.mpigrow, "merge_with_parent", Merged)
    monkeypatch.setattr(grow, "Membership", Members)
    monkeypatch.setattr(grow, "own_host", lambda: "c")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU host, as far as the binding asks
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    joined = grow.join()
    expected = torch.device("cuda", 0) if backend == "nccl" else None
    assert built == [(backend, expected)]
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
    spawn_stuck(dist, ["nodec"], tmp_path, 31)
    assert statuses == [4]  # EXIT_HANG: the process ends (nothing can interrupt the MPI call)
    (record,) = failure.read_all(tmp_path)
    assert (record.kind, record.ranks, record.hosts, record.step) == ("hang", [], [], 31)  # no host blamed
    assert "MPI_Comm_spawn onto nodec has not returned after 60 s" in capsys.readouterr().err
