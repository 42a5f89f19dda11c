"""The grow tests' excuse (tests/spawnbug.py): Open MPI 5.0.11's prterun crash by its own signs, never a failure of
mpiddp's own."""

import pytest

from spawnbug import excuse, prterun_crash

PMIX = "[nodea:01234] PMIX ERROR: UNREACHABLE in file server/pmix_server_dyn.c at line 1113\n"
LOST = ("PRTE has lost communication with a remote daemon.\n  HNP daemon   : [prterun-nodea-1@0,0] on node nodea\n"
        "  Remote daemon: [prterun-nodea-1@0,2] on node nodec\n")
FALL_BACK = ("[rank 0] ERROR in-job recovery not possible: a new rank failed while joining on noded "
             "(RuntimeError: Connection closed by peer); ending the job\n")


@pytest.mark.parametrize("status, output, sign", [
    (134, PMIX + "corrupted size vs. prev_size\n", "corrupted size vs. prev_size"),
    (-6, PMIX + "double free or corruption (!prev)\n", "double free or corruption"),
    (1, PMIX + "free(): invalid pointer\n", "free(): invalid pointer"),  # launch's status, prterun's words
    (-11, PMIX, "SIGSEGV"),
    (139, "", "SIGSEGV"),
    (0, PMIX + LOST, "lost communication"),  # under --with-ft ulfm prterun exits 0
    (4, PMIX + "mpiddp: growing back: MPI_Comm_spawn onto noded has not returned after 60 s (...)\n", "never returned"),
])
def test_prteruns_own_signs_name_the_external_cause(status, output, sign):
    cause = prterun_crash(status, output)
    assert cause is not None and sign in cause, cause
    assert "Open MPI 5.0.11's spawn bug during the spawn: " in excuse(cause, "during the spawn")


@pytest.mark.parametrize("status, output", [
    (1, PMIX),  # mpiddp's own failure after prterun's usual PMIx line: no crash of prterun's
    (1, PMIX + FALL_BACK),  # mpiddp's join fell back
    (134, PMIX + FALL_BACK + "corrupted size vs. prev_size\n"),  # even with a crash after it
    (139, PMIX + FALL_BACK),
    (0, PMIX + LOST + FALL_BACK),
    (1, PMIX + "[rank 2] ERROR grow: this rank could not warm up (ImportError: x); the job goes on without it\n"),
    (134, "abort\n"),  # SIGABRT with none of glibc's heap words: not prterun's known crash
    (139, "prterun noticed that process rank 1 with PID 77 on node nodeb exited on signal 11 (Segmentation fault).\n"),
    (134, "free(): invalid pointer\nprterun noticed that process rank 0 with PID 7 on node nodea exited on signal 6 "
          "(Aborted).\n"),  # a rank's own crash, reported by prterun
    (0, LOST),  # a daemon lost with no sign of the spawn's bug
    (4, "mpiddp: growing back: MPI_Comm_spawn onto noded has not returned after 60 s (...)\n"),
    (0, PMIX + "corrupted size vs. prev_size\n"),  # a status 0: nothing crashed
])
def test_mpiddps_own_failures_and_unknown_ones_are_not_excused(status, output):
    assert prterun_crash(status, output) is None
