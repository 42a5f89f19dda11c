"""The run's metric log (rank 0 writes, a do-nothing logger elsewhere), the summary."""

from __future__ import annotations

import json
import logging
import os
import platform
import queue
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from mpiddp.job.topology import Topology
from mpiddp.trainer.config import Config, wandb_mode

if TYPE_CHECKING:
    from mpiddp.trainer.steptime import StepDurations

log = logging.getLogger(__name__)

_IMPORT_TIME = time.time()  # fallback for process_start_time where /proc is missing
WANDB_INIT_TIMEOUT_S = 60


class RunLogger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """Appends one JSON object per line to metrics.jsonl; line-buffered so a crash loses at most one line."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def log(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record, sort_keys=True) + "\n")

    def close(self) -> None:
        self.file.close()


class NullLogger:
    """Used on every rank that does not log; keeps call sites branch-free."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class WandbLogger:
    """Rank 0's wandb run, started and fed on a thread of its own: wandb's start (1-2 s, up to its timeout when
    the network is bad) never delays the first step, and records logged before it is up wait in the queue.
    A failure never stops training: it warns once and goes quiet (metrics.jsonl has every record anyway)."""

    def __init__(self, start: Callable[[], Any], run_id: str) -> None:
        self.run_id = run_id
        self._queue: queue.SimpleQueue[dict[str, Any] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, args=(start,), name="mpiddp-wandb", daemon=True)
        self._thread.start()

    def log(self, record: dict[str, Any]) -> None:
        if record["kind"] not in ("start", "first_step"):  # a job's markers are for metrics.jsonl, report, launch
            self._queue.put(record)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(WANDB_INIT_TIMEOUT_S + 30)
        if self._thread.is_alive():
            log.warning("wandb did not finish within %d s; its local files may be incomplete", WANDB_INIT_TIMEOUT_S + 30)

    def _work(self, start: Callable[[], Any]) -> None:
        run = start()
        while (record := self._queue.get()) is not None:
            if run is not None:
                run = self._send(run, record)
        if run is not None:
            try:
                run.finish()
            except Exception as exc:
                log.warning("wandb did not finish cleanly: %s", exc)

    @staticmethod
    def _send(run: Any, record: dict[str, Any]) -> Any:
        values: dict[str, Any] = {}
        for key, value in record.items():
            if key in ("kind", "step", "time") or value is None:
                continue
            if isinstance(value, list):  # per-rank values: one series per rank, so a slow host stands out
                values.update({f"{record['kind']}/{key}/rank_{rank}": v for rank, v in enumerate(value)})
            else:
                values[f"{record['kind']}/{key}"] = value
        try:
            run.log(values, step=record["step"])
            return run
        except Exception as exc:  # wandb lost its service or connection: keep training
            log.warning("wandb logging failed (%s); continuing without wandb", exc)
            return None


class FanOut:
    def __init__(self, *loggers: RunLogger) -> None:
        self.loggers = loggers

    def log(self, record: dict[str, Any]) -> None:
        for logger in self.loggers:
            logger.log(record)

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()


def start_wandb(cfg: Config, run_dir: Path, resume_id: str | None) -> WandbLogger | None:
    """Rank 0 only. Never prompts; bounded start-up, in the background; offline or nothing when online cannot
    start. The run id is chosen here, so snapshots can carry it before wandb is up."""
    mode = wandb_mode(cfg.outputs.wandb, dict(os.environ), Path.home() / ".netrc")
    if mode == "disabled":
        return None
    run_id = resume_id or secrets.token_hex(4)  # wandb ids: lower-case letters and digits

    def start() -> Any:
        try:
            import wandb
        except ImportError:
            log.warning("wandb is not installed; continuing without it (pip install wandb)")
            return None
        for attempt in [mode] if mode == "offline" else [mode, "offline"]:
            try:
                run = wandb.init(
                    project=cfg.outputs.wandb_project,
                    name=cfg.outputs.wandb_name or run_dir.name,
                    group=cfg.outputs.wandb_group,
                    tags=list(cfg.outputs.wandb_tags) or None,
                    config=cfg.to_dict(),
                    dir=str(run_dir),
                    mode=attempt,
                    id=run_id,
                    resume="allow",
                    settings=wandb.Settings(init_timeout=WANDB_INIT_TIMEOUT_S, console="off", silent=True),
                )
                log.info("wandb %s run %s in %s", attempt, run.id, run_dir / "wandb")
                return run
            except Exception as exc:
                log.warning("wandb %s start failed (%s)", attempt, str(exc).splitlines()[0] if str(exc) else exc)
        log.warning("continuing without wandb")
        return None

    return WandbLogger(start, run_id)


