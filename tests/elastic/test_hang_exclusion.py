"""A hung rank under in-job recovery, in-process: the hang watchdog writes the hang file, then ends the rank behind
(a rank on its host does, else `launch` is asked through a file), and the job is not aborted; without in-job
recovery, or when nothing ends it in time, the job ends as before. The end-to-end runs are in
test_recovery_e2e.py (a peer on the host) and test_drill.py (launch)."""

import contextlib
import json
import time
import threading

import pytest

import mpiddp.job.watchdog as watchdog_module
from mpiddp import failure
from mpiddp.errors import EXIT_HANG
from mpiddp.job import storekeys
from mpiddp.job.watchdog import Watchdog
from mpiddp.launch.ender import Ender, end_command, host_agent, host_command
from test_launch_record import DictStore
from test_watch import wait_for

STOPPED_PID = 424242  # the stopped rank's pid, as its last progress record says


@pytest.fixture
def ended(monkeypatch):
    """The pids the watchdogs end (SIGKILL), recorded instead of sent."""
    monkeypatch.setattr(watchdog_module, "GRACE_S", 0.1)
    monkeypatch.setattr(watchdog_module, "EXCLUDE_WAIT_MIN_S", 0.5)
    pids = []
    monkeypatch.setattr(watchdog_module, "end_process", pids.append)
    return pids


def watchdogs_with_rank_1_stopped(tmp_path, hosts, exclude_hung=True, timeout_s=1):
    """Three watchdogs on one store; rank 1 stopped (its watchdog went quiet) after publishing its pid."""
    store, aborted = DictStore(), []
    watchdogs = [Watchdog(timeout_s, rank, 3, f"rank {rank}/3", store, aborted.append, hosts,
                          tmp_path / failure.FAILURES_DIR, tmp_path) for rank in range(3)]
    for each in watchdogs:
        each.exclude_hung = exclude_hung
        each.beat("train", 7)
        each._publish()
    record = json.loads(store.get(storekeys.progress(1)))
    store.set(storekeys.progress(1), json.dumps({**record, "pid": STOPPED_PID}))
    for _ in range(watchdog_module.STALE_INTERVALS + 1):
        watchdogs[0]._publish()
        watchdogs[2]._publish()
    return watchdogs, aborted


def fire(watchdog):
    thread = threading.Thread(target=watchdog._fire, daemon=True)
    thread.start()
    return thread


def test_a_stopped_rank_is_ended_by_the_rank_on_its_host_after_the_hang_file_and_the_job_goes_on(tmp_path, ended):
    watchdogs, aborted = watchdogs_with_rank_1_stopped(tmp_path, {0: "hosta", 1: "hostb", 2: "hostb"})
    first = fire(watchdogs[0])
    peer = watchdogs[2]

    def polled():  # a round of the peer's watchdog (its rank kept making progress, so it never fires itself)
        peer.beat("train", 7)
        return peer.poll() is None

    assert wait_for(lambda: polled() and peer.hang_requested())
    peer._answer()  # asked for its stacks, as its next poll would
    assert wait_for(lambda: polled() and ended == [STOPPED_PID])  # the peer on hostb ends rank 1
    (hang_file,) = tmp_path.glob("hang-*.txt")  # written before the end
    text = hang_file.read_text()
    assert "ranks behind: 1 on hostb" in text
    assert f"in-job recovery: rank 1 (pid {STOPPED_PID}) on hostb will be ended (SIGKILL)" in text
    assert watchdogs[0].excluded == peer.excluded == {1}  # the recovery's cause: a hang
    watchdogs[0].stopped.set()  # the survivors recovered: the watchdog follows them
    first.join(30)
    assert not first.is_alive() and aborted == []
    assert failure.read_all(tmp_path / failure.FAILURES_DIR) == []  # a recovered job leaves no failure record
    assert failure.to_end(tmp_path / failure.FAILURES_DIR) == []  # nothing for launch to do


def test_a_stopped_rank_alone_on_its_host_is_left_to_launch(tmp_path, ended):
    watchdogs, aborted = watchdogs_with_rank_1_stopped(tmp_path, {0: "hosta", 1: "hostb", 2: "hostc"})
    first = fire(watchdogs[0])
    directory = tmp_path / failure.FAILURES_DIR
    assert wait_for(lambda: failure.to_end(directory))
    ((name, asked),) = failure.to_end(directory)
    assert (asked["host"], asked["pid"], asked["rank"]) == ("hostb", STOPPED_PID, 1) and ended == []
    watchdogs[0].stopped.set()
    first.join(30)
    assert aborted == []


