"""Step-level in-job recovery of a torchrun-style loop under `mpirun --with-ft ulfm ... python -m mpiddp run`: the
loop untouched, the model in mpiddp.DistributedDataParallel and the optimizer in mpiddp.Optimizer. A rank
SIGKILLs itself mid-step (its peers wait for it in the gradient all-reduce); the survivors, the same processes,
skip that step alike and finish at the reduced size with the same model, every step taken or skipped once."""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, find_mpirun
from test_leftovers import assert_nothing_left, marked_env
from test_recovery_e2e import _ulfm_missing

pytestmark = pytest.mark.mpi
PROGRAM = REPO / "tests" / "programs" / "steps_loop.py"
EXAMPLE, RECOVERABLE = REPO / "run" / "examples" / "torchrun_digits.py", REPO / "run" / "examples" / "recoverable_digits.py"
RANKS, ITERATIONS = 3, 12


@pytest.fixture(autouse=True)
def ulfm():
    missing = _ulfm_missing()
    if missing:
        pytest.skip(missing)


def run_job(args: list[str], tmp_path: Path, ft: bool = True, timeout: float = 240,
            **env_extra: str) -> subprocess.CompletedProcess:
    env, mark = marked_env(**env_extra)
    command = [find_mpirun(), *(["--with-ft", "ulfm"] if ft else []), "-np", str(RANKS), sys.executable, "-m",
               "mpiddp", "run", *args]
    try:
        return subprocess.run(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=timeout)
    finally:
        assert_nothing_left(mark)


def lines_of(out: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kill, extra", [
    ("1:5", ()), ("0:5", ()), ("2:4:1", ("--accumulate", "3")),
    ("1:5", ("--second-model", "own-optimizer")), ("1:5", ("--second-model", "shared-optimizer"))],
    ids=["rank 1 mid-step", "rank 0 with the store", "during gradient accumulation", "two models, two optimizers",
         "two models, one optimizer"])
def test_the_survivors_skip_the_failed_step_alike_and_finish_with_the_same_model(tmp_path, kill, extra):
    out = tmp_path / "out"
    out.mkdir()
    # a spare named: the loop did not declare its position (mpiddp.keep), so the job says once why it does not
    # grow back
    job = run_job([str(PROGRAM), str(out), str(ITERATIONS), "--kill", kill, *extra], tmp_path,
                  MPIDDP_SPARE_HOSTS="sparehost")
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    victim = int(kill.split(":")[0])
    survivors = [rank for rank in range(RANKS) if rank != victim]
    finals = []
    for rank in survivors:
        lines = lines_of(out, rank)
        steps = [line for line in lines if "iteration" in line]
        assert [line["iteration"] for line in steps] == list(range(ITERATIONS)), lines  # the loop went on
        assert len({line["pid"] for line in steps}) == 1  # the same process throughout
        (final,) = [line for line in lines if line.get("done")]
        assert (final["steps"], final["skipped"]) == (ITERATIONS - 1, 1), final  # each step taken or skipped once
        assert {line["world"] for line in steps[int(kill.split(":")[1]):]} == {RANKS - 1}
        finals.append(final)
    assert len({final["checksum"] for final in finals}) == 1, finals  # the same model and momentum everywhere
    assert "done" not in (out / f"rank{victim}.jsonl").read_text()
    assert re.search(rf"in-job recovery: ranks \[{victim}\] on \S+ failed; 2 ranks go on \(state the same on every "
                     r"survivor", output), output[-3000:]
    assert "in-job recovery: on for a script that uses mpiddp.DistributedDataParallel" in output
    assert output.count("in-job recovery: on for a script") == 1  # said once, by rank 0
    # said once, at the loop's first step (not first at the loss): the loop did not declare its position
    assert output.count("not growing back: this loop under mpiddp.Optimizer recovers from a lost rank but cannot grow "
                        "back, as it did not say which of its own variables hold its position") == 1, output[-3000:]
    assert output.index("not growing back: this loop") < output.index("in-job recovery: ranks")
    assert "keeps its position in its own variables, which it did not declare" not in output  # not again


