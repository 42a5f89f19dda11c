"""Blame follows the record (issue 44), in-process: survivors that refuse an in-job recovery record the ranks they
lost and their hosts before the abort (the engine's NotRecovered, FailFast's record), also after the shrink, when
MPI tells them of no failed peer any more and the placement file already numbers the survivors; `launch` reads those
records and relaunches without the lost ranks' hosts, every time. One short end-to-end run on fake hosts at the end."""

import dataclasses
import json
import os
import signal
import sys
import time
from types import SimpleNamespace

import pytest
from conftest import job_env, rank_pid, run_acting_on, run_supervisor
from fakehosts import FakeHosts, running_fake_hosts

import mpiddp.elastic.engine as engine_module
from mpiddp import failure
from mpiddp.elastic.engine import Engine, NotRecovered, Policy
from mpiddp.elastic.membership import MembersLost, RecoveryFailed
from mpiddp.failure import FailureRecord, replace_placement, write_placement
from mpiddp.job.collective import Dist, SoloTransport
from mpiddp.job.failfast import FailFast
from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.launch.diagnose import diagnose, lost_peer
from mpiddp.launch.hosts import Host
from mpiddp.launch.supervisor import Attempt, Plan, Supervisor


class KnowsNoFailure(SoloTransport):
    """A survivor's communicator where MPI reports no failed member: the shrunk one, or before MPI told it."""

    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def failed_ranks(self):
        return ()


class MpiError(Exception):
    pass


def world(slots, failure_dir, rank=0):
    """The topology of `rank` in a job of `slots` ({host: ranks on it}, filled in host order)."""
    records, first = [], 0
    for host, count in slots.items():
        records += [RankRecord(first + i, host, first, i, count) for i in range(count)]
        first += count
    return dataclasses.replace(build_topology(rank, records), failure_file=str(failure_dir))


class Refusing(Policy):
    """A policy that refuses before the shrink (`reason`), or whose resume fails after it (`fails_in_resume`)."""

    def __init__(self, reason=None, fails_in_resume=False):
        self.reason, self.fails_in_resume = reason, fails_in_resume

    def alive_at(self):
        return 0.0

    def records_dir(self):
        return None

    def refusal(self):
        return self.reason

    def resume(self, dist, before, failed):
        if self.fails_in_resume:
            raise RuntimeError("Connection closed by peer [nodea]:1234")  # a second failure during the sync
        return "ddp", None


def survivors_refuse(tmp_path, monkeypatch, slots, lost, policy, refused=None):
    """Every survivor of `lost` goes through the engine's recovery, which `policy` refuses (or the shrink's min size:
    `refused`), and ends through FailFast, which writes its record: the records and placement as the job leaves
    them in the failures directory."""
    directory = tmp_path / failure.FAILURES_DIR
    start = world(slots, directory)
    write_placement(directory, [(name, list(ranks)) for name, ranks in start.hosts])  # rank 0, at start-up
    alive = tuple(r for r in range(start.world_size) if r not in lost)

    def bind(dists, members, topology, guard, log_level, verb="goes on"):  # survivors.bind_topology, without MPI
        for each in dists:
            each.rebind(topology, KnowsNoFailure(topology.rank, topology.world_size), None)
        if topology.rank == 0:  # the new rank 0 rewrites the placement launch reads
            replace_placement(directory, [(name, list(ranks)) for name, ranks in topology.hosts])

    monkeypatch.setattr(engine_module, "bind_topology", bind)
    monkeypatch.setattr(engine_module, "mark_recovered", lambda: None)
    for old_rank in alive:
        def shrink(min_size, new_rank=alive.index(old_rank)):
            if refused is not None:
                raise RecoveryFailed(refused, lost)
            return SimpleNamespace(failed_ranks=lost, old_ranks_alive=alive, rank=new_rank, phases={})

        members = SimpleNamespace(waiting_since=None, recover=shrink, _mpi=SimpleNamespace(Exception=MpiError))
        dist = Dist(world(slots, directory, old_rank), KnowsNoFailure(old_rank, start.world_size))
        engine = Engine(members, [dist], 1, policy)
        guard = FailFast()
        guard.dist = dist
        with pytest.raises(NotRecovered) as raised:
            engine.recover(MembersLost(lost, time.time()))
        assert guard.write_record(raised.value, 1)  # what FailFast.__exit__ writes before it aborts the job
    return directory


