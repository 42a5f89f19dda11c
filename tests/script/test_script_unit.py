"""`mpiddp run` in-process: how the command line splits, how the target runs, what its failures become."""

import sys

import pytest

from mpiddp.errors import ScriptError, ScriptExit, UserError
from mpiddp.script.run import RunConfig, Target, execute, parse_run_args, split_argv
from mpiddp.trainer.config import ConfigError, HelpRequested


def test_options_end_at_the_script_name():
    own, target = split_argv(["--finish-timeout", "5", "--iface=eth0", "train.py", "--lr", "0.1", "-m", "x"])
    assert own == ["--finish-timeout", "5", "--iface=eth0"]
    assert target == Target("train.py", None, ("--lr", "0.1", "-m", "x"))


def test_module_form_and_double_dash():
    assert split_argv(["-m", "pkg.train", "--epochs", "2"]) == ([], Target(None, "pkg.train", ("--epochs", "2")))
    assert split_argv(["--", "-odd-name.py", "a"])[1] == Target("-odd-name.py", None, ("a",))


@pytest.mark.parametrize("argv, message", [
    ([], "run needs a script to run"),
    (["--master-addr"], "--master-addr needs a value"),
    (["-m"], "-m needs a module name"),
])
def test_incomplete_command_lines(argv, message):
    with pytest.raises(UserError, match=message):
        split_argv(argv)


def test_run_options_parse_and_validate():
    assert parse_run_args(["--finish-timeout", "0"]) == RunConfig(finish_timeout_s=0.0)
    with pytest.raises(ConfigError, match="--finish-timeout must be at least 0"):
        parse_run_args(["--finish-timeout", "-1"])
    assert parse_run_args(["--hang-timeout", "30"]).hang_timeout_s == 30.0 and RunConfig().hang_timeout_s == 300.0
    with pytest.raises(ConfigError, match="--hang-timeout must be a number, got nan"):  # nan would turn it off
        parse_run_args(["--hang-timeout", "nan"])
    with pytest.raises(HelpRequested, match="--finish-timeout"):
        parse_run_args(split_argv(["--help"])[0])


def test_missing_and_unimportable_targets(tmp_path):
    with pytest.raises(UserError, match="script 'nope.py' not found"):
        Target("nope.py", None, ()).digest()
    with pytest.raises(UserError, match="no module named 'no_such_module_xyz'"):
        Target(None, "no_such_module_xyz", ()).digest()
    with pytest.raises(UserError, match="cannot import module 'no_such_pkg_xyz.train'"):
        Target(None, "no_such_pkg_xyz.train", ()).digest()


def write(tmp_path, text):
    script = tmp_path / "train.py"
    script.write_text(text)
    return Target(str(script), None, ("--lr", "1")), script


def test_the_script_runs_as_python_would_run_it(tmp_path):
    target, script = write(tmp_path, "import sys\nimport json\nopen(sys.argv[0] + '.out', 'w').write("
                                     "json.dumps([sys.argv, __name__, sys.path[0]]))\n")
    before = sys.argv[:], sys.path[0]
    execute(target, script)
    assert (sys.argv[:], sys.path[0]) == before  # restored afterwards
    import json

    argv, name, path0 = json.loads((tmp_path / "train.py.out").read_text())
    assert argv == [str(script), "--lr", "1"] and name == "__main__" and path0 == str(tmp_path)


@pytest.mark.parametrize("ending, expected", [("sys.exit(0)", None), ("sys.exit()", None), ("pass", None),
                                              ("sys.exit(3)", 3), ("sys.exit('bye')", 1)])
def test_exit_statuses(tmp_path, ending, expected):
    target, script = write(tmp_path, f"import sys\n{ending}\n")
    if expected is None:
        execute(target, script)
    else:
        with pytest.raises(ScriptExit) as caught:
            execute(target, script)
        assert caught.value.status == expected


def test_an_exception_report_starts_in_the_users_code(tmp_path):
    target, script = write(tmp_path, "def step():\n    raise KeyError('lr')\n\nstep()\n")
    with pytest.raises(ScriptError) as caught:
        execute(target, script)
    report = caught.value.report
    assert report.startswith("Traceback (most recent call last):\n  File \"" + str(script))
    assert report.endswith("KeyError: 'lr'") and "runpy" not in report and "mpiddp" not in report


