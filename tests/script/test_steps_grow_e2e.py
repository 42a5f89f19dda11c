"""Growing back for a loop under mpiddp's step wrappers (no run_recoverable): tests/programs/steps_grow.py is
nanoGPT's loop shape (its position in module-level variables, declared with mpiddp.keep; the learning rate set from
`iter_num` each iteration; gradient accumulation) under `mpirun --with-ft ulfm -np 4 -x MPIDDP_SPARE_RANKS=1`:
rank 1 is SIGKILLed, the survivors recover, the hot spare runs the script from the top and joins at its first
optimizer step with every rank's state and the loop's variables, the job finishes at full size with the same
parameters and optimizer state on every rank, status 0, nothing left running."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, STARTUP_RACE_RETRIES, find_mpirun, launcher_never_started
from test_leftovers import assert_nothing_left, marked_env
from test_recovery_e2e import _ulfm_missing

pytestmark = pytest.mark.mpi
PROGRAM = REPO / "tests" / "programs" / "steps_grow.py"
WORKERS, ITERATIONS, KILL = 3, 30, "1:5"


@pytest.fixture(autouse=True)
def ulfm():
    missing = _ulfm_missing()
    if missing:
        pytest.skip(missing)


def records(out: Path) -> dict[int, list[dict]]:
    """Each process's lines, by pid (a new rank's rank is not one it started with)."""
    return {int(path.stem[3:]): [json.loads(line) for line in path.read_text().splitlines()]
            for path in out.glob("pid*.jsonl")}


def run_job(command: list[str], env: dict[str, str], mark: str, log: Path, cwd: Path,
            launch_run_dir: Path | None = None) -> tuple[int, str]:
    """The job run to its end (its status and output); nothing of it may be left running. A job that ended in
    Open MPI's start-up race before any rank ran is run again (launch's in a new `launch_run_dir`)."""
    for _ in range(STARTUP_RACE_RETRIES + 1):
        try:
            with log.open("w") as sink:
                status = subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                        stderr=subprocess.STDOUT, timeout=300).returncode
        finally:
            assert_nothing_left(mark)
        output = log.read_text(errors="replace")
        if status == 0 or not launcher_never_started(output):
            break
        if launch_run_dir is not None:
            shutil.rmtree(launch_run_dir, ignore_errors=True)
    return status, output


@pytest.mark.parametrize("runner, commit", [("run", "strict"), ("init", "strict"), ("run", "late")],
                         ids=["mpiddp-run", "plain-mpirun-init", "late-commit"])
def test_a_step_wrapper_loop_that_keeps_its_position_grows_back_and_every_rank_ends_alike(tmp_path, runner, commit):
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    started = ["-m", "mpiddp", "run", str(PROGRAM)] if runner == "run" else [str(PROGRAM), "--init"]
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(WORKERS + 1), "-x", "MPIDDP_SPARE_RANKS",
               sys.executable, *started, str(out), str(ITERATIONS), "--kill", KILL, "--until-full", str(WORKERS),
               "--commit", commit, "--prelude", "3"]  # the new rank's start waits for 3 steps of the survivors
    status, output = run_job(command, env, mark, log, tmp_path)
    assert status == 0, output[-6000:]
    assert "grew back: ranks [2] joined" in output and "running at full size again: 3 ranks" in output, output[-5000:]
    by_pid = records(out)
    finals = {pid: lines[-1] for pid, lines in by_pid.items() if lines[-1].get("done")}
    assert len(finals) == WORKERS and len(by_pid) == WORKERS + 1, output[-5000:]  # the victim wrote no end
    (new,) = [pid for pid, lines in by_pid.items() if lines[0]["iter"] > 0]  # the spare: it joined mid-run
    joined_at = by_pid[new][0]
    # it entered at the very step the survivors stood at: the same iteration, steps and skipped, at full size
    survivors = [pid for pid in finals if pid != new]
    for pid in survivors:
        (same,) = [line for line in by_pid[pid] if line.get("iter") == joined_at["iter"] and "done" not in line]
        assert (same["steps"], same["skipped"], same["world"]) == (joined_at["steps"], joined_at["skipped"], 3)
        assert same["world"] == 3 and by_pid[pid][by_pid[pid].index(same) - 1]["world"] == 2  # the grow's step
    # the same parameters and Adam moments everywhere (a learning rate off by one step on the new rank would differ)
    assert len({(f["checksum"], f["iter"], f["steps"], f["skipped"], f["world"]) for f in finals.values()}) == 1, finals
    assert finals[new]["best_val_loss"] < 1e9  # rank 0's value, which only rank 0 tracks, handed over
    # the all_reduce the script took by name before its loop (the new rank's was the stand-in's) reached the others
    assert all(abs(f["mean_checksum"] - f["checksum"]) < 1e-6 * abs(f["checksum"]) for f in finals.values()), finals
    assert "hot spares released" not in output and "not growing back" not in output, output[-5000:]


def test_a_new_rank_whose_start_calls_a_collective_leaves_with_one_line_and_the_job_goes_on(tmp_path):
    """The script broadcasts from rank 0 before its loop: the new rank's broadcast would meet no survivor (they are
    past it), so it raises at once, saying what to do, tells rank 0 (which says why once, if the job still runs),
    ends (status 0), and the job finishes at reduced size. Its barrier before that returned at once."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(WORKERS + 1), "-x", "MPIDDP_SPARE_RANKS",
               sys.executable, "-m", "mpiddp", "run", str(PROGRAM), str(out), "20", "--kill", KILL,
               "--prelude-broadcast"]
    status, output = run_job(command, env, mark, log, tmp_path)
    assert status == 0, output[-6000:]
    assert ("grow: this rank could not warm up (BeforeJoining: torch.distributed.broadcast() before the first "
            "training step" in output), output[-5000:]
    assert "grew back" not in output, output[-5000:]
    finals = [lines[-1] for lines in records(out).values() if lines[-1].get("done")]
    assert [f["world"] for f in finals] == [WORKERS - 1] * (WORKERS - 1), finals


