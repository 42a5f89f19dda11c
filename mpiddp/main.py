"""The CLI: picks a subcommand (train, run, check, report, launch) and hands over; nothing else."""

from __future__ import annotations

import sys
from typing import Any

from mpiddp.commands import split_command


def main(argv: list[str] | None = None, stop: Any = None) -> int:
    """`stop`: training's stop request when `python -m mpiddp` installed it already, as its first line."""
    command, args = split_command(list(sys.argv[1:] if argv is None else argv))
    if command == "report":  # reads files; no MPI
        from mpiddp.tools import report

        return report.main(args)
    if command == "launch":  # the supervisor: outside MPI, it starts the launcher itself
        from mpiddp.launch.cli import main as launch

        return launch(args)
    if command == "run":  # the user's own script: its signals are its own, as under torchrun
        from mpiddp.script.run import main as run_script

        return run_script(args)
    from mpiddp.trainer.entry import main as train_or_join

    if command == "check":
        from mpiddp.tools.check import run_check

        return train_or_join(args, check=run_check)
    return train_or_join(args, stop)


def main_cli(stop: Any = None) -> None:
    status = main(stop=stop)
    if split_command(sys.argv[1:])[0] in ("train", "check"):  # a rank that ran only mpiddp's code
        from mpiddp.trainer.run import exit_rank

        exit_rank(status)
    sys.exit(status)
