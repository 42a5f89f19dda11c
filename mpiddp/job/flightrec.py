"""torch's flight recorder: this rank's ring buffer of recent collectives as a file, and what every rank's says.

The dump is torch's own pickle (`torch._C._distributed_c10d._dump_nccl_trace()`, torch 2.4 to 2.14): a dict
with "version", "pg_config", "entries" (one dict per collective: "pg_id", "process_group" (name, description),
"collective_seq_id", "profiling_name", "input_sizes", "input_dtypes", "output_sizes", "state" ("scheduled",
"started", "completed"), "is_p2p", ...) and, from torch 2.8 or so, "pg_status" (the last enqueued, started and
completed sequence number per process group id). The files are named as torch's own dump on a collective timeout
names them (`<prefix><rank>`), so torch's analyser reads them too.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mpiddp.atomicfile import write_bytes_atomic

TRACE_PREFIX = "nccl-trace-rank"  # RUN_DIR/nccl-trace-rank<N>: ours, and torch's own on a collective timeout
DUMP_TIMEOUT_S = 10.0  # a dump that takes longer (the recorder's lock held by a stuck thread) is given up
READ_LIMIT = 512 * 1024 * 1024  # a dump of 2000 collectives with Python frames is a few MB


def trace_path(run_dir: Path, rank: int) -> Path:
    return run_dir / f"{TRACE_PREFIX}{rank}"


def nccl_trace() -> bytes:
    """This rank's NCCL flight-recorder buffer as torch pickles it (every collective, with its Python frames)."""
    from torch._C import _distributed_c10d

    return _distributed_c10d._dump_nccl_trace()


def write_trace(path: Path, dump: Callable[[], bytes], timeout_s: float = DUMP_TIMEOUT_S) -> str | None:
    """Write this rank's dump to `path` atomically; None when written, else one line saying why not.

    The dump runs in a helper thread with a deadline, so a recorder that cannot be read never keeps the caller
    (the hang watchdog, which must still end the job) waiting."""
    result: list[bytes | BaseException] = []

    def run() -> None:
        try:
            result.append(dump())
        except BaseException as exc:  # reported, never raised: the caller goes on to end the job
            result.append(exc)

    worker = threading.Thread(target=run, name="mpiddp-flight-recorder-dump", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not result:
        return f"the dump did not finish within {timeout_s:g} s"
    data = result[0]
    if isinstance(data, BaseException):
        return f"the dump failed ({type(data).__name__}: {data})"
    try:
        write_bytes_atomic(path, data)
    except OSError as exc:
        return f"writing {path} failed ({exc.strerror or exc})"
    return None


class _Plain(pickle.Unpickler):
    """Builds only what pickle builds without imports (dicts, lists, tuples, strings, numbers): a dump is a file
    on a shared filesystem, and unpickling anything else could run code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused {module}.{name}: a flight-recorder dump holds plain data only")


def load_trace(path: Path) -> dict[str, Any] | str:
    """The dump at `path`, or one line saying why it cannot be read."""
    try:
        with path.open("rb") as source:
            data = source.read(READ_LIMIT + 1)
    except FileNotFoundError:
        return f"no file {path}"
    except OSError as exc:
        return f"cannot read {path} ({exc.strerror or exc})"
    if len(data) > READ_LIMIT:
        return f"{path} is larger than {READ_LIMIT >> 20} MiB"
    try:
        dump = _Plain(io.BytesIO(data)).load()
    except Exception as exc:  # truncated, not a pickle, or a refused global
        return f"{path} is not a readable flight-recorder dump ({type(exc).__name__}: {exc})"
    if not isinstance(dump, dict) or not isinstance(dump.get("entries"), list):
        return f"{path} is not a flight-recorder dump with entries"
    version = str(dump.get("version", "?"))
    if version.split(".")[0] != "2":
        return f"{path} has dump format version {version}; mpiddp reads 2.x (torch 2.4 to 2.14)"
    return dump


def slim(dump: dict[str, Any] | str, per_group: int = 16) -> dict[str, Any] | str:
    """The part of a dump the analysis reads: each process group's newest entries, without Python frames, so
    the rank that reads every rank's dump holds little of each."""
    if isinstance(dump, str):
        return dump
    kept: dict[Any, list[dict[str, Any]]] = {}
    has_completed: set[str] = set()
    skipped: dict[str, dict[str, Any]] = {}  # per group, the oldest entry left out so far
    for entry in reversed(dump["entries"]):  # oldest first in the dump
        if not isinstance(entry, dict):
            continue
        name = str(entry.get("process_group"))
        group = kept.setdefault(name, [])
        completed = entry.get("state") == "completed"
        bare = {key: value for key, value in entry.items() if key != "frames"}
        if len(group) < per_group:
            group.append(bare)
            has_completed.update([name] if completed else [])
        elif completed and name not in has_completed:
            # beyond the newest entries, the newest completed one and the collective after it (the one the rank
            # waits in) still count: without torch 2.8's pg_status they are the only word on how far the group got
            # when many collectives are in flight (DDP's buckets)
            group.extend([bare, skipped[name]] if name in skipped else [bare])
            has_completed.add(name)
        elif name not in has_completed:
            skipped[name] = bare
    entries = [entry for group in kept.values() for entry in reversed(group)]  # the order does not matter
    return {**{key: value for key, value in dump.items() if key != "entries"}, "entries": entries}


@dataclass(frozen=True)
class Collective:
    """One entry of the recorder: a collective a rank entered (called), in one process group."""

    seq: int
    op: str
    sizes: str
    state: str

    def describe(self) -> str:
        return f"{self.op} #{self.seq} ({self.sizes}, {self.state})"


@dataclass
class GroupView:
    """What one rank's dump says about one process group."""

    label: str
    default: bool = False  # the default process group, of every rank
    entered: dict[int, Collective] = field(default_factory=dict)  # by sequence number
    completed: int = 0  # the last completed sequence number (0: none)

    @property
    def last_entered(self) -> int:
        return max(self.entered, default=0)

    @property
    def waiting_in(self) -> int | None:
        """The first collective this rank entered and has not completed."""
        return self.completed + 1 if self.last_entered > self.completed else None


def _sizes(entry: Mapping[str, Any]) -> str:
    dtypes = entry.get("input_dtypes") or []
    shown = f"in {entry.get('input_sizes', '?')}" + (f" {','.join(map(str, dict.fromkeys(dtypes)))}" if dtypes else "")
    outputs = entry.get("output_sizes")
    return shown + (f", out {outputs}" if outputs not in (None, entry.get("input_sizes")) else "")


def group_views(dump: Mapping[str, Any]) -> dict[str, GroupView]:
    """Per process group (by name), the collectives this rank entered and the last it completed."""
    views: dict[str, GroupView] = {}
    name_of_id: dict[str, str] = {}
    for entry in dump.get("entries", []):
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue  # sends and receives have their own numbering; the analysis is about collectives
        group = entry.get("process_group") or (str(entry.get("pg_id", "?")), "")
        name, desc = (str(group[0]), str(group[1]) if len(group) > 1 else "")
        view = views.setdefault(name, GroupView(f"pg {name}" + (f" ({desc})" if desc else ""), desc == "default_pg"))
        name_of_id[str(entry.get("pg_id"))] = name
        seq, state = int(entry.get("collective_seq_id", 0)), str(entry.get("state", "?"))
        view.entered[seq] = Collective(seq, str(entry.get("profiling_name", "?")), _sizes(entry), state)
        if state == "completed":
            view.completed = max(view.completed, seq)
    for name, config in (dump.get("pg_config") or {}).items():  # a group this rank has entered nothing of yet
        desc = str(config.get("desc", "")) if isinstance(config, dict) else ""
        if name and str(name) not in views:
            views[str(name)] = GroupView(f"pg {name}" + (f" ({desc})" if desc else ""), desc == "default_pg")
    # torch 2.8+: the recorder's own counters (the entries of some backends are never marked completed)
    for pg_id, status in (dump.get("pg_status") or {}).items():
        if str(pg_id) in name_of_id and isinstance(status, dict):
            view = views[name_of_id[str(pg_id)]]
            view.completed = max(view.completed, int(status.get("last_completed_collective", 0) or 0))
    return views


def _group_order(name: str) -> tuple[int, str]:
    return len(name), name  # torch names groups 0, 1, ..., 10: in the order they were made


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks))


