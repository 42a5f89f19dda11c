"""Settings declared once as dataclass fields that are also flags: `option`, the parser derived from them, and their
checks; plus the settings the job shares with the trainer (device, backend, rendezvous address, log level).

Used by the trainer's Config and by `run`'s RunConfig alike, so that the job layer needs nothing of the trainer's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from dataclasses import field
from typing import Any, TypeVar

from mpiddp.contract import MASTER_ADDR_ENV  # noqa: F401 - re-exported
from mpiddp.errors import HelpRequested, UserError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
START_METHODS = ("forkserver", "spawn", "fork")
LOG_LEVELS = ("debug", "info", "warning", "error")
T = TypeVar("T")


class ConfigError(UserError):
    """A bad flag or flag combination: reported as one line, exit status 2."""


def option(default: Any, *names: str, help: str, group: str, parse: type | Callable[[str], Any] = str,
           choices: tuple[str, ...] = (), at_least: float | None = None, **argparse_options: Any) -> Any:
    """A Config field that is also a command-line flag. `parse` turns the flag's text into the value; the
    field's rules (choices, at_least) are checked on every Config, however it was built."""
    metadata = {"names": names, "help": help, "group": group, "parse": parse, "choices": choices,
                "at_least": at_least, "argparse": argparse_options}
    return field(default=default, metadata=metadata)


def check_declared(settings: Any) -> None:
    """Every rule a dataclass built with `option` declares on its fields (Config, RunConfig)."""
    for spec in dataclasses.fields(settings):
        check_field(spec, getattr(settings, spec.name))


def check_field(spec: dataclasses.Field, value: Any) -> None:
    """The rules a field declares for itself, with the flag's name in the message."""
    flag = spec.metadata["names"][0]
    choices, at_least = spec.metadata["choices"], spec.metadata["at_least"]
    if choices and value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
    if at_least is not None and value is not None and value < at_least:
        raise ValueError(f"{flag} must be at least {at_least:g}, got {value}")


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so the caller decides which rank speaks."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise HelpRequested(message or "")

    def print_help(self, file: Any = None) -> None:
        raise HelpRequested(self.format_help())


def parser_for(settings: type, prog: str, description: str,
               shortcuts: tuple[tuple[tuple[str, ...], str, Any, str], ...] = ()) -> argparse.ArgumentParser:
    """A command line derived from a dataclass whose fields were declared with `option` (flags, defaults and
    help are written there only); `shortcuts`: (flags, field, value, help) for flags that set a field to a value."""
    from mpiddp.version import __version__

    parser = _Parser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--version", action="version", version=f"mpiddp {__version__}")
    groups: dict[str, Any] = {}
    for spec in dataclasses.fields(settings):
        meta = spec.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        options = dict(meta["argparse"])
        env = options.pop("env", None)
        default = os.environ.get(env, spec.default) if env else spec.default
        if isinstance(spec.default, bool):
            group.add_argument(*meta["names"], dest=spec.name, action="store_true", help=meta["help"])
            continue
        # Text stays text here; `parse` converts it afterwards so its ValueError message reaches the user intact.
        shown = ",".join(default) if isinstance(default, tuple) else default
        group.add_argument(*meta["names"], dest=spec.name, default=shown, help=meta["help"], **options)
        for names, target, value, text in shortcuts:
            if target == spec.name:
                group.add_argument(*names, dest=target, action="store_const", const=value, help=text)
    return parser


def parse_into(settings: type[T], parser: argparse.ArgumentParser, argv: list[str] | None) -> T:
    """Parse `argv` and build the dataclass; ConfigError (one line) for anything wrong, HelpRequested for --help."""
    values = vars(parser.parse_args(argv))
    values.pop("ignored_local_rank", None)
    for spec in dataclasses.fields(settings):
        text, parse = values[spec.name], spec.metadata["parse"]
        if isinstance(text, str) and parse is not str:
            try:
                values[spec.name] = parse(text)
            except ValueError as exc:
                detail = str(exc) if parse not in (int, float) else f"invalid {parse.__name__} value: {text!r}"
                raise ConfigError(detail if detail.startswith("--") else f"{spec.metadata['names'][0]}: {detail}") from None
    try:
        return settings(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