def test_a_stopped_rank_not_ended_in_time_ends_the_job_as_before(tmp_path, ended):
    watchdogs, aborted = watchdogs_with_rank_1_stopped(tmp_path, {0: "hosta", 1: "hostb", 2: "hostc"})
    watchdogs[0]._fire()  # launch never ends it (plain mpirun): the wait runs out
    assert aborted == [EXIT_HANG]
    (record,) = failure.read_all(tmp_path / failure.FAILURES_DIR)
    assert (record.kind, record.ranks, record.hosts) == ("hang", [1], ["hostb"])


def test_a_watchdog_that_fired_and_wakes_after_the_recovery_followed_the_new_store_does_not_end_the_job(
        tmp_path, ended):
    """A peer's watchdog fired too, and is still in its grace period when the survivors recover and follow their
    new store (where no exclusion plan is): it must see that its watch is over, not read the new store's empty
    plan as "nothing to end" and abort the recovered job with the hang status."""
    watchdogs, aborted = watchdogs_with_rank_1_stopped(tmp_path, {0: "hosta", 1: "hostb", 2: "hostc"})
    first = fire(watchdogs[0])
    assert wait_for(lambda: watchdogs[2].exclusion() is not None)  # the first watchdog's plan is in the store
    peer = fire(watchdogs[2])  # it fired as well and waits out its grace period
    assert wait_for(lambda: failure.to_end(tmp_path / failure.FAILURES_DIR))
    for each in (watchdogs[0], watchdogs[2]):  # what follow() does: a new store (no plan in it), a new event
        old_stopped = each.stopped
        each.store = DictStore()
        each.stopped = threading.Event()
        old_stopped.set()
    first.join(30)
    peer.join(30)
    assert not first.is_alive() and not peer.is_alive() and aborted == []


def test_without_in_job_recovery_a_hang_ends_the_job_and_nobody_is_killed(tmp_path, ended):
    watchdogs, aborted = watchdogs_with_rank_1_stopped(tmp_path, {0: "hosta", 1: "hostb", 2: "hostb"},
                                                       exclude_hung=False)
    watchdogs[0]._fire()
    assert aborted == [EXIT_HANG] and ended == []
    assert not watchdogs[0].store.check([storekeys.HANG_EXCLUDE])
    assert failure.to_end(tmp_path / failure.FAILURES_DIR) == []
    (record,) = failure.read_all(tmp_path / failure.FAILURES_DIR)
    assert (record.kind, record.ranks) == ("hang", [1])


@pytest.mark.parametrize("args, env", [
    (["--mca", "btl", "tcp,self", "--mca", "plm_rsh_agent", "/x/agent.sh -q"], {}),  # Open MPI 4 (5 reads it too)
    (["--mca", "plm_ssh_agent", "/x/agent.sh -q"], {}),  # the name Open MPI 5 documents
    (["--prtemca", "plm_ssh_agent", "/x/agent.sh -q"], {}),
    (["--prtemca", "plm_rsh_agent", "/x/agent.sh -q : ssh"], {}),  # a list: its first
    ([], {"PRTE_MCA_plm_ssh_agent": "/x/agent.sh -q"}),  # Open MPI 5 reads this, not OMPI_MCA_plm_rsh_agent
    ([], {"PRTE_MCA_plm_rsh_agent": "/x/agent.sh -q : ssh"}),
    ([], {"OMPI_MCA_plm_rsh_agent": "/x/agent.sh -q"}),
    (["-launcher", "ssh", "-launcher-exec", "/x/agent.sh -q"], {}),  # MPICH's Hydra
    (["-launcher-exec=/x/agent.sh -q"], {}),
    ([], {"HYDRA_LAUNCHER_EXEC": "/x/agent.sh -q"}),
    (["--mca", "plm_ssh_agent", "/x/agent.sh -q"], {"PRTE_MCA_plm_ssh_agent": "ssh"}),  # the command line wins
])
def test_launch_reaches_the_host_through_the_agent_however_it_is_named(args, env):
    assert host_agent(args, env) == ["/x/agent.sh", "-q"]


