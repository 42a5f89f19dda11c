"""Hot spares (mpiddp.job.spares, mpiddp.elastic.spawning.wake_and_merge): the rule in-process, the MPI layer
under a real `mpirun --with-ft ulfm`."""

import json
import subprocess
import sys

import pytest

from conftest import REPO, find_mpirun, hold_survivors_while_the_spare_warms
from mpiddp.job.spares import spare_count
from test_leftovers import assert_nothing_left, marked_env
from test_recovery_e2e import _ulfm_missing, steps_logged

PROGRAM = REPO / "tests" / "programs" / "hot_spare_layer.py"


def test_the_spare_count_is_a_whole_number_said_in_one_line():
    assert spare_count({}) == 0 and spare_count({"MPIDDP_SPARE_RANKS": " 2 "}) == 2
    with pytest.raises(ValueError, match="give the number of hot spare ranks"):
        spare_count({"MPIDDP_SPARE_RANKS": "two"})


@pytest.mark.mpi
@pytest.mark.parametrize("value, said", [("two", "give the number of hot spare ranks"),
                                         ("2", "leaves no rank to train with -np 2")])
def test_a_spare_count_that_cannot_be_ends_every_rank_with_one_line(tmp_path, value, said):
    env, mark = marked_env(MPIDDP_SPARE_RANKS=value)
    command = [find_mpirun(), "-np", "2", "-x", "MPIDDP_SPARE_RANKS", sys.executable, "-m", "mpiddp", "--run-dir",
               str(tmp_path / "run"), "--epochs", "1", "--no-progress", "--wandb", "disabled"]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    finally:
        assert_nothing_left(mark)
    assert done.returncode == 2 and "mpiddp: MPIDDP_SPARE_RANKS=" in done.stderr, done.stderr
    assert said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_each_process_alone_in_its_world_leaves_the_launcher_mismatch_to_be_named(monkeypatch):
    """mpi4py built against another MPI than the launcher's: every process sees a world of one. The spares are
    not split off then (which would say "-np 1 leaves no rank"): the bootstrap's launcher check names the cause."""
    from types import SimpleNamespace

    from mpiddp.job.mpistart import _split_or_exit

    world = SimpleNamespace(Get_size=lambda: 1, Get_rank=lambda: 0)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "3")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "0")
    assert _split_or_exit(world, 1) is world
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    with pytest.raises(SystemExit):  # one process that leaves no rank to train: said in one line
        _split_or_exit(world, 1)


@pytest.mark.mpi
def test_a_check_with_a_hot_spare_ends_and_releases_it(tmp_path):
    """`python -m mpiddp check` never grows back: its spare waits for the end and leaves with the workers."""
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    command = [find_mpirun(), "--with-ft", "ulfm", "--oversubscribe", "-np", "3", "-x", "MPIDDP_SPARE_RANKS",
               sys.executable, "-m", "mpiddp", "check", "--device", "cpu", "--runs-root", str(tmp_path)]
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    finally:
        assert_nothing_left(mark)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 ranks" in done.stdout + done.stderr, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("first_spare_dies", [False, True], ids=["both-wait", "first-spare-dies"])
def test_survivors_grow_back_onto_a_waiting_spare_and_release_the_other(tmp_path, first_spare_dies):
    """With two spares: the first taken in, the second released at the end; or, the first dead while it waited,
    the second taken in (rank 0 chooses among the live ones) and nothing left to release."""
    reason = _ulfm_missing()
    if reason:
        pytest.skip(reason)
    env, mark = marked_env(PYTHONPATH=str(REPO), MPIDDP_SPARE_RANKS="2")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", "5", "-x", "MPIDDP_SPARE_RANKS", sys.executable,
               str(PROGRAM), str(tmp_path), *(["first-spare-dies"] if first_spare_dies else [])]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    finally:
        assert_nothing_left(mark)
    assert done.returncode == 0, done.stdout + done.stderr
    workers = {int(p.suffix[1:]): json.loads(p.read_text()) for p in tmp_path.glob("worker.*")}
    assert sorted(workers) == [0, 2], workers  # world rank 1 died; the others went on
    for steps, size, grew in workers.values():
        assert (steps, size) == (30, 3) and set(grew) == {"spawn", "merge"}, workers
    (joined,) = tmp_path.glob("joined.*")
    assert joined.name == "joined.2" and json.loads(joined.read_text()) == [20, 3]  # the last rank of the grown job
    assert len(list(tmp_path.glob("released.*"))) == (0 if first_spare_dies else 1)  # told the job ended


