"""The GPU tier: real mpirun jobs on CUDA with NCCL. Skipped, saying why, where torch sees no GPU.

Uses up to two GPUs (one rank each); every test also runs on a machine with one GPU.
"""

import json
import os
import re
import stat
import sys

import pytest
import torch

from conftest import REPO, job_env, run_command

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
RANKS = min(NUM_GPUS, 2)
pytestmark = [
    pytest.mark.mpi,
    pytest.mark.gpu,
    pytest.mark.skipif(NUM_GPUS == 0, reason="no CUDA GPU visible to torch (the GPU tier runs on GPU machines)"),
]
FAST = ("--device", "cuda", "--no-progress", "--wandb", "disabled")


def trained(job, min_accuracy=None):
    assert job.returncode == 0, job.output[-4000:]
    summary = job.summary
    assert summary["backend"] == "nccl" and summary["device"] == "cuda"
    if min_accuracy is not None:
        assert summary["eval_accuracy"] >= min_accuracy
    return summary


def test_nccl_ddp_equals_one_process_on_the_global_batch(mpirun, tmp_path):
    out = tmp_path / "equivalence.json"
    job = run_command([mpirun, "-np", str(RANKS), sys.executable, str(REPO / "tests" / "programs" / "ddp_equivalence.py"),
                       str(out), "2", "cuda"], tmp_path, timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    result = json.loads(out.read_text())
    assert result["max_diff_between_ranks"] == 0.0
    assert result["max_diff_to_reference"] < 1e-9 < result["max_change_from_init"]


@pytest.mark.parametrize("amp", ["fp16", "bf16"])
def test_mixed_precision_trains(run_job, amp):
    if amp == "bf16" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bf16")
    summary = trained(run_job(RANKS, *FAST, "--amp", amp, "--epochs", "5", timeout=300), min_accuracy=0.9)
    assert summary["config"]["amp"] == amp


def test_channels_last_sync_bn_and_pinned_loaders_on_a_resnet(run_job, tmp_path):
    from datagen import write_cifar10

    data_dir = write_cifar10(tmp_path / "cifar", per_batch=64, test=64)  # files: loader workers, pinned memory
    trained(run_job(RANKS, *FAST, "--arch", "resnet18", "--dataset", "cifar10", "--data-dir", str(data_dir),
                    "--channels-last", "--sync-bn", "--num-workers", "2", "--epochs", "1", timeout=300))


def test_compiled_model_trains(run_job):
    trained(run_job(RANKS, *FAST, "--compile", "--epochs", "5", timeout=600), min_accuracy=0.9)


def test_deterministic_runs_repeat_bit_for_bit(run_job, tmp_path):
    flags = (*FAST, "--deterministic", "--epochs", "2")
    first = trained(run_job(RANKS, *flags, run_dir=tmp_path / "a", timeout=300))
    second = trained(run_job(RANKS, *flags, run_dir=tmp_path / "b", timeout=300))
    a = torch.load(tmp_path / "a" / "checkpoints" / "snapshot-epoch0002.pt", weights_only=True)
    b = torch.load(tmp_path / "b" / "checkpoints" / "snapshot-epoch0002.pt", weights_only=True)
    assert all(torch.equal(tensor, b["model"][name]) for name, tensor in a["model"].items())
    assert first["train_loss"] == second["train_loss"]


def test_a_model_without_deterministic_cuda_kernels_is_one_line(run_job):
    job = run_job(RANKS, *FAST, "--deterministic", "--arch", "vgg11", "--use_syn", "--num-classes", "10",
                  "--image-size", "32", "--steps-per-epoch", "2", "--epochs", "1", timeout=300)
    assert job.returncode == 2, job.output[-4000:]
    assert "--deterministic: --arch vgg11 uses" in job.output and "no deterministic implementation on cuda" in job.output
    assert "Traceback" not in job.output


def test_one_visible_gpu_per_rank_binds_cuda_0(mpirun, tmp_path):
    """As Slurm's --gpus-per-task=1 does: each rank's CUDA_VISIBLE_DEVICES names only its own GPU."""
    wrapper = tmp_path / "own_gpu.sh"
    wrapper.write_text('#!/bin/sh\nexport CUDA_VISIBLE_DEVICES="${OMPI_COMM_WORLD_LOCAL_RANK:-${MPI_LOCALRANKID:-0}}"\n'
                       'exec "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    run_dir = tmp_path / "run"
    job = run_command([mpirun, "-np", str(RANKS), str(wrapper), sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir),
                       *FAST, "--epochs", "1"], run_dir, timeout=300)
    summary = trained(job)  # two ranks each seeing one GPU were once refused ("runs 2 ranks but has 1 GPUs")
    assert summary["world_size"] == RANKS
    assert "uses cuda:0" in job.output and "of 1 visible" in job.output  # rank 0's line


def test_two_ranks_on_one_gpu_are_refused(run_job):
    env = job_env(CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    job = run_job(2, *FAST, "--epochs", "1", env=env, timeout=120)
    assert job.returncode == 2, job.output[-4000:]
    assert "ranks 0 and 1 on" in job.output and "each rank needs its own GPU" in job.output
    assert "Traceback" not in job.output


def test_check_measures_nccl(mpirun, tmp_path):
    job = run_command([mpirun, "-np", str(RANKS), sys.executable, "-m", "mpiddp", "check", "--device", "cuda",
                       "--runs-root", str(tmp_path / "runs"), "--wandb", "disabled"], tmp_path, timeout=300)
    assert job.returncode == 0, job.output[-4000:]
    assert f"nccl all-reduce (float32, {RANKS} ranks)" in job.output and "busbw GB/s" in job.output


def test_a_hang_on_nccl_leaves_flight_recorder_dumps_and_the_hang_file_names_the_collective(run_job, tmp_path):
    from mpiddp.job.flightrec import load_trace

    run_dir = tmp_path / "hang"
    # the last rank stalls after step 4 (its all-reduce done); every rank's watchdog fires 10 s later
    job = run_job(RANKS, *FAST, "--epochs", "3", "--inject-fault", f"stall:{RANKS - 1}:4", "--hang-timeout", "10",
                  run_dir=run_dir, timeout=300)
    assert job.returncode == 4, job.output[-4000:]
    for rank in range(RANKS):  # each rank dumped its recorder before the abort, in torch's own format
        dump = load_trace(run_dir / f"nccl-trace-rank{rank}")
        assert isinstance(dump, dict) and dump["entries"], dump
    (hang_file,) = run_dir.glob("hang-*.txt")
    text = hang_file.read_text()
    assert "==== collectives by rank (torch's flight recorder, dumps in" in text, text
    assert re.search(r"pg 0[^:\n]*: no collective pending", text), text  # the stall is outside NCCL
    for rank in range(RANKS):  # names the last collective each rank entered: op, sequence number, sizes, state
        assert re.search(rf"rank {rank}, pg 0[^:\n]*: last entered nccl:\w+ #\d+ \(in \[\[\d+.*, completed\); "
                         rf"last completed #\d+", text), text


def test_run_turns_the_flight_recorder_on_for_a_script_on_gpus(mpirun, tmp_path):
    script = tmp_path / "show_recorder.py"
    script.write_text("import os\nnames = ('TORCH_FR_BUFFER_SIZE', 'TORCH_NCCL_TRACE_BUFFER_SIZE', "
                      "'TORCH_NCCL_DUMP_ON_TIMEOUT')\nprint('recorder:', *(os.environ.get(n, '-') for n in names))\n")
    env = job_env()
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT"):
        env.pop(name, None)
    job = run_command([mpirun, "-np", str(RANKS), sys.executable, "-m", "mpiddp", "run", str(script)], tmp_path,
                      timeout=300, env=env)
    assert job.returncode == 0, job.output[-4000:]
    assert re.search(r"recorder: (2000 -|- 2000) 1", job.output), job.output[-4000:]  # the name this torch reads
