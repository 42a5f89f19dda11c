"""Blame only from evidence, in-process: every rank's record, the recorded placement, the launcher's evidence lines,
the phase of a stuck step, and the order of the two timeouts."""

from mpiddp.failure import FAILURES_DIR, FailureRecord, read_all, read_placement, write_placement, write_rank
from mpiddp.launch.diagnose import OutputKeeper, diagnose, unreachable
from mpiddp.launch.hosts import Host
from mpiddp.launch.policy import decide
from mpiddp.launch.supervisor import OUTPUT_TAIL_LINES, placement_of

THREE = [Host("nodea", 1), Host("nodeb", 1), Host("nodec", 1)]
TWO_RANKS = {0: "nodea", 1: "nodeb"}


def raised(rank, host, step=3, message=None, progressed=True, kind="exception", status=1):
    return FailureRecord(kind, [rank], [host], message or f"RuntimeError: injected fault on rank {rank} at step {step}",
                         step=step, rank=rank, status=status, progressed=progressed)


def test_the_same_crash_on_every_rank_blames_no_host(tmp_path):
    # both ranks' records are kept (the first writer no longer hides the other) and read together
    for rank, host in TWO_RANKS.items():
        assert write_rank(tmp_path / FAILURES_DIR, rank, raised(rank, host))
    records = read_all(tmp_path / FAILURES_DIR)
    assert sorted(r.rank for r in records) == [0, 1]
    failure = diagnose(1, records, "", 2, TWO_RANKS)
    assert (failure.kind, failure.ranks, failure.hosts, failure.recorded, failure.step) == ("exception", (), (), 2, 3)
    assert "the same on every rank: no host to blame" in failure.message
    decision = decide(failure, THREE, [], 0, 3, 2, THREE[:2], placement=TWO_RANKS)
    assert decision.retry and decision.excluded == [] and "no host to blame" in decision.reason
    # one rank's record alone (its peer died in the abort before writing): that host, as before
    alone = diagnose(1, records[:1], "", 2, TWO_RANKS)
    assert alone.ranks == (records[0].rank,) and len(alone.hosts) == 1


def test_the_same_crash_on_every_host_blames_none_even_when_some_ranks_did_not_record():
    placement = {0: "nodea", 1: "nodea", 2: "nodeb", 3: "nodeb"}
    records = [raised(0, "nodea"), raised(3, "nodeb")]
    failure = diagnose(1, records, "", 4, placement)
    assert (failure.ranks, failure.hosts) == ((), ()) and "every host" in failure.message
    other = diagnose(1, [raised(0, "nodea"), raised(3, "nodeb", message="ValueError: nan loss")], "", 4, placement)
    assert (other.ranks, other.hosts) == ((0,), ("nodea",))  # different failures: the oldest one, its host


def test_a_rank_that_timed_out_waiting_is_a_witness_and_the_hang_record_names_the_culprit():
    gloo = FailureRecord("exception", [0], ["nodea"], "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] "
                         "Timed out waiting 8000ms for recv operation to complete", step=40, rank=0)
    alone = diagnose(1, [gloo], "", 2, TWO_RANKS)
    assert (alone.ranks, alone.hosts, alone.witnesses) == ((), (), (0,))  # the healthy rank 0 is never blamed
    assert decide(alone, THREE, [], 0, 3, 2, THREE[:2], placement=TWO_RANKS).excluded == []
    hang = FailureRecord("hang", [1], ["nodeb"], "no progress for 8 s on rank(s) 1", step=40, rank=0)
    both = diagnose(4, [gloo, hang], "", 2, TWO_RANKS)
    assert (both.kind, both.ranks, both.hosts) == ("hang", (1,), ("nodeb",))
    assert decide(both, THREE, [], 0, 3, 2, THREE[:2], placement=TWO_RANKS).excluded == ["nodeb"]


def test_the_collective_timeout_is_raised_above_the_hang_timeout():
    from mpiddp.trainer.config import parse_args

    cfg, note = parse_args(["--hang-timeout", "8", "--collective-timeout", "8"]).ordered_timeouts()
    assert cfg.dist.collective_timeout_s >= 8 + 30 and "raised to" in note
    kept, nothing = parse_args(["--hang-timeout", "8", "--collective-timeout", "100"]).ordered_timeouts()
    assert kept.dist.collective_timeout_s == 100 and nothing == ""
    off, nothing = parse_args(["--hang-timeout", "0", "--collective-timeout", "5"]).ordered_timeouts()
    assert off.dist.collective_timeout_s == 5 and nothing == ""
    default, _ = parse_args([]).ordered_timeouts()
    assert default.dist.collective_timeout_s > default.dist.hang_timeout_s


