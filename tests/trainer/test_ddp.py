"""DDP correctness under a real mpirun: mpiddp's own step keeps ranks identical and equal to one process
stepping on the concatenated batches, with and without gradient accumulation."""

import json
import sys

import pytest

from conftest import REPO, run_command


@pytest.mark.mpi
@pytest.mark.parametrize("np, accum", [(2, 1), (3, 2)])
def test_train_step_matches_single_process_on_concatenated_batches(mpirun, tmp_path, np, accum):
    out = tmp_path / "result.json"
    program = str(REPO / "tests" / "programs" / "ddp_equivalence.py")
    job = run_command([mpirun, "-np", str(np), sys.executable, program, str(out), str(accum)], tmp_path, timeout=120)
    assert job.returncode == 0, job.output
    result = json.loads(out.read_text())
    assert result["world_size"] == np and result["steps"] == 6
    assert result["max_change_from_init"] > 1e-3  # training really moved the weights
    assert result["max_diff_between_ranks"] == 0.0  # all-reduced gradients: bitwise identical replicas
    assert result["max_diff_to_reference"] < 1e-10
