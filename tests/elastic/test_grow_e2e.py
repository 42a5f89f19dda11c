"""Growing back after an in-job recovery, on four fake hosts (nodea, nodeb, nodec and a spare, noded) under
`mpirun --with-ft ulfm -np 3`: the rank on nodeb is SIGKILLed mid-epoch, the survivors (the same processes) go
on at reduced size, then spawn a new rank on the spare host, hand it the state from memory, and the job
finishes on 3 ranks at the same global batch, every step once.

The victim is held with `--inject-fault stall-data:1:5` (see tests/elastic/test_recovery_e2e.py), then killed."""

import json
import re
import subprocess
import sys

import pytest

from conftest import find_mpirun, hold_survivors_while_the_spare_warms
from fakehosts import FakeHosts, running_fake_hosts
from mpiddp import failure
from mpiddp.trainer.startup import PHASES
from spawnbug import CRASH_STATUSES, excuse, prterun_crash
from test_leftovers import marked_env
from test_recovery_e2e import JOB, Job, _ulfm_missing, metrics, survivors_pids

pytestmark = pytest.mark.mpi
HOSTS = "nodea:1,nodeb:1,nodec:1,noded:1"  # -np 3 fills the first three; noded's slot is the spare


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _ulfm_missing()
    if reason:
        pytest.skip(reason)
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec", "noded"], tmp_path_factory.mktemp("grow-hosts"),
                                      tag="g")) as cluster:
        yield cluster


class GrowJob(Job):
    """Job's `mpirun --with-ft ulfm -np 3` with noded in the host list and named as the spare."""

    def __init__(self, hosts: FakeHosts, tmp_path, *flags: str, spare: str = "noded", layout: str = HOSTS) -> None:
        self.run_dir, self.log = tmp_path / "run", tmp_path / "job.log"
        env, self.mark = marked_env(MPIDDP_SPARE_HOSTS=spare)
        env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
        command = [find_mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", "3", "-H", layout,
                   sys.executable, "-m", "mpiddp", "--run-dir", str(self.run_dir), *JOB, *flags]
        self.start = lambda: self._start(hosts.command_on("nodea", command), env)
        self.start()
        self.relaunches = 0


