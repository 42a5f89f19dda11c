"""Snapshot files. Saving is collective: global rank 0 writes atomically, then `latest` moves, then all go on.
Loading uses weights_only=True, so a snapshot file can never run code; rank 0 reads, every rank receives."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from mpiddp.collective import Dist
from mpiddp.errors import UserError
from mpiddp.rundir import write_atomic
from mpiddp.snapshot import Snapshot

log = logging.getLogger(__name__)

LATEST = "latest"
_SNAPSHOT = re.compile(r"^snapshot-epoch(\d{4,})(?:-batch(\d+))?\.pt$")


def snapshot_name(epoch: int, batches_done: int = 0) -> str:
    """`epoch` completed epochs, plus `batches_done` batches of the next one for a stopped run."""
    return f"snapshot-epoch{epoch:04d}-batch{batches_done:06d}.pt" if batches_done else f"snapshot-epoch{epoch:04d}.pt"


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshots in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [((int(m.group(1)), int(m.group(2) or 0)), p) for p in directory.iterdir() if (m := _SNAPSHOT.match(p.name))]
    return [p for _, p in sorted(found)]


def write_snapshot(directory: Path, snapshot: Snapshot, keep_last: int) -> Path:
    """Rank 0's part of `save`: the file, then `latest`, then rotation. A UserError leaves the previous one intact."""
    path = directory / snapshot_name(snapshot.epoch, snapshot.batches_done)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        payload = snapshot.to_payload()
        write_atomic(path, lambda out: torch.save(payload, out))
        # Only now, with the new file complete on disk, does `latest` move; then old snapshots go.
        write_atomic(directory / LATEST, lambda out: out.write(f"{path.name}\n".encode()))
        for old in list_snapshots(directory)[:-keep_last]:
            old.unlink(missing_ok=True)
    except (OSError, RuntimeError) as exc:
        previous = list_snapshots(directory)
        kept = f"the previous snapshot {previous[-1]} is intact" if previous else "no earlier snapshot exists"
        raise UserError(
            f"saving snapshot {path} failed ({type(exc).__name__}: {exc}); {kept}. Free space or choose another "
            f"--checkpoint-dir, then --resume"
        ) from None
    return path


def save(directory: Path, snapshot: Snapshot, dist: Dist, keep_last: int) -> Path:
    """Collective: rank 0 writes the snapshot; every rank returns its path once `latest` names it, or raises
    the same AgreedError (disk full, permissions) while the previous snapshot stays loadable."""
    path = dist.from_main(lambda: write_snapshot(directory, snapshot, keep_last))
    log.info("saved %s", path)
    return path


def save_weights(path: Path, state_dict: dict[str, Any], dist: Dist) -> None:
    """Collective: rank 0 writes the final weights (a plain state_dict on CPU, as the classic scripts save)."""

    def write() -> None:
        on_cpu = {name: value.cpu() if isinstance(value, torch.Tensor) else value for name, value in state_dict.items()}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda out: torch.save(on_cpu, out))  # loadable on a machine without a GPU
        except (OSError, RuntimeError) as exc:
            raise UserError(f"writing the final weights to {path} failed ({type(exc).__name__}: {exc})") from None

    dist.from_main(write)


def load(path: Path) -> Snapshot:
    """Read and check one snapshot. weights_only=True: tensors and plain containers only, never code."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"snapshot {path} does not exist") from None
    except Exception as exc:  # torch raises many types for truncated or foreign files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"snapshot {path} is corrupt, truncated or not an mpiddp snapshot ({first_line[:200]})") from None
    return Snapshot.from_payload(payload, path)


def resolve(resume: str, directory: Path) -> tuple[Path, Snapshot] | None:
    """The snapshot to resume from. `auto`: the newest loadable one in `directory` (`latest` first), or None."""
    if resume != "auto":
        return Path(resume), load(Path(resume))
    candidates = list_snapshots(directory)
    pointer = directory / LATEST
    if pointer.is_file():
        named = directory / pointer.read_text().strip()
        if named in candidates:  # what `latest` names first, then older ones
            candidates = [p for p in candidates if p != named] + [named]
    for path in reversed(candidates):
        try:
            return path, load(path)
        except UserError as exc:
            log.warning("skipping %s", exc)
    return None


def refuse_reuse(directory: Path) -> None:
    """Rank 0, for a job that does not resume: a directory that already holds snapshots is an earlier job's,
    and this job would overwrite and rotate them away."""
    existing = list_snapshots(directory)
    if existing:
        raise UserError(
            f"{directory} already holds snapshots of an earlier job (newest: {existing[-1].name}): add --resume to "
            f"continue it, or choose a new --run-dir (mpiddp never overwrites snapshots it did not resume from)"
        )


def find_for(resume: str, directory: Path, arch: str) -> tuple[Path, Snapshot] | None:
    """Rank 0's part of `restore`: resolve, and refuse a snapshot of another model."""
    found = resolve(resume, directory)
    if found is not None and found[1].arch != arch:
        raise UserError(
            f"snapshot {found[0]} holds a {found[1].arch!r} model but this run builds {arch!r}: "
            f"pass the same --arch, or start without --resume"
        )
    return found


def restore(resume: str, directory: Path, arch: str, dist: Dist) -> tuple[Path, Snapshot] | None:
    """Collective: rank 0 finds and checks the snapshot, every rank receives it (no shared filesystem needed).

    Raises the same AgreedError on every rank when the snapshot is missing, unreadable or for another model.
    """
    return dist.from_main(lambda: find_for(resume, directory, arch))
