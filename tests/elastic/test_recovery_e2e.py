"""In-job recovery of the built-in trainer on three fake hosts (nodea, nodeb, nodec; one rank each) under
`mpirun --with-ft ulfm`: a rank is SIGKILLed by the test while its peers wait for it in the gradient all-reduce,
and the survivors (the same processes) finish the run on 2 ranks at the same global batch, or, before the first
step, the job fails fast as without recovery.

The victim is held with `--inject-fault stall-data:RANK:STEP` (it blocks before loading the batch after step STEP,
so its peers go on into the step's all-reduce and wait there), then killed once it says so."""

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import REPO, STARTUP_RACE_RETRIES, find_mpirun, launcher_never_started, rank_pids
from mpiddp import recoveries
from fakehosts import FakeHosts, running_fake_hosts
from test_leftovers import assert_nothing_left, marked_env, where_they_wait

pytestmark = pytest.mark.mpi
HOSTS = "nodea:1,nodeb:1,nodec:1"
# 1438 digits training samples: at 16 per rank x 3 ranks, 30 steps an epoch (480 per rank, 30 batches of 16)
JOB = ("--dataset", "digits", "--epochs", "2", "--batch-size", "16", "--log-every", "1", "--no-progress",
       "--wandb", "disabled")


def _ulfm_missing() -> str | None:
    mpirun = find_mpirun()
    if mpirun is None or not (Path(mpirun).parent / "ompi_info").exists():
        return "needs Open MPI (with ULFM) beside this python"
    info = subprocess.run([str(Path(mpirun).parent / "ompi_info")], capture_output=True, text=True).stdout
    return None if re.search(r"FT MPI support: yes", info) else "this Open MPI has no ULFM (FT MPI support)"


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _ulfm_missing()
    if reason:
        pytest.skip(reason)
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path_factory.mktemp("recovery-hosts"),
                                      tag="r")) as cluster:
        yield cluster


class Job:
    """`mpirun --with-ft ulfm -np 3` of the trainer on the three hosts, started on nodea, output in a file."""

    def __init__(self, hosts: FakeHosts, tmp_path: Path, *flags: str, layout: str = HOSTS) -> None:
        self.run_dir, self.log = tmp_path / "run", tmp_path / "job.log"
        env, self.mark = marked_env()
        env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
        command = [find_mpirun(), *hosts.openmpi_args(), "--with-ft", "ulfm", "-np", "3", "-H", layout,
                   sys.executable, "-m", "mpiddp", "--run-dir", str(self.run_dir), *JOB, *flags]
        self.start = lambda: self._start(hosts.command_on("nodea", command), env)
        self.start()
        self.relaunches = 0

    def _start(self, command: list[str], env: dict[str, str]) -> None:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def launched_again(self) -> bool:
        """Whether the launcher ended in Open MPI's start-up race before any rank ran (conftest's
        launcher_never_started), and so was launched again: at most STARTUP_RACE_RETRIES times a job, by whichever
        of wait_for and finish sees it."""
        if (self.relaunches >= STARTUP_RACE_RETRIES or self.process.poll() in (None, 0)
                or not launcher_never_started(self.output())):
            return False
        self.relaunches += 1
        self.start()
        return True

    def wait_for(self, what: str, predicate, deadline_s: float = 180):
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline and (self.process.poll() is None or self.launched_again()):
            found = predicate()
            if found:
                return found
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising
        self.process.kill()
        assert_nothing_left(self.mark)
        pytest.fail(f"never saw {what}:\n{self.output()[-5000:]}")

    def kill_when_stalled(self, victim: int, kind: str = "stall-data") -> dict[int, int]:
        """Every rank's pid once all three run; SIGKILL `victim` once it holds up the others (its --inject-fault
        `kind` said so). Returns the pids."""
        pids = self.wait_for("three ranks", lambda: (found := rank_pids(self.run_dir)) and len(found) == 3 and found)
        self.wait_for("the stall", lambda: f"injecting fault '{kind}'" in self.output())
        pids[victim] = rank_pids(self.run_dir)[victim]  # the same process: a rank's pid never changes
        subprocess.run(["kill", "-KILL", str(pids[victim])], check=False)
        return pids

    def hang_reports(self) -> str:
        """The hang watchdog's reports of this job (every rank's stacks), for a failure's message; '' if none."""
        return "".join(f"\n{report.name}:\n{report.read_text(errors='replace')[:12000]}"
                       for report in sorted(self.run_dir.glob("hang-*.txt")))

    def finish(self, timeout: float = 240) -> int:
        try:
            status = self.process.wait(timeout=timeout)
            while self.launched_again():
                status = self.process.wait(timeout=timeout)
            return status
        except subprocess.TimeoutExpired:
            waiting = where_they_wait(self.mark)  # before the SIGTERM changes it
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)
            output = f"{self.output()[-5000:]}\nwhere the job's processes waited:\n{waiting}"
            output += self.hang_reports()
            try:  # what was left is said with the job's log, not instead of it (the assertion in `finally` would be)
                assert_nothing_left(self.mark)
            except AssertionError as left:
                output += f"\n{left}"
            pytest.fail(f"the job did not end:\n{output}")
        finally:
            assert_nothing_left(self.mark)