@pytest.mark.parametrize("transport", ["gloo", "mpi"])
def test_the_job_grows_back_onto_the_spare_host_and_finishes_at_full_size(hosts, tmp_path, transport):
    """Rank 1 (nodeb) killed at step 5: the survivors recover (same pids), train a step on 2 ranks, then a new
    rank joins on noded with the state of rank 0; the job ends on 3 ranks at the same global batch (16 x 3),
    every step trained once (no sample skipped or repeated), with the recovery and the grow recorded."""
    job = GrowJob(hosts, tmp_path, "--grad-transport", transport, "--inject-fault", "stall-data:1:5")
    pids = job.kill_when_stalled(1)
    hold_survivors_while_the_spare_warms(job.output, [pids[0], pids[2]], ended=lambda: job.process.poll() is not None)
    status = job.finish()
    output = job.output()
    spawn = failure.spawning(job.run_dir / failure.FAILURES_DIR)  # the job's mark: a spawn that never ended
    crash = prterun_crash(status, output)
    if crash is not None and spawn is not None and not (job.run_dir / "summary.json").exists():
        # Open MPI 5.0.11's prterun can crash during MPI_Comm_spawn ("PMIX ERROR ... pmix_server_dyn.c", then
        # "corrupted double-linked list", or "PRTE has lost communication with a remote daemon" naming a survivor's
        # host, then exit 0 under ULFM): the launcher's luck, not the job's, shown by its own signs and none of
        # mpiddp's failure lines. The product's answer is launch's relaunch with the spawn's host kept, tested with
        # a launcher that fails so (test_launch_recovery.py's
        # test_a_launcher_that_fails_during_the_jobs_spawn_is_not_evidence_against_any_host), not end to end
        pytest.xfail(excuse(crash, f"during the spawn onto {', '.join(spawn[0])}"))
    finished = (job.run_dir / "summary.json").exists()
    if crash is not None and not finished and "running at full size again: 3 ranks" in output:
        # seen once (CI, fast training): prterun aborted ("free(): invalid pointer") after the grow had ended, while
        # the grown job trained on: the same launcher bug, which took the ranks with it
        assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]
        pytest.xfail(excuse(crash, "after the grow, while the grown job trained"))
    # mpirun itself (prterun 5.0.11) sometimes crashes once such a job has finished (SIGSEGV or glibc "free():
    # invalid pointer", when the spawned rank ends, after the summary is written): xfail after every other check
    assert status == 0 or (status in (-11, -6, 139, 134) and finished), f"status {status}\n{output[-6000:]}"
    assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]
    assert "running at reduced size 2 of 3 ranks" in output
    # the threads every first rank has: a fake host is a one-core host (OMP_NUM_THREADS=1, fakehosts.py), which
    # a spawned rank inherits too (before, Open MPI bound a spawned rank to one core and it took 1 of 2)
    assert "grow: this process" in output and "joins as rank 2 of 3, 1 CPU thread" in output, output[-3000:]
    assert "1 CPU threads per rank" in output, output[-3000:]
    assert "3 ranks go on at the same global batch (16 per rank x 1 accumulation)" in output, output[-3000:]
    assert "running at full size again: 3 ranks" in output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    recovery, grew = summary["recoveries"]
    assert (recovery["cause"], recovery["ranks_lost"], recovery["world_before"], recovery["world_after"]) == \
        ("process_failed", [1], 3, 2), recovery
    assert (grew["cause"], grew["ranks_added"], grew["hosts_added"], grew["world_before"], grew["world_after"],
            grew["steps_lost"]) == ("grew", [2], ["noded"], 2, 3, 0), grew
    # spawned after one step at reduced size; taken in at the first boundary after it warmed up, the survivors
    # training meanwhile (the warm-up, interpreter to model, took 2.6 s here)
    assert "growing back: ranks [2] started on noded" in output and "they warm up while the job trains" in output
    assert grew["step"] >= 6 and grew["warm_up"] > 0, grew
    assert set(grew["phases"]) == {"spawn", "merge", "process_group", "state_transfer", "ddp", "first_step"}
    assert all(isinstance(v, float) and v >= 0 for v in grew["phases"].values()), grew
    # the survivors stood still from the boundary to their next step's end, less an ordinary step at 3 ranks (from
    # before the failure): every phase of the grow lies inside that span
    assert grew["ordinary_step"] > 0, grew
    span = grew["survivors_stall"] + grew["ordinary_step"]
    assert span >= sum(grew["phases"][name] for name in ("spawn", "merge", "state_transfer")), grew
    records = metrics(job.run_dir)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, 61)), steps  # 30 an epoch on 3 ranks, on 2, and on 3 again
    first, second = [r for r in records if r["kind"] == "epoch"]
    assert (first["step"], second["step"]) == (30, 60)
    # The epoch's meters keep the steps before the failure (the survivors' 5 x 2 x 16; the dead rank's are gone with
    # it). Taken in during epoch 1 (at step 6 or later), every later step of it trains 48 samples on 2 ranks or 3:
    # had the new rank started the epoch again or skipped ahead, the count would differ. Taken in only at epoch 2's
    # start (a slow warm-up, under load), epoch 1 ended on 2 ranks: from sample 240 each rank's shard of 1438 has
    # 599 samples left, 49 micro-batches of 12 (the last step has one)
    in_epoch_1 = grew["step"] < 30
    expected = 5 * 2 * 16 + (25 * 48 if in_epoch_1 else 49 * 12 * 2)
    assert round(first["images_per_second"] * first["epoch_time_s"]) == expected, (grew["step"], first)
    assert second["images_per_second"] > 0  # the epoch after the grow, at full size (the benchmark compares it)
    assert summary["world_size"] == 3 and summary["eval_accuracy"] > 0.8, summary
    # the job's start-up is the first ranks' own: the joined rank's start (the grow's, above) is not in it
    assert set(summary["startup_s"]) == set(PHASES), summary["startup_s"]
    assert all(entry["rank"] < 2 for entry in summary["startup_s"].values()), summary["startup_s"]
    assert sum(e["seconds"] for e in summary["startup_s"].values()) == pytest.approx(summary["time_to_first_step_s"],
                                                                                    abs=1.0)
    if status != 0:
        crash = prterun_crash(status, output)
        assert crash is not None, f"status {status}, not prterun's crash\n{output[-6000:]}"
        pytest.xfail(excuse(crash, "after the grown job had finished"))