def test_without_fault_tolerance_the_wrappers_say_why_and_a_kill_ends_the_job(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    job = run_job([str(PROGRAM), str(out), str(ITERATIONS), "--kill", "1:5"], tmp_path, ft=False)
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    assert output.count("in-job recovery: off (") == 1 and "relaunches it" in output, output[-3000:]


def test_the_torchrun_example_becomes_recoverable_in_a_few_lines():
    def code(path: Path) -> list[str]:  # the script without its module docstring
        text = path.read_text()
        return text[text.index('"""', 3) + 3:].splitlines()

    changed = [line for line in difflib.unified_diff(code(EXAMPLE), code(RECOVERABLE), lineterm="", n=0)
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    added = [line for line in changed if line.startswith("+")]
    assert len(added) <= 6, "\n".join(changed)  # a changed line counts once: the diff's lines that replace it
    loop = "        for inputs, targets in loader:\n"
    step_loop = lambda path: path.read_text().split(loop)[1].split("optimizer.step()")[0]  # noqa: E731
    assert step_loop(RECOVERABLE) == step_loop(EXAMPLE)  # the training loop itself untouched


def test_the_recoverable_example_finishes_after_a_kill_as_accurate_as_without(tmp_path):
    """Kill rank 1 after the first epoch's report: the survivors finish the epochs; the final test accuracy is
    within 0.03 of an uninterrupted run's (digits, 5 epochs)."""
    env, mark = marked_env()
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", str(RANKS), sys.executable, "-m", "mpiddp", "run",
               str(RECOVERABLE), "--epochs", "5"]
    whole = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-3000:]
    log = tmp_path / "job.log"
    with log.open("w") as sink:
        job = subprocess.Popen(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=sink,
                               stderr=subprocess.STDOUT)
    try:
        victim = wait_for_rank_pid(job, log, mark, rank=1, after="epoch 1:")
        subprocess.run(["kill", "-KILL", str(victim)], check=True)
        assert job.wait(timeout=240) == 0, log.read_text()[-5000:]
    finally:
        if job.poll() is None:
            job.kill()
        assert_nothing_left(mark)
    output = log.read_text()
    assert "running at reduced size 2 of 3 ranks" in output, output[-3000:]
    assert accuracy(output, epoch=5) >= accuracy(whole.stdout + whole.stderr, epoch=5) - 0.03, output[-3000:]


def accuracy(output: str, epoch: int) -> float:
    found = re.search(rf"epoch {epoch}: loss \S+, test accuracy (\S+)", output)
    assert found, output[-3000:]
    return float(found.group(1))


def wait_for_rank_pid(job: subprocess.Popen, log: Path, mark: str, rank: int, after: str) -> int:
    """The pid of the job's rank `rank` once `after` is in the job's output (polling with a deadline)."""
    import time

    from test_leftovers import processes_of

    deadline = time.monotonic() + 180
    while after not in log.read_text(errors="replace"):
        assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
    for pid, command_line in processes_of(mark).items():  # the rank itself, not its forkserver
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"OMPI_COMM_WORLD_RANK={rank}".encode() in environ and "mpiddp run" in command_line:
            return pid
    raise AssertionError(f"no process of rank {rank}")


def test_under_launch_a_script_that_opts_in_recovers_in_the_job(tmp_path):
    """`mpiddp launch ... --launcher-args "--with-ft ulfm" -- run script`: one attempt, the survivors finish it."""
    out, run_dir = tmp_path / "out", tmp_path / "run"
    out.mkdir()
    env, mark = marked_env()
    command = [sys.executable, "-m", "mpiddp", "launch", "-np", str(RANKS), "--run-dir", str(run_dir),
               "--launcher-args", "--with-ft ulfm --oversubscribe", "--", "run", str(PROGRAM), str(out),
               str(ITERATIONS), "--kill", "1:5"]
    try:
        job = subprocess.run(command, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=300)
    finally:
        assert_nothing_left(mark)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    (attempt,) = json.loads((run_dir / "attempts.json").read_text())["attempts"]  # no relaunch
    assert attempt["in_job_recovery"] is True, attempt
    (recovery,) = attempt["recoveries"]  # the script's recovery on record, as the trainer's: launch learns the host
    assert (recovery["ranks_lost"], recovery["world_after"]) == ([1], RANKS - 1), recovery
    for rank in (0, 2):
        (final,) = [line for line in lines_of(out, rank) if line.get("done")]
        assert (final["steps"], final["skipped"]) == (ITERATIONS - 1, 1), final


def test_a_state_value_that_differs_across_ranks_is_named_at_the_first_commit(tmp_path):
    """Issue 34's nanoGPT finding: a value only rank 0 updates would be overwritten by a recovery: named once."""
    script = tmp_path / "diverging.py"
    script.write_text(
        "import mpiddp\nfrom torch import nn\nimport torch\n"
        "dist = mpiddp.init()\nmodel = nn.Linear(2, 2)\n"
        "state = mpiddp.State(model=model, step=0, best=float(dist.rank), mine=dist.rank, per_rank=['mine'])\n"
        "def train(state):\n    for _ in range(3):\n        state.step += 1\n        state.commit()\n"
        "mpiddp.run_recoverable(train, state)\n")
    env, mark = marked_env()
    try:
        job = subprocess.run([find_mpirun(), "--with-ft", "ulfm", "-np", "2", sys.executable, str(script)],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    finally:
        assert_nothing_left(mark)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-3000:]
    assert output.count("mpiddp.State: 'best' differs across ranks at the first commit") == 1, output[-3000:]
    assert "'mine'" not in output and "'step'" not in output  # per-rank and equal values are not named