@pytest.mark.parametrize("args, env, options", [
    (["--mca", "plm_ssh_args", "-p 2222 -o ConnectTimeout=5"], {}, ["-p", "2222", "-o", "ConnectTimeout=5"]),
    (["--prtemca", "plm_ssh_args", "-p 1"], {"PRTE_MCA_plm_ssh_args": "-q"}, ["-p", "1"]),  # the line wins
    (["--mca", "plm_ssh_args", "-p 2222", "--mca", "plm_rsh_args", "-p 1111"], {}, ["-p", "2222"]),  # ssh's name
    (["--mca", "plm_rsh_args", "-p 1111", "--mca", "plm_ssh_args", "-p 1", "--mca", "plm_ssh_args", "-p 2222"], {},
     ["-p", "2222"]),  # in either order; the last given
    (["--prtemca", "plm_rsh_args", "-p 1111"], {}, ["-p", "1111"]),
    (["--prtemca", "plm_rsh_args", "-p 1111"], {"PRTE_MCA_plm_ssh_args": "-p 2222"}, ["-p", "2222"]),
    ([], {"PRTE_MCA_plm_ssh_args": "-p 2222"}, ["-p", "2222"]),
    # names Open MPI 5 reads for no agent (PRRTE 3.0.14 passes none of these on): none
    ([], {"PRTE_MCA_plm_rsh_args": "-p 1", "OMPI_MCA_plm_ssh_args": "-p 1", "OMPI_MCA_plm_rsh_args": "-p 1"}, []),
    (["--mca", "btl", "tcp,self"], {"PRTE_MCA_plm_ssh_args": " "}, []),
    (["--mca", "plm_ssh_args", "-l o'brien"], {}, ["-l", "o'brien"]),  # split on spaces, as PRRTE: no quoting
])
def test_launch_reaches_the_host_with_the_options_open_mpi_gives_its_agent(args, env, options):
    """Open MPI puts plm_ssh_args between the agent and the host (sshd on another port, as in containers): launch's
    own commands on a host (ending a hung rank or a dead launcher's daemons, its probe) carry them too, read as
    PRRTE 3.0.14 reads them (checked with a logging agent). MPICH's Hydra takes none."""
    agent = ["--mca", "plm_ssh_agent", "/x/agent.sh -q"]
    assert host_command([*agent, *args], env) == ["/x/agent.sh", "-q", *options]
    assert host_command(args, env) == ["ssh", *options]
    assert host_command(["-launcher-exec", "/x/agent.sh", *args], env, "mpich") == ["/x/agent.sh"]


def test_launch_reaches_the_host_through_the_launchers_agent():
    assert host_agent(["--mca", "btl", "tcp,self"], {"PRTE_MCA_plm_ssh_agent": " "}) == ["ssh"]
    assert host_agent([], {}) == ["ssh"]
    assert end_command(["ssh"], "nodeb", 77) == ["ssh", "nodeb", "kill -KILL 77"]
    assert end_command(["ssh"], "localhost", 77) == ["kill", "-KILL", "77"]


def test_launch_ends_each_process_the_job_asks_for_once(tmp_path):
    directory = tmp_path / failure.FAILURES_DIR
    assert failure.ask_to_end(directory, 1, "nodeb", 77)
    assert failure.ask_to_end(directory, 2, "nodec", 77)  # containers: the same pid on another host
    assert not failure.ask_to_end(directory, 1, "nodeb", 77)  # asked once
    ran, said = [], []
    ender = Ender(directory, ["agent"], said.append, run=lambda command: ran.append(command) or 0)
    ender.once()
    ender.once()
    assert ran == [["agent", "nodeb", "kill -KILL 77"], ["agent", "nodec", "kill -KILL 77"]]
    assert said == ["ending hung rank 1 (pid 77) on nodeb for in-job recovery: agent nodeb kill -KILL 77",
                    "ending hung rank 2 (pid 77) on nodec for in-job recovery: agent nodec kill -KILL 77"]
    failure.clear(directory)  # a new attempt: an earlier attempt's requests are gone
    assert failure.to_end(directory) == []


