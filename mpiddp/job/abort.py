"""MPI_Abort with a deadline: the abort that ends a failed job must not become its hang.

MPI_Abort asks the launcher's runtime (PMIx_Abort to the local daemon) to end every process, and waits for it.
Open MPI's has deadlocked there (open-mpi/ompi#3225, #8925: an abort that waits on a runtime busy with a peer's
own exit), and a rank stuck in its abort keeps mpirun, and so the whole job and its supervisor, waiting for good.
mpi4py holds the GIL inside MPI_Abort, so no Python thread could end the process then: faulthandler's watchdog
is a C thread that needs no GIL. If the abort has not ended this process after ABORT_DEADLINE_S, it writes every
thread's stack to stderr (under "Timeout": the abort named in it) and exits 1; the launcher then sees this rank
end, as it would have after the abort.
"""

from __future__ import annotations

import faulthandler
import sys
from typing import Any, NoReturn

# Long against an abort that works (it ends every process in well under a second, measured on fake hosts), short
# against the minutes a stuck job costs.
ABORT_DEADLINE_S = 20.0


def abort_within(comm: Any, code: int, deadline_s: float = ABORT_DEADLINE_S) -> NoReturn:
    """MPI_Abort(`comm`, `code`); should it not end this process within `deadline_s`, exit 1 (module docstring)."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed stream: the abort matters more than the flush
        pass
    try:
        faulthandler.dump_traceback_later(deadline_s, exit=True, file=sys.__stderr__ or 2)
    except (RuntimeError, ValueError, OSError):  # no file to write to: the abort goes on unguarded
        pass
    comm.Abort(code)
    raise SystemExit(code)  # not reached: MPI_Abort does not return
