"""Snapshot files. Saving is collective: global rank 0 writes the file atomically, every rank hears that it
succeeded, and only then does `latest` move and the lineage rotate. Loading uses weights_only=True, so a snapshot
file can never run code; rank 0 reads, every rank receives."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import torch

from mpiddp.errors import UserError
from mpiddp.job.collective import Dist
from mpiddp.trainer.rundir import write_atomic
from mpiddp.trainer.snapshot import Snapshot

log = logging.getLogger(__name__)

LATEST = "latest"
# The snapshots of the lineage that `latest` continues, oldest first, one name a line: each line's parent is the
# line before it. Rotation deletes only from here, so a rollback's abandoned future is never what decides.
LINEAGE = "lineage"
_SNAPSHOT = re.compile(r"^snapshot-epoch(\d{4,})(?:-batch(\d+))?(?:-r(\d+))?\.pt$")


def snapshot_name(epoch: int, batches_done: int = 0, revision: int = 0) -> str:
    """`epoch` completed epochs, plus `batches_done` batches of the next one for a stopped run; `revision` > 0
    when a rollback reaches a position whose snapshot is still on disk (never overwritten: see `free_name`)."""
    name = f"snapshot-epoch{epoch:04d}-batch{batches_done:06d}" if batches_done else f"snapshot-epoch{epoch:04d}"
    return f"{name}-r{revision}.pt" if revision else f"{name}.pt"


def snapshot_key(name: str) -> tuple[int, int, int] | None:
    """(completed epochs, batches of the next one, revision): the order of training progress, and among the
    snapshots of one position the order they were saved in; None for other names."""
    m = _SNAPSHOT.match(name)
    return (int(m.group(1)), int(m.group(2) or 0), int(m.group(3) or 0)) if m else None


def free_name(directory: Path, epoch: int, batches_done: int) -> str:
    """The first name for this position that no file has: after a rollback, the abandoned snapshot of the same
    position stays on disk as it was (the README promises they are left), and the new one gets the next revision."""
    revision = 0
    while (directory / snapshot_name(epoch, batches_done, revision)).exists():
        revision += 1
    return snapshot_name(epoch, batches_done, revision)


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshots in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [(key, p) for p in directory.iterdir() if (key := snapshot_key(p.name)) is not None]
    return [p for _, p in sorted(found)]


def latest_name(directory: Path) -> str | None:
    """The file name `latest` holds, or None without one."""
    pointer = directory / LATEST
    return (pointer.read_text().strip() or None) if pointer.is_file() else None


def read_lineage(directory: Path) -> list[str]:
    """The current lineage's snapshot names, oldest first (some may already be deleted). A directory written
    before lineages were recorded: every snapshot up to the one `latest` names, by name."""
    path = directory / LINEAGE
    if path.is_file():
        return [line.strip() for line in path.read_text().splitlines() if snapshot_key(line.strip()) is not None]
    head = latest_name(directory)
    head_key = snapshot_key(head) if head else None
    return [p.name for p in list_snapshots(directory)
            if head_key is None or (snapshot_key(p.name) or head_key) <= head_key]


def lineage_up_to(directory: Path, parent: Path | None) -> list[str]:
    """The lineage a snapshot continuing `parent` extends: the current one cut after the parent, else the parent
    alone if it is a file in `directory`, else nothing (no parent, or one in another directory)."""
    if parent is None or parent.resolve().parent != directory.resolve():
        return []
    current = read_lineage(directory)
    if parent.name in current:
        return current[: current.index(parent.name) + 1]
    return [parent.name] if parent.is_file() else []


def side_path(snapshot_path: Path, rank: int) -> Path:
    """Where `rank` keeps its own part of a snapshot (PowerSGD's state), next to the snapshot file. Not `*.pt`:
    never taken for a snapshot."""
    return snapshot_path.with_name(f"{snapshot_path.name}.rank{rank:05d}")


def write_side(snapshot_path: Path, rank: int, own: dict[str, Any] | None) -> None:
    """This rank's part of `save`: its own side file, atomically; a UserError leaves `latest` where it was."""
    path = side_path(snapshot_path, rank)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # a host that does not share rank 0's file system
        write_atomic(path, lambda out: torch.save(own or {}, out))
    except (OSError, RuntimeError) as exc:
        raise UserError(f"saving {path} failed ({type(exc).__name__}: {exc}); the previous snapshot is intact. "
                        f"Free space or choose another --checkpoint-dir, then --resume") from None


def read_side(snapshot_path: Path, rank: int) -> dict[str, Any] | None:
    """This rank's side file (weights_only), or None with a warning: its PowerSGD state then starts from zero."""
    path = side_path(snapshot_path, rank)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # missing (a checkpoint directory not shared by every host), truncated, foreign
        log.warning("cannot read %s (%s): this rank's PowerSGD error feedback starts from zero", path,
                    type(exc).__name__)
        return None


def remove_partial(directory: Path) -> list[str]:
    """Rank 0, before it writes a snapshot: the temporary files of saves that never finished (a rank 0 killed while
    it wrote, whose write_atomic could not clean up). Their names (`.snapshot-....pt.XXXX.tmp`) never pass for a
    snapshot; they are only space. Only rank 0 of the one job that owns `directory` writes there, and not now.
    Returns the names removed."""
    removed = []
    for partial in directory.glob(".snapshot-epoch*.tmp"):
        try:
            partial.unlink()
            removed.append(partial.name)
        except OSError:
            pass  # gone already, or not ours to remove: only space either way
    if removed:
        log.warning("removed %d unfinished snapshot file(s) of an interrupted save in %s: %s", len(removed),
                    directory, ", ".join(removed))
    return removed


def give_up(directory: Path, path: Path) -> None:
    """Rank 0, when a save fails after it wrote `path` (a rank lost before every rank heard of it): the file goes
    unless `latest` already names it, so the save done again takes its name and no unpublished file is left."""
    try:
        if latest_name(directory) != path.name:
            path.unlink(missing_ok=True)
    except OSError as exc:  # an unpublished file left is only space: never what `latest` names
        log.warning("could not remove %s of an interrupted save (%s)", path, exc.strerror or exc)


def write_snapshot(directory: Path, snapshot: Snapshot) -> Path:
    """Rank 0's first part of `save`: the file alone (`latest` still names the previous one). A UserError leaves
    the previous snapshot intact."""
    path = directory / snapshot_name(snapshot.epoch, snapshot.batches_done)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        remove_partial(directory)
        path = directory / free_name(directory, snapshot.epoch, snapshot.batches_done)
        payload = snapshot.to_payload()
        write_atomic(path, lambda out: torch.save(payload, out))
    except (OSError, RuntimeError) as exc:
        previous = latest_name(directory)
        kept = f"the previous snapshot {directory / previous} is intact" if previous else "no earlier snapshot exists"
        raise UserError(
            f"saving snapshot {path} failed ({type(exc).__name__}: {exc}); {kept}. Free space or choose another "
            f"--checkpoint-dir, then --resume"
        ) from None
    return path


def publish(directory: Path, path: Path, keep_last: int, parent: Path | None = None) -> list[str]:
    """Rank 0's second part of `save`, once every rank has heard the file is complete: the lineage file, then
    `latest`, then rotation. Returns the names rotated away.

    `parent` is the snapshot the new one continues: the one this job resumed from, or the last one it saved;
    None for a fresh run. The new lineage is the current one up to the parent, or just the parent when the
    current lineage does not hold it (an explicit --resume of an abandoned snapshot), or nothing when the parent
    is not in `directory` (a fresh run, or a snapshot resumed from elsewhere): never guessed from names, so a
    rollback's abandoned future stays on disk and out of the lineage.
    Rotation keeps the newest `keep_last` of the lineage and never deletes the new file or what `latest` names.
    """
    name = path.name
    assert snapshot_key(name) is not None, name
    lineage = [old for old in lineage_up_to(directory, parent) if old != name] + [name]
    try:
        write_atomic(directory / LINEAGE, lambda out: out.write("".join(f"{n}\n" for n in lineage).encode()))
        write_atomic(directory / LATEST, lambda out: out.write(f"{name}\n".encode()))
    except OSError as exc:
        raise UserError(
            f"snapshot {path} is complete, but moving {directory / LATEST} to it failed ({exc.strerror or exc}); "
            f"resume from it with --resume {path}"
        ) from None
    protected = {name, latest_name(directory)}
    doomed = [old for old in lineage[:-keep_last] if old not in protected]
    try:
        for old in doomed:
            (directory / old).unlink(missing_ok=True)
            for side in directory.glob(f"{old}.rank*"):  # its ranks' side files go with it
                side.unlink(missing_ok=True)
        kept = [n for n in lineage if n not in doomed]
        write_atomic(directory / LINEAGE, lambda out: out.write("".join(f"{n}\n" for n in kept).encode()))
    except OSError as exc:  # the new snapshot is safe and published: old files left behind are only space
        log.warning("rotating old snapshots in %s failed (%s); %s stays loadable", directory, exc.strerror or exc, path)
    return doomed


def save(directory: Path, snapshot: Snapshot, dist: Dist, keep_last: int, parent: Path | None = None) -> Path:
    """Collective: rank 0 writes the snapshot, which continues `parent` (see `publish`); every rank hears it
    succeeded (a barrier, so a rank that died meanwhile stops the job before anything moves); then rank 0 moves
    `latest` and rotates, and every rank returns the path. A failure raises the same AgreedError everywhere while
    the previous snapshot stays loadable; a peer lost after the file was written raises there, and rank 0 removes
    the file that `latest` does not name (give_up)."""
    written: list[Path] = []  # rank 0's file, once written: a peer lost in from_main's own broadcast leaves it too

    def write() -> Path:
        written.append(write_snapshot(directory, snapshot))
        return written[0]

    try:
        path = dist.from_main(write)
        if snapshot.side_ranks:  # each rank writes its own side file: its PowerSGD state never passes through rank 0
            dist.agree(lambda: write_side(path, dist.rank, snapshot.own_side))  # and a barrier, as below
        else:
            dist.barrier()  # `latest` names only a snapshot that every rank knows was saved
        dist.from_main(lambda: publish(directory, path, keep_last, parent))
    except UserError:
        raise  # a disk's error, said alike on every rank: the files stay as its message says
    except Exception:  # a peer lost (in-job recovery gives the save up and saves again)
        if dist.is_main and written:  # a local clean-up, no collective
            give_up(directory, written[0])
        raise
    log.debug("saved %s", path)  # the caller logs it with its cost
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
    """The snapshot to resume from. `auto`: what `latest` names, else the newest loadable one of its lineage
    (never a newer snapshot a rollback abandoned); without `latest` (an older mpiddp), the newest by name; or None."""
    if resume != "auto":
        return Path(resume), load(Path(resume))
    head = latest_name(directory)
    if head is None:
        candidates = list_snapshots(directory)
    else:
        head_key = snapshot_key(head)
        older = [n for n in read_lineage(directory) if head_key is None or (snapshot_key(n) or head_key) < head_key]
        candidates = [directory / n for n in [*older, head] if (directory / n).is_file()]
        if not (directory / head).is_file():
            log.warning("skipping %s, which %s names: it does not exist", directory / head, directory / LATEST)
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


def resolve_relaunch(resume: str, directory: Path, launch_id: str) -> tuple[Path, Snapshot] | None:
    """A relaunch by `launch` `launch_id`: the newest snapshot (`auto`) when this launch saved it, since the job's
    own `--resume PATH` (a rollback) is where the launch began, not where its last attempt got to; else `resume`."""
    if resume != "auto" and launch_id:
        newest = resolve("auto", directory)
        if newest is not None and newest[1].launch_id == launch_id:
            log.info("relaunched: resuming %s, which this launch saved, instead of --resume %s", newest[0], resume)
            return newest
    return resolve(resume, directory)


def find_for(resume: str, directory: Path, arch: str, launch_id: str = "") -> tuple[Path, Snapshot] | None:
    """Rank 0's part of `restore`: resolve, and refuse a snapshot of another model."""
    found = resolve_relaunch(resume, directory, launch_id)
    if found is not None and found[1].arch != arch:
        raise UserError(
            f"snapshot {found[0]} holds a {found[1].arch!r} model but this run builds {arch!r}: "
            f"pass the same --arch, or start without --resume"
        )
    return found


def restore(resume: str, directory: Path, arch: str, dist: Dist,
            launch_id: str = "") -> tuple[Path, Snapshot] | None:
    """Collective: rank 0 finds and checks the snapshot, every rank receives it (no shared filesystem needed):
    the shared part by broadcast, and of the per-rank RNG only its own; PowerSGD's error feedback (as large as the
    gradients) each rank reads from its own side file (an older snapshot's, from the file, by scatter), so a
    rank's memory at resume does not grow with the number of ranks. `launch_id`: this job is a relaunch by that
    `launch` (see `resolve_relaunch`).

    Raises the same AgreedError on every rank when the snapshot is missing, unreadable or for another model.
    """
    per_rank: list[tuple[Any, Any]] = []

    def load_and_split() -> tuple[Path, Snapshot] | None:
        found = find_for(resume, directory, arch, launch_id)
        if found is None:
            return None
        path, snapshot = found
        shared, parts = snapshot.split_per_rank(dist.world_size)
        per_rank.extend(parts)
        return path, shared

    found = dist.from_main(load_and_split)
    if found is None:
        return None
    path, snapshot = found
    snapshot.take_own_part(dist.rank, dist.scatter(per_rank if dist.is_main else None))
    if snapshot.side_ranks:  # each rank reads its own side file; ranks beyond the saved job's have none
        snapshot.take_own_side(dist.rank, read_side(path, dist.rank) if dist.rank < snapshot.side_ranks else None)
    return path, snapshot
