"""`python -m mpiddp report RUN_DIR`: plots of a run's metrics.jsonl and a short text summary (no MPI needed)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

from mpiddp import recoveries
from mpiddp.errors import UserError
from mpiddp.failure import DOWNTIME_PHASES


def read_run(run_dir: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    metrics_path = run_dir / "metrics.jsonl"
    if not metrics_path.is_file():
        raise UserError(f"{metrics_path} does not exist: give the --run-dir of an mpiddp run")
    records = []
    for number, line in enumerate(metrics_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            raise UserError(f"{metrics_path}:{number} is not JSON (a run killed mid-write leaves at most one such line)") from None
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
    return replay(records), summary


def replay(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run as it finally happened: a job that resumed from step S (its `start` record) replaces what an
    earlier job logged after S (the steps it redid), so resumed runs plot as one curve without repeats."""
    kept: list[dict[str, Any]] = []
    for record in records:
        if record.get("kind") == "start":
            kept = [r for r in kept if r.get("step", 0) <= record.get("step", 0)]
        kept.append(record)
    return [r for r in kept if r.get("kind") != "start"]


def text_summary(records: list[dict[str, Any]], summary: dict[str, Any] | None) -> str:
    epochs = [r for r in records if r["kind"] == "epoch"]
    lines = []
    if summary:
        lines.append(f"{summary.get('arch')} on {summary.get('dataset')}: {summary['world_size']} ranks on "
                     f"{summary['num_hosts']} hosts, {summary['backend']} on {summary['device']}")
        lines.append(f"{summary['epochs']} epochs, {summary['images_per_second']:.0f} images/s, "
                     f"wall time {summary['wall_time_s']:.1f} s, first step after {summary['time_to_first_step_s']:.1f} s")
        saving = snapshot_line(summary)
        if saving:
            lines.append(saving)
    else:
        lines.append("no summary.json: the run did not finish (stopped, crashed or still running)")
    if epochs:
        first, last = epochs[0], epochs[-1]
        accuracy = last.get("eval_accuracy")
        lines.append(f"train loss {first['train_loss']:.4f} -> {last['train_loss']:.4f} over epochs "
                     f"{first['epoch']}-{last['epoch']}" + (f"; eval accuracy {100 * accuracy:.2f}%" if accuracy is not None else ""))
        verdict = straggler_line(epochs)
        if verdict:
            lines.append(verdict)
    return "\n".join(lines)


def snapshot_line(summary: dict[str, Any]) -> str | None:
    """What this job's snapshots cost (None for a run written before it was recorded, or one that saved none)."""
    saves = summary.get("snapshots")
    if not saves or not saves.get("count"):
        return None
    interval = summary.get("config", {}).get("save_interval_s")
    every = f", every {interval:g} s by time" if interval else ""
    wall = summary.get("wall_time_s") or 0.0
    share = f" ({100 * saves['total_s'] / wall:.1f}% of the wall time)" if wall > 0 else ""
    return (f"snapshots: {saves['count']} saved{every}, {saves['total_s']:.2f} s in all{share}, "
            f"slowest {saves['max_s']:.2f} s, last {saves['bytes_last'] / 1e6:.1f} MB")


def read_attempts(run_dir: Path, summary: dict[str, Any] | None) -> dict[str, Any] | None:
    """The attempts under `launch`: attempts.json (the supervisor writes it last, with every attempt), else the
    copy in summary.json, else None (not launched by `launch`)."""
    try:
        data = json.loads((run_dir / "attempts.json").read_text())
    except (OSError, ValueError):
        data = (summary or {}).get("attempts")
    return data if isinstance(data, dict) and data.get("attempts") else None


PHASE_NAMES = {"first_step": "first step"}


