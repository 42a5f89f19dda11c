"""A hung rank in a script under in-job recovery (`mpirun --with-ft ulfm ... python -m mpiddp run --hang-timeout 2`,
the loop under mpiddp's step wrappers): the survivors, kept waiting in the gradient all-reduce, name the rank behind
in a hang report, the rank on its host ends it, and they finish at the reduced size with the same model. A rank 0
that stops takes its store with it: it is found by its store's silence. Every rank busy on its own (a script's own
phase) for longer than the timeout is no hang. The same under `mpiddp.init(hang_timeout_s=2)` and run_recoverable
(plain mpirun). The watchdog's logic, in-process: tests/elastic/test_hang_exclusion.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, find_mpirun
from test_leftovers import assert_nothing_left, marked_env
from test_steps_e2e import ITERATIONS, PROGRAM, RANKS, lines_of, run_job, ulfm  # noqa: F401 (ulfm: a fixture)

pytestmark = pytest.mark.mpi
HANG_TIMEOUT_S = 2


def finals_of(out: Path, survivors: list[int]) -> list[dict]:
    """Each survivor's last line, once every iteration ran in the same process."""
    finals = []
    for rank in survivors:
        lines = lines_of(out, rank)
        steps = [line for line in lines if "iteration" in line]
        assert [line["iteration"] for line in steps] == list(range(ITERATIONS)), lines  # the loop went on
        assert len({line["pid"] for line in steps}) == 1
        (final,) = [line for line in lines if line.get("done")]
        finals.append(final)
    return finals


@pytest.mark.parametrize("hang", ["1:5:stop", "2:5:block", "0:5:stop"],
                         ids=["a stopped rank", "a rank whose main thread blocks", "a stopped rank 0 with the store"])
def test_a_hung_rank_is_named_and_ended_and_the_others_finish(tmp_path, hang):
    out = tmp_path / "out"
    out.mkdir()
    job = run_job(["--hang-timeout", str(HANG_TIMEOUT_S), str(PROGRAM), str(out), str(ITERATIONS), "--hang", hang],
                  tmp_path)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    victim = int(hang.split(":")[0])
    assert "hung" in (out / f"rank{victim}.jsonl").read_text() and "done" not in (out / f"rank{victim}.jsonl").read_text()
    finals = finals_of(out, [rank for rank in range(RANKS) if rank != victim])
    assert {(final["steps"], final["skipped"]) for final in finals} == {(ITERATIONS - 1, 1)}, finals
    assert len({final["checksum"] for final in finals}) == 1, finals  # the same model and momentum everywhere
    assert re.search(rf"ending rank {victim} \(pid \d+\) on \S+ with SIGKILL: in-job recovery leaves it behind",
                     output), output[-5000:]
    # what rank 0 says of the recovery names the hang, whichever survivor's watchdog ended the rank
    assert re.search(rf"in-job recovery: ranks \[{victim}\] on \S+ hung and were ended; 2 ranks go on", output), \
        output[-5000:]
    if victim == 0:  # its store went with it: the survivors found it by the store's silence
        assert "rank 0's store (rank 0 on" in output and "stopped answering" in output, output[-5000:]
        return
    assert f"waited {HANG_TIMEOUT_S} s on the other ranks in a collective" in output, output[-5000:]
    (report,) = tmp_path.glob("hang-*.txt")  # the directory the job started in: no launch run dir here
    text = report.read_text()
    assert re.search(rf"^ranks behind: {victim} on \S+$", text, re.MULTILINE), text
    assert text.count("==== Python stacks of rank") >= 2, text  # the survivors' stacks at least
    if hang.endswith("block"):  # its watchdog thread still answered: its own stacks show where it blocks
        assert "steps_loop.py" in text.split(f"==== Python stacks of rank {victim}/")[1], text


def test_every_rank_busy_on_its_own_for_longer_than_the_timeout_is_no_hang(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = run_job(["--hang-timeout", str(HANG_TIMEOUT_S), str(PROGRAM), str(out), str(ITERATIONS),
                   "--busy", f"3:{3 * HANG_TIMEOUT_S}"], tmp_path)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    finals = finals_of(out, list(range(RANKS)))
    assert {(final["steps"], final["skipped"]) for final in finals} == {(ITERATIONS, 0)}, finals
    assert "hang watchdog: a rank kept waiting 2 s on the others" in output  # it was on
    assert not re.search(r"hang watchdog: rank \d", output) and not list(tmp_path.glob("hang-*.txt")), output[-5000:]


@pytest.mark.parametrize("where", ["step", "reduce"])
def test_a_run_recoverable_script_under_a_plain_mpirun_has_its_hung_rank_ended(tmp_path, where):
    """mpiddp.init(hang_timeout_s=2), run_recoverable and watch_gradients: rank 1 stalls in its own loop at step 5
    (no test kills it) while its peers wait in the gradient all-reduce, or in the script's dist.reduce (an MPI
    collective, which has no timeout of its own); their watchdogs end it and they finish."""
    out = tmp_path / "out"
    out.mkdir()
    env, mark = marked_env(PYTHONPATH=str(REPO), MPIDDP_TEST_HANG_TIMEOUT=str(HANG_TIMEOUT_S))
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", "3", sys.executable,
               str(REPO / "tests" / "programs" / "recoverable_script.py"), str(out), "12", "1", "5", where]
    try:
        job = subprocess.run(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=240)
    finally:
        assert_nothing_left(mark)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    finals = {rank: json.loads((out / f"final.{rank}.json").read_text()) for rank in (0, 2)}
    assert not (out / "final.1.json").exists()
    assert {(final["step"], final["world_size"]) for final in finals.values()} == {(12, 2)}, finals
    assert len({final["digest"] for final in finals.values()}) == 1, finals
    assert [change["ranks_lost"] for change in finals[0]["changes"]] == [[1]], finals
    assert re.search(r"in-job recovery: ranks \[1\] on \S+ hung and were ended; 2 ranks go on", output), output[-5000:]
    (report,) = tmp_path.glob("hang-*.txt")
    assert re.search(r"^ranks behind: 1 on \S+$", report.read_text(), re.MULTILINE), report.read_text()


def test_a_rank_whose_script_ends_while_the_others_wait_for_it_ends_the_job_once(tmp_path):
    """Rank 1's loop ends early (its script then ends as usual) while ranks 0 and 2 wait for it in the next
    all-reduce. It is no hang (its last record says it finished): the finish watch names it and ends the job with
    status 4 through MPI_Abort. Found by the outside review: the finish watch's own exit, under MPI's fault
    tolerance, was a failure the other waiting rank began to recover from, and the job could hang."""
    out = tmp_path / "out"
    out.mkdir()
    job = run_job(["--hang-timeout", str(HANG_TIMEOUT_S), "--finish-timeout", "3", str(PROGRAM), str(out),
                   str(ITERATIONS), "--early", "1:3"], tmp_path, timeout=120)
    output = job.stdout + job.stderr
    assert job.returncode == 4, output[-5000:]
    assert "after the script finished on rank(s) 1 (--finish-timeout 3)" in output, output[-5000:]
    assert "hung and were ended" not in output and "goes on as rank" not in output, output[-5000:]
    assert not list(tmp_path.glob("hang-*.txt"))
