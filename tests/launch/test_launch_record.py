"""The failure records, in-process: every failing rank writes RUN_DIR/failures/rank-N.json; the supervisor reads them all."""

import json
import signal
import threading

import pytest

from mpiddp.errors import AgreedError, UserError
from mpiddp.failure import FAILURES_DIR, FailureRecord, read, read_all, rank_path, write_first
from mpiddp.job.collective import Dist, SoloTransport
from mpiddp.job.failfast import EXIT_CRASH, EXIT_USER_ERROR, FailFast
from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.job.watchdog import Watchdog, ranks_behind


class RecordingTransport(SoloTransport):
    def __init__(self, rank, size):
        self.rank, self.size, self.aborted = rank, size, None

    def abort(self, code):
        self.aborted = code
        raise SystemExit(code)


def guard_for(rank, size=2, failure_file=""):
    import dataclasses

    guard = FailFast()
    records = [RankRecord(r, f"host{r}", r, 0, 1) for r in range(size)]
    topo = dataclasses.replace(build_topology(rank, records), failure_file=failure_file)
    guard.dist = Dist(topo, RecordingTransport(rank, size))
    return guard


def fail(guard, exc):
    with pytest.raises(SystemExit) as caught:
        with guard:
            raise exc
    return caught.value.code


def test_an_exception_on_rank_1_records_rank_1_and_its_host(tmp_path, capsys):
    guard = guard_for(1)
    guard.set_run_dir(tmp_path)
    guard.progress = lambda: (17, True)  # the loop's last completed step
    assert fail(guard, RuntimeError("boom")) == EXIT_CRASH
    record = json.loads(rank_path(tmp_path / FAILURES_DIR, 1).read_text())
    assert record["kind"] == "exception" and record["ranks"] == [1] and record["hosts"] == ["host1"]
    assert record["message"] == "RuntimeError: boom" and record["time"] > 0
    assert (record["step"], record["rank"], record["status"], record["progressed"]) == (17, 1, EXIT_CRASH, True)
    assert set(record) == {"kind", "ranks", "hosts", "message", "step", "time", "rank", "status", "progressed"}


def test_a_user_error_records_user_error(tmp_path, capsys):
    guard = guard_for(1)
    guard.set_run_dir(tmp_path)
    assert fail(guard, UserError("no such file")) == EXIT_USER_ERROR
    (record,) = read_all(tmp_path / FAILURES_DIR)
    assert record == FailureRecord("user_error", [1], ["host1"], "no such file", time=record.time, rank=1,
                                   status=EXIT_USER_ERROR, progressed=False)


def test_an_agreed_error_is_recorded_once_by_rank_0_and_blames_no_host(tmp_path, capsys):
    for rank in (1, 0):
        guard = guard_for(rank)
        guard.set_run_dir(tmp_path / f"r{rank}")
        (tmp_path / f"r{rank}").mkdir()
        assert fail(guard, AgreedError("error: bad flag")) == EXIT_USER_ERROR
    assert read_all(tmp_path / "r1" / FAILURES_DIR) == []
    (record,) = read_all(tmp_path / "r0" / FAILURES_DIR)
    assert (record.kind, record.ranks, record.hosts) == ("user_error", [], [])
    help_guard = guard_for(0)
    help_guard.set_run_dir(tmp_path)
    assert fail(help_guard, AgreedError("usage: ...", 0, to_stdout=True)) == 0
    assert not (tmp_path / FAILURES_DIR).exists()


def test_the_supervisors_directory_wins_and_no_run_dir_means_no_record(tmp_path, capsys):
    named = tmp_path / "elsewhere"
    guard = guard_for(0, failure_file=str(named))
    guard.set_run_dir(tmp_path)
    fail(guard, KeyboardInterrupt())
    assert read(rank_path(named, 0)).kind == "stopped" and not (tmp_path / FAILURES_DIR).exists()
    fail(guard_for(0), RuntimeError("nowhere to write"))  # no run dir yet, not supervised: nothing, no error
    assert [p.name for p in tmp_path.iterdir()] == ["elsewhere"]