def test_a_hot_spare_whose_grow_is_given_up_during_the_scripts_start_waits_again_and_is_taken_in(tmp_path):
    """Rank 1 is killed, the hot spare runs the script's start, and a second rank is killed meanwhile: the survivors
    give that grow up. The spare learns it at its first step; it waits again with its start done (a script cannot
    run twice in one process), and the next grow takes it in at the place that grow gives it. It ended there
    before, the survivors waiting for it to come back, and the job never grew again."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(WORKERS + 1), "-x", "MPIDDP_SPARE_RANKS",
               sys.executable, "-m", "mpiddp", "run", str(PROGRAM), str(out), "20", "--kill", KILL,
               "--kill-in-late-start", "2", "--until-full", str(WORKERS - 1)]
    status, output = run_job(command, env, mark, log, tmp_path)
    assert status == 0, output[-6000:]
    assert "growing back given up" in output and "this hot spare waits again" in output, output[-5000:]
    assert "grew back: ranks [1] joined" in output, output[-5000:]
    by_pid = records(out)
    finals = {pid: lines[-1] for pid, lines in by_pid.items() if lines[-1].get("done")}
    (new,) = [pid for pid, lines in by_pid.items() if lines[0]["iter"] > 0]  # the spare: it joined mid-run
    assert new in finals and [f["world"] for f in finals.values()] == [WORKERS - 1] * 2, finals
    assert len({(f["checksum"], f["iter"], f["steps"], f["world"]) for f in finals.values()}) == 1, finals


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    from fakehosts import FakeHosts, running_fake_hosts

    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec", "noded"], tmp_path_factory.mktemp("stepgrow-hosts"),
                                      tag="s")) as cluster:
        yield cluster


def test_under_launch_on_fake_hosts_a_step_loop_grows_back_onto_the_spare_host(hosts, tmp_path):
    """`mpiddp launch -H nodea:1,...,noded:1 -np 3 ... -- run steps_grow.py`: launch runs a hot spare on noded, the
    rank on nodeb is killed, the job grows back onto noded within the one attempt, and launch records both."""
    out, log, run_dir = tmp_path / "out", tmp_path / "job.log", tmp_path / "run"
    out.mkdir()
    env, mark = marked_env(PYTHONPATH=str(REPO))
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
    command = hosts.command_on("nodea", [
        sys.executable, "-m", "mpiddp", "launch", "-H", "nodea:1,nodeb:1,nodec:1,noded:1", "-np", "3",
        "--max-restarts", "0", "--run-dir", str(run_dir), "--launcher-args",
        " ".join(["--with-ft", "ulfm", *hosts.transport_args()]), "--", "run", str(PROGRAM), str(out),
        str(ITERATIONS), "--kill", KILL, "--until-full", str(WORKERS)])
    status, output = run_job(command, env, mark, log, REPO, launch_run_dir=run_dir)
    assert status == 0 and (run_dir / "finished").exists(), output[-6000:]
    finals = [lines[-1] for lines in records(out).values() if lines[-1].get("done")]
    assert len(finals) == WORKERS, output[-5000:]
    assert len({(f["checksum"], f["iter"], f["world"]) for f in finals}) == 1, finals
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]  # no relaunch
    assert [r["cause"] for r in attempt["recoveries"]] == ["process_failed", "grew"], attempt["recoveries"]
    assert attempt["recoveries"][1]["hosts_added"] == ["noded"], attempt["recoveries"]