def survivors_pids(output: str) -> dict[int, int]:
    """New rank -> pid, from the line each survivor logs after a recovery."""
    found = re.findall(r"this process \(pid (\d+)\) goes on as rank (\d+) of \d+", output)
    return {int(rank): int(pid) for pid, rank in found}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def steps_logged(job) -> list[int]:
    """The steps rank 0 has logged so far (metrics.jsonl; a line still being written is left out)."""
    path = job.run_dir / "metrics.jsonl"
    steps = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record["kind"] == "step":
            steps.append(record["step"])
    return steps


def assert_recovered(job: Job, pids: dict[int, int], victim: int, host: str) -> dict:
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    survivors = [rank for rank in range(3) if rank != victim]
    assert survivors_pids(output) == {new: pids[old] for new, old in enumerate(survivors)}, output[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["ranks_lost"], recovery["hosts_lost"], recovery["world_before"], recovery["world_after"]) == \
        ([victim], [host], 3, 2), recovery
    assert recovery["cause"] == "process_failed" and recovery["step"] == 5 and recovery["steps_lost"] == 1, recovery
    assert set(recovery["phases"]) == {"detect", "agree_and_shrink", "process_group", "ddp", "first_step"}
    assert all(isinstance(value, float) and value >= 0 for value in recovery["phases"].values()), recovery
    # the same global batch: 16 x 3 ranks x 1 = 12 x 2 ranks x 2 accumulation
    assert "2 ranks go on at the same global batch (12 per rank x 2 accumulation)" in output
    assert "running at reduced size 2 of 3 ranks" in output
    records = metrics(job.run_dir)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == list(range(1, 61)), steps  # every step once, none repeated or skipped: 30 an epoch as on 3
    first, second = [r for r in records if r["kind"] == "epoch"]
    assert (first["step"], second["step"]) == (30, 60)
    # the survivors went on at sample 240 of epoch 1 (5 steps x 48): 49 batches of 12 on each of 2 ranks, to
    # sample 1416 (the tail of 22 is left out as a trailing short batch is); the epoch's record counts each
    # survivor's 5 x 16 samples before the failure too (the dead rank's are gone with it): 2 x (80 + 588) = 1336.
    # Had they started the epoch again, they would have trained 1416 samples after the recovery, not 1176
    assert round(first["images_per_second"] * first["epoch_time_s"]) == 1336, first
    assert summary["steps"] == 60, summary  # every step of this job, those before the failure included
    (recorded,) = recoveries.recorded(job.run_dir / "failures")  # on record as it happened, before the summary
    assert (recorded["ranks_lost"], recorded["hosts_lost"], recorded["step"]) == ([victim], [host], 5), recorded
    assert summary["world_size"] == 2 and summary["eval_accuracy"] > 0.8, summary
    return summary


def test_a_rank_killed_in_the_mpi_gradient_all_reduce_is_left_behind_and_the_survivors_finish(hosts, tmp_path):
    """The rank on the second host SIGKILLed mid-epoch while its peers wait in the MPI all-reduce (MPI carries
    the gradients): the survivors are told by MPI, and the same processes finish on 2 ranks."""
    job = Job(hosts, tmp_path, "--grad-transport", "mpi", "--inject-fault", "stall-data:1:5")
    pids = job.kill_when_stalled(1)
    assert_recovered(job, pids, 1, "nodeb")


