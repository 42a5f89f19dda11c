"""A step-wrapper script (mpiddp.DistributedDataParallel + mpiddp.Optimizer, no run_recoverable) that does not declare
its loop's position (mpiddp.keep) in a job with a hot spare, under `mpirun --with-ft ulfm ... python -m mpiddp run`:
such a loop cannot grow back, so rank 0 says so once at its first step and the spare is released then and ends,
while the job trains on; the job ends with status 0 (also after a rank is lost: it recovers in the job at reduced
size) and nothing is left running. A loop that declares it grows back: tests/script/test_steps_grow_e2e.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, find_mpirun
from test_leftovers import assert_nothing_left, marked_env, processes_of
from test_recovery_e2e import _ulfm_missing

pytestmark = pytest.mark.mpi
PROGRAM = REPO / "tests" / "programs" / "steps_gated.py"
WORKERS, ITERATIONS, GATE = 3, 10, 3
SAID = ("hot spares released at start-up: this loop under mpiddp.Optimizer recovers from a lost rank but cannot "
        "grow back")
SPARE_ENDS = re.compile(r"mpiddp: this hot spare \(pid (\d+) on \S+\) ends: released at start-up")


@pytest.fixture(autouse=True)
def ulfm():
    missing = _ulfm_missing()
    if missing:
        pytest.skip(missing)


def wait_until(condition, what: str, job: subprocess.Popen, log: Path, seconds: float = 150):
    """Poll a condition the job makes true (a line in its log, a process gone), with a deadline."""
    deadline = time.monotonic() + seconds
    while (found := condition()) is None or found is False:
        assert time.monotonic() < deadline and job.poll() is None, f"{what}: never\n{log.read_text()[-4000:]}"
        time.sleep(0.1)  # polling a condition with a deadline, not synchronising
    return found


def lines_of(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kill, runner", [("", "run"), ("1:5", "run"), ("", "init")],
                         ids=["no-loss", "rank-1-killed", "plain-mpirun-init"])
def test_a_step_wrapper_loop_releases_its_hot_spare_at_start_up_and_the_job_trains_on(tmp_path, kill, runner):
    """`runner`: `python -m mpiddp run` (the spare waits in the runner), or a plain mpirun of a script that calls
    mpiddp.init() (the spare waits inside it)."""
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    started = ["-m", "mpiddp", "run", str(PROGRAM)] if runner == "run" else [str(PROGRAM), "--init"]
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(WORKERS + 1), "-x", "MPIDDP_SPARE_RANKS",
               sys.executable, *started, str(out), str(ITERATIONS), str(GATE), *(["--kill", kill] if kill else [])]
    try:
        with log.open("w") as sink:
            job = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                                   stderr=subprocess.STDOUT)
        try:
            # the spare says it ends (the job's own log, with its pid), and is gone, while every worker waits at
            # the gate: training has not finished anywhere
            spare = int(wait_until(lambda: SPARE_ENDS.search(log.read_text()), "the spare's end", job, log)[1])
            wait_until(lambda: spare not in processes_of(mark), "the spare gone", job, log, seconds=30)
            assert job.poll() is None
            for rank in range(WORKERS):
                assert not any(line.get("done") for line in lines_of(out, rank))
                assert spare not in {line["pid"] for line in lines_of(out, rank)}  # a spare, not a worker
            (out / "go").touch()
            status = job.wait(timeout=240)
        finally:
            if job.poll() is None:
                job.kill()
    finally:
        assert_nothing_left(mark)
    output = log.read_text()
    assert status == 0, output[-5000:]
    assert output.count(SAID) == 1, output[-5000:]  # once, by rank 0, at start-up
    assert "to grow back, declare them before the loop (mpiddp.keep(globals(), " in output
    assert "not growing back" not in output and "growing back:" not in output, output[-5000:]  # not said again
    assert len(SPARE_ENDS.findall(output)) == 1
    victim = int(kill.split(":")[0]) if kill else None
    for rank in range(WORKERS):
        lines = lines_of(out, rank)
        if rank == victim:
            assert not any(line.get("done") for line in lines)
            continue
        (final,) = [line for line in lines if line.get("done")]
        assert (final["steps"], final["skipped"]) == ((ITERATIONS - 1, 1) if kill else (ITERATIONS, 0)), final
        assert lines[-2]["world"] == (WORKERS - 1 if kill else WORKERS), lines  # at reduced size after the loss
    if kill:
        assert re.search(r"in-job recovery: ranks \[1\] on \S+ failed; 2 ranks go on", output), output[-3000:]
        assert "running at reduced size 2 of 3 ranks" in output, output[-3000:]