def test_a_ranks_first_record_stays_even_when_it_races_itself(tmp_path):
    path = tmp_path / "rank-0.json"
    results = []
    threads = [threading.Thread(target=lambda r=r: results.append(write_first(path, FailureRecord("exception", [r], [f"h{r}"], "x"))))
               for r in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(results) == [False] * 7 + [True]
    winner = read(path)
    assert winner.hosts == [f"h{winner.ranks[0]}"]
    assert [p.name for p in tmp_path.iterdir()] == ["rank-0.json"]  # no temporary file left
    assert not write_first(tmp_path / "rank-0.json" / "x", winner)  # a file where the directory should be: never raises
    assert read(tmp_path / "absent.json") is None


def test_the_hang_record_names_the_ranks_behind_and_their_hosts(tmp_path):
    progress = {0: {"step": 5, "phase": "train", "idle_s": 9}, 1: {"step": 4, "phase": "train", "idle_s": 9},
                2: {"step": 5, "phase": "train", "idle_s": 9}}
    assert ranks_behind(progress, 3) == [1]
    assert ranks_behind({0: progress[0]}, 3) == [1, 2]  # never reported: behind everyone
    fresh, stale = {**progress[0], "tick": 40}, {**progress[0], "tick": 12}
    assert ranks_behind({0: fresh, 1: stale, 2: fresh}, 3, quiet_since=30) == [1]  # its watchdog went quiet
    assert ranks_behind({0: fresh, 1: fresh}, 2, quiet_since=30) == [0, 1]
    watchdog = Watchdog(10, 0, 3, "rank 0/3 on a", None, lambda code: None, {0: "a", 1: "b", 2: "c"},
                        tmp_path / FAILURES_DIR)
    watchdog._record(progress, ranks_behind(progress, 3))
    (record,) = read_all(tmp_path / FAILURES_DIR)
    assert (record.kind, record.ranks, record.hosts, record.step, record.rank) == ("hang", [1], ["b"], 4, 0)
    everyone = Watchdog(10, 0, 2, "rank 0/2 on a", None, lambda code: None, {0: "a", 1: "b"}, tmp_path / "all")
    everyone._record({0: progress[0], 1: progress[0]}, [0, 1])
    (everyone_record,) = read_all(tmp_path / "all")  # all stuck at one step: no host stands out, no rank blamed
    assert (everyone_record.ranks, everyone_record.hosts) == ([], [])
    assert "rank(s) 0, 1" in everyone_record.message


def test_the_summary_learns_the_steps_lost_of_the_failure_before_it(tmp_path):
    from mpiddp.failure import read_attempts

    assert read_attempts(tmp_path, 22) is None
    (tmp_path / "attempts.json").write_text(json.dumps(
        {"restarts": 1, "attempts": [{"status": 137, "cause": "killed", "failed_at_step": 29, "steps_lost": None}]}))
    attempt = read_attempts(tmp_path, 22)["attempts"][0]
    assert (attempt["resumed_at_step"], attempt["steps_lost"]) == (22, 7)


def test_the_supervisor_finds_where_the_next_attempt_resumed(tmp_path):
    from mpiddp.failure import read_metrics
    from mpiddp.launch.supervisor import Attempt, Plan, Supervisor, last_logged_step, start_step

    lines = [{"kind": "start", "step": 0, "time": 1.0}, {"kind": "step", "step": 29, "time": 2.0},
             {"kind": "start", "step": 22, "time": 11.0}, {"kind": "step", "step": 40, "time": 12.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines) + "{torn")
    records = read_metrics(tmp_path)
    assert last_logged_step(records) == 40 and start_step(records, 10.0) == 22 and start_step(records, 20.0) is None
    supervisor = Supervisor(Plan("train", [], tmp_path, 2, [], [], 3, "mpirun", "mpirun", "openmpi"), env={})
    supervisor.attempts = [Attempt(0, [], [], 0.5, failed_at_step=29), Attempt(1, [], [], 10.0)]
    supervisor._count_steps_lost(records)
    assert (supervisor.attempts[0].resumed_at_step, supervisor.attempts[0].steps_lost) == (22, 7)


class DictStore:
    """The few TCPStore calls the watchdog makes, in memory."""

    def __init__(self):
        self.data, self.counters = {}, {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key, amount):
        self.counters[key] = self.counters.get(key, 0) + amount
        return self.counters[key]

    def check(self, keys):
        return all(k in self.data for k in keys)

    def get(self, key):
        return self.data[key]

    def multi_get(self, keys):
        return [self.data[k] for k in keys]


@pytest.mark.parametrize("rank_1_answers", [True, False])
def test_a_hang_leaves_one_file_with_the_ranks_behind_and_every_ranks_stacks(tmp_path, monkeypatch, capsys,
                                                                              rank_1_answers):
    import mpiddp.job.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "GRACE_S", 0.1)
    store = DictStore()
    store.set("mpiddp/progress/0", json.dumps({"step": 5, "phase": "train", "idle_s": 9}))
    store.set("mpiddp/progress/1", json.dumps({"step": 4, "phase": "train", "idle_s": 12}))
    if rank_1_answers:  # its watchdog fired too (a stall); a SIGSTOPped rank gives nothing
        store.set("mpiddp/stacks/1", "rank 1/2 on hostb\nThread 0x1 (most recent call first):\n  File \"x.py\", line 1 in stuck_here\n")
    aborted = []
    watchdog = Watchdog(0.1, 0, 2, "rank 0/2 on hosta", store, aborted.append, {0: "hosta", 1: "hostb"},
                        tmp_path / FAILURES_DIR, tmp_path)
    watchdog._fire()
    assert aborted == [4]
    (hang_file,) = tmp_path.glob("hang-*.txt")
    text = hang_file.read_text()
    assert "ranks behind: 1 on hostb" in text
    assert "==== Python stacks of rank 0/2 on hosta" in text and "in _fire" in text  # this rank's own stacks
    if rank_1_answers:
        assert "==== Python stacks of rank 1/2 on hostb" in text and "stuck_here" in text
    else:
        assert "==== rank 1 on hostb: no stacks" in text
    (record,) = read_all(tmp_path / FAILURES_DIR)
    assert (record.kind, record.ranks, record.hosts) == ("hang", [1], ["hostb"]) and hang_file.name in record.message
    assert f"hang report with every rank's stacks: {hang_file}" in capsys.readouterr().err