def test_the_rank_that_never_reached_the_collective_is_behind():
    from mpiddp.job.watchdog import ranks_behind

    # every rank shows step 12; rank 2 is stuck in its loader while the others wait in the all-reduce
    progress = {0: {"step": 12, "phase": "communication"}, 1: {"step": 12, "phase": "communication"},
                2: {"step": 12, "phase": "data"}}
    assert ranks_behind(progress, 3) == [2]
    progress[2]["phase"] = "compute"  # a wedged GPU: it never got its gradients ready
    assert ranks_behind(progress, 3) == [2]
    progress[2]["phase"] = "communication"  # every rank in the collective: nobody stands out
    assert ranks_behind(progress, 3) == [0, 1, 2]
    progress[0] = {"step": 13, "phase": "train"}  # a lower step is behind whatever its phase
    assert ranks_behind(progress, 3) == [1, 2]


def test_the_watchdog_phase_is_not_progress(tmp_path):
    from mpiddp.job.watchdog import Watchdog

    watchdog = Watchdog(10, 0, 2, "rank 0/2", None, lambda code: None)
    before = watchdog.last_beat
    watchdog.enter("data")
    assert (watchdog.phase, watchdog.last_beat, watchdog.progressed) == ("data", before, False)
    watchdog.beat("train", 5)
    assert watchdog.progressed and watchdog.step == 5


def test_the_recorded_placement_blames_the_right_host(tmp_path):
    # srun spread 6 ranks over two 4-slot hosts as 3+3; slot order would put ranks 0-3 on n1 and 4-5 on n2
    hosts = [Host("n1", 4), Host("n2", 4), Host("n3", 4)]
    assert write_placement(tmp_path, [("n1.cluster", [0, 1, 2]), ("n2.cluster", [3, 4, 5])])
    placement = placement_of(read_placement(tmp_path), hosts[:2], 6)
    assert placement == {0: "n1", 1: "n1", 2: "n1", 3: "n2", 4: "n2", 5: "n2"}
    failure = diagnose(1, [raised(3, "n2.cluster", message="RuntimeError: CUDA error: an illegal memory access")],
                       "", 6, placement)
    decision = decide(failure, hosts, [], 0, 3, 6, hosts[:2], placement=placement)
    assert decision.excluded == ["n2"]  # slot order would have blamed n1
    assert decide(failure, hosts, [], 0, 3, 6, hosts[:2]).excluded == ["n1"]  # the old guess, for contrast
    assert placement_of(None, hosts[:2], 6) == {0: "n1", 1: "n1", 2: "n1", 3: "n1", 4: "n2", 5: "n2"}
    by_address = [Host("10.0.0.1", 4), Host("10.0.0.2", 4)]  # the job's names cannot be matched: slot order
    assert placement_of(read_placement(tmp_path), by_address, 6)[4] == "10.0.0.2"
    assert placement_of(read_placement(tmp_path), [], 6)[4] == "n2.cluster"  # no host list: the job's own names


OPENMPI_UNREACHABLE = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    nodea
  Remote host:   nodeb
  Daemon exit status: 255

