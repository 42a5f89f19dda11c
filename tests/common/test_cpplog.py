"""torch's C++ warnings quieted in a rank's process (mpiddp/cpplog.py): a dead rank 0's store must not put
torch's C++ stack trace into a survivor's log."""

import subprocess
import sys

import pytest

from mpiddp.cpplog import CPP_LOG_LEVEL_ENV, debug_asked, quiet_cpp_warnings

# a TCPStore server in a process of its own, killed; this process's client then sends to it, as a survivor's
# watcher does to rank 0's store after rank 0 died
DEAD_STORE = """
import os, signal, subprocess, sys
from mpiddp.commands import split_command
from mpiddp.cpplog import quiet_cpp_warnings
quiet_cpp_warnings(*split_command(sys.argv[1:]))
import torch.distributed as tdist
server = subprocess.Popen([sys.executable, "-c", "import time, torch.distributed as d; "
                           "s = d.TCPStore('127.0.0.1', 0, 2, True, wait_for_workers=False); "
                           "print(s.port, flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
client = tdist.TCPStore("127.0.0.1", int(server.stdout.readline()), 2, False)
client.set("a", "1")
server.kill()
server.wait()
try:
    client.set("b", "2")
    client.get("b")
except Exception as exc:
    print(f"survivor: {type(exc).__name__}: {exc}", file=sys.stderr)
"""


def dead_store_output(*args: str, env: dict[str, str] | None = None) -> str:
    import os

    environ = {key: value for key, value in os.environ.items() if key != CPP_LOG_LEVEL_ENV}
    done = subprocess.run([sys.executable, "-c", DEAD_STORE, *args], capture_output=True, text=True, timeout=120,
                          env={**environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_a_survivors_request_to_a_dead_store_logs_one_line_not_torchs_cpp_trace():
    said = dead_store_output("--epochs", "1")
    assert "survivor: DistNetworkError" in said, said  # torch's own one-line error, for mpiddp to handle
    assert "Exception raised from" not in said and "frame #" not in said and "[c10d]" not in said, said


def torch_logs_the_store_trace() -> bool:
    """torch 2.5 and later log a TCPStore client's C++ stack trace on a broken connection; 2.4 raises the one-line
    error only, so there is nothing for debug level to show (the floor run)."""
    import torch

    return tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def test_at_debug_level_or_where_the_user_chose_a_level_torchs_trace_is_the_detail():
    for said in (dead_store_output("--log-level", "debug"),
                 dead_store_output("--epochs", "1", env={CPP_LOG_LEVEL_ENV: "WARNING"})):
        assert "survivor: DistNetworkError" in said, said[-2000:]
        if torch_logs_the_store_trace():
            assert "[c10d]" in said and "Exception raised from" in said, said[-2000:]


@pytest.mark.parametrize("command, args, environ, level", [
    ("train", ["--epochs", "1"], {}, "ERROR"),
    ("run", ["script.py"], {}, "ERROR"),
    ("check", [], {}, "ERROR"),
    ("train", ["--log-level", "debug"], {}, None),
    ("run", ["--log-level=debug", "script.py"], {}, None),
    ("train", [], {CPP_LOG_LEVEL_ENV: "INFO"}, None),  # the user's own choice stands
    ("launch", ["-np", "2"], {}, None),  # no rank here: its ranks decide for themselves
    ("report", [], {}, None),
])
def test_the_level_is_quieted_only_in_a_rank_that_did_not_ask_for_the_detail(command, args, environ, level):
    before = dict(environ)
    assert quiet_cpp_warnings(command, args, environ) == level
    assert environ == (before if level is None else {**before, CPP_LOG_LEVEL_ENV: level})


def test_debug_is_read_from_the_flag_before_a_double_dash_only():
    assert debug_asked(["--log-level", "debug"]) and not debug_asked(["--log-level", "info"])
    assert not debug_asked(["--", "--log-level", "debug"]) and not debug_asked(["--log-level"])
