"""The GPU tier of in-job recovery: NCCL under `mpirun --with-ft ulfm`. Skipped, saying why, where torch sees no
GPU, where this Open MPI has no ULFM, or where a test needs more GPUs than the machine has.

NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"), so a kill with survivors needs
at least two GPUs (one rank each). On a machine with one GPU only the abort and rebuild of a one-rank NCCL group
runs: the same code path a recovery takes (the old communicator aborted, a new one connected on a new store over
the shrunk MPI communicator), without a dead peer.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import REPO, find_mpirun, rank_pids
from test_leftovers import assert_nothing_left, marked_env
from test_membership import _ulfm_missing, finish, kill_victim_when_peers_wait, records, start_loop, still_running

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS == 0, reason="no CUDA GPU visible to torch (the GPU tier runs on GPU machines)"),
]
NEEDS_TWO = pytest.mark.skipif(NUM_GPUS < 2, reason=f"a kill with survivors on NCCL needs 2 or more GPUs (one rank "
                                                    f"each: NCCL refuses two ranks on one GPU); this machine has "
                                                    f"{NUM_GPUS}")


@pytest.fixture(autouse=True)
def ulfm():
    missing = _ulfm_missing()
    if missing:
        pytest.skip(missing)


def steps_of(lines: list[dict]) -> list[dict]:
    return [line for line in lines if "step" in line and "pid" in line]


def test_a_nccl_group_is_aborted_and_connected_again_on_one_gpu(tmp_path: Path):
    out_dir = tmp_path / "out"
    job = start_loop(out_dir, 1, 6, -1, 0, ("--backend=nccl", "--rebuild-at=3"))
    hang = finish(job, out_dir, [0])
    assert still_running(out_dir) == ""
    lines = records(out_dir, 0)
    assert [line for line in lines if line.get("rebuilt")] == [{"rebuilt": True, "step": 3, "backend": "nccl"}]
    done = steps_of(lines)
    assert [line["step"] for line in done] == list(range(6)) and all(line["exact"] for line in done), done
    assert {line["backend"] for line in done} == {"nccl"} and len({line["pid"] for line in done}) == 1
    if hang:
        pytest.xfail(hang)


@NEEDS_TWO
def test_survivors_abort_nccl_and_go_on_after_a_kill_in_the_all_reduce(tmp_path: Path):
    np, steps, at_step, victim = min(NUM_GPUS, 3), 10, 4, 1
    out_dir = tmp_path / "out"
    job = start_loop(out_dir, np, steps, victim, at_step, ("--backend=nccl",))
    killed_pid, _ = kill_victim_when_peers_wait(job, out_dir, np, victim)
    survivor_ranks = [rank for rank in range(np) if rank != victim]
    hang = finish(job, out_dir, survivor_ranks)
    assert still_running(out_dir) == ""
    for rank in survivor_ranks:
        lines = records(out_dir, rank)
        (recovery,) = [line for line in lines if line.get("recovered")]
        assert recovery["failed"] == [victim] and recovery["world"] == np - 1, lines
        done = steps_of(lines)
        assert [line["step"] for line in done] == list(range(steps)) and all(line["exact"] for line in done), done
        assert {line["backend"] for line in done} == {"nccl"}
        assert len({line["pid"] for line in done}) == 1 and killed_pid not in {line["pid"] for line in done}
        assert {line["world"] for line in done if line["step"] >= at_step} == {np - 1}
    if hang:
        pytest.xfail(hang)


@NEEDS_TWO
def test_the_trainer_on_nccl_recovers_in_the_job_after_a_kill(tmp_path: Path):
    np, victim = min(NUM_GPUS, 3), 1
    run_dir, log = tmp_path / "run", tmp_path / "job.log"
    env, mark = marked_env()
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(np), sys.executable, "-m", "mpiddp", "--run-dir",
               str(run_dir), "--device", "cuda", "--dataset", "digits", "--epochs", "2", "--batch-size", "16",
               "--log-every", "1", "--no-progress", "--wandb", "disabled", "--inject-fault", f"stall-data:{victim}:5"]
    with log.open("w") as out:
        job = subprocess.Popen(command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while "injecting fault 'stall-data'" not in log.read_text(errors="replace") or victim not in rank_pids(run_dir):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")[-5000:]
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising
        subprocess.run(["kill", "-KILL", str(rank_pids(run_dir)[victim])], check=False)
        status = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            job.kill()
        assert_nothing_left(mark)
    output = log.read_text(errors="replace")
    assert status == 0, output[-5000:]
    assert "in-job recovery is on" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["backend"] == "nccl" and summary["device"] == "cuda"
    (recovery,) = summary["recoveries"]
    assert recovery["ranks_lost"] == [victim] and (recovery["world_before"], recovery["world_after"]) == (np, np - 1)
    assert recovery["step"] == 5 and recovery["steps_lost"] <= 1


def test_a_script_with_mpiddps_wrappers_trains_on_nccl_with_recovery_armed(tmp_path: Path):
    """One GPU: mpiddp.DistributedDataParallel + mpiddp.Optimizer on NCCL under `mpirun --with-ft ulfm ... mpiddp
    run`: in-job recovery turns on (the NCCL refusal passes, the membership builds NCCL groups), every step's
    all-reduce is waited for on the main thread and agreed on, and every step is taken."""
    out = tmp_path / "out"
    out.mkdir()
    env, mark = marked_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", "1", sys.executable, "-m", "mpiddp", "run",
               str(REPO / "tests" / "programs" / "steps_loop.py"), str(out), "20", "--device", "cuda"]
    try:
        job = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        assert_nothing_left(mark)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    assert "in-job recovery is on (MPI fault tolerance)" in output, output[-3000:]
    (final,) = [json.loads(line) for line in (out / "rank0.jsonl").read_text().splitlines() if '"done"' in line]
    assert (final["steps"], final["skipped"]) == (20, 0), final


@NEEDS_TWO
def test_a_script_with_mpiddps_wrappers_on_nccl_skips_the_failed_step_and_goes_on(tmp_path: Path):
    np, victim = min(NUM_GPUS, 3), 1
    out = tmp_path / "out"
    out.mkdir()
    env, mark = marked_env(TORCH_NCCL_ASYNC_ERROR_HANDLING="0")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(np), sys.executable, "-m", "mpiddp", "run",
               str(REPO / "tests" / "programs" / "steps_loop.py"), str(out), "20", "--device", "cuda", "--kill",
               f"{victim}:5"]
    try:
        job = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    finally:
        assert_nothing_left(mark)
    assert job.returncode == 0, (job.stdout + job.stderr)[-5000:]
    finals = [json.loads(line) for rank in range(np) if rank != victim
              for line in (out / f"rank{rank}.jsonl").read_text().splitlines() if '"done"' in line]
    assert len(finals) == np - 1 and {(f["steps"], f["skipped"]) for f in finals} == {(19, 1)}, finals
    assert len({f["checksum"] for f in finals}) == 1, finals
