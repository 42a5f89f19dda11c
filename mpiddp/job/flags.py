"""Settings declared once as dataclass fields that are also flags: `option`, `section` (a dataclass of options
inside another), the parser derived from them, and their checks; plus the settings the job shares with the trainer:
`DistSettings` (device, backend, rendezvous, timeouts, threads), declared here once.

Used by the trainer's Config, by `run`'s RunConfig and by `mpiddp.init` alike, so that the job layer needs nothing
of the trainer's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from mpiddp.contract import MASTER_ADDR_ENV  # noqa: F401 - re-exported
from mpiddp.errors import HelpRequested, UserError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
START_METHODS = ("forkserver", "spawn", "fork")
LOG_LEVELS = ("debug", "info", "warning", "error")
DISTRIBUTED = "distributed"
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


def section(kind: type, flags: tuple[str, ...] | None = None, help: dict[str, str] | None = None) -> Any:
    """A field holding a section: a dataclass of `option` fields (training's data, checkpoint, ...; DistSettings).
    Its flags are the holder's flags. `flags`: the section's fields this command offers (default: all; the others
    keep their defaults); `help`: this command's own wording for some of them."""
    return field(default_factory=kind, metadata={"section": kind, "flags": flags, "help": help or {}})


def flag_fields(settings: type) -> Iterator[tuple[dataclasses.Field, dict[str, Any]]]:
    """Every field that is a flag, sections walked, in declaration order: (field, its metadata as this command
    shows it)."""
    for spec in dataclasses.fields(settings):
        kind = spec.metadata.get("section")
        if kind is None:
            yield spec, dict(spec.metadata)
            continue
        offered, wording = spec.metadata["flags"], spec.metadata["help"]
        for inner, meta in flag_fields(kind):
            if offered is None or inner.name in offered:
                yield inner, {**meta, "help": wording.get(inner.name, meta["help"])}


def flat_values(settings: Any) -> dict[str, Any]:
    """{field name: value} of every flag of `settings`, sections walked: the flat view logs and records show."""
    values: dict[str, Any] = {}
    for spec in dataclasses.fields(settings):
        value = getattr(settings, spec.name)
        if "section" not in spec.metadata:
            values[spec.name] = value
            continue
        offered = spec.metadata["flags"]
        values.update((name, inner) for name, inner in flat_values(value).items() if offered is None or name in offered)
    return values


def from_flat(settings: type[T], values: dict[str, Any]) -> T:
    """Build `settings` and its sections from flat {field name: value} (what the parser yields; tests use it too);
    fields left out keep their defaults. A TypeError names a value no field takes."""
    left = dict(values)
    built = _build(settings, left)
    if left:
        raise TypeError(f"{settings.__name__} has no setting {', '.join(sorted(left))}")
    return built


def _build(settings: type[T], left: dict[str, Any]) -> T:
    kwargs: dict[str, Any] = {}
    for spec in dataclasses.fields(settings):
        kind = spec.metadata.get("section")
        if kind is not None:
            kwargs[spec.name] = _build(kind, left)
        elif spec.name in left:
            kwargs[spec.name] = left.pop(spec.name)
    return settings(**kwargs)


def check_declared(settings: Any) -> None:
    """Every rule the `option` fields of a dataclass declare (its sections' are theirs: each section, or for
    DistSettings its holder, checks them)."""
    for spec in dataclasses.fields(settings):
        if "section" not in spec.metadata:
            check_field(spec, getattr(settings, spec.name))


def check_field(spec: dataclasses.Field, value: Any) -> None:
    """The rules a field declares for itself, with the flag's name in the message."""
    flag = spec.metadata["names"][0]
    choices, at_least = spec.metadata["choices"], spec.metadata["at_least"]
    if choices and value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
    if isinstance(value, float) and value != value:  # NaN passes every comparison: a timeout of nan is no timeout
        raise ValueError(f"{flag} must be a number, got {value}")
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
    for spec, meta in flag_fields(settings):
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
    for spec, _ in flag_fields(settings):
        text, parse = values[spec.name], spec.metadata["parse"]
        if isinstance(text, str) and parse is not str:
            try:
                values[spec.name] = parse(text)
            except ValueError as exc:
                detail = str(exc) if parse not in (int, float) else f"invalid {parse.__name__} value: {text!r}"
                raise ConfigError(detail if detail.startswith("--") else f"{spec.metadata['names'][0]}: {detail}") from None
    try:
        return from_flat(settings, values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class DistSettings:
    """Where and how the ranks meet: device and backend, the rendezvous (address, interface, timeout), the
    collective and hang timeouts, CPU threads. Declared once, embedded by the trainer's Config, `run`'s RunConfig
    and `mpiddp.init`'s settings, each offering the flags it needs. Its holder checks it (flags and the Python
    API word their errors differently)."""

    device: str = option("auto", "--device", group=DISTRIBUTED, choices=DEVICES, help=f"one of {', '.join(DEVICES)}")
    backend: str = option("auto", "--backend", group=DISTRIBUTED, choices=BACKENDS,
                          help=f"one of {', '.join(BACKENDS)} (mpi: only if torch was built with it)")
    master_addr: str | None = option(None, "--master-addr", group=DISTRIBUTED, env=MASTER_ADDR_ENV,
                                     help=f"address rank 0 advertises for the rendezvous (env {MASTER_ADDR_ENV}; "
                                     "default: chosen automatically)")
    iface: str | None = option(None, "--iface", group=DISTRIBUTED,
                               help="network interface for the rendezvous and gloo/NCCL on every host (default: chosen automatically)")
    rendezvous_timeout_s: float = option(120.0, "--rendezvous-timeout", group=DISTRIBUTED, parse=float,
                                         help="seconds a rank waits to reach rank 0's store")
    collective_timeout_s: float = option(600.0, "--collective-timeout", group=DISTRIBUTED, parse=float,
                                         help="seconds before a stuck gloo/NCCL collective fails")
    hang_timeout_s: float = option(600.0, "--hang-timeout", group=DISTRIBUTED, parse=float,
                                   help="seconds without progress on a rank before the watchdog dumps stacks and aborts (0: off)")
    num_threads: int | None = option(None, "--num-threads", group=DISTRIBUTED, parse=int, at_least=1,
                                     help="torch CPU threads per rank (default: OMP_NUM_THREADS if set, else a fair share)")


# A script's hang watchdog (`run --hang-timeout`, `mpiddp.init(hang_timeout_s=...)`) watches its waits on the others
# only, in collectives the script started itself: it must fire before torch's own timeout ends them (NCCL's: 600 s).
SCRIPT_HANG_TIMEOUT_S = 300.0


def check_address(settings: DistSettings) -> None:
    """The rule on --master-addr that every command offering it shares."""
    if settings.master_addr is not None and not settings.master_addr.strip():
        raise ValueError("--master-addr is empty: give a host name or IP address, or leave it out")