def describe_traces(dumps: Mapping[int, Mapping[str, Any] | str], world_size: int) -> list[str]:
    """What the dumps show: per process group, the collective some ranks wait in and which ranks never entered
    it; then per rank the last collective it entered and the last it completed. A str in `dumps` says why that
    rank's dump is missing. Pure; never raises on odd dumps (a line says what could not be read)."""
    views: dict[int, dict[str, GroupView]] = {}
    lines: list[str] = []
    for rank in range(world_size):
        dump = dumps.get(rank, "no dump")
        if isinstance(dump, str):
            continue
        try:
            views[rank] = group_views(dump)
        except Exception as exc:  # a dump of an unexpected shape: say so, describe the others
            dumps = {**dumps, rank: f"unexpected content ({type(exc).__name__}: {exc})"}
    missing = [rank for rank in range(world_size) if rank not in views]
    groups = sorted({name for by_group in views.values() for name in by_group}, key=_group_order)
    for name in groups:
        members = {rank: by_group[name] for rank, by_group in views.items() if name in by_group}
        label = next(iter(members.values())).label
        pending = [view.waiting_in for view in members.values() if view.waiting_in is not None]
        if not pending:
            last = max(view.completed for view in members.values())
            lines.append(f"{label}: no collective pending (last completed #{last}): the ranks are stuck outside "
                         f"collectives, see their stacks")
            continue
        seq = min(pending)
        waiting = [rank for rank, view in members.items() if view.last_entered >= seq and view.completed < seq]
        behind = [rank for rank, view in members.items() if view.last_entered < seq]
        op = next((members[rank].entered[seq] for rank in waiting if seq in members[rank].entered), None)
        what = f"{op.op} #{seq} of {label}, {op.sizes}" if op else f"#{seq} of {label}"
        line = f"rank{'s' if len(waiting) > 1 else ''} {_ranks(waiting)} wait{'' if len(waiting) > 1 else 's'} in {what}"
        if behind:
            line += "; " + "; ".join(f"rank {rank}'s last entered is #{members[rank].last_entered}"
                                 if members[rank].entered else f"rank {rank} entered none" for rank in behind)
            line += f": {'they' if len(behind) > 1 else 'it'} never entered #{seq}"
        else:
            line += ": every rank with a dump entered it (a stuck network, GPU or NCCL rather than a rank behind)"
        unknown = [rank for rank in missing if rank not in members]
        if unknown and any(view.default for view in members.values()):
            line += f"; no dump from rank{'s' if len(unknown) > 1 else ''} {_ranks(unknown)}"
        lines.append(line)
    for rank in range(world_size):
        if rank not in views:
            lines.append(f"rank {rank}: {dumps.get(rank, 'no dump')}")
            continue
        if not views[rank]:
            lines.append(f"rank {rank}: no collective recorded")
        for name in sorted(views[rank], key=_group_order):
            view = views[rank][name]
            last = view.entered.get(view.last_entered)
            lines.append(f"rank {rank}, {view.label}: last entered {last.describe() if last else 'none'}; "
                         f"last completed #{view.completed}")
    return lines