def test_a_new_job_clears_an_earlier_jobs_record(tmp_path):
    from mpiddp.failure import clear_stale, read_placement, write_placement, write_rank

    old = FailureRecord("exception", [1], ["nodeb"], "an earlier job's crash")
    assert write_rank(tmp_path / FAILURES_DIR, 1, old)
    assert write_placement(tmp_path / FAILURES_DIR, [("nodea", [0]), ("nodeb", [1])])
    clear_stale(tmp_path)
    clear_stale(tmp_path)  # nothing there: fine
    assert read_placement(tmp_path / FAILURES_DIR) is None
    new = FailureRecord("hang", [0], ["nodea"], "this job's hang")
    assert write_rank(tmp_path / FAILURES_DIR, 1, new)  # without the clear, the earlier record would stay
    assert [r.message for r in read_all(tmp_path / FAILURES_DIR)] == ["this job's hang"]


def test_a_host_fault_is_recorded_by_rank_0_with_the_faulty_hosts_so_launch_leaves_them_out(tmp_path, capsys):
    from mpiddp.launch.diagnose import diagnose
    from mpiddp.launch.hosts import Host
    from mpiddp.launch.policy import decide

    for rank in (1, 0):
        guard = guard_for(rank, size=3)
        guard.set_run_dir(tmp_path / f"r{rank}")
        (tmp_path / f"r{rank}").mkdir()
        error = AgreedError("error: host1 runs 1 ranks but has 0 GPUs", EXIT_CRASH, faulty_ranks=(1,))
        assert fail(guard, error) == EXIT_CRASH
    assert read_all(tmp_path / "r1" / FAILURES_DIR) == []
    (record,) = read_all(tmp_path / "r0" / FAILURES_DIR)
    assert (record.kind, record.ranks, record.hosts) == ("host_fault", [1], ["host1"])
    hosts = [Host("host0", 1), Host("host1", 1), Host("host2", 1), Host("host3", 1)]
    decision = decide(diagnose(EXIT_CRASH, record, ""), hosts, [], 0, 3, 3, hosts[:3])
    assert decision.retry and decision.excluded == ["host1"]
    assert [h.name for h in decision.hosts] == ["host0", "host2", "host3"]