# ---- the trainer with a hot spare, on four fake hosts ------------------------------------------------------------

HOSTS = "nodea:1,nodeb:1,nodec:1,noded:1"  # -np 4: the last rank, on noded, is the hot spare


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _ulfm_missing()
    if reason:
        pytest.skip(reason)
    from fakehosts import FakeHosts, running_fake_hosts

    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec", "noded"], tmp_path_factory.mktemp("hot-hosts"),
                                      tag="s")) as cluster:
        yield cluster


def hot_job(hosts, tmp_path, *flags: str, spares: int = 1, workers: str = "nodea:1,nodeb:1,nodec:1"):
    """`mpirun --with-ft ulfm -np W+spares` of the trainer with MPIDDP_SPARE_RANKS=spares: the `workers` slots
    train (three ranks on three hosts by default), noded's wait."""
    from test_recovery_e2e import JOB, Job

    layout = f"{workers},noded:{spares}" if spares else workers
    ranks = sum(int(slot.split(":")[1]) for slot in layout.split(","))

    class HotJob(Job):
        def __init__(self) -> None:
            self.run_dir, self.log = tmp_path / "run", tmp_path / "job.log"
            env, self.mark = marked_env(MPIDDP_SPARE_RANKS=str(spares))
            env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
            command = [find_mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", str(ranks), "-H",
                       layout, "-x", "MPIDDP_SPARE_RANKS", sys.executable,
                       "-m", "mpiddp", "--run-dir", str(self.run_dir), *JOB, *flags]
            self.start = lambda: self._start(hosts.command_on("nodea", command), env)
            self.start()
            self.relaunches = 0

    return HotJob()


def test_a_job_whose_launcher_never_started_is_launched_once_more_even_where_only_its_end_is_awaited(tmp_path):
    """HotJob's (and GrowJob's) Job: Open MPI's start-up race on the fake hosts ("A daemon failed to report back",
    status 213, nothing of mpiddp ran; seen in CI under load) launches the job again (at most twice) also in
    `finish`, which a job nobody waits on before its end goes straight to; a third such end, or one where a rank
    ran, stays."""
    from test_recovery_e2e import Job

    race = "echo 'A daemon failed to report back after being spawned.'; exit 213"

    def finished(*launches: str) -> int:
        job, scripts = Job.__new__(Job), iter(launches)
        env, job.mark = marked_env()
        job.log, job.relaunches = tmp_path / "job.log", 0
        job.start = lambda: job._start(["sh", "-c", next(scripts)], env)
        job.start()
        return job.finish(timeout=60)

    assert finished(race, "echo trained; exit 0") == 0
    assert finished(race, race, "echo trained; exit 0") == 0  # it struck twice in a row once, in CI
    assert finished(race, race, race) == 213  # STARTUP_RACE_RETRIES times only
    assert finished(f"echo 'mpiddp: rank 0 ...'; {race}", "exit 0") == 213  # a rank ran: not the launcher's race
    assert finished("exit 3", "exit 0") == 3


def stalled_pids(job, processes: int) -> dict[int, int]:
    """Once all `processes` of the job run and the --inject-fault stall-data rank says it stalls: rank -> pid."""
    from conftest import rank_pids

    pids = job.wait_for("the processes", lambda: (found := rank_pids(job.run_dir)) and len(found) == processes
                        and found)
    job.wait_for("the stall", lambda: "injecting fault 'stall-data'" in job.output())
    return pids