def test_rank_0_and_its_store_killed_in_the_gloo_all_reduce_the_survivors_finish(hosts, tmp_path):
    """Rank 0, which holds the rendezvous store, SIGKILLed while its peers wait in a gloo all-reduce (which no
    abort interrupts): MPI tells them, the new rank 0 opens a new store, and the job finishes on nodeb and nodec."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:0:5")
    pids = job.kill_when_stalled(0)
    assert_recovered(job, pids, 0, "nodea")
    # a survivor's request to the dead store: torch's one-line error, not its C++ stack (mpiddp.cpplog)
    assert "Exception raised from" not in job.output() and "frame #" not in job.output(), job.output()[-5000:]


def test_a_kill_before_the_first_step_fails_fast_saying_why(hosts, tmp_path):
    """Before the first training step there is nothing to go on from: one line why, then the job ends as it
    would without recovery (a non-zero status, so `launch` relaunches it), and nothing is left running."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:0")
    job.kill_when_stalled(1)
    status = job.finish()
    output = job.output()
    assert status != 0, output[-5000:]
    assert "in-job recovery not possible: a rank failed before the first training step" in output, output[-5000:]
    assert "goes on as rank" not in output
    assert not (job.run_dir / "summary.json").exists()


def test_two_failures_one_after_another_leave_one_rank_that_finishes(hosts, tmp_path):
    """Rank 1 killed mid-epoch, then, once the survivors have trained on, the rank on nodec: the last survivor
    (the same process as rank 0 at the start) finishes alone at the same global batch. The ranks are slowed
    down (a straggler drill on every rank) so the test's kills land in training, never in the final save."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "3", "--save-every", "100",
              "--inject-fault", "slow-compute:all:0")

    def step_at_least(step: int) -> bool:
        return (job.run_dir / "metrics.jsonl").exists() and \
            any(r["kind"] == "step" and r["step"] >= step for r in metrics(job.run_dir))

    job.wait_for("step 3", lambda: step_at_least(3))
    pids = rank_pids(job.run_dir)
    subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
    job.wait_for("the first recovery", lambda: "running at reduced size 2 of 3" in job.output())
    resumed = max(r["step"] for r in metrics(job.run_dir) if r["kind"] == "step")
    job.wait_for("steps on 2 ranks", lambda: step_at_least(resumed + 3))
    subprocess.run(["kill", "-KILL", str(pids[2])], check=False)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    first, second = summary["recoveries"]
    assert (first["ranks_lost"], first["hosts_lost"], first["world_before"], first["world_after"]) == \
        ([1], ["nodeb"], 3, 2), first
    assert (second["ranks_lost"], second["hosts_lost"], second["world_before"], second["world_after"]) == \
        ([1], ["nodec"], 2, 1), second
    # the first per-rank batch (16) is the most a rank takes: 48 on one rank is 16 x 3, not 12 x 4
    assert "1 ranks go on at the same global batch (16 per rank x 3 accumulation)" in output
    assert survivors_pids(output)[0] == pids[0]
    records = metrics(job.run_dir)
    steps = [r["step"] for r in records if r["kind"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 90, steps  # none repeated; 30 an epoch throughout
    assert [r["step"] for r in records if r["kind"] == "epoch"] == [30, 60, 90]
    assert summary["world_size"] == 1


def test_a_snapshot_after_a_recovery_records_the_split_it_was_trained_with(hosts, tmp_path):
    """A stop after a recovery saves mid-epoch: the snapshot says 2 ranks of 12 x 2 accumulation (what its
    position counts in), not the start's 16 per rank on 3, so a resume lands on the sample it stopped at."""
    from mpiddp.trainer.checkpoint import load

    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-data:1:5")
    job.kill_when_stalled(1)
    job.wait_for("the recovery", lambda: "running at reduced size 2 of 3" in job.output())
    job.process.send_signal(signal.SIGUSR1)  # mpirun forwards it: the survivors agree to stop and save
    status = job.finish()
    assert status == 3, job.output()[-5000:]
    (path,) = [p for p in (job.run_dir / "checkpoints").glob("snapshot-*batch*.pt")]
    snapshot = load(path)
    assert snapshot.world_size == 2, snapshot.world_size
    assert (snapshot.config["batch_size"], snapshot.config["grad_accum"]) == (12, 2), snapshot.config