def make_run_logger(cfg: Config, run_dir: Path, topo: Topology, resume_id: str | None) -> tuple[RunLogger, str | None]:
    """Rank 0: metrics.jsonl plus wandb; every other rank: a logger that does nothing (and never imports wandb)."""
    if not topo.is_main:
        return NullLogger(), None
    wandb_logger = start_wandb(cfg, run_dir, resume_id)
    if wandb_logger is None:
        return JsonlLogger(run_dir / "metrics.jsonl"), None
    return FanOut(JsonlLogger(run_dir / "metrics.jsonl"), wandb_logger), wandb_logger.run_id


def process_start_time() -> float:
    """When this process started (epoch seconds), so start-up cost includes interpreter and imports."""
    try:
        with open("/proc/self/stat") as stat:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as uptime:
            seconds_since_boot = float(uptime.read().split()[0])
        return time.time() - seconds_since_boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORT_TIME


def build_summary(
    *,
    config: dict[str, Any],
    topo: Topology,
    backend: str,
    device: str,
    epochs: list[dict[str, Any]],
    rank_durations: list[StepDurations],
    rank_images_after_warmup: list[int],
    rank_seconds_after_warmup: list[float],
    first_step_done_at: list[float | None],
    job_started_at: float,
    finished_at: float,
    torch_version: str,
) -> dict[str, Any]:
    """summary.json from values every rank holds after the final gather (pure, so it is unit-tested)."""
    from mpiddp.trainer.steptime import Durations
    from mpiddp.version import __version__

    assert len(rank_durations) == topo.world_size
    slowest = max(rank_seconds_after_warmup)
    last = epochs[-1] if epochs else {}
    done = [t for t in first_step_done_at if t is not None]
    return {
        "mpiddp_version": __version__,
        "world_size": topo.world_size,
        "num_hosts": topo.num_hosts,
        "hosts": topo.hosts_dict,
        "backend": backend,
        "device": device,
        "epochs": last.get("epoch", 0),  # completed epochs, counting those before a resume
        "steps": rank_durations[0].count,
        "train_loss": last.get("train_loss"),
        "eval_loss": last.get("eval_loss"),
        "eval_accuracy": last.get("eval_accuracy"),
        # Global images per second after warm-up: all ranks' images over the slowest rank's time.
        "images_per_second": sum(rank_images_after_warmup) / slowest if slowest > 0 else 0.0,
        "step_time_s": Durations.merged(d.step for d in rank_durations).distribution(),
        "rank_step_time_s": [d.step.mean for d in rank_durations],
        # What the all-reduce evens out: a slow loader or a slow device shows here, not in the step time.
        "rank_data_wait_s": [d.data_wait.mean for d in rank_durations],
        "rank_compute_s": [d.compute.mean for d in rank_durations],
        "time_to_first_step_s": (max(done) - job_started_at) if done else None,
        "first_step_done_at": max(done) if done else None,
        "wall_time_s": finished_at - job_started_at,
        "mpi_library": topo.mpi_library,
        "mpi_settings": topo.mpi_settings,
        "torch_version": torch_version,
        "python_version": platform.python_version(),
        "config": config,
    }
