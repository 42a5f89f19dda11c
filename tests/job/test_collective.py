"""Dist in-process: agree/from_main error paths, the no-communication rule, reductions, stop agreement."""

import numpy as np
import pytest

from mpiddp.errors import AgreedError, HelpRequested, UserError
from mpiddp.job.collective import AGREEMENT_MARK as MARK, Dist, SoloTransport, agree_on, solo_dist
from mpiddp.job.topology import RankRecord, build_topology


class PeersTransport(SoloTransport):
    """This process plays rank `rank`; the other ranks' contributions are given up front."""

    def __init__(self, rank, others, reduce_with=None, main_value=None):
        self.rank, self.others = rank, list(others)
        self.size = len(self.others) + 1
        self.reduce_with = reduce_with
        self.main_value = main_value
        self.aborted = None

    def allgather(self, value):
        gathered = list(self.others)
        gathered.insert(self.rank, value)
        return gathered

    def bcast(self, value):
        return value if self.rank == 0 else self.main_value

    def allreduce(self, values, op):
        rows = np.vstack([values, *self.reduce_with])
        return {"sum": rows.sum, "max": rows.max, "min": rows.min}[op](axis=0)

    def abort(self, code):
        self.aborted = code
        raise SystemExit(code)


def dist_for(transport):
    records = [RankRecord(r, "h", 0, r, transport.size) for r in range(transport.size)]
    return Dist(build_topology(transport.rank, records), transport)


def fail(text):
    raise UserError(text)


def test_agree_returns_the_result_when_no_rank_failed():
    assert agree_on(PeersTransport(0, [None, None]), lambda: 42) == 42


def test_the_same_error_on_every_rank_is_one_line():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(0, [("error", "bad flag")]), lambda: fail("bad flag"))
    assert caught.value.message == "error: bad flag" and caught.value.exit_code == 2


def test_an_error_on_one_rank_stops_the_ranks_that_succeeded_too():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(0, [None, ("error", "no data on host b")]), lambda: 1)
    assert caught.value.message == "error on rank 2: no data on host b"


def test_different_errors_are_listed_by_rank():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(1, [("error", "a")]), lambda: fail("b"))
    assert caught.value.message.splitlines() == ["error on rank 0: a", "error on rank 1: b"]


def test_help_anywhere_ends_every_rank_with_status_zero_on_stdout():
    def ask_help():
        raise HelpRequested("usage: ...")

    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(0, [("help", "usage: ...")]), ask_help)
    assert (caught.value.exit_code, caught.value.to_stdout, caught.value.message) == (0, True, "usage: ...")


def test_a_crash_is_not_agreed_on_it_propagates():
    with pytest.raises(ZeroDivisionError):
        agree_on(PeersTransport(0, [None]), lambda: 1 / 0)


def test_a_collective_inside_an_attempt_is_refused():
    dist = solo_dist()
    with pytest.raises(AssertionError, match="allgather called inside a agree attempt"):
        dist.agree(lambda: dist.allgather(1))
    with pytest.raises(AssertionError, match="barrier called inside a from_main attempt"):
        dist.from_main(dist.barrier)
    assert dist.agree(lambda: 3) == 3  # the scope is released after a refusal


def test_from_main_returns_rank_0s_result_everywhere():
    assert solo_dist().from_main(lambda: "run-1") == "run-1"
    follower = dist_for(PeersTransport(1, [None], main_value=(True, "run-1")))
    assert follower.from_main(lambda: pytest.fail("only rank 0 runs the attempt")) == "run-1"


def test_from_main_user_error_is_raised_on_every_rank():
    with pytest.raises(AgreedError, match="^error: disk full$"):
        solo_dist().from_main(lambda: fail("disk full"))
    follower = dist_for(PeersTransport(1, [None], main_value=(False, "disk full")))
    with pytest.raises(AgreedError, match="^error: disk full$"):
        follower.from_main(lambda: None)


def test_reductions():
    dist = dist_for(PeersTransport(0, [None, None], reduce_with=[[3.0, 1.0], [5.0, -1.0]]))
    assert dist.reduce([1.0, 0.0], "sum") == [9.0, 0.0]
    assert dist.reduce([1.0, 0.0], "max") == [5.0, 1.0]
    assert dist.reduce([1.0, 0.0], "min") == [1.0, -1.0]
    assert dist.reduce([1.0, 0.0], "mean") == [3.0, 0.0]


