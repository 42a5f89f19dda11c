"""FailFast's decisions, in-process: who prints what, with which exit status, and when the job is aborted."""

import pytest

from mpiddp.errors import AgreedError, UserError
from mpiddp.job.collective import Dist, SoloTransport
from mpiddp.job.failfast import EXIT_CRASH, EXIT_INTERRUPTED, EXIT_USER_ERROR, FailFast
from mpiddp.job.topology import LauncherMismatch, RankRecord, build_topology


class RecordingTransport(SoloTransport):
    def __init__(self, rank, size):
        self.rank, self.size, self.aborted = rank, size, None

    def abort(self, code):
        self.aborted = code
        raise SystemExit(code)


def guard_for(rank=0, size=2, claim=None):
    guard = FailFast()
    records = [RankRecord(r, "node", 0, r, size) for r in range(size)]
    guard.dist = Dist(build_topology(rank, records), RecordingTransport(rank, size))
    guard.claim_report = claim
    return guard


def test_agreed_error_is_printed_by_rank_0_only():
    error = AgreedError("error: bad flag")
    assert guard_for(0).decide(error) == (2, "mpiddp: error: bad flag")
    assert guard_for(1).decide(error) == (2, "")
    assert guard_for(0).decide(AgreedError("usage: x", 0, to_stdout=True)) == (0, "usage: x")


def test_launcher_mismatch_is_explained_by_the_launchers_rank_0():
    assert guard_for(0, 1).decide(LauncherMismatch("wrong mpirun", 0)) == (EXIT_USER_ERROR, "mpiddp: error: wrong mpirun")
    assert guard_for(0, 1).decide(LauncherMismatch("wrong mpirun", 3)) == (EXIT_USER_ERROR, "")


def test_a_user_error_on_one_rank_names_the_rank():
    code, text = guard_for(1).decide(UserError("no such file"))
    assert code == EXIT_USER_ERROR and text == "mpiddp: error on rank 1/2 on node: no such file"


@pytest.mark.parametrize("status, expected", [(0, EXIT_CRASH), (None, EXIT_CRASH), (1, 1), (7, 7)])
def test_an_early_exit_ends_the_job_even_with_status_0(status, expected):
    code, text = guard_for(1).decide(SystemExit(status))
    assert code == expected and f"exited early (status {status})" in text


def test_interrupt():
    assert guard_for(0).decide(KeyboardInterrupt())[0] == EXIT_INTERRUPTED


def test_first_failing_rank_prints_the_traceback_later_ones_one_line():
    claims = iter([True, False])
    guard = guard_for(1, claim=lambda: next(claims))
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        first = guard.decide(exc)
        second = guard.decide(exc)
    assert first[0] == EXIT_CRASH and "Traceback" in first[1] and "RuntimeError: boom" in first[1]
    assert second == (EXIT_CRASH, "mpiddp: rank 1/2 on node also failed: RuntimeError: boom")


def test_a_dead_store_means_another_rank_failed_first():
    def dead():
        raise ConnectionError("store gone")

    assert "also failed" in guard_for(1, claim=dead).decide(RuntimeError("x"))[1]


def test_a_crash_aborts_the_whole_job_an_agreed_error_does_not(capsys):
    crashing = guard_for(1)
    with pytest.raises(SystemExit) as caught:
        with crashing:
            raise RuntimeError("boom")
    assert caught.value.code == EXIT_CRASH and crashing.dist.transport.aborted == EXIT_CRASH
    agreed = guard_for(0)
    with pytest.raises(SystemExit) as caught:
        with agreed:
            raise AgreedError("error: bad flag")
    assert caught.value.code == EXIT_USER_ERROR and agreed.dist.transport.aborted is None
    assert capsys.readouterr().err.endswith("mpiddp: error: bad flag\n")


def test_before_mpi_is_up_the_failure_is_still_reported():
    guard = FailFast()
    code, text = guard.decide(UserError("mpi4py missing"))
    assert code == EXIT_USER_ERROR and "error on rank 0 on" in text


def test_once_a_rank_recorded_the_end_of_the_job_no_survivor_recovers_or_records_anything(tmp_path):
    """A rank that leaves on purpose (its record: a fatal failure, the hang fallback, a stop) is never recovered
    from: the survivor leaves with the decided status and writes no record of its own (the deciding one stands)."""
    from mpiddp.errors import EndDecided
    from mpiddp.failure import FailureRecord, read_all, write_rank
    from mpiddp.elastic.survivors import unless_end_decided

    unless_end_decided(tmp_path, [0])  # nothing recorded: a peer that died (SIGKILL) is recovered from
    write_rank(tmp_path, 0, FailureRecord("hang", [1], ["nodeb"], "no progress for 8 s", rank=0, status=4))
    with pytest.raises(EndDecided) as decided:
        unless_end_decided(tmp_path, [0])
    assert decided.value.status == 4 and "rank 0 recorded the end of the job (hang" in str(decided.value)
    guard = FailFast()
    assert guard.record(decided.value, 4) is None
    assert guard.decide(decided.value)[0] == 4
    assert [r.rank for r in read_all(tmp_path)] == [0]