def test_a_collective_returning_after_mpi_reported_a_failure_is_not_trusted(monkeypatch):
    """Under ULFM an Allreduce cut short by a failure returned on a survivor with its buffer never filled (the
    stop agreement's garbage asked for a save, and the recovery then refused "a failure during a save"): the
    survivors' transport raises MembersLost for any collective that returns once MPI has reported a failure."""
    import numpy as np

    from mpiddp.elastic.membership import MembersLost
    from mpiddp.elastic.membership import WatchedTransport

    class Comm:
        def Get_rank(self):
            return 0

        def Get_size(self):
            return 2

        def Allreduce(self, values, out, op):
            inside.append(members.inside)
            out[:] = 12345.0  # what an aborted schedule left in the buffer

        def Get_failed(self):
            raise NotImplementedError  # (MpiTransport.failed_ranks: nothing known)

    class Members:
        comm, _lost, lost, inside = Comm(), 5.0, None, False

        def failed(self):
            return self.lost

        @contextlib.contextmanager
        def waiting(self):  # a wait on the others: a script's hang clock runs
            self.inside = True
            try:
                yield
            finally:
                self.inside = False

    monkeypatch.setattr("mpi4py.util.pkl5.Intracomm", lambda comm: comm)  # a fake communicator
    members, inside = Members(), []
    transport = WatchedTransport(members)
    assert transport.allreduce(np.zeros(2), "max").tolist() == [12345.0, 12345.0]  # no failure known: as before
    assert inside == [True] and not members.inside  # MPI's collective waited under the hang clock, and no longer
    members.lost = (1,)
    with pytest.raises(MembersLost) as caught:
        transport.allreduce(np.zeros(2), "max")
    assert caught.value.ranks == (1,) and caught.value.detected_at == 5.0
    members.lost = None  # the failure watch has not heard yet, but this communicator knows rank 1 failed
    monkeypatch.setattr(WatchedTransport, "failed_ranks", lambda self: (1,))
    with pytest.raises(MembersLost) as caught:
        transport.allreduce(np.zeros(2), "max")
    assert caught.value.ranks == (1,)


def test_a_host_launch_cannot_reach_is_said_in_one_line_and_the_jobs_fallback_stands(tmp_path):
    directory = tmp_path / failure.FAILURES_DIR
    assert failure.ask_to_end(directory, 1, "nodeb", 77)
    said = []
    Ender(directory, ["agent"], said.append, run=lambda command: 255).once()
    assert said == ["ending hung rank 1 (pid 77) on nodeb for in-job recovery: agent nodeb kill -KILL 77 (exit "
                    "status 255: cannot end it through agent; the job's hang fallback ends the job)"]


def test_the_daemons_of_a_launcher_that_died_by_a_signal_are_ended_on_the_other_hosts_only():
    """Open MPI 5.0.11's mpirun crashing (SIGABRT) after a grow left a prted running on the spare: launch ends
    that launcher's daemons, and only its own (prterun-LAUNCH_HOST-PID), through the agent."""
    from mpiddp.launch.ender import daemon_end_commands, end_daemons

    commands = daemon_end_commands(["ssh", "-x"], ["nodea", "nodeb", "nodeb", "noded", "localhost"],
                                   "nodea.cluster", 4242)
    assert [command[:3] for command in commands] == [["ssh", "-x", "nodeb"], ["ssh", "-x", "noded"]]
    assert "pkill -KILL -f 'ess_base_nspace prterun-nodea[^ ]*-4242@'" in commands[0][3]
    assert "^PMIX_NAMESPACE=prterun-nodea[^ ]*-4242@' $p/environ && kill -KILL" in commands[0][3]
    ran: list[list[str]] = []
    end_daemons(["agent"], ["nodeb", "nodec"], 7, run=lambda command: ran.append(command) or 0)
    assert sorted(command[1] for command in ran) == ["nodeb", "nodec"]


class StoppedStore(DictStore):
    """Rank 0's store once rank 0 is SIGSTOPped: every request waits (a stopped process keeps its sockets open)."""

    def __init__(self):
        super().__init__()
        self.answering = threading.Event()
        self.answering.set()

    def add(self, key, amount):
        self.answering.wait()
        return super().add(key, amount)