def test_a_rank_lost_after_the_scripts_finished_ends_the_job_in_one_line(tmp_path):
    """In-job recovery covers the loop, not a script's tail: a rank that dies after its loop (rank 0's save may be
    missing) ends the job with one line naming it (no traceback from the finish's barrier) and a failure status
    for `launch` to relaunch; nothing is left running."""
    job = run_job([str(REPO / "tests" / "programs" / "dies_after_loop.py")], tmp_path)
    output = job.stdout + job.stderr
    assert job.returncode != 0, output[-3000:]
    assert output.count("rank(s) 1 failed after the script had finished here") == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_batchnorm_buffers_are_broadcast_as_torchs_ddp_does(tmp_path):
    """The wrapper broadcasts BatchNorm's buffers before each forward itself (watched): without a failure each
    rank's model, running statistics and momentum end as under torch's own DDP over the same loop (to rounding:
    the gradient mean is taken in another order). A rank's last forward updates its statistics from its own data,
    so ranks differ from each other, by far more than this tolerance."""
    checksums = {}
    for kind in ("plain", "wrapped"):
        out = tmp_path / kind
        out.mkdir()
        job = run_job([str(PROGRAM), str(out), "6", "--batchnorm", *(["--plain"] if kind == "plain" else [])],
                      tmp_path)
        assert job.returncode == 0, (job.stdout + job.stderr)[-3000:]
        checksums[kind] = [value for rank in range(RANKS) for line in lines_of(out, rank) if line.get("done")
                           for value in (line["checksum"], line["buffers"])]
    assert checksums["wrapped"] == pytest.approx(checksums["plain"], rel=1e-7, abs=0), checksums
    assert checksums["plain"][1] != pytest.approx(checksums["plain"][3], rel=1e-5, abs=0), checksums  # buffers


def test_a_rank_lost_in_the_batchnorm_broadcast_is_recovered(tmp_path):
    """Rank 0 (the broadcast's source) SIGKILLed before its forward: its peers wait for it in the buffer broadcast
    of that forward, learn of it under MPI's watch, skip the step alike and finish with the same model."""
    out = tmp_path / "out"
    out.mkdir()
    job = run_job([str(PROGRAM), str(out), str(ITERATIONS), "--batchnorm", "--kill", "0:5",
                   "--kill-before-forward"], tmp_path)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    finals = [line for rank in (1, 2) for line in lines_of(out, rank) if line.get("done")]
    assert [(final["steps"], final["skipped"]) for final in finals] == [(ITERATIONS - 1, 1)] * 2, finals
    assert len({final["checksum"] for final in finals}) == 1, finals


def test_under_the_late_commit_a_rank_lost_after_its_step_is_undone_on_every_survivor(tmp_path):
    """commit="late" on CPU runs the GPU's late commit (the step not waited for, agreed on at the next one): rank 1
    dies once its step 5 is taken, before the agreement on it. The survivors undo step 5 from their copy and skip
    step 6: each goes on from the very state it held before step 5 (not the one after it, which the strict wait
    keeps), the same on both, and the job finishes."""
    out = tmp_path / "out"
    out.mkdir()
    job = run_job([str(PROGRAM), str(out), str(ITERATIONS), "--commit", "late", "--kill-after-step", "1:5"], tmp_path)
    output = job.stdout + job.stderr
    assert job.returncode == 0, output[-5000:]
    starts = {}
    for rank in (0, 2):
        lines = lines_of(out, rank)
        steps = {line["iteration"]: line for line in lines if "iteration" in line}
        assert sorted(steps) == list(range(ITERATIONS)), lines
        (final,) = [line for line in lines if line.get("done")]
        assert (final["steps"], final["skipped"]) == (ITERATIONS - 2, 2), final  # step 5 undone, step 6 skipped
        assert steps[7]["start"] == steps[5]["start"] != steps[6]["start"], [steps[i] for i in (5, 6, 7)]
        starts[rank] = [steps[i]["start"] for i in range(ITERATIONS)]
        assert steps[7]["world"] == RANKS - 1
    assert starts[0] == starts[2]  # bit for bit the same on both survivors, every step
    assert "each step commits one step late" in output
    assert "skipped on every survivor and the step before it undone" in output, output[-3000:]
