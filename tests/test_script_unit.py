"""`mpiddp run` in-process: how the command line splits, how the target runs, what its failures become."""

import sys

import pytest

from mpiddp.config import ConfigError, HelpRequested
from mpiddp.errors import ScriptError, ScriptExit, UserError
from mpiddp.script import RunConfig, Target, execute, parse_run_args, split_argv


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