def test_only_contiguous_rank_layouts_run_torchrun_scripts():
    from mpiddp.script.run import check_contiguous
    from mpiddp.job.topology import RankRecord, build_topology

    def topology(hosts):  # world rank -> host name; a host's leader is its lowest rank
        leaders = {host: hosts.index(host) for host in hosts}
        local = {host: [r for r, h in enumerate(hosts) if h == host] for host in hosts}
        return build_topology(0, [RankRecord(r, h, leaders[h], local[h].index(r), len(local[h]))
                                  for r, h in enumerate(hosts)])

    check_contiguous(topology(["a", "a", "b", "b"]))  # mpirun --map-by slot
    check_contiguous(topology(["a", "b", "b", "b"]))  # uneven hosts, still one block each
    with pytest.raises(UserError, match=r"a runs ranks 0, 2, but .* contiguous \(0-1\): .*--map-by slot"):
        check_contiguous(topology(["a", "b", "a", "b"]))  # mpirun --map-by node


def test_one_gpu_per_rank_gives_every_rank_local_rank_0(monkeypatch):
    import torch

    from mpiddp.script.run import virtual_local_rank, visible_gpus

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert visible_gpus() == 0
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # srun --gpus-per-task=1
    assert visible_gpus() == 1 and virtual_local_rank([visible_gpus()] * 4)
    assert not virtual_local_rank([8, 8, 8, 8])  # every GPU visible: cuda:<LOCAL_RANK>
    assert not virtual_local_rank([1, 2]) and not virtual_local_rank([0, 0])


def test_forkserver_becomes_the_default_without_fixing_it():
    import subprocess

    start = "import multiprocessing as mp\nfrom mpiddp.script.run import default_start_method\n"
    probes = [
        "with default_start_method('forkserver') as chosen:\n"
        "    assert chosen == 'forkserver' and mp.get_start_method(allow_none=True) is None\n"
        "    assert mp.get_start_method() == 'forkserver'  # what DataLoader workers get\n",
        "with default_start_method('forkserver'):\n"
        "    mp.set_start_method('spawn')  # the script's own choice is still allowed, and wins\n"
        "assert mp.get_start_method() == 'spawn'\n"
        "with default_start_method('forkserver') as chosen:\n"
        "    assert chosen is None  # already chosen: left alone\n",
    ]
    for probe in probes:  # each in a fresh interpreter: the start method is process-wide
        done = subprocess.run([sys.executable, "-c", start + probe + "print('ok')"], capture_output=True, text=True,
                              timeout=60)
        assert done.stdout.strip() == "ok", done.stderr


def test_the_users_omp_num_threads_wins_over_the_fair_share():
    from mpiddp.job.bootstrap import fair_thread_count, user_thread_count
    from mpiddp.job.flags import DistSettings
    from mpiddp.job.collective import solo_topology

    topo = solo_topology()
    assert fair_thread_count(RunConfig().dist, topo, {"OMP_NUM_THREADS": "1"}) == 1
    assert fair_thread_count(RunConfig(dist=DistSettings(num_threads=3)).dist, topo, {"OMP_NUM_THREADS": "1"}) == 3  # the flag first
    assert user_thread_count({"OMP_NUM_THREADS": "4,2"}) == 4  # OpenMP's nested form: the outer level
    assert user_thread_count({}) is None and user_thread_count({"OMP_NUM_THREADS": "0"}) is None
    assert user_thread_count({"OMP_NUM_THREADS": "many"}) is None


def test_torchrun_variables_carry_the_restart_count_and_nccl_error_handling(monkeypatch):
    import dataclasses
    import os

    from mpiddp.job.bootstrap import export_environment
    from mpiddp.job.collective import solo_topology

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.setenv(name, "")  # restored afterwards
    export_environment(dataclasses.replace(solo_topology(), restarts=2), "127.0.0.1", 1234)
    assert os.environ["TORCHELASTIC_RESTART_COUNT"] == "2" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    export_environment(solo_topology(), "127.0.0.1", 1234)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"  # the user's setting stays


def test_the_exit_handler_learns_the_status_the_script_gave_sys_exit(monkeypatch):
    import threading

    from mpiddp.script.api import _as_exit_code, _ExitStatus

    assert [_as_exit_code(s) for s in (None, 0, 3, True, "bye")] == [0, 0, 3, 1, 1]
    monkeypatch.setattr(sys, "exit", sys.exit)  # restored afterwards
    seen = _ExitStatus().install()
    def leave_thread():
        try:
            sys.exit(5)  # ends only this thread: not the script's status
        except SystemExit:
            pass

    thread = threading.Thread(target=leave_thread)
    thread.start()
    thread.join()
    assert seen.status == 0
    with pytest.raises(SystemExit) as caught:
        sys.exit(3)
    assert caught.value.code == 3 and seen.status == 3