def test_a_grown_rank_lost_later_is_recovered_from_and_the_job_goes_on_without_a_second_spawn(hosts, tmp_path):
    """A second failure, and it takes the rank that joined (noded has a second spare slot). Rank 1 (nodeb) killed
    at step 5, the survivors grow onto noded; then the grown rank is SIGKILLed: the survivors (still the first
    processes) recover from it in the job. Open MPI 5.0's launcher cannot spawn into a job that lost a rank after
    it grew (tried: the new rank's merge failed, opal_modex_recv -46, and prterun crashed or hung, 3 of 3 runs),
    so rank 0 says once why it does not grow again and the job finishes at reduced size, every step once."""
    # --hang-timeout 120: a job that stops making progress (seen once in CI: the survivors and prterun still up
    # after 300 s) ends within finish's bound, and its report says where every rank stood
    job = GrowJob(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:5", "--epochs", "4",
                  "--hang-timeout", "120", spare="noded:2", layout="nodea:1,nodeb:1,nodec:1,noded:2")
    pids = job.kill_when_stalled(1)
    try:
        hold_survivors_while_the_spare_warms(job.output, [pids[0], pids[2]],
                                             ended=lambda: job.process.poll() is not None)
        joined = job.wait_for("the grow", lambda: re.findall(r"grow: this process \(pid (\d+)\) joins", job.output()))
    except pytest.fail.Exception:  # mpirun ended before the grow: its spawn crash? (seen: "double free or corruption")
        status = job.process.returncode
        crash = prterun_crash(status, job.output()) if status is not None else None
        if crash is not None and failure.spawning(job.run_dir / failure.FAILURES_DIR) is not None:
            pytest.xfail(excuse(crash, "during the first spawn"))
        raise
    job.wait_for("full size", lambda: "running at full size again" in job.output())
    # in the grown job's first steps: DDP's bucket re-layout after the new wrap is under way then, watched (it
    # ran inside DDP's forward, unwatched, and a survivor once waited there for a live peer: CI)
    subprocess.run(["kill", "-KILL", joined[0]], check=False)
    status = job.finish(timeout=300)
    output = job.output()
    finished = (job.run_dir / "summary.json").exists()
    crash = prterun_crash(status, output)
    if not finished and crash is not None and failure.spawning(job.run_dir / failure.FAILURES_DIR) is not None:
        pytest.xfail(excuse(crash, "during the spawn"))
    if not finished and crash is not None and status in CRASH_STATUSES:
        # seen once in 4 runs: prterun crashed as the spawned rank was killed, after the grow had ended
        pytest.xfail(excuse(crash, "around the spawned rank"))
    # 137: mpirun reports the spawned job's rank that the test SIGKILLed (seen in 1 run of 3; under launch the
    # job's finished mark decides); the others: its crash after a grown job finished
    assert status == 0 or (status in (137, -11, -6, 139, 134) and finished), \
        f"status {status}\n{output[-6000:]}{job.hang_reports()}"
    summary = json.loads((job.run_dir / "summary.json").read_text())
    causes = [(r["cause"], r["hosts_lost"] or r["hosts_added"]) for r in summary["recoveries"]]
    assert causes == [("process_failed", ["nodeb"]), ("grew", ["noded"]), ("process_failed", ["noded"])], causes
    assert summary["recoveries"][2]["ranks_lost"] == [2] and summary["world_size"] == 2, summary["recoveries"]
    assert output.count("not growing back: Open MPI v5.0") == 1, output[-3000:]
    assert "cannot spawn again into a job that lost a rank after it grew" in output
    assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]  # the first survivors, twice
    steps = [r["step"] for r in metrics(job.run_dir) if r["kind"] == "step"]
    # 30 an epoch, 4 epochs: none repeated. The grown rank is killed at any point of a step: where the survivors
    # had finished that step (steps_lost 0), its metrics line is lost with the reduction that failed
    second = summary["recoveries"][2]
    missing = set(range(1, 121)) - set(steps)
    assert steps == sorted(set(steps)) and steps[-1] == 120, steps
    assert missing <= ({second["step"]} if second["steps_lost"] == 0 else set()), (missing, second)


def test_without_a_spare_slot_the_job_says_why_once_and_finishes_at_reduced_size(hosts, tmp_path):
    """No spare named: after the recovery rank 0 says once why it does not grow, and the job finishes on the
    survivors as before (noded stays idle)."""
    job = GrowJob(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:5", spare="")
    job.kill_when_stalled(1)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert output.count("not growing back: no spare slot to grow onto") == 1, output[-3000:]
    assert "joins as rank" not in output and "grew back" not in output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert [r["cause"] for r in summary["recoveries"]] == ["process_failed"] and summary["world_size"] == 2