def test_under_launch_a_recovery_then_a_failure_that_ends_the_job_leaves_out_both_hosts(hosts, tmp_path):
    """`launch --min-np 2`: rank 1 (nodeb) killed, the job recovers in the job on 2 ranks; then the rank on nodec
    killed: 1 rank left, fewer than --min-np, so the job ends. attempts.json lists the recovery (recorded as it
    happened: the job ended before summary.json) and launch leaves out nodeb as well as nodec (nodea alone is too
    few for --min-np 2: it stops, saying so). Before: the recovery was missing and nodeb was not left out."""
    from test_launch_e2e import attempts, launch_command

    run_dir, log = tmp_path / "run", tmp_path / "launch.log"
    env, mark = marked_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    # --max-restarts 2: Open MPI's start-up race can cost an attempt that never started (status 213, seen)
    command = launch_command("-H", HOSTS, "-np", "3", "--min-np", "2", "--max-restarts", "2", "--launcher", "mpirun",
                             "--launcher-args", " ".join(hosts.transport_args()), "--run-dir", str(run_dir),
                             "--", "--run-dir", str(run_dir),  # the ranks' command line names it (rank_pids)
                             *(flag if flag != "2" else "3" for flag in JOB),  # 3 epochs: time for both kills
                             "--save-every", "100", "--inject-fault", "slow-compute:all:0")
    with log.open("w") as out:
        process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                                   stdout=out, stderr=subprocess.STDOUT)
    job = SimpleNamespace(process=process, run_dir=run_dir, mark=mark, output=lambda: log.read_text(errors="replace"))

    def step_at_least(step: int) -> bool:
        return (run_dir / "metrics.jsonl").exists() and \
            any(r["kind"] == "step" and r["step"] >= step for r in metrics(run_dir))

    try:
        Job.wait_for(job, "step 3", lambda: step_at_least(3))
        pids = Job.wait_for(job, "three ranks", lambda: (found := rank_pids(run_dir)) and len(found) == 3 and found)
        subprocess.run(["kill", "-KILL", str(pids[1])], check=False)
        Job.wait_for(job, "the recovery on record", lambda: recoveries.recorded(run_dir / "failures"))
        resumed = max(r["step"] for r in metrics(run_dir) if r["kind"] == "step")
        Job.wait_for(job, "steps on 2 ranks", lambda: step_at_least(resumed + 2))
        subprocess.run(["kill", "-KILL", str(pids[2])], check=False)
        status = process.wait(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
        assert_nothing_left(mark)
    assert status != 0, job.output()[-5000:]
    (attempt,) = attempts(run_dir)["attempts"]
    (recovery,) = attempt["recoveries"]
    assert (recovery["ranks_lost"], recovery["hosts_lost"], recovery["world_after"]) == ([1], ["nodeb"], 2), attempt
    assert attempt["blamed_hosts"] == ["nodec"], attempt  # the survivors' placement: rank 1 is nodec's now
    assert sorted(attempt["excluded_hosts"]) == ["nodeb", "nodec"], attempt
    assert "fewer than --min-np 2" in attempt["decision"] and "without nodeb too" in attempt["decision"], attempt


def test_a_stopped_rank_is_named_in_the_hang_file_then_ended_by_its_hosts_peer_and_the_survivors_finish(hosts, tmp_path):
    """Rank 1 on nodeb SIGSTOPped mid-epoch (alive, silent: a wedged GPU or NFS) while rank 2 shares its host: the
    hang watchdog writes the hang file, rank 2's watchdog ends rank 1 with SIGKILL (a stopped process ignores
    SIGTERM), MPI declares it failed, and the same two processes finish on 2 ranks, the recovery's cause a hang."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "3", "--hang-timeout", "8",
              layout="nodea:1,nodeb:2")

    def stepped() -> bool:
        return (job.run_dir / "metrics.jsonl").exists() and \
            any(r["kind"] == "step" and r["step"] >= 10 for r in metrics(job.run_dir))

    pids = job.wait_for("three ranks", lambda: (found := rank_pids(job.run_dir)) and len(found) == 3 and found)
    job.wait_for("step 10", stepped)  # the watchdogs have reported (with their pids) by then
    subprocess.run(["kill", "-STOP", str(pids[1])], check=False)
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    (hang_file,) = job.run_dir.glob("hang-*.txt")
    text = hang_file.read_text()
    assert "ranks behind: 1 on nodeb" in text and f"rank 1 (pid {pids[1]}) on nodeb will be ended" in text, text
    assert f"ending rank 1 (pid {pids[1]}) on nodeb with SIGKILL" in output, output[-5000:]
    assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["cause"], recovery["ranks_lost"], recovery["hosts_lost"], recovery["world_before"],
            recovery["world_after"]) == ("hang", [1], ["nodeb"], 3, 2), recovery
    assert summary["world_size"] == 2 and summary["epochs"] == 3, summary
    steps = [r["step"] for r in metrics(job.run_dir) if r["kind"] == "step"]
    assert steps == sorted(set(steps)) and steps[-1] == 90, steps  # none repeated, none skipped at the end


def test_a_rank_killed_during_the_evaluation_the_survivors_evaluate_again_on_their_new_split(hosts, tmp_path):
    """Rank 1 killed at the start of epoch 1's evaluation, while its peers wait for it in the evaluation's
    reduction: the survivors recover (no training step is lost) and evaluate the whole test set again, split over
    2 ranks; the epoch's record is written once, with its evaluation, and the run finishes."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "stall-eval:1:30")
    pids = job.kill_when_stalled(1, "stall-eval")
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    assert survivors_pids(output) == {0: pids[0], 1: pids[2]}, output[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["cause"], recovery["step"], recovery["steps_lost"], recovery["world_after"]) == \
        ("process_failed", 30, 0, 2), recovery
    records = metrics(job.run_dir)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(1, 61))
    epochs = [r for r in records if r["kind"] == "epoch"]
    assert [r["step"] for r in epochs] == [30, 60] and all(r["eval_accuracy"] > 0.5 for r in epochs), epochs
    assert summary["eval_accuracy"] > 0.8, summary


