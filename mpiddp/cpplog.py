"""torch's C++ warnings kept out of a rank's log unless it logs at debug level: among them a survivor's request to a
dead rank 0's store, which torch's TCPStore client logs with the error's whole C++ stack (~20 lines: "[c10d]
sendBytes failed on SocketImpl(...): Connection reset by peer", "Exception raised from ...", "frame #0 ...") before
the one-line Python error (DistNetworkError) that mpiddp handles, and the recovery's own line says what happened.
c10 reads its level once, from TORCH_CPP_LOG_LEVEL, as torch loads (no call changes it later): so this runs before
torch is imported (`python -m mpiddp`'s first lines). A script under plain mpirun imports torch before
`mpiddp.init()`: there TORCH_CPP_LOG_LEVEL=ERROR in its environment does the same. Stdlib only."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

CPP_LOG_LEVEL_ENV = "TORCH_CPP_LOG_LEVEL"
QUIET = "ERROR"  # torch's default is WARNING; C++ errors (NCCL's watchdog, a failed collective) still show
RANK_COMMANDS = ("train", "check", "run")  # the commands that run ranks (launch and report start none here)


def debug_asked(args: list[str]) -> bool:
    """Whether the command line asks for `--log-level debug` (the trainer's and `mpiddp run`'s flag)."""
    for index, arg in enumerate(args):
        if arg == "--":
            return False
        if arg == "--log-level=debug" or (arg == "--log-level" and args[index + 1:index + 2] == ["debug"]):
            return True
    return False


def quiet_cpp_warnings(command: str, args: list[str],
                       environ: MutableMapping[str, str] | None = None) -> str | None:
    """Before torch is imported, in a rank's process: torch's C++ log level set to ERROR, unless the user set
    TORCH_CPP_LOG_LEVEL or asked for --log-level debug (the C++ warnings, a dead store's trace among them, are
    the detail then), or `command` runs no rank. The level set, None where left as it was."""
    environ = os.environ if environ is None else environ
    if command not in RANK_COMMANDS or CPP_LOG_LEVEL_ENV in environ or debug_asked(args):
        return None
    environ[CPP_LOG_LEVEL_ENV] = QUIET
    return QUIET