def test_stop_agreement_takes_any_ranks_signal():
    # The per-step reduction carries (signal, save due): one call for both.
    assert dist_for(PeersTransport(0, [None], reduce_with=[[10, 0, MARK]])).agree_stop(0) == 10
    assert dist_for(PeersTransport(0, [None], reduce_with=[[0, 0, MARK]])).agree_stop(0) == 0


def test_the_step_agreement_carries_a_snapshot_request_in_the_same_reduction():
    assert dist_for(PeersTransport(1, [None], reduce_with=[[0, 1, MARK]])).agree_step(0, False) == (0, True)
    assert dist_for(PeersTransport(0, [None], reduce_with=[[15, 0, MARK]])).agree_step(0, True) == (15, True)
    assert dist_for(PeersTransport(0, [None], reduce_with=[[0, 0, MARK]])).agree_step(0, False) == (0, False)


def test_a_step_agreement_without_its_mark_is_not_trusted():
    """Under ULFM a reduction cut short by a peer's failure returned another collective's numbers on a survivor
    (they asked for a save): without every rank's mark the result is an error, which in-job recovery tells as
    the peer's failure."""
    transport = PeersTransport(0, [None], reduce_with=[[0, 1, 0]])
    transport.allreduce = lambda values, op: np.array([37.0, 16.0, 2.5])  # a metric reduction's sums, say
    with pytest.raises(RuntimeError, match="the stop agreement returned numbers that are not its own"):
        dist_for(transport).agree_step(0, False)


def test_gather_reaches_rank_0_only():
    assert solo_dist().gather("x") == ["x"]
    assert dist_for(PeersTransport(1, ["a"])).gather("b") is None


def test_solo_dist_is_a_world_of_one():
    dist = solo_dist("box")
    assert (dist.rank, dist.world_size, dist.is_main, dist.label) == (0, 1, True, "rank 0/1 on box")
    assert dist.allgather({"a": 1}) == [{"a": 1}]
    assert str(dist.device) == "cpu"


def host_fault(text):
    from mpiddp.errors import HostFault

    raise HostFault(text)


def test_a_host_fault_on_some_hosts_is_a_crash_that_names_the_faulty_ranks():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(1, [None, ("host", "b runs 2 ranks but has 1 GPUs"), None]),
                 lambda: host_fault("b runs 2 ranks but has 1 GPUs"))
    assert caught.value.exit_code == 1 and caught.value.faulty_ranks == (1, 2)
    assert caught.value.message.splitlines()[0] == "error: b runs 2 ranks but has 1 GPUs"  # once, not per rank
    assert "leave this host out" in caught.value.message


def test_a_host_fault_on_every_host_is_a_user_error():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(0, [("host", "no GPU on b")]), lambda: host_fault("no GPU on a"))
    assert caught.value.exit_code == 2 and caught.value.faulty_ranks == ()


def test_a_host_fault_beside_a_user_error_is_a_user_error():
    with pytest.raises(AgreedError) as caught:
        agree_on(PeersTransport(0, [("error", "bad flag"), None]), lambda: host_fault("no GPU on a"))
    assert caught.value.exit_code == 2 and caught.value.faulty_ranks == ()


def test_mpi_transport_knows_failed_peers_only_through_the_query_installed_above_it(monkeypatch):
    """The job layer calls none of MPI's fault tolerance itself: without the elastic layer's query MPI knows of no
    failed peer here; with it, the query answers for the transport's own communicator."""
    from types import SimpleNamespace

    from mpiddp.job import collective

    transport = SimpleNamespace(comm="the job's communicator")
    monkeypatch.setattr(collective, "_failed_ranks_query", None)
    assert collective.MpiTransport.failed_ranks(transport) == ()
    asked = []
    collective.set_failed_ranks_query(lambda comm: asked.append(comm) or (1, 3))
    assert collective.MpiTransport.failed_ranks(transport) == (1, 3)
    assert asked == ["the job's communicator"]
