"""In-job recoveries as the job records them in summary.json (`recoveries`), and each as it happens in the
failures directory (recoveries.jsonl, for a job that a later failure ends), read and told in one line each.

Stdlib only: `launch` (which mentions them in its attempts) and `report` both read them. Each item is
{"cause", "ranks_lost", "hosts_lost", "step", "steps_lost", "world_before", "world_after", "phases"}, with
`phases` in seconds per RECOVERY_PHASES; the downtime is their sum (from the failure to the first step after).
`cause`: "process_failed" (a rank died), "hang" (the hang watchdog ended a rank that stopped answering), or
"silent_host" (a host went silent and the survivors cut it off: mpiddp.job.silenthost).
A grow back to full size is an item of the same list with cause "grew", `ranks_added`, `hosts_added` and
GROW_PHASES (its downtime: from the spawn to the first step on the grown job).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mpiddp.failure import RECOVERIES_FILE

SUMMARY_FILE = "summary.json"
RECOVERY_PHASES = ("detect", "agree_and_shrink", "process_group", "ddp", "first_step")
# a grow back to full size (cause "grew", with ranks_added and hosts_added): mpiddp.elastic.grow
GROW_PHASES = ("spawn", "merge", "process_group", "state_transfer", "ddp", "first_step")
PHASE_NAMES = {"detect": "detect", "agree_and_shrink": "agree and shrink", "process_group": "process group",
               "ddp": "DDP", "first_step": "first step", "spawn": "spawn", "merge": "merge",
               "state_transfer": "state transfer"}


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


def record(directory: Path, recovery: dict[str, Any]) -> None:
    """The new rank 0, as a recovery ends: one line in DIRECTORY/recoveries.jsonl (the failures directory), so
    the recovery stays on record when a later failure ends the job before summary.json. Never raises OSError:
    a record that cannot be written must not end the job that just recovered."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with (directory / RECOVERIES_FILE).open("a") as out:
            out.write(json.dumps(recovery) + "\n")
    except OSError:
        pass


def recorded(directory: Path) -> list[dict[str, Any]]:
    """The recoveries `record` wrote into DIRECTORY (a torn last line is left out); empty when there are none."""
    try:
        lines = (directory / RECOVERIES_FILE).read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return [item for item in found if isinstance(item, dict)]


def of_attempt(run_dir: Path, failures_dir: Path, since: float) -> list[dict[str, Any]]:
    """An attempt's recoveries: summary.json's (every survivor's phases) when the job wrote it in this attempt,
    else those recorded as they happened (the job ended before its summary: a later failure)."""
    return read_recoveries(run_dir, since) or recorded(failures_dir)


def recoveries_in(summary: Any) -> list[dict[str, Any]]:
    """summary.json's `recoveries` list (only its well-formed items); empty when absent."""
    found = summary.get("recoveries") if isinstance(summary, dict) else None
    return [item for item in found if isinstance(item, dict)] if isinstance(found, list) else []


def downtime(recovery: dict[str, Any]) -> float | None:
    """Seconds the job stood still: the sum of the recorded phases (None when none is recorded)."""
    phases = recovery.get("phases")
    values = [v for v in phases.values() if isinstance(v, (int, float))] if isinstance(phases, dict) else []
    return sum(values) if values else None


def is_grow(recovery: dict[str, Any]) -> bool:
    return recovery.get("cause") == "grew"


def _who(recovery: dict[str, Any]) -> str:
    grew = is_grow(recovery)
    ranks = recovery.get("ranks_added" if grew else "ranks_lost") or []
    hosts = recovery.get("hosts_added" if grew else "hosts_lost") or []
    verb = "added" if grew else "lost"
    said = (("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))) if ranks else "a rank"
    return f"{said} on {', '.join(map(str, dict.fromkeys(hosts)))} {verb}" if hosts else f"{said} {verb}"


def describe(recovery: dict[str, Any]) -> str:
    """One line: `killed at step 30: rank 1 on nodeb lost, 3 -> 2 ranks, 1 step lost, down 0.42 s (detect 0.03,
    agree and shrink 0.11, process group 0.05, DDP 0.02, first step 0.21)`; what is not recorded is left out."""
    step = recovery.get("step")
    parts = [f"{recovery.get('cause') or 'failure'}{f' at step {step}' if step is not None else ''}: {_who(recovery)}"]
    before, after = recovery.get("world_before"), recovery.get("world_after")
    if before is not None and after is not None:
        parts.append(f"{before} -> {after} ranks")
    lost = recovery.get("steps_lost")
    if lost is not None and not (is_grow(recovery) and lost == 0):
        parts.append(f"{lost} step{'' if lost == 1 else 's'} lost")
    total = downtime(recovery)
    if total is not None:
        given = recovery["phases"]  # summary.json may sort its keys: told in the order they happen
        known = GROW_PHASES if is_grow(recovery) else RECOVERY_PHASES
        order = sorted(given, key=lambda n: known.index(n) if n in known else len(known))
        phases = ", ".join(f"{PHASE_NAMES.get(name, name)} {given[name]:.2f}" for name in order
                           if isinstance(given[name], (int, float)))
        parts.append(f"down {total:.2f} s ({phases})")
    stall = recovery.get("survivors_stall")
    if isinstance(stall, (int, float)):
        step = recovery.get("ordinary_step")
        beyond = f" beyond a {step:.2f} s step" if isinstance(step, (int, float)) else ""
        parts.append(f"survivors stood still {stall:.2f} s{beyond}")
    warm = recovery.get("warm_up")
    if isinstance(warm, (int, float)):
        parts.append(f"new ranks warmed up {warm:.2f} s while the job trained")
    return ", ".join(parts)


def count_line(recoveries: list[dict[str, Any]]) -> str:
    """`1 in-job recovery (rank 1 on nodeb lost, down 0.42 s)`, for launch's line about an attempt ('' for none)."""
    if not recoveries:
        return ""
    said = []
    for item in recoveries:
        total = downtime(item)
        said.append(_who(item) + (f", down {total:.2f} s" if total is not None else ""))
    grows = sum(1 for item in recoveries if is_grow(item))
    count = len(recoveries) - grows
    told = [f"{count} in-job recover{'y' if count == 1 else 'ies'}"] if count else []
    told += [f"{grows} grow{'' if grows == 1 else 's'}"] if grows else []
    return f"{' and '.join(told)} ({'; '.join(said)})"