def test_a_quiet_watchdog_is_judged_by_the_stores_counter_not_by_clocks_of_other_hosts(tmp_path, monkeypatch, capsys):
    import mpiddp.job.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "GRACE_S", 0.1)
    store = DictStore()
    hosts = {0: "hosta", 1: "hostb", 2: "hostc"}
    watchdogs = [Watchdog(60, rank, 3, f"rank {rank}/3", store, lambda code: None, hosts, tmp_path / FAILURES_DIR,
                          tmp_path) for rank in range(3)]
    for rank in range(3):
        watchdogs[rank].beat("train", 7)
        watchdogs[rank]._publish()
    for _ in range(watchdog_module.STALE_INTERVALS + 1):  # rank 1 stopped (SIGSTOP): its watchdog went quiet
        watchdogs[0]._publish()
        watchdogs[2]._publish()
    watchdogs[0]._fire()  # every rank is at step 7: only the quiet one is behind
    (record,) = read_all(tmp_path / FAILURES_DIR)
    assert (record.ranks, record.hosts) == ([1], ["hostb"])


def write_metrics(run_dir, records):
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


# attempt 0 runs from t=0, logs step 29 at t=50 and its launcher exits at t=53; attempt 1 is launched at t=54,
# its first rank starts at 55, rendezvous at 60, restores at 63 and finishes its first step at 64.
RELAUNCH = [{"kind": "start", "step": 0, "time": 1.0, "process_started_at": 0.5, "rendezvous_at": 0.8,
             "restored_at": 0.9},
            {"kind": "first_step", "step": 1, "time": 2.0}, {"kind": "step", "step": 29, "time": 50.0},
            {"kind": "start", "step": 22, "time": 63.5, "process_started_at": 55.0, "rendezvous_at": 60.0,
             "restored_at": 63.0},
            {"kind": "first_step", "step": 23, "time": 64.0}, {"kind": "step", "step": 30, "time": 70.0}]
PHASES = {"detection": 3.0, "relaunch": 1.0, "launcher": 1.0, "startup": 5.0, "restore": 3.0, "first_step": 1.0}


def test_the_downtime_runs_from_the_last_good_step_to_the_relaunched_jobs_first_step(tmp_path):
    from mpiddp.failure import DOWNTIME_PHASES, downtime, last_progress_at, read_metrics
    from mpiddp.launch.supervisor import Attempt, Plan, Supervisor

    write_metrics(tmp_path, RELAUNCH)
    records = read_metrics(tmp_path)
    assert last_progress_at(records, 0.0, 53.0) == 50.0 and last_progress_at(records, 0.0, 0.95) is None
    assert downtime(50.0, 53.0, 54.0, records) == (14.0, PHASES) and tuple(PHASES) == DOWNTIME_PHASES
    assert downtime(50.0, 53.0, 80.0, records) == (None, {})  # the relaunched job has not started yet
    assert downtime(None, 53.0, 54.0, records) == (None, {})
    supervisor = Supervisor(Plan("train", [], tmp_path, 2, [], [], 3, "mpirun", "mpirun", "openmpi"), env={})
    supervisor.attempts = [Attempt(0, [], [], 0.0, ended_at=53.0, failed_at_step=29, last_step_at=50.0),
                           Attempt(1, [], [], 54.0)]
    supervisor._count_steps_lost(records)
    first = supervisor.attempts[0]
    assert (first.steps_lost, first.downtime_s, first.downtime_phases) == (7, 14.0, PHASES)
    assert sum(first.downtime_phases.values()) == pytest.approx(first.downtime_s)


def test_the_summary_lists_the_attempts_before_this_job_with_their_downtime(tmp_path):
    from mpiddp.failure import read_attempts
    from mpiddp.launch.supervisor import Attempt, write_attempts

    write_metrics(tmp_path, RELAUNCH)
    failed = Attempt(0, ["a", "b"], [], 0.0, ended_at=53.0, status=137, cause="killed", failed_at_step=29,
                     excluded_hosts=["b"], last_step_at=50.0)
    write_attempts(tmp_path / "attempts.json", [failed])
    assert read_attempts(tmp_path, 22)["attempts"][0]["downtime_s"] is None  # no relaunch listed: unknown
    write_attempts(tmp_path / "attempts.json", [failed, Attempt(1, ["a", "c"], [], 54.0, excluded_hosts=["b"])])
    data = read_attempts(tmp_path, 22)
    assert data["restarts"] == 1 and data["excluded_hosts"] == ["b"]
    (attempt,) = data["attempts"]  # this job's own entry (no status yet) is not among them
    assert (attempt["steps_lost"], attempt["downtime_s"], attempt["downtime_phases"]) == (7, 14.0, PHASES)
    write_attempts(tmp_path / "attempts.json", [Attempt(0, ["a", "b"], [], 0.0)])
    assert read_attempts(tmp_path, 0) is None  # the first attempt: nothing before it