def attempt_lines(data: dict[str, Any]) -> list[str]:
    """One line per attempt: its hosts, why it failed, whom it blamed, the steps lost and the downtime."""
    attempts = data["attempts"]
    left_out = data.get("excluded_hosts") or []
    restarts = data.get("restarts", max(0, len(attempts) - 1))  # summary.json's copy lists the failed ones only
    lines = [f"launch: {restarts} restart{'' if restarts == 1 else 's'}"
             + (f"; hosts left out: {', '.join(left_out)}" if left_out else "")]
    for attempt in attempts:
        hosts = ", ".join(attempt.get("hosts") or []) or "the default hosts"
        count = attempt.get("num_ranks")
        ranks_used = f" ({count} rank{'' if count == 1 else 's'})" if count else ""
        launch = f"launch {attempt['launch']}, " if attempt.get("launch") else ""  # a requeue's or resubmission's
        parts = [f"  {launch}attempt {attempt.get('number')} on {hosts}{ranks_used}: "]
        within = recoveries.count_line(recoveries.recoveries_in(attempt))
        if attempt.get("status") is None:
            parts.append("running (or the supervisor was killed)")
        elif attempt.get("cause") is None:
            parts.append("finished" + (f" after {within}" if within else ""))
        else:
            ranks, blamed = attempt.get("failed_ranks") or [], attempt.get("failed_hosts") or []
            who = ([("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))] if ranks else []) + (
                ["on " + ", ".join(blamed)] if blamed else [])
            recorded = attempt.get("ranks_recorded")
            evidence = f"; {recorded} rank{'' if recorded == 1 else 's'} recorded" if recorded else ""
            parts.append(f"{attempt['cause']} (exit status {attempt.get('status')}; {' '.join(who) or 'no host blamed'}"
                         f"{evidence})")
            if attempt.get("failed_at_step") is not None:
                parts.append(f" at step {attempt['failed_at_step']}")
            if attempt.get("steps_lost") is not None:
                parts.append(f", {attempt['steps_lost']} steps lost")
            if attempt.get("downtime_s") is not None:
                given = attempt.get("downtime_phases") or {}  # summary.json sorts its keys: put them in order
                phases = ", ".join(f"{PHASE_NAMES.get(name, name)} {given[name]:.1f}"
                                   for name in sorted(given, key=lambda n: DOWNTIME_PHASES.index(n)
                                                      if n in DOWNTIME_PHASES else len(DOWNTIME_PHASES)))
                parts.append(f", down {attempt['downtime_s']:.1f} s" + (f" ({phases})" if phases else ""))
            if within:
                parts.append(f"; before it, {within}")
        lines.append("".join(parts))
    return lines


def recovery_lines(summary: dict[str, Any] | None) -> list[str]:
    """One line per in-job recovery in summary.json (none when it recorded none): who was lost, the world before
    and after, the steps lost and the downtime with its phases."""
    found = recoveries.recoveries_in(summary)
    if not found:
        return []
    total = sum(recoveries.downtime(item) or 0.0 for item in found)
    lines = [f"in-job recoveries: {len(found)}, down {total:.2f} s in all"]
    lines += [f"  recovery {number}: {recoveries.describe(item)}" for number, item in enumerate(found)]
    return lines


def rank_series(epochs: list[dict[str, Any]], key: str | tuple[str, ...]) -> list[list[tuple[int, float]]]:
    """Per rank, its (epoch, value) over the epochs it was in: an epoch after a recovery lists fewer ranks, one
    after a grow more, so rank r (that epoch's rank number) has a value only in the epochs with more than r ranks.
    A tuple of keys sums them, over the epochs that recorded them all. Empty when no epoch recorded `key`."""
    keys = (key,) if isinstance(key, str) else key
    series: list[list[tuple[int, float]]] = []
    for record in epochs:
        lists = [record.get(k) for k in keys]
        if not all(lists):
            continue
        for rank, values in enumerate(zip(*lists)):
            if rank == len(series):
                series.append([])
            series[rank].append((record.get("epoch", 0), sum(values)))
    return series


def rank_means(epochs: list[dict[str, Any]], key: str | tuple[str, ...]) -> list[float]:
    """Each rank's `key` averaged over the epochs it was in that recorded it (empty when none did)."""
    return [sum(value for _, value in values) / len(values) for values in rank_series(epochs, key)]


def above_the_others(values: list[float], rank: int) -> float:
    """How far `rank`'s value stands above the median of the other ranks' (0.0 with no other rank)."""
    others = values[:rank] + values[rank + 1:]
    return values[rank] - statistics.median(others) if others else 0.0


def straggler_line(epochs: list[dict[str, Any]]) -> str | None:
    """Each rank's time before it waits for the others (data wait + compute; every rank's whole step is the
    slowest one's after the all-reduce), and the rank that holds the job back, with what slows it. A rank is
    held against the median of the *other* ranks: with itself in, two ranks' median is their mean and a rank
    1.2x slower than its peer would read 1.1x."""
    waits, computes = rank_means(epochs, "rank_data_wait_s"), rank_means(epochs, "rank_compute_s")
    if not waits or len(waits) != len(computes):  # a run written before the split was recorded
        busy, parts = rank_means(epochs, "rank_step_time_s"), None
    else:
        busy, parts = rank_means(epochs, ("rank_data_wait_s", "rank_compute_s")), (waits, computes)
    if not busy:
        return None
    slowest = max(range(len(busy)), key=busy.__getitem__)
    others = busy[:slowest] + busy[slowest + 1:]
    median = statistics.median(others) if others else busy[slowest]
    ratio = busy[slowest] / median if median > 0 else 1.0
    verdict = "no straggler"
    if ratio > 1.1:
        cause = ""
        if parts is not None:
            cause = (": waiting for data" if above_the_others(waits, slowest) > above_the_others(computes, slowest)
                     else ": computing")
        verdict = f"rank {slowest} is a straggler ({ratio:.2f}x the others' median{cause})"
    if parts is None:
        return f"mean step time per rank: {', '.join(f'{t * 1000:.1f} ms' for t in busy)}; {verdict}"
    return ("mean data wait + compute per rank: "
            f"{', '.join(f'{w * 1000:.1f}+{c * 1000:.1f} ms' for w, c in zip(waits, computes))}; {verdict}")


def plot(records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("plots need matplotlib: pip install 'mpiddp[report]' (or pip install matplotlib)") from None
    steps = [r for r in records if r["kind"] == "step"]
    epochs = [r for r in records if r["kind"] == "epoch"]
    written = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], label="train loss (window)")
    ax.plot([r["step"] for r in epochs], [r["train_loss"] for r in epochs], "o-", label="train loss (epoch)")
    if any(r.get("eval_loss") is not None for r in epochs):
        ax.plot([r["step"] for r in epochs], [r["eval_loss"] for r in epochs], "s-", label="eval loss")
    ax.set(xlabel="step", ylabel="loss", yscale="log", title="loss")
    ax.legend()
    save(fig, "loss.png")

    if any(r.get("eval_accuracy") is not None for r in epochs):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["epoch"] for r in epochs], [100 * r["eval_accuracy"] for r in epochs], "o-")
        ax.set(xlabel="epoch", ylabel="eval accuracy (%)", title="accuracy")
        save(fig, "accuracy.png")

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["time"] - records[0]["time"] for r in steps], [r["images_per_second"] for r in steps])
    ax.set(xlabel="seconds since the first record", ylabel="images/s (all ranks)", title="throughput")
    save(fig, "throughput.png")

    busy = rank_series(epochs, ("rank_data_wait_s", "rank_compute_s"))
    if busy:
        fig, ax = plt.subplots(figsize=(7, 4))
        for rank, points in enumerate(busy):  # each rank over the epochs it was in
            ax.plot([epoch for epoch, _ in points], [1000 * value for _, value in points], "o-", label=f"rank {rank}")
        ax.set(xlabel="epoch", ylabel="data wait + compute per step (ms)",
               title="time before the all-reduce wait, per rank (stragglers stand out)")
        ax.legend(ncol=4, fontsize="small")
        save(fig, "rank_step_time.png")
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        sys.stderr.write("usage: python -m mpiddp report RUN_DIR\n")
        return 2
    run_dir = Path(argv[0])
    try:
        records, summary = read_run(run_dir)
        if not records:
            raise UserError(f"{run_dir / 'metrics.jsonl'} is empty: the run logged nothing yet")
        paths = plot(records, run_dir)
    except UserError as exc:
        sys.stderr.write(f"mpiddp: error: {exc}\n")
        return 2
    print(text_summary(records, summary))
    attempts = read_attempts(run_dir, summary)
    if attempts is not None:
        print("\n".join(attempt_lines(attempts)))
    for line in recovery_lines(summary):
        print(line)
    print("plots: " + ", ".join(str(p) for p in paths))
    return 0
