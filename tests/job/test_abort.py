"""MPI_Abort with a deadline (mpiddp.job.abort): an abort that ends the process is left alone; one that hangs (Open
MPI's PMIx_Abort has deadlocked) ends the process by itself, with the stacks that show where it hung."""

import faulthandler
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from mpiddp.job.abort import abort_within


class EndingComm:
    def __init__(self):
        self.codes = []

    def Abort(self, code):  # noqa: N802 - mpi4py's name
        self.codes.append(code)
        raise KeyboardInterrupt  # stands for the process ending: the deadline must not outlive a working abort



def test_a_working_abort_is_called_once_with_the_code():
    comm = EndingComm()
    try:
        with pytest.raises(KeyboardInterrupt):
            abort_within(comm, 7, deadline_s=600)
    finally:
        faulthandler.cancel_dump_traceback_later()  # this process goes on: its deadline must not end the tests
    assert comm.codes == [7]


def test_an_abort_that_hangs_ends_the_process_within_its_deadline_and_says_where():
    program = textwrap.dedent("""
        import time
        from mpiddp.job.abort import abort_within

        class HangingComm:
            def Abort(self, code):
                while True:  # holds the GIL as mpi4py's MPI_Abort does: no Python thread could run
                    pass

        abort_within(HangingComm(), 3, deadline_s=1.0)
    """)
    # the deadline, 1 s, ends it; the timeout only bounds a failure of this test
    ended = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert ended.returncode == 1, ended.stderr
    assert "Timeout" in ended.stderr and "in Abort" in ended.stderr and "abort_within" in ended.stderr, ended.stderr