ONE_SLOT = {"nodea": 1, "nodeb": 1, "nodec": 1}
TWO_SLOTS = {"nodea": 2, "nodeb": 2}


@pytest.mark.parametrize("refusal", ["before", "min_np"])
def test_survivors_refusing_before_the_shrink_record_the_lost_ranks_and_their_hosts(tmp_path, monkeypatch, refusal):
    """A rank failed before the first training step (or too few would be left, --min-np): every survivor's record
    names the lost rank and its host, even where MPI no longer tells it which peer failed."""
    policy = Refusing("a rank failed before the first training step" if refusal == "before" else None)
    directory = survivors_refuse(tmp_path, monkeypatch, ONE_SLOT, (1,), policy,
                                 refused="2 of 3 ranks are left, fewer than the 3 the job needs"
                                 if refusal == "min_np" else None)
    records = failure.read_all(directory)
    assert [r.rank for r in sorted(records, key=lambda r: r.rank)] == [0, 2]
    assert all((r.kind, r.ranks, r.hosts) == ("killed", [1], ["nodeb"]) and not lost_peer(r) for r in records), records
    found = diagnose(1, records, "", 3, failure.read_placement(directory))
    assert (found.kind, found.ranks, found.hosts) == ("killed", (1,), ("nodeb",))


@pytest.mark.parametrize("slots, lost", [(TWO_SLOTS, (3,)), (ONE_SLOT, (1,))])
def test_a_refusal_after_the_shrink_blames_the_lost_host_not_a_survivors(tmp_path, monkeypatch, slots, lost):
    """After the shrink the survivors' communicator reports no failed peer, and the new rank 0 has replaced the
    placement with the survivors' numbering: the records name the lost ranks' hosts (their old rank numbers would
    point at survivors), and launch relaunches without nodeb (was: no host to blame; or, with no survivor left on
    nodeb, the slot order's rank 1, which the survivors' placement puts on nodec)."""
    directory = survivors_refuse(tmp_path, monkeypatch, slots, lost, Refusing(fails_in_resume=True))
    records = failure.read_all(directory)
    assert records and all((r.kind, r.ranks, r.hosts) == ("killed", [], ["nodeb"]) for r in records), records
    assert "a second failure during recovery" in records[0].message
    hosts = [Host(name, count) for name, count in slots.items()] + [Host("noded", max(slots.values()))]
    relaunched = relaunch_after(tmp_path, monkeypatch, hosts, sum(slots.values()), directory)
    assert relaunched[0] == list(slots) and "nodeb" not in relaunched[1], relaunched


def relaunch_after(tmp_path, monkeypatch, hosts, num_ranks, directory):
    """The hosts of each attempt of a supervised launch whose first attempt left `directory`'s records (mpirun
    --with-ft ulfm exits 0 after racing aborts) and whose second one finishes."""
    kept = {path.name: path.read_bytes() for path in directory.iterdir()}
    plan = Plan("train", ["--epochs", "1"], tmp_path, num_ranks, hosts, [], 3, "mpirun", "mpirun", "openmpi")
    sup = Supervisor(plan, {})
    assert sup.failure_file == directory
    placed = []

    def attempt(number, hosts_now, excluded):
        placed.append([h.name for h in hosts_now])
        failure.clear(directory)
        if number == 0:
            for name, data in kept.items():
                (directory / name).write_bytes(data)
        record = Attempt(number, placed[-1], ["mpirun"], time.time(), status=1 if number == 0 else 0,
                         num_ranks=num_ranks)
        sup.attempts.append(record)
        return record, "MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD\n"

    monkeypatch.setattr(sup, "_attempt", attempt)
    assert run_supervisor(sup) == 0
    first = sup.attempts[0]
    assert first.blamed_hosts == ["nodeb"] and "nodeb" in first.excluded_hosts, first
    return placed