This may also be caused by a firewall on the remote host. Please
check that any firewall (e.g., iptables) has been disabled and
try again.
------------------------------------------------------------
ssh: connect to host nodeb port 22: Connection refused
"""  # Open MPI 5.0.11, three fake hosts, the rsh agent refusing nodeb


HYDRA_UNREACHABLE = """ssh: connect to host nodeb port 22: Connection refused
[mpiexec@nodea] ui_cmd_cb (/mpich-5.0.2/src/pm/hydra/mpiexec/pmiserv_pmci.c:51): Launch proxy failed.
[mpiexec@nodea] HYDT_dmxu_poll_wait_for_event (/mpich-5.0.2/src/pm/hydra/lib/tools/demux/demux_poll.c:76): callback \
returned error status
[mpiexec@nodea] main (/mpich-5.0.2/src/pm/hydra/mpiexec/mpiexec.c:270): process manager error waiting for completion
"""  # MPICH 5.0.2's mpiexec, three fake hosts, the ssh agent refusing nodeb (exit status 255)


def test_a_host_the_launcher_cannot_reach_is_blamed():
    assert unreachable(OPENMPI_UNREACHABLE) == ("nodeb",)
    assert unreachable(HYDRA_UNREACHABLE) == ("nodeb",)
    assert unreachable("ssh: Could not resolve hostname gpu9: Name or service not known\n") == ("gpu9",)
    assert unreachable('HYDU_sock_connect (lib/utils/sock.c:110): unable to connect from "nodea" to "nodeb" '
                       '(Connection refused)\n') == ("nodeb",)
    assert unreachable("all good\n") == ()
    failure = diagnose(255, [], OPENMPI_UNREACHABLE, 2, {})
    assert (failure.kind, failure.hosts, failure.source) == ("unreachable", ("nodeb",), "launcher output")
    decision = decide(failure, THREE, [], 0, 3, 2, THREE[:2])
    assert decision.retry and decision.excluded == ["nodeb"] and [h.name for h in decision.hosts] == ["nodea", "nodec"]


OPENMPI_DAEMON_LOST = """--------------------------------------------------------------------------
PRTE has lost communication with a remote daemon.

  HNP daemon   : [prterun-nodea-8007@0,0] on node nodea
  Remote daemon: [prterun-nodea-8007@0,1] on node nodeb

This is usually due to either a failure of the TCP network
connection to the node, or possibly an internal failure of
the daemon itself. We cannot recover from this failure, and
therefore will terminate the job.
--------------------------------------------------------------------------
"""  # Open MPI 5.0.11's mpirun, three fake hosts, nodeb's processes stopped and its link down (exit status 1)


def test_a_host_that_went_silent_while_the_job_ran_is_blamed():
    keeper = OutputKeeper(OUTPUT_TAIL_LINES)
    for line in ["step 1\n"] * 500 + OPENMPI_DAEMON_LOST.splitlines(keepends=True) + ["after\n"] * 500:
        keeper.append(line)
    failure = diagnose(1, [], "".join(keeper), 2, {0: "nodea", 1: "nodeb"})
    assert (failure.kind, failure.hosts, failure.source) == ("unreachable", ("nodeb",), "launcher output")
    assert "lost nodeb while the job ran" in failure.message
    decision = decide(failure, THREE, [], 0, 3, 2, THREE[:2])
    assert decision.retry and decision.excluded == ["nodeb"] and [h.name for h in decision.hosts] == ["nodea", "nodec"]


def test_evidence_lines_are_kept_however_much_output_follows():
    keeper = OutputKeeper(OUTPUT_TAIL_LINES)
    keeper.append("starting\n")
    keeper.append("prterun noticed that process rank 1 with PID 4242 on node nodeb exited on\n")
    keeper.append("signal 9 (Killed).\n")
    for rank in range(1000):
        keeper.append(f"mpiddp: rank {rank + 2}/1002 on nodea also failed: RuntimeError: Connection closed by peer\n")
    text = "".join(keeper)
    assert len(text.splitlines()) <= OUTPUT_TAIL_LINES + 20 and "starting" not in text
    survivor = FailureRecord("exception", [0], ["nodea"], "RuntimeError: [gloo] Connection closed by peer", rank=0)
    failure = diagnose(137, [survivor], text, 1002, {0: "nodea", 1: "nodeb"})
    assert (failure.kind, failure.ranks, failure.hosts) == ("killed", (1,), ("nodeb",))
    assert text.splitlines()[-1].startswith("mpiddp: rank 1001/1002")  # the tail is still there, in order


def test_the_same_exit_on_every_rank_before_any_progress_is_a_user_error():
    records = [raised(r, h, step=None, message="badargs.py exited with status 2", kind="exit", status=2,
                      progressed=False) for r, h in TWO_RANKS.items()]
    failure = diagnose(2, records, "", 2, TWO_RANKS)
    assert (failure.kind, failure.ranks, failure.hosts) == ("user_error", (), ())
    decision = decide(failure, THREE, [], 0, 3, 2, THREE[:2], placement=TWO_RANKS)
    assert not decision.retry and "fix it and launch again" in decision.reason
    later = [FailureRecord(**{**r.__dict__, "progressed": True}) for r in records]  # after training began: retried
    assert diagnose(2, later, "", 2, TWO_RANKS).kind == "exit"
    one = diagnose(2, records[:1], "", 2, TWO_RANKS)  # one rank alone: not the script's error everywhere
    assert one.kind == "exit" and one.hosts == ("nodea",)


def test_a_failing_rank_records_first_and_waits_briefly_for_its_peers_records_before_the_abort(tmp_path, monkeypatch,
                                                                                                capsys):
    import mpiddp.job.failfast as failfast
    from test_launch_record import fail, guard_for

    counts, events = {"failed": 0}, []

    def tally(amount):
        events.append(("tally", amount, rank_files()))
        counts["failed"] += amount
        if amount == 0:  # the peer records its own failure while this rank waits
            counts["failed"] = 2
        return counts["failed"]

    def rank_files():
        return sorted(p.name for p in (tmp_path / FAILURES_DIR).glob("rank-*.json"))

    guard = guard_for(0)
    guard.set_run_dir(tmp_path)
    guard.tally = tally
    assert fail(guard, RuntimeError("boom")) == 1
    assert events[0] == ("tally", 1, ["rank-0.json"])  # its own record is on disk before it counts and waits
    assert events[-1][1] == 0 and guard.dist.transport.aborted == 1  # every rank recorded: then the abort
    monkeypatch.setattr(failfast, "PEER_RECORDS_WAIT_S", 0.2)
    alone = guard_for(1)
    alone.set_run_dir(tmp_path / "alone")
    alone.tally = lambda amount: 1  # a peer that never fails: the wait is bounded
    assert fail(alone, RuntimeError("boom")) == 1 and alone.dist.transport.aborted == 1
    dead = guard_for(1)
    dead.set_run_dir(tmp_path / "dead")
    dead.tally = lambda amount: (_ for _ in ()).throw(ConnectionError("store gone"))  # rank 0 died with the store
    assert fail(dead, RuntimeError("boom")) == 1 and len(read_all(tmp_path / "dead" / FAILURES_DIR)) == 1


def test_a_ranks_own_timeout_is_not_a_witness_but_a_collective_timeout_is():
    """Only a wait for a peer makes a witness: a GPU's "the launch timed out" or a loader's own timeout is the
    raising rank's fault (found by an outside review: the broad "timed out" hid the culprit)."""
    from mpiddp.failure import FailureRecord
    from mpiddp.launch.diagnose import lost_peer

    def record(message):
        return FailureRecord("exception", [1], ["nodeb"], message)

    assert not lost_peer(record("RuntimeError: CUDA error: the launch timed out and was terminated"))
    assert not lost_peer(record("RuntimeError: DataLoader timed out after 60 seconds"))
    assert lost_peer(record("DistBackendError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 8000ms "
                            "for recv operation to complete"))
    assert lost_peer(record("RuntimeError: [Rank 0] Watchdog caught collective operation timeout: WorkNCCL(...)"))