def test_a_rank_killed_after_an_epochs_last_step_the_survivors_go_on_to_its_evaluation(hosts, tmp_path):
    """Rank 1 dies right after step 30, epoch 1's last (30 batches of 16 on each of 3 ranks reach position 1440,
    past the 1438 samples: the last round is padded). On 2 ranks nothing of the epoch is left to train: the
    survivors evaluate it and train epoch 2 on the new split, every step once."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "kill:1:30")
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["step"], recovery["world_after"]) == (30, 2), recovery
    records = metrics(job.run_dir)
    assert [r["step"] for r in records if r["kind"] == "epoch"] == [30, 60], records
    assert summary["steps"] == 60 and summary["eval_accuracy"] > 0.8, summary


def leftovers(run_dir: Path) -> list[str]:
    """Temporary files of unfinished saves in the run's checkpoint directory (none may stay)."""
    return sorted(p.name for p in (run_dir / "checkpoints").glob(".*.tmp"))


def latest_snapshot(run_dir: Path):
    from mpiddp.trainer.checkpoint import load

    directory = run_dir / "checkpoints"
    return load(directory / (directory / "latest").read_text().strip())


def test_a_rank_killed_during_a_save_is_recovered_and_the_survivors_save_again(hosts, tmp_path):
    """Rank 1 SIGKILLed at the start of the final epoch's save (`--inject-fault kill-save`), while rank 0 writes
    the snapshot: the survivors give that save up (rank 0 writes atomically and moves `latest` last), recover,
    and save the epoch again; the run finishes with status 0 in one attempt. Before: "a rank failed during a save"
    ended the job and `launch` relaunched it."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--epochs", "1", "--inject-fault", "kill-save:1:30")
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    assert "injecting fault 'kill-save' at step 30" in output and "not possible" not in output, output[-5000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["ranks_lost"], recovery["step"], recovery["steps_lost"], recovery["world_after"]) == \
        ([1], 30, 0, 2), recovery
    snapshot = latest_snapshot(job.run_dir)  # the save done again, complete
    assert (snapshot.epoch, snapshot.step, snapshot.world_size) == (1, 30, 2)
    assert leftovers(job.run_dir) == []
    assert [r["step"] for r in metrics(job.run_dir) if r["kind"] == "epoch"] == [30]  # evaluated once
    assert summary["steps"] == 30 and summary["eval_accuracy"] > 0.5, summary


def test_rank_0_killed_during_a_save_then_a_stop_and_resume_continue_from_a_complete_snapshot(hosts, tmp_path):
    """Rank 0, the writer, SIGKILLed at the start of epoch 1's save: the new rank 0 saves the epoch; a stop then
    saves mid-epoch 2, and `--resume` (the same flags: the drill does not fire again) continues from that snapshot,
    complete, to the run's end."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--inject-fault", "kill-save:0:30")
    job.wait_for("the recovery", lambda: "running at reduced size 2 of 3" in job.output())
    job.wait_for("a step after it", lambda: any(r["kind"] == "step" and r["step"] > 30 for r in metrics(job.run_dir)))
    job.process.send_signal(signal.SIGUSR1)  # mpirun forwards it: the survivors agree to stop and save
    status = job.finish()
    assert status == 3, job.output()[-5000:]
    checkpoints = job.run_dir / "checkpoints"
    lineage = (checkpoints / "lineage").read_text().split()
    assert lineage[0] == "snapshot-epoch0001.pt" and "batch" in lineage[-1], lineage  # the save done again, then the stop's
    stopped = latest_snapshot(job.run_dir)
    assert stopped.epoch == 1 and stopped.step > 30 and leftovers(job.run_dir) == []
    (tmp_path / "resume").mkdir()
    resumed = Job(hosts, tmp_path / "resume", "--grad-transport", "gloo", "--run-dir", str(job.run_dir),
                  "--resume", "auto", "--inject-fault", "kill-save:0:30")
    status = resumed.finish()
    output = resumed.output()
    assert status == 0 and "injecting fault" not in output, output[-5000:]
    starts = [r for r in metrics(job.run_dir) if r["kind"] == "start"]
    assert starts[-1]["resumed_from"] == str(checkpoints / lineage[-1]) and starts[-1]["step"] == stopped.step
    assert [r["step"] for r in metrics(job.run_dir) if r["kind"] == "epoch"] == [30, 60]