def test_a_record_naming_ranks_on_several_hosts_blames_each_host():
    """A record lists each host once (ranks 0 and 1 on nodea, 3 on nodeb): every named rank's host is blamed, not
    the hosts paired with the first ranks only."""
    record = FailureRecord("killed", [0, 1, 3], ["nodea", "nodeb"], "lost in the job: ranks 0, 1, 3 on nodea, nodeb",
                           rank=2, status=1)
    placement = {0: "nodea", 1: "nodea", 2: "nodeb", 3: "nodeb", 4: "nodec", 5: "nodec"}
    assert diagnose(1, [record], "", 6, placement).hosts == ("nodea", "nodeb")
    assert diagnose(1, [record], "", 6, {2: "nodeb"}).hosts == ("nodea", "nodeb")  # ranks it cannot map: its names


def test_a_scripts_refusal_hidden_in_its_script_error_is_still_the_failure(tmp_path):
    """`mpiddp run` reports a script's exception as a ScriptError raised from None: the refused recovery behind it
    still names the lost rank's host."""
    from mpiddp.errors import ScriptError

    guard = FailFast()
    guard.dist = Dist(world(ONE_SLOT, tmp_path), KnowsNoFailure(0, 3))
    try:
        try:
            raise NotRecovered("in-job recovery not possible: 2 of 3 ranks are left (MPI_ERR_PROC_FAILED: ranks 1 "
                               "failed)", (1,), ("nodeb",))
        except NotRecovered:
            raise ScriptError("train.py", "Traceback ...", "NotRecovered: ...") from None
    except ScriptError as exc:
        record = guard.record(exc, 1)
    assert (record.kind, record.ranks, record.hosts) == ("killed", [1], ["nodeb"])


@pytest.fixture
def hosts(tmp_path, mpirun):
    (tmp_path / "fakehosts").mkdir()
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path / "fakehosts")) as cluster:
        yield cluster


@pytest.mark.mpi
def test_launch_blames_the_host_of_a_rank_killed_before_the_first_step(hosts, tmp_path):
    """End to end on fake hosts, under launch with in-job recovery on: rank 1 (nodeb) is killed while rank 0 waits
    for it in the first step; the survivor refuses to recover, and its record blames nodeb (--max-restarts 0: the
    relaunch would stall the same way on the spare)."""
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1", "-np", "2", "--launcher",
               "mpirun", "--max-restarts", "0", "--launcher-args", " ".join(hosts.transport_args()), "--",
               "--run-dir", str(run_dir), "--epochs", "1", "--no-progress", "--wandb", "disabled",
               "--inject-fault", "stall-data:1:0"]
    env = job_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    status, output = run_acting_on(hosts.command_on("nodea", command), env, run_dir,
                                   lambda line: "injecting fault 'stall-data'" in line,  # rank 1 holds rank 0 up
                                   lambda: os.kill(rank_pid(run_dir, 1), signal.SIGKILL), timeout=240)
    (first,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]
    assert status != 0 and first["in_job_recovery"], output[-5000:]
    assert "in-job recovery not possible: a rank failed before the first training step" in output, output[-5000:]
    assert (first["cause"], first["cause_source"], first["failed_ranks"], first["failed_hosts"],
            first["blamed_hosts"]) == ("killed", "failure record", [1], ["nodeb"], ["nodeb"]), first
    assert first["message"].startswith("lost in the job: rank 1 on nodeb; in-job recovery not possible"), first
