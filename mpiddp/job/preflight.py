"""Before training: every rank must run the same software with the same settings, or the job stops with a diff."""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path
from typing import Any

from mpiddp.errors import AgreedError
from mpiddp.job.collective import Dist
from mpiddp.job.topology import Topology

# Settings that may legitimately differ per rank (read from each rank's own environment).
RANK_LOCAL_SETTINGS = ("master_addr",)


def code_hash() -> str:
    """A hash of mpiddp's own source files, so a host with an older checkout is caught."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    while (package.parent / "__init__.py").exists():  # the whole package, from whichever folder of it this file is in
        package = package.parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def fingerprint(settings: dict[str, Any], topo: Topology, extra: dict[str, str] | None = None) -> dict[str, str]:
    """What must be the same on every rank: versions, mpiddp's code, the settings, and `extra` (a script's hash)."""
    import torch

    from mpiddp.version import __version__

    shared = {k: v for k, v in settings.items() if k not in RANK_LOCAL_SETTINGS}
    return {
        "mpiddp": __version__,
        "code": code_hash(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "mpi": topo.mpi_library,
        **(extra or {}),
        "config": hashlib.sha256(json.dumps(shared, sort_keys=True).encode()).hexdigest()[:16],
        "_settings": json.dumps(shared, sort_keys=True),
    }


def differences(prints: list[dict[str, str]], topo: Topology) -> list[str]:
    """Readable lines for every field where some rank differs from rank 0 (empty when all agree)."""
    lines = []
    reference = prints[0]
    for field in (f for f in reference if not f.startswith("_")):
        odd = [rank for rank, p in enumerate(prints) if p[field] != reference[field]]
        if not odd:
            continue
        detail = [f"rank 0 ({_host_of(0, topo)}): {reference[field]}"]
        detail += [f"rank {r} ({_host_of(r, topo)}): {prints[r][field]}" for r in odd[:4]]
        if field == "config":
            ours, theirs = json.loads(reference["_settings"]), json.loads(prints[odd[0]]["_settings"])
            changed = [f"{k}={ours.get(k)!r} vs {theirs.get(k)!r}" for k in sorted(ours) if ours.get(k) != theirs.get(k)]
            detail.append(f"differing settings (rank 0 vs rank {odd[0]}): {', '.join(changed)}")
        lines.append(f"{field} differs: " + "; ".join(detail))
    return lines


def _host_of(rank: int, topo: Topology) -> str:
    return next(name for name, ranks in topo.hosts if rank in ranks)


def check(settings: dict[str, Any], dist: Dist, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Collective: gather every rank's fingerprint; every rank raises the same AgreedError on a mismatch."""
    mine = fingerprint(settings, dist.topology, extra)
    prints = dist.allgather(mine)
    problems = differences(prints, dist.topology)
    if problems:
        raise AgreedError(
            "error: the ranks of this job do not run the same thing:\n  " + "\n  ".join(problems)
            + "\nInstall the same mpiddp, torch and MPI on every host and pass the same flags to every rank."
        )
    return {k: v for k, v in mine.items() if not k.startswith("_")}
