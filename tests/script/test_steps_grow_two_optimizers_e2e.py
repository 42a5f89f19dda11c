"""Growing back a GAN-shaped step-wrapper loop (tests/programs/steps_grow_two_optimizers.py): two wrapped models and
two mpiddp.Optimizer, the clock (built first) stepped second, an LR scheduler kept with mpiddp.keep, and rank 0 killed
under `mpirun --with-ft ulfm -np 4 -x MPIDDP_SPARE_RANKS=1`: the hot spare joins, and every rank ends with the same
parameters and optimizer state of both models and the same scheduler position, status 0, nothing left running."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import REPO, find_mpirun
from test_leftovers import marked_env
from test_recovery_e2e import _ulfm_missing
from test_steps_grow_e2e import run_job

pytestmark = pytest.mark.mpi
PROGRAM = REPO / "tests" / "programs" / "steps_grow_two_optimizers.py"


def test_a_two_optimizer_loop_grows_back_after_rank_0_dies_and_every_rank_ends_alike(tmp_path: Path) -> None:
    missing = _ulfm_missing()
    if missing:
        pytest.skip(missing)
    out, log = tmp_path / "out", tmp_path / "job.log"
    out.mkdir()
    env, mark = marked_env(MPIDDP_SPARE_RANKS="1")
    command = [find_mpirun(), "--with-ft", "ulfm", "-np", "4", "-x", "MPIDDP_SPARE_RANKS", sys.executable, "-m",
               "mpiddp", "run", str(PROGRAM), str(out), "30", "5", "20"]
    status, output = run_job(command, env, mark, log, tmp_path)
    assert status == 0, output[-6000:]
    assert "grew back: ranks [2] joined" in output, output[-5000:]
    lines = {path: [json.loads(line) for line in path.read_text().splitlines()] for path in out.glob("pid*.jsonl")}
    finals = [records[-1] for records in lines.values() if records and records[-1].get("done")]
    assert len(finals) == 3 and len(lines) == 4, output[-5000:]  # the victim wrote no end
    assert any(records[0]["iter"] > 0 for records in lines.values())  # the spare joined mid-run
    # a new rank that missed the discriminator's state or the scheduler's position would end elsewhere
    assert len({(f["checksum"], f["iter"], f["last_epoch"], f["world"]) for f in finals}) == 1, finals
