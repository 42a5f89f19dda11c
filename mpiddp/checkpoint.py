"""Snapshots. Saving is collective: global rank 0 writes atomically, all ranks agree, then `latest` moves.
Loading uses weights_only=True, so a snapshot file can never run code."""

from __future__ import annotations

import logging
import random
import re
from pathlib import Path
from typing import Any

import torch

from mpiddp.errors import AgreedError, UserError
from mpiddp.rundir import write_atomic
from mpiddp.topology import Topology

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST = "latest"
_SNAPSHOT = re.compile(r"^snapshot-epoch(\d{4,})(?:-batch(\d+))?\.pt$")
REQUIRED_KEYS = ("format", "arch", "model", "optimizer", "scheduler", "epoch", "step", "rng", "world_size")


def snapshot_name(epoch: int, batches_done: int = 0) -> str:
    """`epoch` completed epochs, plus `batches_done` batches of the next one for a stopped run."""
    return f"snapshot-epoch{epoch:04d}-batch{batches_done:06d}.pt" if batches_done else f"snapshot-epoch{epoch:04d}.pt"


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's random generators: restoring them makes a resumed run draw the same numbers."""
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def list_snapshots(directory: Path) -> list[Path]:
    """Snapshots in `directory`, oldest first."""
    if not directory.is_dir():
        return []
    found = [((int(m.group(1)), int(m.group(2) or 0)), p) for p in directory.iterdir() if (m := _SNAPSHOT.match(p.name))]
    return [p for _, p in sorted(found)]


def save(
    directory: Path, epoch: int, payload: dict[str, Any], topo: Topology, comm: Any, device: torch.device,
    keep_last: int, batches_done: int = 0,
) -> Path:
    """Collective: gather every rank's RNG state, rank 0 writes the snapshot, every rank learns the outcome.

    On failure (disk full, permissions) every rank raises the same AgreedError, and the previous snapshot,
    which `latest` still names, stays loadable.
    """
    rng_states = comm.gather(rng_state(device), root=0)
    path = directory / snapshot_name(epoch, batches_done)
    problem: str | None = None
    if topo.is_main:
        try:
            directory.mkdir(parents=True, exist_ok=True)
            snapshot = {**payload, "format": FORMAT_VERSION, "rng": rng_states, "world_size": topo.world_size}
            write_atomic(path, lambda out: torch.save(snapshot, out))
        except (OSError, RuntimeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        previous = list_snapshots(directory)
        kept = f"the previous snapshot {previous[-1]} is intact" if previous else "no earlier snapshot exists"
        raise AgreedError(
            f"error: saving snapshot {path} failed ({problem}); {kept}. Free space or choose another "
            f"--checkpoint-dir, then --resume"
        )
    if topo.is_main:
        # Only now, with the new file complete on disk, does `latest` move; then old snapshots go.
        write_atomic(directory / LATEST, lambda out: out.write(f"{path.name}\n".encode()))
        for old in list_snapshots(directory)[:-keep_last]:
            old.unlink(missing_ok=True)
    comm.Barrier()  # nobody reads `latest` or the snapshot list while rank 0 is still updating them
    log.info("saved %s", path)
    return path


def save_weights(path: Path, state_dict: dict[str, Any], topo: Topology, comm: Any) -> None:
    """Collective: rank 0 writes the final weights (a plain state_dict, as the classic scripts save)."""
    problem: str | None = None
    if topo.is_main:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda out: torch.save(state_dict, out))
        except (OSError, RuntimeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        raise AgreedError(f"error: writing the final weights to {path} failed ({problem})")


def load(path: Path) -> dict[str, Any]:
    """Read and check one snapshot. weights_only=True: tensors and plain containers only, never code."""
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise UserError(f"snapshot {path} does not exist") from None
    except Exception as exc:  # torch raises many types for truncated or foreign files
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"snapshot {path} is corrupt, truncated or not an mpiddp snapshot ({first_line[:200]})") from None
    if not isinstance(payload, dict) or any(key not in payload for key in REQUIRED_KEYS):
        raise UserError(f"{path} is not an mpiddp snapshot (a plain state_dict? those cannot resume training)")
    if payload["format"] != FORMAT_VERSION:
        raise UserError(f"{path} has snapshot format {payload['format']}; this mpiddp reads format {FORMAT_VERSION}")
    return payload


def resolve(resume: str, directory: Path) -> tuple[Path, dict[str, Any]] | None:
    """The snapshot to resume from and its contents. `auto`: the newest loadable one in `directory`, or None."""
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


def restore(
    resume: str, directory: Path, arch: str, topo: Topology, comm: Any
) -> tuple[Path, dict[str, Any]] | None:
    """Collective: rank 0 finds and checks the snapshot, every rank receives it (no shared filesystem needed).

    Raises the same AgreedError on every rank when the snapshot is missing, unreadable or for another model.
    """
    import torch.distributed as dist

    found: tuple[Path, dict[str, Any]] | None = None
    problem: str | None = None
    if topo.is_main:
        try:
            found = resolve(resume, directory)
            if found is not None and found[1]["arch"] != arch:
                raise UserError(
                    f"snapshot {found[0]} holds a {found[1]['arch']!r} model but this run builds {arch!r}: "
                    f"pass the same --arch, or start without --resume"
                )
        except UserError as exc:
            problem = str(exc)
    problem = comm.bcast(problem, root=0)
    if problem is not None:
        raise AgreedError(f"error: {problem}")
    box = [found]
    dist.broadcast_object_list(box, src=0)
    return box[0]
