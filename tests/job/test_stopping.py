"""StopRequest in-process: repeated scheduler signals never abort; Ctrl-C escalates; late signals are harmless."""

import os
import signal

import pytest

from mpiddp.job.stopping import STOP_SIGNALS, StopRequest


@pytest.fixture
def request_installed():
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    yield StopRequest().install()
    for signum, handler in before.items():
        signal.signal(signum, handler)


def test_any_number_of_scheduler_signals_keep_the_first_and_never_abort(request_installed):
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR2, signal.SIGUSR1):
        os.kill(os.getpid(), signum)
    assert request_installed.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGINT) == request_installed._handle


def test_second_ctrl_c_hands_sigint_back_to_the_kernel(request_installed, capfd):
    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop first: Ctrl-C still counts from one
    os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == request_installed._handle
    os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL  # the third one ends the process
    assert request_installed.signum == signal.SIGTERM
    assert "press Ctrl-C once more" in capfd.readouterr().err


def test_release_ignores_late_scheduler_signals(request_installed):
    request_installed.release()
    for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        assert signal.getsignal(signum) == signal.SIG_IGN
        os.kill(os.getpid(), signum)  # would end this test process if not ignored
    assert signal.getsignal(signal.SIGINT) == signal.default_int_handler


def test_release_after_a_stop_ignores_a_late_ctrl_c(request_installed):
    os.kill(os.getpid(), signal.SIGTERM)  # the stop is decided: its exit status is 3 through teardown
    request_installed.release()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # survives Python's finalization, unlike a handler
    os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt (exit 130) with Python's default


def test_release_after_two_ctrl_c_keeps_the_kernels_default(request_installed):
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)  # a person escalating: the next Ctrl-C must still end the rank
    request_installed.release()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL


def test_python_m_mpiddp_installs_the_stop_handlers_before_any_heavy_import():
    import subprocess
    import sys

    # What `python -m mpiddp` runs before its first line, and that line: no numpy, torch or MPI may load first.
    probe = ("import signal, sys; from mpiddp.trainer.early import install_stop; "
             "stop = install_stop(['--epochs', '1']); "
             "print(sorted(m for m in ('numpy', 'torch', 'mpi4py') if m in sys.modules), "
             "signal.getsignal(signal.SIGTERM) == stop._handle, install_stop(['launch', '-np', '2']))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["[]", "True", "None"], out
