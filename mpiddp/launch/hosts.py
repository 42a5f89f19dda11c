"""Host lists for the supervisor: a hostfile (Open MPI or MPICH form), `-H a:8,b:8`, a Slurm allocation, PBS."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class HostListError(ValueError):
    """A host list that cannot be read: one line saying what to fix."""


# A host name or address as launchers take it: ASCII letters, digits, '.', '-', '_' (no spaces, no shell syntax)
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_NUMBER = re.compile(r"[0-9]+")  # ASCII digits only: str.isdigit() also takes '²', which int() refuses


@dataclass(frozen=True)
class Host:
    name: str
    slots: int


def _merge(pairs: list[tuple[str, int]]) -> list[Host]:
    """Hosts in order of first mention; a host named twice gets the slots of both (PBS names it once per slot)."""
    slots: dict[str, int] = {}
    for name, count in pairs:
        if not _HOST_NAME.fullmatch(name):
            raise HostListError(f"{name!r} is not a host name (letters, digits, '.', '-' and '_' only)")
        if count < 1:
            raise HostListError(f"host {name!r} has {count} slots: give at least 1")
        slots[name] = slots.get(name, 0) + count
    return [Host(name, count) for name, count in slots.items()]


def _count(text: str, what: str) -> int:
    if not _NUMBER.fullmatch(text):
        raise HostListError(f"{what}: slot count {text!r} is not a number")
    return int(text)


def parse_hostfile(text: str) -> list[Host]:
    """Open MPI `host slots=N` (other keys ignored), MPICH `host:N`, or a bare `host` (1 slot); `#` comments."""
    pairs = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        first, *rest = line.split()
        where = f"hostfile line {number} ({raw.strip()!r})"
        if ":" in first:
            name, _, count = first.partition(":")
            pairs.append((name, _count(count, where)))
            continue
        options = dict(item.partition("=")[::2] for item in rest)
        pairs.append((first, _count(options["slots"], where) if "slots" in options else 1))
    if not pairs:
        raise HostListError("the hostfile names no host")
    return _merge(pairs)


def parse_host_option(text: str) -> list[Host]:
    """`-H a:8,b:8` (a bare name is one slot)."""
    pairs = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, count = item.partition(":")
        if not name.strip():
            raise HostListError(f"-H {text}: an entry has no host name (give host:slots,host:slots)")
        pairs.append((name.strip(), _count(count, f"-H {text}") if count else 1))
    if not pairs:
        raise HostListError("-H names no host: give -H host:slots,host:slots")
    return _merge(pairs)


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets: `node[01-03,07],gpu5` -> `node[01-03,07]`, `gpu5`."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    parts.append(text[start:])
    return [part for part in parts if part]


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list: `node[01-03,07],gpu5` -> node01 node02 node03 node07 gpu5 (zero padding kept)."""
    names = []
    for part in _split_top_level(text.strip()):
        match = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if match is None:
            names.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            low, _, high = item.partition("-")
            if not _NUMBER.fullmatch(low) or (high and not _NUMBER.fullmatch(high)):
                raise HostListError(f"cannot read the Slurm node list {text!r} at {item!r}")
            if high and int(high) < int(low):
                raise HostListError(f"cannot read the Slurm node list {text!r}: the range {item!r} runs backwards")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                # the rest may hold more brackets: rack[1-2]-node[01-02]
                names.extend(expand_nodelist(f"{prefix}{number:0{width}d}{suffix}"))
    return names


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's SLURM_TASKS_PER_NODE: `8(x2),4` -> 8, 8, 4."""
    counts = []
    for item in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise HostListError(f"cannot read SLURM_TASKS_PER_NODE {text!r} at {item!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def from_slurm(env: Mapping[str, str]) -> list[Host]:
    names = expand_nodelist(env["SLURM_JOB_NODELIST"])
    counts = expand_tasks_per_node(env.get("SLURM_TASKS_PER_NODE", ",".join("1" for _ in names)))
    if len(counts) != len(names):
        raise HostListError(f"the Slurm allocation names {len(names)} nodes but SLURM_TASKS_PER_NODE gives "
                            f"{len(counts)} counts")
    return _merge(list(zip(names, counts)))


def from_pbs(text: str) -> list[Host]:
    """PBS_NODEFILE: one line per slot."""
    pairs = [(line.strip(), 1) for line in text.splitlines() if line.strip()]
    if not pairs:
        raise HostListError("PBS_NODEFILE names no host")
    return _merge(pairs)


def discover(hostfile: str | None, host_option: str | None, env: Mapping[str, str]) -> tuple[list[Host], str]:
    """(hosts, where they came from): --hostfile, -H, the Slurm allocation, the PBS job; else none."""
    if hostfile and host_option:
        raise HostListError("give --hostfile or -H, not both")
    if hostfile:
        try:
            return parse_hostfile(Path(hostfile).read_text()), f"hostfile {hostfile}"
        except OSError as exc:
            raise HostListError(f"cannot read the hostfile {hostfile}: {exc.strerror or exc}") from None
    if host_option:
        return parse_host_option(host_option), "-H"
    if env.get("SLURM_JOB_NODELIST"):
        return from_slurm(env), f"Slurm allocation {env.get('SLURM_JOB_ID', '')}".rstrip()
    if env.get("PBS_NODEFILE"):
        try:
            return from_pbs(Path(env["PBS_NODEFILE"]).read_text()), f"PBS job {env.get('PBS_JOBID', '')}".rstrip()
        except OSError as exc:
            raise HostListError(f"cannot read PBS_NODEFILE {env['PBS_NODEFILE']}: {exc.strerror or exc}") from None
    return [], "this host"


def place(hosts: list[Host], num_ranks: int) -> tuple[list[Host], list[Host]]:
    """(hosts to run on, spares): the first hosts in list order whose slots hold `num_ranks`; the last one used
    gives only the slots needed. Raises HostListError when the slots do not reach."""
    used: list[Host] = []
    needed = num_ranks
    for index, host in enumerate(hosts):
        if needed == 0:
            return used, hosts[index:]
        take = min(host.slots, needed)
        used.append(Host(host.name, take))
        needed -= take
    if needed:
        total = sum(h.slots for h in hosts)
        raise HostListError(f"-np {num_ranks} needs {num_ranks} slots, the hosts left have {total}: "
                            f"{format_hosts(hosts) or 'none'}")
    return used, []


def format_hosts(hosts: list[Host]) -> str:
    """`a:8,b:8`, the form -H takes."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)
