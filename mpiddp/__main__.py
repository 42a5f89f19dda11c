"""`python -m mpiddp`: run the job, ending the whole MPI job if any rank fails.

The stop handlers come first, before any heavy import (numpy, torch, MPI): a scheduler's SIGTERM in a rank's
first moments must stop the job with a snapshot and exit 3, never kill the rank (exit 143, which no batch
script requeues). torch's C++ warnings are quieted before torch loads, too (mpiddp.cpplog)."""

import sys

from mpiddp.commands import split_command
from mpiddp.cpplog import quiet_cpp_warnings
from mpiddp.trainer.early import install_stop

stop = install_stop(sys.argv[1:])
quiet_cpp_warnings(*split_command(sys.argv[1:]))  # before torch loads: c10 reads its log level once

from mpiddp.main import main_cli  # noqa: E402  (after the handlers, on purpose)

main_cli(stop)
