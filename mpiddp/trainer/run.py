"""Training's front door: parse -> bootstrap -> build -> restore -> train -> summarise -> close (and `check`, which
shares the bootstrap)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from mpiddp import failure, supervision
from mpiddp.contract import JobRecord, default_checkpoint_dir, write_job_record
from mpiddp.errors import UserError
from mpiddp.failure import read_attempts
from mpiddp.job import preflight
from mpiddp.job.bootstrap import connect, distributed
from mpiddp.job.collective import Dist
from mpiddp.job.failfast import EXIT_OK, EXIT_STOPPED, FailFast
from mpiddp.job.log import setup_logging
from mpiddp.job.startup import StartupClock, slowest_per_phase
from mpiddp.job.stopping import Stopped, StopRequest, note_supervisor_death
from mpiddp.trainer.config import DEFAULT_RUNS_ROOT, Config, parse_args
from mpiddp.trainer.metrics import build_summary, make_run_logger, process_start_time
from mpiddp.trainer.rundir import prepare_run_dir, write_json_atomic


log = logging.getLogger("mpiddp")

# `check`'s report on a bootstrapped job (mpiddp.tools.check.run_check), handed over by the CLI
CheckFn = Callable[[Config, Dist, Path], tuple[int, str]]


def main(args: list[str], stop: StopRequest | None = None, check: CheckFn | None = None) -> int:
    """Training (or with `check`, the check) on every rank. `stop`: training's stop request when `python -m mpiddp`
    installed it already, as its first line."""
    startup = StartupClock(process_start_time())
    startup.mark("interpreter_and_imports")
    # Training, from the first moment: a scheduler's stop signal during start-up must not kill a rank.
    if stop is None:
        stop = StopRequest().install() if check is None else StopRequest()
    try:
        return _main(args, startup, stop, check)
    finally:
        stop.release()


def load_data(cfg: Config, dist: Dist) -> tuple[Any, int]:
    """Collective: (this rank's loaders, input channels the model takes); a bad model or dataset stops every rank."""
    from mpiddp.trainer.data import build_loaders, fetch, load_datasets
    from mpiddp.trainer.models import check_arch, input_channels

    dist.agree(lambda: check_arch(cfg.model_name))
    fetch(cfg, dist)
    datasets = dist.agree(lambda: load_datasets(cfg, lambda data_channels: input_channels(cfg.model_name, data_channels)))
    return build_loaders(cfg, datasets, dist), datasets.channels


def resume(cfg: Config, dist: Dist, state: Any, checkpoint_dir: Path,
           mode: str | None = None) -> tuple[Path, Any] | None:
    """Collective: with --resume (or in a job the scheduler requeued), put the snapshot back into `state` on
    every rank; settings that cannot continue the run stop every rank, the others are listed. `mode`: what
    resume_mode answered (`run` asks it once), else the flags' and the restart count's answer."""
    from mpiddp.trainer import checkpoint

    mode = mode or resume_mode(cfg, dist)
    if mode is None:
        return None
    # A relaunch of a rollback (`--resume PATH`): the newest snapshot this launch saved since, else PATH again.
    relaunched = dist.topology.launch_id if dist.topology.restarts > 0 else ""
    restored = checkpoint.restore(mode, checkpoint_dir, cfg.model_name, dist, relaunched)
    if restored is None:
        if dist.is_main:  # one line for the job
            log.warning("--resume: no snapshot in %s, starting from scratch", checkpoint_dir)
        return None
    from mpiddp.trainer.optim import apply_on_resume
    from mpiddp.trainer.state import schedule_position

    path, snapshot = restored
    changes = dist.agree(lambda: snapshot.check_settings(cfg.to_dict()))
    snapshot.restore_into(state, dist, cfg.seed, cfg.batch_size, cfg.grad_accum)
    if state.batches_per_epoch and state.batches_done >= state.batches_per_epoch:
        # Stopped after an epoch's last batch (a snapshot of an older mpiddp, or fewer batches per epoch now): its
        # training is complete, as after a stop during its evaluation; an epoch of 0 steps would record nothing.
        state.epoch, state.batches_done = state.epoch + 1, 0
    # Loading brought back the snapshot's lr, momentum, weight decay and schedule base: this job's flags win.
    before = state.optimizer.param_groups[0]["lr"]
    after = apply_on_resume(cfg, state.optimizer, state.scheduler, schedule_position(
        state.epoch, state.batches_done, state.batches_per_epoch, cfg.grad_accum))
    if dist.is_main:  # a local log line, no collective
        for change in changes:
            log.warning("resuming with %s", change)
        if abs(before - after) > 1e-9 * max(abs(before), 1e-12):
            log.warning("the learning-rate schedule changed with the settings: at step %d it was %.6g and is now %.6g",
                        state.step, before, after)
    log.info("resumed from %s: epoch %d, step %d", path, state.epoch, state.step)
    return restored


def resume_mode(cfg: Config, dist: Dist, run_dir: Path | None = None) -> str | None:
    """'auto', a snapshot path, or None (a fresh run). A requeued or relaunched job resumes by itself: with the
    user's snapshot path, `checkpoint.restore` prefers what this launch has saved since. Collective when
    `run_dir` is given under `launch`: so does the first attempt of a launch rerun after its supervisor died."""
    if cfg.resume:
        return cfg.resume
    if dist.topology.restarts > 0:
        log.info("the scheduler requeued this job (restart %d): resuming from the newest snapshot", dist.topology.restarts)
        return "auto"
    # The dead supervisor's record told the user to rerun the same launch command, which names no --resume.
    if run_dir is not None and dist.topology.launch_id and \
            dist.from_main(lambda: supervision.stopped_by_supervisor_death(run_dir)):
        log.info("the last attempt in %s stopped when its supervisor died: resuming from the newest snapshot", run_dir)
        return "auto"
    return None


def summarise(cfg: Config, dist: Dist, outcome: Any, loaders: Any, job_started_at: float,
              startup: StartupClock) -> dict[str, Any]:
    """Collective: gather every rank's timing to global rank 0, which alone writes the job's summary and returns
    it; the other ranks return an empty dict."""
    import torch

    timing = outcome.timing
    if timing.first_step_done_at is not None:
        startup.mark("first_step", at=timing.first_step_done_at)
    gathered = dist.gather(  # a few hundred numbers per rank, however long the run
        (timing.durations, timing.images_after_warmup, timing.seconds_after_warmup, timing.first_step_done_at,
         startup.durations())
    )
    (finished_at,) = dist.reduce([time.time()], "max")
    if gathered is None:  # not global rank 0: nothing of the summary is for this rank
        return {}
    summary = build_summary(
        config=cfg.to_dict(), topo=dist.topology, backend=dist.backend, device=dist.device.type,
        epochs=outcome.epochs,
        rank_durations=[g[0] for g in gathered],
        rank_images_after_warmup=[g[1] for g in gathered],
        rank_seconds_after_warmup=[g[2] for g in gathered],
        first_step_done_at=[g[3] for g in gathered],
        job_started_at=job_started_at, finished_at=finished_at, torch_version=torch.__version__,
    )
    summary["startup_s"] = slowest_per_phase([g[4] for g in gathered])
    summary.update(arch=cfg.model_name, dataset=cfg.dataset, num_train=loaders.num_train, num_eval=loaders.num_eval)
    return summary


def run(cfg: Config, dist: Dist, run_dir: Path, stop: StopRequest, startup: StartupClock,
        guard: FailFast | None = None) -> dict[str, Any] | None:
    """Collective: build, restore, train and summarise on every rank; rank 0's loggers write the files.
    None when a resumed run had nothing left to train; the summary on global rank 0, an empty dict elsewhere.
    `guard` learns the step a failure happens after."""
    from mpiddp.job.watchdog import Watchdog
    from mpiddp.trainer import checkpoint
    from mpiddp.trainer.saveclock import SaveClock, SaveCost
    from mpiddp.trainer.snapshot import Snapshot
    from mpiddp.trainer.state import TrainState, build_state, configure_torch
    from mpiddp.trainer.train import Hooks, train

    startup.mark("process_group")
    (job_started_at,) = dist.reduce([startup.started_at], "min")
    checkpoint_dir = checkpoint_dir_of(cfg, run_dir)
    mode = resume_mode(cfg, dist, run_dir)
    if mode is None:  # before anything is loaded or written
        dist.from_main(lambda: checkpoint.refuse_reuse(checkpoint_dir))
    configure_torch(cfg)
    loaders, channels = load_data(cfg, dist)
    startup.mark("data")
    state = build_state(cfg, dist, loaders.num_classes, channels, len(loaders.train))
    restored = resume(cfg, dist, state, checkpoint_dir, mode)
    resumed_at_step = state.step
    startup.mark("model")
    if state.epoch >= cfg.epochs and state.pending_epoch is None:  # a pending evaluation is still to do
        log.info("nothing to do: %s already holds all %d epochs (raise --epochs to train further); nothing changed",
                 checkpoint_dir, state.epoch)
        return None
    log.info(
        "training %s on %s: %d train / %d eval samples, global batch %d (%d per rank x %d ranks x %d accumulation)",
        cfg.model_name, cfg.dataset, loaders.num_train, loaders.num_eval,
        cfg.batch_size * dist.world_size * cfg.grad_accum, cfg.batch_size, dist.world_size, cfg.grad_accum,
    )
    run_logger, wandb_run_id = make_run_logger(
        cfg, run_dir, dist.topology, restored[1].wandb_run_id if restored else None
    )
    # the start-up times only this job knows, for the downtime of a relaunch (mpiddp.failure.downtime)
    run_logger.log({"kind": "start", "epoch": state.epoch, "step": state.step, "world_size": dist.world_size,
                    "resumed_from": str(restored[0]) if restored else None, "time": time.time(),
                    "process_started_at": job_started_at, "rendezvous_at": startup.ends["process_group"],
                    "restored_at": startup.ends["model"]})
    startup.mark("logger")
    watchdog = Watchdog.for_job(cfg.hang_timeout_s, dist, run_dir).start()
    if guard is not None:  # a failure record carries the last completed step, and whether this job made progress
        guard.progress = lambda: (state.step, watchdog.progressed)

    # What the next snapshot continues: the one resumed from, then the last one this job saved (its lineage).
    parent = restored[0] if restored is not None else None
    save_cost = SaveCost()

    def save(train_state: TrainState) -> None:
        nonlocal parent
        watchdog.beat("save", train_state.step)
        started = time.perf_counter()
        snapshot = Snapshot.capture(train_state, dist, cfg.model_name, cfg.to_dict(), wandb_run_id)
        parent = checkpoint.save(checkpoint_dir, snapshot, dist, cfg.keep_last, parent)
        # The save ends when every rank has heard `latest` moved: the slowest rank's time is the job's cost.
        seconds, nbytes = dist.reduce([time.perf_counter() - started, file_size(parent) if dist.is_main else 0], "max")
        save_cost.add(seconds, int(nbytes))
        log.info("saved %s in %.2f s (%.1f MB)", parent, seconds, nbytes / 1e6)
        watchdog.beat("train", train_state.step)

    try:
        hooks = Hooks(run_logger, save, stop, watchdog.beat, SaveClock(cfg.save_interval_s), watchdog.enter)
        outcome = train(cfg, state, loaders, dist, hooks)
    finally:
        watchdog.stop()
        run_logger.close()
    if cfg.model_filename:
        checkpoint.save_weights(checkpoint_dir / cfg.model_filename, state.unwrapped.state_dict(), dist)
    summary = summarise(cfg, dist, outcome, loaders, job_started_at, startup)
    assert dist.rendezvous is not None
    summary.update(
        resumed_from=str(restored[0]) if restored is not None else None,
        checkpoint_dir=str(checkpoint_dir),
        rendezvous={"master_addr": dist.rendezvous.master_addr, "master_port": dist.rendezvous.master_port,
                    "interfaces": dist.rendezvous.interface_per_host},
        wandb_run_id=wandb_run_id,
        snapshots=save_cost.record(),
        grad_transport=state.gradient_hook.transport.record() if state.gradient_hook and state.gradient_hook.transport else None,
    )
    # under `launch`: the earlier attempts and why they failed (a stale file of an earlier launch does not count)
    attempts = read_attempts(run_dir, resumed_at_step) if dist.topology.failure_file and dist.is_main else None
    if attempts is not None:
        summary["attempts"] = attempts
    dist.from_main(lambda: write_summary(run_dir / "summary.json", summary))
    return summary


def checkpoint_dir_of(cfg: Config, run_dir: Path) -> Path:
    return Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else default_checkpoint_dir(run_dir)


def file_size(path: Path) -> int:
    """Bytes in `path` (0 if it cannot be read: a size is for the record, never a reason to fail)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def write_summary(path: Path, summary: dict[str, Any]) -> None:
    """Rank 0's part: the summary file, or a UserError every rank reports (the snapshots are already safe)."""
    try:
        write_json_atomic(path, summary)
    except OSError as exc:
        raise UserError(f"writing {path} failed ({exc.strerror or exc}); the snapshots are intact") from None


def _main(args: list[str], startup: StartupClock, stop: StopRequest, check: CheckFn | None) -> int:
    with FailFast() as guard:
        dist = connect(guard)
        given, cfg = dist.agree(lambda: parse_for_world(args, dist.world_size))
        cfg, timeouts_raised = cfg.ordered_timeouts()
        setup_logging(dist.topology, cfg.log_level)
        if timeouts_raised and dist.is_main:  # a local log line, no collective
            log.info("%s", timeouts_raised)
        topo = dist.topology
        log.info("%d ranks on %d hosts %s; %s", topo.world_size, topo.num_hosts, topo.hosts_dict, topo.mpi_description)
        startup.mark("mpi_and_topology")
        if check is not None:
            return _check(cfg, dist, guard, check)
        log.info("config: %s", cfg.to_dict())
        log.info("every rank runs %s", preflight.check(cfg.to_dict(), dist))
        run_dir = prepare_run_dir(cfg.run_dir or launch_run_dir(cfg, topo), cfg.runs_root, dist)
        if topo.job_record:  # under `launch`: where this job writes, and its global batch
            dist.from_main(lambda: tell_launch(Path(topo.job_record), run_dir, checkpoint_dir_of(cfg, run_dir), cfg,
                                               given.batch_size, topo.world_size))
        if not topo.failure_file:  # the supervisor manages the file it named; here the record is ours to reset
            dist.from_main(lambda: failure.clear_stale(run_dir))
        guard.set_run_dir(run_dir)
        startup.mark("preflight")
        try:
            with distributed(cfg, dist, guard, trace_dir=run_dir) as placed:
                summary = run(cfg, placed, run_dir, stop, startup, guard)
        except Stopped as stopped:
            # Every rank saved and left the loop at the same step, and the teardown ran: a clean, agreed exit.
            if dist.is_main:  # one line for the job, not one per rank
                saved = "snapshot saved in %s" if stopped.saved else "nothing trained since the last snapshot in %s"
                log.warning("%s; " + saved + ". Continue with --resume (exit status %d)", stopped, run_dir, EXIT_STOPPED)
            note_supervisor_death(topo, run_dir, stopped.step)
            return EXIT_STOPPED
        if summary is None or not dist.is_main:  # the summary and its lines are rank 0's
            return EXIT_OK
        accuracy = summary["eval_accuracy"]
        log.info(
            "done: eval accuracy %s, %.0f images/s, wall time %.1f s; outputs in %s",
            "n/a" if accuracy is None else f"{100 * accuracy:.2f}%", summary["images_per_second"],
            summary["wall_time_s"], run_dir,
        )
        log.info("start-up, slowest rank per phase: %s",
                 ", ".join(f"{phase} {entry['seconds']:.2f} s (rank {entry['rank']})"
                           for phase, entry in summary["startup_s"].items()))
    return EXIT_OK


def parse_for_world(args: list[str], world_size: int) -> tuple[Config, Config]:
    """(the flags as given, the config on `world_size` ranks: --global-batch derives the per-rank split)."""
    given = parse_args(args)
    return given, given.for_world(world_size)


def launch_run_dir(cfg: Config, topo: Any) -> str | None:
    """Under `launch`, training writes into launch's run dir unless its own --run-dir (checked by the caller) or a
    --runs-root other than the default names another place: launch then learns it from the job record, and a
    relaunch is told that directory (one under --runs-root), which it then keeps."""
    given = topo.launch_run_dir
    if not given:
        return None
    if cfg.runs_root == DEFAULT_RUNS_ROOT or Path(given).resolve().parent == Path(cfg.runs_root).resolve():
        return given
    return None


def tell_launch(path: Path, run_dir: Path, checkpoint_dir: Path, cfg: Config, max_per_rank: int,
                world_size: int) -> None:
    """Rank 0: the job record (mpiddp.contract) that `launch` reads instead of parsing this job's flags."""
    record = JobRecord(str(run_dir), str(checkpoint_dir.resolve()), world_size,
                       cfg.batch_size * world_size * cfg.grad_accum, max_per_rank)
    if not write_job_record(path, record):
        log.warning("cannot write %s: launch will not know this job's run dir or global batch", path)


def exit_rank(status: int) -> NoReturn:
    """The end of a `python -m mpiddp` (training or check) rank: Python's exit without the interpreter's teardown
    (mpiddp.job.mpistart.exit_without_teardown). Only mpiddp's code ran in it, and nothing of it waits for the
    teardown; a script under `run` may (objects that flush in __del__), so `run` exits as Python does."""
    from mpiddp.job.mpistart import exit_without_teardown

    exit_without_teardown(status)


def _check(cfg: Config, dist: Dist, guard: FailFast, run_check: CheckFn) -> int:
    """Collective: the `check` command; every rank returns the same status."""
    with distributed(cfg, dist, guard) as placed:
        status, text = run_check(cfg, placed, Path(cfg.run_dir or cfg.runs_root))
    if dist.is_main:
        print(text, flush=True)
    return status