def test_under_the_late_commit_the_held_step_is_undone_on_every_survivor_and_trained_again(hosts, tmp_path):
    """--commit late on CPU runs the GPU's late commit: rank 1 dies right after its step 5, before the survivors
    agree on it (at step 6; no metric line before step 10 settles it earlier). They undo step 5 from their copy
    (step and position with it), recover at step 4 and train step 5 again: every step once, and the recovery
    counts the step undone as lost."""
    job = Job(hosts, tmp_path, "--grad-transport", "gloo", "--commit", "late", "--log-every", "10",
              "--inject-fault", "kill:1:5")
    status = job.finish()
    output = job.output()
    assert status == 0, output[-5000:]
    assert "each step commits one step late (--commit late" in output, output[-3000:]
    summary = json.loads((job.run_dir / "summary.json").read_text())
    (recovery,) = summary["recoveries"]
    assert (recovery["step"], recovery["steps_lost"], recovery["world_after"]) == (4, 1, 2), recovery
    records = metrics(job.run_dir)
    assert [r["step"] for r in records if r["kind"] == "step"] == list(range(10, 61, 10)), records
    # epoch 1's images: each survivor's 4 x 16 before the failure (step 5's, undone, taken back out), then from
    # sample 192 (4 steps x 48) 51 batches of 12 to sample 1416: 2 x (64 + 612); counting step 5 twice gives 1384
    first = next(r for r in records if r["kind"] == "epoch")
    assert round(first["images_per_second"] * first["epoch_time_s"]) == 1352, first
    # summary.json's steps are the steps run and timed: the undone one ran too, so 61 for the run's 60
    assert summary["steps"] == 61 and summary["eval_accuracy"] > 0.8, summary