def kill_rank_1_and_hold_at_the_wake(job, pids: dict[int, int]) -> list[str]:
    """SIGKILL rank 1; once the grow has woken the first spare, SIGSTOP the survivors and that spare: their pids,
    for the caller to resume (SIGCONT) as its case needs."""
    subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
    job.wait_for("the grow's start", lambda: "growing back: ranks [2] woken" in job.output())
    held = [str(pids[0]), str(pids[2]), str(pids[3])]  # the survivors and the woken spare
    subprocess.run(["kill", "-STOP", *held], check=False)
    return held


@pytest.mark.mpi
def test_the_trainer_grows_back_onto_a_hot_spare_without_a_spawn(hosts, tmp_path):
    """Rank 1 (nodeb) killed at step 5: the survivors recover, wake the spare waiting on noded (no process started,
    nothing through the launcher's PMIx_Connect: no spawn mark), it warms up while they train and joins; the job
    ends on 3 ranks, every step once, mpirun's status 0, nothing left running."""
    from mpiddp import failure
    from test_recovery_e2e import metrics, survivors_pids

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:5")
    pids = stalled_pids(job, 4)
    subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
    hold_survivors_while_the_spare_warms(job.output, [pids[0], pids[2]])
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]
    assert f"this process (pid {pids[3]}) joins as rank 2 of 3" in output, output[-3000:]
    assert "running at full size again: 3 ranks" in output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    recovery, grew = summary["recoveries"]
    assert (recovery["ranks_lost"], recovery["world_before"], recovery["world_after"]) == ([1], 3, 2), recovery
    assert (grew["cause"], grew["ranks_added"], grew["hosts_added"], grew["world_after"]) == \
        ("grew", [2], ["noded"], 3), grew
    assert grew["survivors_stall"] >= 0 and grew["ordinary_step"] > 0 and grew["warm_up"] > 0, grew
    assert failure.last_spawn(job.run_dir / failure.FAILURES_DIR) is None  # nothing was spawned
    steps = [r["step"] for r in metrics(job.run_dir) if r["kind"] == "step"]
    assert steps == list(range(1, 61)), steps