def test_report_shows_one_line_per_attempt(tmp_path, capsys, monkeypatch):
    from mpiddp.tools import report

    monkeypatch.setattr(report, "plot", lambda records, out_dir: [])  # the text is under test, not the plots
    write_metrics(tmp_path, RELAUNCH)
    attempts = {"restarts": 1, "excluded_hosts": ["nodeb"], "attempts": [
        {"number": 0, "hosts": ["nodea", "nodeb"], "status": 137, "cause": "killed", "failed_ranks": [1],
         "failed_hosts": ["nodeb"], "failed_at_step": 29, "steps_lost": 7, "downtime_s": 14.0,
         "downtime_phases": dict(sorted(PHASES.items()))},  # summary.json sorts keys: report puts them in order
        {"number": 1, "hosts": ["nodea", "nodec"], "status": 0, "cause": None}]}
    # summary.json's copy (the failed attempts) when attempts.json is gone; attempts.json (all of them) wins
    (tmp_path / "summary.json").write_text(json.dumps({"attempts": {**attempts, "attempts": attempts["attempts"][:1]}}))
    monkeypatch.setattr(report, "text_summary", lambda records, summary: "")
    assert report.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "launch: 1 restart; hosts left out: nodeb" in out
    assert ("attempt 0 on nodea, nodeb: killed (exit status 137; rank 1 on nodeb) at step 29, 7 steps lost, "
            "down 14.0 s (detection 3.0, relaunch 1.0, launcher 1.0, startup 5.0, restore 3.0, first step 1.0)") in out
    assert "attempt 1" not in out
    (tmp_path / "attempts.json").write_text(json.dumps(attempts))
    assert report.main([str(tmp_path)]) == 0
    assert "  attempt 1 on nodea, nodec: finished" in capsys.readouterr().out
    attempts["attempts"][1]["num_ranks"] = 1  # a shrink (--min-np) shows its rank count
    assert "  attempt 1 on nodea, nodec (1 rank): finished" in report.attempt_lines(attempts)
    attempts["attempts"][0].update(failed_ranks=[], failed_hosts=[], downtime_s=None, ranks_recorded=2)
    assert "killed (exit status 137; no host blamed; 2 ranks recorded) at step 29, 7 steps lost\n" in "\n".join(
        report.attempt_lines(attempts)) + "\n"


def test_the_supervisor_reads_metrics_once_per_failed_attempt(tmp_path, monkeypatch):
    """metrics.jsonl grows with the run: each failure reads it once, for its step, its last progress, the steps
    lost and the downtime alike."""
    from mpiddp import failure
    from mpiddp.launch import supervisor as supervisor_module
    from mpiddp.launch.supervisor import Attempt, Plan, Supervisor

    write_metrics(tmp_path, RELAUNCH)
    reads = []
    real_read = failure.read_metrics
    monkeypatch.setattr(failure, "read_metrics", lambda run_dir: reads.append(run_dir) or real_read(run_dir))
    supervisor = Supervisor(Plan("train", [], tmp_path, 2, [], [], 2, "mpirun", "mpirun", "openmpi"), env={})

    def attempt(number, hosts, excluded):  # a launcher that failed with no record: each failure's step is read
        ran = Attempt(number, [], [], 54.0 * number, ended_at=54.0 * number + 53.0, status=1)
        supervisor.attempts.append(ran)
        return ran, ""

    monkeypatch.setattr(supervisor, "_attempt", attempt)
    monkeypatch.setattr(supervisor_module, "say", lambda text: None)
    handlers = {signum: signal.getsignal(signum) for signum in (*supervisor_module.FORWARDED, signal.SIGHUP)}
    try:
        assert supervisor.run() == 1
    finally:  # run() installs the supervisor's own signal handlers: this test process gets its own back
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert len(supervisor.attempts) == 3 and len(reads) == 3
    assert supervisor.attempts[0].failed_at_step == 30 and supervisor.attempts[0].last_step_at == 50.0
