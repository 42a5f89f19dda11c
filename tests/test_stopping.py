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
