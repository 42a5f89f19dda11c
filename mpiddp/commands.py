"""The subcommands of `python -m mpiddp`: stdlib only, so the first line of __main__ can read them."""

from __future__ import annotations

COMMANDS = ("train", "run", "check", "report", "launch")


def split_command(args: list[str]) -> tuple[str, list[str]]:
    """(the subcommand, its arguments); without one, `train` with all of them."""
    if args and args[0] in COMMANDS:
        return args[0], list(args[1:])
    return "train", list(args)
