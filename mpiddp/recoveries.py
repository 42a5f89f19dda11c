"""In-job recoveries as the job records them in summary.json (`recoveries`), read and told in one line each.

Stdlib only: `launch` (which mentions them in its attempts) and `report` both read them. Each item is
{"cause", "ranks_lost", "hosts_lost", "step", "steps_lost", "world_before", "world_after", "phases"}, with
`phases` in seconds per RECOVERY_PHASES; the downtime is their sum (from the failure to the first step after).
`cause`: "process_failed" (a rank died), or "hang" (the hang watchdog ended a rank that stopped answering).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUMMARY_FILE = "summary.json"
RECOVERY_PHASES = ("detect", "agree_and_shrink", "process_group", "ddp", "first_step")
PHASE_NAMES = {"detect": "detect", "agree_and_shrink": "agree and shrink", "process_group": "process group",
               "ddp": "DDP", "first_step": "first step"}


def read_recoveries(run_dir: Path, since: float = 0.0) -> list[dict[str, Any]]:
    """The recoveries in RUN_DIR/summary.json, when that file was written at or after `since` (an earlier job's
    summary does not describe this attempt); empty when there are none or nothing readable."""
    path = run_dir / SUMMARY_FILE
    try:
        if path.stat().st_mtime < since:
            return []
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return recoveries_in(data)


def recoveries_in(summary: Any) -> list[dict[str, Any]]:
    """summary.json's `recoveries` list (only its well-formed items); empty when absent."""
    found = summary.get("recoveries") if isinstance(summary, dict) else None
    return [item for item in found if isinstance(item, dict)] if isinstance(found, list) else []


def downtime(recovery: dict[str, Any]) -> float | None:
    """Seconds the job stood still: the sum of the recorded phases (None when none is recorded)."""
    phases = recovery.get("phases")
    values = [v for v in phases.values() if isinstance(v, (int, float))] if isinstance(phases, dict) else []
    return sum(values) if values else None


def _who(recovery: dict[str, Any]) -> str:
    ranks, hosts = recovery.get("ranks_lost") or [], recovery.get("hosts_lost") or []
    said = (("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))) if ranks else "a rank"
    return f"{said} on {', '.join(map(str, hosts))} lost" if hosts else f"{said} lost"


def describe(recovery: dict[str, Any]) -> str:
    """One line: `killed at step 30: rank 1 on nodeb lost, 3 -> 2 ranks, 1 step lost, down 0.42 s (detect 0.03,
    agree and shrink 0.11, process group 0.05, DDP 0.02, first step 0.21)`; what is not recorded is left out."""
    step = recovery.get("step")
    parts = [f"{recovery.get('cause') or 'failure'}{f' at step {step}' if step is not None else ''}: {_who(recovery)}"]
    before, after = recovery.get("world_before"), recovery.get("world_after")
    if before is not None and after is not None:
        parts.append(f"{before} -> {after} ranks")
    lost = recovery.get("steps_lost")
    if lost is not None:
        parts.append(f"{lost} step{'' if lost == 1 else 's'} lost")
    total = downtime(recovery)
    if total is not None:
        given = recovery["phases"]  # summary.json may sort its keys: told in the order they happen
        order = sorted(given, key=lambda n: RECOVERY_PHASES.index(n) if n in RECOVERY_PHASES else len(RECOVERY_PHASES))
        phases = ", ".join(f"{PHASE_NAMES.get(name, name)} {given[name]:.2f}" for name in order
                           if isinstance(given[name], (int, float)))
        parts.append(f"down {total:.2f} s ({phases})")
    return ", ".join(parts)


def count_line(recoveries: list[dict[str, Any]]) -> str:
    """`1 in-job recovery (rank 1 on nodeb lost, down 0.42 s)`, for launch's line about an attempt ('' for none)."""
    if not recoveries:
        return ""
    said = []
    for item in recoveries:
        total = downtime(item)
        said.append(_who(item) + (f", down {total:.2f} s" if total is not None else ""))
    count = len(recoveries)
    return f"{count} in-job recover{'y' if count == 1 else 'ies'} ({'; '.join(said)})"