def polled_until_an_ending(watchdog, seconds=30.0):
    """The watchdog's rounds, each on a thread of its own (a round that never returns fails the test, not hangs it),
    until one returns what ends the job; (that ending, seconds it took)."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        found = []
        round_ = threading.Thread(target=lambda: found.append(watchdog.poll()), daemon=True)
        round_.start()
        round_.join(watchdog.interval + 5)
        assert not round_.is_alive(), "a round of the watchdog blocked on rank 0's stopped store"
        if found[0] is not None:
            return found[0], time.monotonic() - started
        time.sleep(watchdog.interval)  # the watcher's own pace between rounds
    pytest.fail("rank 0's mute store was never noticed")


@pytest.mark.parametrize("exclude_hung", [True, False])
def test_a_stopped_rank_0_whose_store_never_answers_is_ended_after_the_hang_timeout(tmp_path, ended, exclude_hung):
    """Issue 44: rank 0 holds the store and is stopped; each request to it has a deadline, and once it has not
    answered for --hang-timeout, rank 0 is named: under in-job recovery launch is asked to end it (its pid from its
    first progress record) and the recovery follows; without it, the job ends with rank 0 recorded as behind."""
    store, aborted = StoppedStore(), []
    hosts = {0: "hosta", 1: "hostb", 2: "hostc"}
    watchdogs = [Watchdog(1, rank, 3, f"rank {rank}/3", store, aborted.append, hosts,
                          tmp_path / failure.FAILURES_DIR, tmp_path) for rank in range(3)]
    for each in watchdogs:
        each.exclude_hung = exclude_hung
        each._publish()
    record = json.loads(store.get(storekeys.progress(0)))
    store.set(storekeys.progress(0), json.dumps({**record, "pid": STOPPED_PID}))
    witness = watchdogs[1]
    assert witness.poll() is None and witness.rank_0_pid == STOPPED_PID
    store.answering.clear()  # rank 0 stopped
    ending, took = polled_until_an_ending(witness)
    assert took >= witness.timeout_s  # never before the hang timeout
    run = threading.Thread(target=ending, daemon=True)
    run.start()
    directory = tmp_path / failure.FAILURES_DIR
    if exclude_hung:
        assert wait_for(lambda: failure.to_end(directory))
        ((_, asked),) = failure.to_end(directory)
        assert (asked["host"], asked["pid"], asked["rank"]) == ("hosta", STOPPED_PID, 0)
        assert witness.excluded == {0}  # the recovery's cause: a hang
        witness.stopped.set()  # the survivors recovered on a new store
        run.join(30)
        assert not run.is_alive() and aborted == [] and failure.read_all(directory) == []
    else:
        run.join(30)
        assert aborted == [EXIT_HANG] and failure.to_end(directory) == []
        (record,) = failure.read_all(directory)
        assert (record.kind, record.ranks, record.hosts) == ("hang", [0], ["hosta"])
    (hang_file,) = tmp_path.glob("hang-*.txt")
    assert "ranks behind: 0 on hosta" in hang_file.read_text()
    store.answering.set()  # the stopped request's thread ends


def test_a_scripts_hang_clock_runs_only_while_its_rank_waits_on_the_others():
    """A script's own phases are unknown to mpiddp: a rank busy for long (its own evaluation, a save) is no hang;
    one kept waiting in a watched collective past the timeout is, and its record says it waits."""
    store, aborted, waited = DictStore(), [], [None]
    watchdog = Watchdog(1, 0, 2, "rank 0/2", store, aborted.append)
    watchdog.waited = lambda: waited[0]
    watchdog.beat("compute", 4)
    watchdog.last_beat -= 100  # busy on its own since its last commit
    assert (watchdog.idle_s(), watchdog.where()) == (0.0, "compute")
    assert watchdog.poll() is None
    waited[0] = 0.5
    assert watchdog.poll() is None and watchdog.where() == "communication"
    waited[0] = 2.0
    assert watchdog.poll() == watchdog._fire  # the ending its thread runs
    record = json.loads(store.get(storekeys.progress(0)))
    assert (record["phase"], record["step"], record["idle_s"]) == ("communication", 4, 2.0)
    watchdog.resumed(150)  # the whole process stood still meanwhile (SIGSTOP): that is not waiting on the others
    assert watchdog.idle_s() < 0.5 and watchdog.poll() is None and aborted == []


def test_of_two_ranks_at_one_commit_the_one_not_waiting_on_the_other_is_behind():
    progress = {0: {"step": 4, "phase": "communication"}, 1: {"step": 4, "phase": "compute"},
                2: {"step": 4, "phase": "communication"}}
    assert watchdog_module.ranks_behind(progress, 3) == [1]


def test_a_membership_says_how_long_its_rank_has_waited_only_while_it_waits():
    """Membership.waited_s, the script's hang clock: set in the step's all-reduce wait and in the commit's
    agreement, None again once either returns or raises."""
    from types import SimpleNamespace

    from mpiddp.elastic.membership import Membership

    members = Membership.__new__(Membership)
    members._waiting_from, members._lost, members.poll_s = None, None, 0.001
    members._watch = SimpleNamespace(Test=lambda: False)  # no failure reported
    seen = []

    class Work:
        def is_completed(self):
            seen.append(members.waited_s())
            return len(seen) > 2

        def wait(self):
            pass

    assert members.waited_s() is None
    members.wait(Work())
    assert all(waited is not None and waited >= 0 for waited in seen) and members.waited_s() is None
    members.comm = SimpleNamespace(Agree=lambda flag: seen.append(members.waited_s()) or flag)
    assert members.all_completed(True) and seen[-1] is not None and members.waited_s() is None

    def agree_raises(flag):
        raise RuntimeError("not an MPI error")

    members.comm = SimpleNamespace(Agree=agree_raises)
    members._mpi = SimpleNamespace(Exception=KeyError)  # MPI's exception class: this RuntimeError is not one
    with pytest.raises(RuntimeError):
        members.all_completed(True)
    assert members.waited_s() is None


def test_a_scripts_rank_0_stopped_while_nobody_waits_on_it_is_no_hang_until_someone_does(tmp_path, ended):
    """Found by the outside review: rank 0 SIGSTOPped (its store mute) while every rank was busy on its own was
    ended, and the job aborted. A script's rank names rank 0 only once it has waited on the others past the
    timeout; then as before."""
    store, aborted, waited = StoppedStore(), [], [None]
    watchdogs = [Watchdog(1, rank, 3, f"rank {rank}/3", store, aborted.append, {0: "a", 1: "b", 2: "c"},
                          tmp_path / failure.FAILURES_DIR, tmp_path) for rank in range(3)]
    for each in watchdogs:
        each.exclude_hung, each.waited = True, lambda: waited[0]
        each._publish()
    witness = watchdogs[1]
    assert witness.poll() is None and witness.rank_0_pid is not None
    store.answering.clear()  # rank 0 stopped
    started = time.monotonic()
    while time.monotonic() - started < 3 * witness.timeout_s:  # busy on its own: its rounds go on, nothing ends
        round_ = threading.Thread(target=lambda: found.append(witness.poll()), daemon=True)
        found = []
        round_.start()
        round_.join(witness.interval + 5)
        assert found == [None]
        time.sleep(witness.interval)  # the watcher's own pace between rounds
    waited[0] = 2 * witness.timeout_s  # now it waits on rank 0 in a step's all-reduce: rank 0 is named
    ending, _ = polled_until_an_ending(witness)
    assert ending.__qualname__.startswith("Watchdog._store_mute") and aborted == [] and ended == []


def test_a_scripts_rank_that_ended_its_script_is_left_to_the_finish_watch(tmp_path, ended):
    """Found by the outside review: a rank whose script ended (its record then stale) was taken for hung and
    ended while the others waited for it. Its last record says it finished: the others' watchdogs do not fire
    (the finish watch names it, or they wait as --finish-timeout 0 asks)."""
    store, aborted, waited = DictStore(), [], [None]
    watchdogs = [Watchdog(1, rank, 2, f"rank {rank}/2", store, aborted.append, {0: "a", 1: "a"},
                          tmp_path / failure.FAILURES_DIR, tmp_path) for rank in range(2)]
    for each in watchdogs:
        each.exclude_hung, each.waited = True, lambda: waited[0]
        each._publish()
    waited[0] = 5.0  # rank 0 waits for rank 1 in a collective, 5 s after its last commit
    watchdogs[0].last_beat -= 5
    assert watchdogs[0].poll() == watchdogs[0]._fire  # as it would for a hung rank 1
    watchdogs[1].finish()
    assert json.loads(store.get(storekeys.progress(1)))["phase"] == "finished" and watchdogs[1].stopped.is_set()
    assert watchdogs[0].poll() is None and aborted == [] and ended == []