def test_a_store_that_stops_answering_names_rank_0_and_ends_the_job(tmp_path):
    """Rank 0 stopped (SIGSTOP) or wedged: the store in its process stops answering, and every other rank's
    watchdog used to end quietly, leaving the job waiting forever (found by an outside review). Now the watchdog
    names rank 0 in its record and ends the job with the hang status."""
    from mpiddp import failure
    from mpiddp.errors import EXIT_HANG
    from mpiddp.job.watchdog import Watchdog

    class SilentStore:
        def __getattr__(self, name):
            def request(*args, **kwargs):
                raise RuntimeError("Socket Timeout")
            return request

    aborted = []
    watchdog = Watchdog(60.0, 1, 2, "rank 1/2", SilentStore(), aborted.append, {0: "nodea", 1: "nodeb"},
                        tmp_path / "failures", tmp_path)
    watchdog.interval = 0.01
    watchdog.start()
    watchdog.thread.join(30)
    assert aborted == [EXIT_HANG]
    (record,) = failure.read_all(tmp_path / "failures")
    assert (record.kind, record.ranks, record.hosts) == ("hang", [0], ["nodea"])


def test_a_store_closed_at_the_end_of_the_job_is_no_hang(tmp_path):
    from mpiddp.job.watchdog import Watchdog

    class ClosedStore:
        def __getattr__(self, name):
            def request(*args, **kwargs):
                raise RuntimeError("Connection reset by peer")
            return request

    aborted = []
    watchdog = Watchdog(60.0, 1, 2, "rank 1/2", ClosedStore(), aborted.append, {0: "nodea"}, tmp_path / "failures",
                        tmp_path)
    watchdog.interval = 0.01
    watchdog.start()
    watchdog.thread.join(30)
    assert aborted == [] and not (tmp_path / "failures").exists()