@pytest.mark.mpi
def test_a_grown_rank_lost_is_recovered_from_and_the_job_grows_again_onto_the_second_spare(hosts, tmp_path):
    """Two spares wait on noded. Rank 1 (nodeb) killed: the first spare joins as rank 2; then that grown rank is
    killed too: the survivors recover again and take the second spare in (no Open MPI 5.0 refusal of a second
    grow: nothing is spawned). The survivors' pids live on throughout; no step is trained twice; the job ends
    at full size with mpirun's status 0."""

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "3", "--inject-fault", "stall-data:1:5",
                  spares=2)
    pids = stalled_pids(job, 5)
    subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
    hold_survivors_while_the_spare_warms(job.output, [pids[0], pids[2]])
    job.wait_for("the first grow", lambda: "running at full size again: 3 ranks" in job.output())
    assert f"this process (pid {pids[3]}) joins as rank 2 of 3" in job.output(), job.output()[-3000:]
    grown_at = len(steps_logged(job))
    job.wait_for("two steps at full size", lambda: len(steps_logged(job)) >= grown_at + 2)  # its stand-still ended
    subprocess.run(["kill", "-KILL", str(pids[3])], check=False)  # the grown rank
    hold_survivors_while_the_spare_warms(job.output, [pids[0], pids[2]], grow=2)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert f"this process (pid {pids[4]}) joins as rank 2 of 3" in output, output[-3000:]
    assert output.count("running at full size again: 3 ranks") == 2, output[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    changes = [(item["cause"] == "grew", item["world_after"]) for item in summary["recoveries"]]
    assert changes == [(False, 2), (True, 3), (False, 2), (True, 3)], summary["recoveries"]
    grows = [item for item in summary["recoveries"] if item["cause"] == "grew"]
    assert all(item["survivors_stall"] >= 0 and item["ordinary_step"] > 0 for item in grows), grows
    assert not any("survivors_stall" in item for item in summary["recoveries"] if item["cause"] != "grew")
    for pid in (pids[0], pids[2]):  # the survivors went on in the same processes to the end
        assert f"this process (pid {pid}) goes on as rank" in output, output[-3000:]
    # the grown rank dies at a random point of a step (the first loss is held before one); where that is the
    # step's exchanges after its update, the survivors catch up on it and write its line as the epoch runs again
    assert steps_logged(job) == list(range(1, 91))


@pytest.mark.mpi
def test_a_rank_lost_while_the_spare_warms_up_gives_that_grow_up_not_the_spare(hosts, tmp_path):
    """Two spares wait on noded. Rank 1 (nodeb) killed: the first spare is woken and warms up; before it is
    taken in, rank 2 (nodec) is killed too. The survivors give that grow up, not the spare: it finishes its
    warm-up, waits again, and the next grow takes both spares in: the job ends at full size (3 ranks) with
    mpirun's status 0. (The woken spare and the survivors are held still while rank 2 dies, so the take-in cannot
    come first however fast the spare warms up.)"""

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "3", "--inject-fault", "stall-data:1:5",
                  spares=2)
    pids = stalled_pids(job, 5)
    held = kill_rank_1_and_hold_at_the_wake(job, pids)
    try:
        subprocess.run(["kill", "-KILL", str(pids[2])], check=False)
        subprocess.run(["kill", "-CONT", str(pids[0])], check=False)
        job.wait_for("the grow given up", lambda: "growing back given up" in job.output())
        subprocess.run(["kill", "-STOP", str(pids[0])], check=False)  # alone, it would end the job meanwhile
        subprocess.run(["kill", "-CONT", str(pids[3])], check=False)
        job.wait_for("the spare waiting again", lambda: "this hot spare waits again" in job.output())
    finally:
        subprocess.run(["kill", "-CONT", *held], check=False)
    # the second grow: both spares warm up (three warm lines in all) while rank 0 is held
    job.wait_for("the second grow's start", lambda: job.output().count("growing back: ranks") >= 2)
    subprocess.run(["kill", "-STOP", str(pids[0])], check=False)
    try:
        job.wait_for("both spares warm", lambda: job.output().count("grow: warm in") >= 3)
    finally:
        subprocess.run(["kill", "-CONT", str(pids[0])], check=False)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert "running at full size again: 3 ranks" in output, output[-4000:]
    assert f"this process (pid {pids[3]}) joins as rank" in output, output[-4000:]
    assert f"this process (pid {pids[4]}) joins as rank" in output, output[-4000:]
    assert "MPI_ERR_RANK" not in output and "not growing back" not in output, output[-4000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert [item["world_after"] for item in summary["recoveries"]][-1] == 3, summary["recoveries"]


@pytest.mark.mpi
def test_training_that_ends_while_the_hot_spare_warms_up_gives_the_grow_up_and_the_spare_leaves_with_the_job(
        hosts, tmp_path):
    """Rank 1 (nodeb) killed at step 40 of 60: the spare on noded is woken and warms up, but training ends first
    (the spare is held still from its wake until the survivors have ended). Rank 0 gives the grow up saying the
    spare leaves with the job, not that it waits again; the spare, resumed, leaves; mpirun's status is 0, the
    job ends on 2 ranks, every step once, nothing left running."""
    from test_recovery_e2e import metrics

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:40")
    pids = stalled_pids(job, 4)
    held = kill_rank_1_and_hold_at_the_wake(job, pids)
    try:
        subprocess.run(["kill", "-CONT", str(pids[0]), str(pids[2])], check=False)  # the survivors train to the end
        job.wait_for("the grow given up", lambda: "growing back given up" in job.output())
    finally:
        subprocess.run(["kill", "-CONT", *held], check=False)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert output.count("growing back given up: training ended while they warmed up; the hot spares on noded leave "
                        "with the job") == 1, output[-4000:]
    assert "the hot spares on noded wait again" not in output and "grew back" not in output, output[-4000:]
    # the spare cannot tell the job's end from a failure by the revoke alone: it says both, and is released
    assert "this hot spare waits again (the next grow takes it in, the job's end releases it)" in output
    summary = json.loads((job.run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and [r["cause"] for r in summary["recoveries"]] == ["process_failed"]
    steps = [r["step"] for r in metrics(job.run_dir) if r["kind"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 60, steps


@pytest.mark.mpi
def test_a_silent_hot_spare_is_found_before_a_grow_and_the_job_goes_on_at_reduced_size(hosts, tmp_path):
    """The spare on noded is stopped (SIGSTOP: alive for MPI, but it answers nothing) before rank 1 is killed. A
    wake would wait for it in the spares' world's shrink until the grow's 60 s bound ends the job; rank 0 asks the
    spares first, and says in one line that it does not answer: the survivors go on at reduced size. (The spare is
    never resumed: nothing else would end it, and mpirun under --with-ft ulfm would wait for it for good, so the
    job's end ends it with one line, and mpirun's status stays the job's own, 0.)"""

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "3", "--inject-fault", "stall-data:1:5")
    pids = stalled_pids(job, 4)
    subprocess.run(["kill", "-STOP", str(pids[3])], check=False)
    try:
        subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
        job.wait_for("the silent spare said", lambda: "not growing back: the hot spare on noded does not answer"
                     in job.output())
        status = job.finish()
    finally:
        subprocess.run(["kill", "-CONT", str(pids[3])], check=False)  # where the job did not end it
    output = job.output()
    assert status == 0, output[-6000:]
    assert "mpiddp: the hot spare on noded never answered; the job ends it (MPI_Abort, status 0)" in output
    assert "(stopped, or its host silent); the job goes on with 2 ranks" in output, output[-4000:]
    assert "has not returned after" not in output and "growing back: ranks" not in output, output[-4000:]
    assert output.count("not growing back") == 1, output[-4000:]


@pytest.mark.mpi
def test_a_hot_spare_never_needed_is_released_and_the_job_ends_with_status_0(hosts, tmp_path):
    """Nothing fails: the workers tell the spare the job ended as they exit (MPI_Finalize would otherwise wait for
    it), it leaves in one line, mpirun ends with status 0, nothing is left running."""
    job = hot_job(hosts, tmp_path, "--epochs", "1")
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert "this hot spare was not needed: the job ended" in output, output[-3000:]
    assert json.loads((job.run_dir / "summary.json").read_text())["world_size"] == 3


@pytest.mark.mpi
@pytest.mark.parametrize("runner", [False, True], ids=["mpirun", "mpiddp-run"])
def test_a_script_grows_back_onto_a_hot_spare_and_every_rank_ends_with_the_same_model(hosts, tmp_path, runner):
    """tests/programs/recoverable_script.py under `mpirun --with-ft ulfm -np 4` with MPIDDP_SPARE_RANKS=1, plain
    (mpiddp.init()) and under `python -m mpiddp run`: rank 1 killed, the survivors take noded's spare in at a
    commit, every rank ends at the last step with the same model, mpirun's status 0."""
    from test_script_grow_e2e import UNTIL_FULL
    from test_script_recovery_e2e import AT_STEP, PROGRAM as SCRIPT, STEPS, Script

    script = Script(hosts, tmp_path, 1, command=lambda out: [
        find_mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", "4", "-H", HOSTS, "-x",
        "MPIDDP_SPARE_RANKS", sys.executable, *(["-m", "mpiddp", "run"] if runner else []), str(SCRIPT),
        str(out), UNTIL_FULL, "1", str(AT_STEP)], MPIDDP_SPARE_RANKS="1")
    pids = script.kill_victim()
    status = script.finish()
    output = script.output()
    assert status == 0, output[-6000:]
    finals = {json.loads(p.read_text())["key"]: json.loads(p.read_text()) for p in script.out.glob("final.*.json")}
    assert sorted(finals) == ["0", "2", "joined.2"], output[-6000:]
    assert len({final["digest"] for final in finals.values()}) == 1, finals  # the same model on every rank
    assert {final["world_size"] for final in finals.values()} == {3}, finals
    assert all(final["step"] >= STEPS for final in finals.values()), finals
    assert (finals["0"]["pid"], finals["2"]["pid"]) == (pids[0], pids[2])
    assert "grew back: ranks [2] joined on noded" in output, output[-3000:]


@pytest.mark.mpi
def test_rank_0_killed_the_new_rank_0_takes_the_hot_spare_in(hosts, tmp_path):
    """Rank 0 (nodea, the store's host) killed at step 5: the survivor that becomes rank 0 chooses and wakes the
    spare; the job is at full size again and mpirun ends with status 0."""

    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:0:5")
    pids = stalled_pids(job, 4)
    subprocess.run(["kill", "-KILL", str(pids[0])], check=False)
    hold_survivors_while_the_spare_warms(job.output, [pids[1], pids[2]])
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert "running at full size again: 3 ranks" in output, output[-3000:]
    assert f"this process (pid {pids[3]}) joins as rank 2 of 3" in output, output[-3000:]


@pytest.mark.mpi
@pytest.mark.parametrize("spares", [0, 1])
def test_two_ranks_a_host_one_lost_the_job_goes_on_in_the_job_at_the_same_global_batch(hosts, tmp_path, spares):
    """The layout of GPU clusters, several ranks a host: 2 on nodea, 2 on nodeb, rank 3 (nodeb) killed. The global
    batch of 64 does not split over 3 ranks: they share each step unevenly (22, 21, 21), each gradient weighted by
    its share, and finish in the same processes with every step once (22 an epoch, as on 4). With a hot spare
    waiting on noded the job grows back to 4 at once."""
    from test_recovery_e2e import metrics

    epochs = 2
    job = hot_job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", str(epochs), "--inject-fault",
                  "stall-data:3:5", spares=spares, workers="nodea:2,nodeb:2")
    pids = stalled_pids(job, 4 + spares)
    subprocess.run(["kill", "-KILL", str(pids[3])], check=False)
    if spares:
        hold_survivors_while_the_spare_warms(job.output, [pids[rank] for rank in range(3)])
    status = job.finish()
    output = job.output()
    assert status == 0, output[-6000:]
    assert ("3 ranks go on at the same global batch (21 or 22 per rank, each rank's gradient weighted by its share, "
            "in 2 micro-batches)") in output, output[-4000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    changes = [(item["cause"], item["world_after"]) for item in summary["recoveries"]]
    assert changes == [("process_failed", 3)] + ([("grew", 4)] * spares), summary["recoveries"]
    assert summary["recoveries"][0]["hosts_lost"] == ["nodeb"]
    assert summary["world_size"] == 3 + spares and summary["eval_accuracy"] > 0.8, summary
    steps = [r["step"] for r in metrics(job.run_dir) if r["kind"] == "step"]
    assert steps == list(range(1, 22 * epochs + 1)), steps
    # `report` draws the real record: epochs on 3 ranks, then (grown) on 4
    drawn = subprocess.run([sys.executable, "-m", "mpiddp", "report", str(job.run_dir)], cwd=REPO,
                           capture_output=True, text=True, timeout=120)
    assert drawn.returncode == 0 and "Traceback" not in drawn.stderr, drawn.stdout + drawn.stderr
    assert list(job.run_dir.glob("*.png")), drawn.stdout
