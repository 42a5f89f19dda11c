"""Training's front door: parse -> bootstrap -> build -> restore -> train -> summarise -> close (and `check`, which
shares the bootstrap)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from mpiddp import failure, supervision
from mpiddp.contract import HOST_RELAYS_ENV, JobRecord, default_checkpoint_dir, mark_finished, write_job_record
from mpiddp.elastic.survivors import end_without_finalize, recovered_in_this_process
from mpiddp.errors import UserError
from mpiddp.failure import read_attempts
from mpiddp.job import preflight
from mpiddp.job.bootstrap import connect, distributed
from mpiddp.job.collective import Dist
from mpiddp.job.failfast import EXIT_OK, EXIT_STOPPED, FailFast
from mpiddp.job.log import setup_logging
from mpiddp.trainer.startup import StartupClock, slowest_per_phase
from mpiddp.job.stopping import Stopped, StopRequest, note_supervisor_death
from mpiddp.trainer.config import (DEFAULT_RUNS_ROOT, CheckpointSettings, Config, OutputSettings, TrainingSettings,
                                    parse_args)
from mpiddp.trainer.elastic_policy import TrainerPolicy, TrainingParts, prepare_nccl
from mpiddp.trainer.metrics import build_summary, make_run_logger, process_start_time
from mpiddp.trainer.rundir import prepare_run_dir, write_json_atomic

if TYPE_CHECKING:
    from mpiddp.trainer.data import Loaders
    from mpiddp.trainer.state import TrainState
    from mpiddp.trainer.train import TrainOutcome

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
        status = _main(args, startup, stop, check)
    finally:
        stop.release()
    if recovered_in_this_process():  # every survivor passed the teardown's barrier; the records are written
        end_without_finalize(status)
    return status


def load_data(cfg: Config, dist: Dist) -> tuple[Any, int, Any]:
    """Collective: (this rank's loaders, input channels the model takes, the datasets: in-job recovery splits them
    again over the survivors); a bad model or dataset stops every rank."""
    from mpiddp.trainer.data import build_loaders, fetch, load_datasets
    from mpiddp.trainer.models import check_arch, input_channels

    dist.agree(lambda: check_arch(cfg.data.model_name))
    fetch(cfg.data, dist)
    datasets = dist.agree(lambda: load_datasets(cfg, lambda data_channels: input_channels(cfg.data.model_name, data_channels)))
    return build_loaders(cfg, datasets, dist), datasets.channels, datasets


def resume(cfg: Config, dist: Dist, state: Any, checkpoint_dir: Path,
           mode: str | None = None) -> tuple[Path, Any] | None:
    """Collective: with --resume (or in a job the scheduler requeued), put the snapshot back into `state` on
    every rank; settings that cannot continue the run stop every rank, the others are listed. `mode`: what
    resume_mode answered (`run` asks it once), else the flags' and the restart count's answer."""
    from mpiddp.trainer import checkpoint

    mode = mode or resume_mode(cfg.checkpoint, dist)
    if mode is None:
        return None
    # A relaunch of a rollback (`--resume PATH`): the newest snapshot this launch saved since, else PATH again.
    relaunched = dist.topology.launch_id if dist.topology.restarts > 0 else ""
    restored = checkpoint.restore(mode, checkpoint_dir, cfg.data.model_name, dist, relaunched)
    if restored is None:
        if dist.is_main:  # one line for the job
            log.warning("--resume: no snapshot in %s, starting from scratch", checkpoint_dir)
        return None
    from mpiddp.trainer.optim import apply_on_resume
    from mpiddp.trainer.state import schedule_position

    path, snapshot = restored
    changes = dist.agree(lambda: snapshot.check_settings(cfg.to_dict()))
    snapshot.restore_into(state, dist, cfg.training.seed, cfg.training.batch_size, cfg.training.grad_accum)
    if state.batches_per_epoch and state.batches_done >= state.batches_per_epoch:
        # Stopped after an epoch's last batch (a snapshot of an older mpiddp, or fewer batches per epoch now): its
        # training is complete, as after a stop during its evaluation; an epoch of 0 steps would record nothing.
        state.epoch, state.batches_done = state.epoch + 1, 0
    # Loading brought back the snapshot's lr, momentum, weight decay and schedule base: this job's flags win.
    before = state.optimizer.param_groups[0]["lr"]
    after = apply_on_resume(cfg.training, state.optimizer, state.scheduler, schedule_position(
        state.epoch, state.batches_done, state.batches_per_epoch, cfg.training.grad_accum))
    if dist.is_main:  # a local log line, no collective
        for change in changes:
            log.warning("resuming with %s", change)
        if abs(before - after) > 1e-9 * max(abs(before), 1e-12):
            log.warning("the learning-rate schedule changed with the settings: at step %d it was %.6g and is now %.6g",
                        state.step, before, after)
    log.info("resumed from %s: epoch %d, step %d", path, state.epoch, state.step)
    return restored


def resume_mode(checkpoints: CheckpointSettings, dist: Dist, run_dir: Path | None = None) -> str | None:
    """'auto', a snapshot path, or None (a fresh run). A requeued or relaunched job resumes by itself: with the
    user's snapshot path, `checkpoint.restore` prefers what this launch has saved since. Collective when
    `run_dir` is given under `launch`: so does the first attempt of a launch rerun after its supervisor died."""
    if checkpoints.resume:
        return checkpoints.resume
    if dist.topology.restarts > 0:
        who = "launch relaunched" if dist.topology.restarted_by == "launch" else "the scheduler requeued"
        log.info("%s this job (restart %d): resuming from the newest snapshot", who, dist.topology.restarts)
        return "auto"
    # The dead supervisor's record told the user to rerun the same launch command, which names no --resume.
    if run_dir is not None and dist.topology.launch_id and \
            dist.from_main(lambda: supervision.stopped_by_supervisor_death(run_dir)):
        log.info("the last attempt in %s stopped when its supervisor died: resuming from the newest snapshot", run_dir)
        return "auto"
    return None


def summarise(cfg: Config, dist: Dist, outcome: Any, loaders: Any, job_started_at: float,
              startup: StartupClock, joined: bool = False) -> dict[str, Any]:
    """Collective: gather every rank's timing to global rank 0, which alone writes the job's summary and returns
    it; the other ranks return an empty dict. A rank that `joined` the running job (a grow) leaves its start out of
    the job's (`time_to_first_step_s`, `startup_s`): the grow's record has it."""
    import torch

    timing = outcome.timing
    if timing.first_step_done_at is not None:
        startup.mark("first_step", at=timing.first_step_done_at)
    gathered = dist.gather(  # a few hundred numbers per rank, however long the run
        (timing.durations, timing.images_after_warmup, timing.seconds_after_warmup,
         None if joined else timing.first_step_done_at, None if joined else startup.durations())
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
    summary.update(arch=cfg.data.model_name, dataset=cfg.data.dataset, num_train=loaders.num_train, num_eval=loaders.num_eval)
    return summary


def start_watchdog(cfg: Config, dist: Dist, run_dir: Path, recovery_on: bool) -> Any:
    """The hang watchdog. Under in-job recovery it ends a hung rank rather than the job, and cuts a silent host off
    where launch's relay layout lets the job outlive a lost host (mpiddp.job.silenthost)."""
    from mpiddp.job.watchdog import Watchdog

    relays = recovery_on and os.environ.get(HOST_RELAYS_ENV) == "1"
    if relays and cfg.dist.hang_timeout_s <= 0 and dist.is_main:
        log.warning("--hang-timeout 0 turns the hang watchdog off: under launch's relay layout a silent host is then "
                    "never noticed and the job waits for it; give a --hang-timeout, or launch with "
                    "--no-host-crash-relays (mpirun then ends the attempt in ~16 s and launch relaunches)")
    return Watchdog.for_job(cfg.dist.hang_timeout_s, dist, run_dir, exclude_hung=recovery_on,
                            watch_hosts=relays).start()


def run(cfg: Config, dist: Dist, run_dir: Path, stop: StopRequest, startup: StartupClock,
        guard: FailFast | None = None) -> dict[str, Any] | None:
    """Collective: build, restore, train and summarise on every rank; rank 0's loggers write the files.
    None when a resumed run had nothing left to train; the summary on global rank 0, an empty dict elsewhere.
    `guard` learns the step a failure happens after."""
    from mpiddp.trainer.saveclock import SaveClock
    from mpiddp.trainer.train import Hooks, train

    startup.mark("process_group")
    others = [guard.dist] if guard is not None and guard.dist is not None and guard.dist is not dist else []
    recovery = TrainerPolicy.enable(dist, others, cfg.dist.collective_timeout_s,  # None: a failure ends the job
                                    cfg.training.grad_compression)
    (job_started_at,) = dist.reduce([startup.started_at], "min")
    checkpoint_dir = checkpoint_dir_of(cfg.checkpoint, run_dir)
    built = build(cfg, dist, run_dir, checkpoint_dir, startup, recovery.members if recovery is not None else None)
    if built is None:
        if dist.topology.job_record:  # finished too: nothing was left to train
            dist.from_main(lambda: mark_finished(run_dir))
        return None
    state, loaders, restored, datasets = built
    resumed_at_step = state.step
    run_logger, wandb_run_id = start_logger(cfg, dist, run_dir, state, restored, job_started_at, startup)
    watchdog = start_watchdog(cfg, dist, run_dir, recovery is not None)
    if guard is not None:  # a failure record carries the last completed step, and whether this job made progress
        guard.progress = lambda: (state.step, watchdog.progressed)
    # What the next snapshot continues: the one resumed from, then the last one this job saved (its lineage).
    saver = Saver(cfg, dist, checkpoint_dir, watchdog, wandb_run_id, restored[0] if restored is not None else None)
    saver.loaders = loaders
    try:
        hooks = Hooks(run_logger, saver.save, stop, watchdog.beat, SaveClock(cfg.checkpoint.save_interval_s),
                      watchdog.enter)
        if recovery is not None:
            recovery.parts = TrainingParts(cfg, state, loaders, datasets, watchdog, guard, run_dir, saver)
            recovery.arm_commit(state, dist)
            hooks = recovery.hooks(hooks)
        outcome = train(cfg, state, loaders, dist, hooks)
    finally:
        watchdog.stop()
        run_logger.close()

    def complete(summary: dict[str, Any]) -> None:
        """What only this job knows, into the summary before rank 0 writes it."""
        assert dist.rendezvous is not None
        hook = state.gradient_hook
        summary.update(
            resumed_from=str(restored[0]) if restored is not None else None,
            checkpoint_dir=str(checkpoint_dir),
            rendezvous={"master_addr": dist.rendezvous.master_addr, "master_port": dist.rendezvous.master_port,
                        "interfaces": dist.rendezvous.interface_per_host},
            wandb_run_id=wandb_run_id,
            snapshots=saver.cost.record(),
            grad_transport=hook.transport.record() if hook and hook.transport else None,
        )
        # under `launch`: the earlier attempts and why they failed (a stale file of an earlier launch does not count)
        attempts = read_attempts(run_dir, resumed_at_step) if dist.topology.failure_file and dist.is_main else None
        if attempts is not None:
            summary["attempts"] = attempts

    return finish(Ending(cfg, dist, state, loaders, checkpoint_dir, run_dir, job_started_at, startup, recovery),
                  outcome, complete)


@dataclass
class Ending:
    """What the end of a training run needs (`finish`), on a rank that started the job or joined it by a grow."""

    cfg: Config  # the job's own: its --model-filename
    dist: Dist
    state: TrainState
    loaders: Loaders
    checkpoint_dir: Path
    run_dir: Path
    started_at: float  # the job's start (the earliest rank's), for the summary's wall time
    startup: StartupClock
    recovery: TrainerPolicy | None  # in-job recovery's policy, when on: its records go into the summary
    summary_cfg: Config | None = None  # the config the summary names, where not `cfg` (a joined rank: its split)


def finish(ending: Ending, outcome: TrainOutcome,
           complete: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Collective, every rank's end of a training run, in this order: the final weights, the summary's timing,
    the recoveries, rank 0 writes summary.json, and under `launch` rank 0 marks the job finished. A rank that
    joined a grown job (mpiddp.trainer.join) runs it too (`complete` None): the same collectives, with rank 0's
    writes left to the job's own rank 0. Returns the summary on global rank 0 (`complete` adds what only the run
    knows), an empty dict elsewhere."""
    from mpiddp.trainer import checkpoint

    cfg, dist, recovery, run_dir = ending.cfg, ending.dist, ending.recovery, ending.run_dir
    joined = complete is None
    if cfg.checkpoint.model_filename:
        checkpoint.save_weights(ending.checkpoint_dir / cfg.checkpoint.model_filename,
                                ending.state.unwrapped.state_dict(), dist)
    summary = summarise(ending.summary_cfg or cfg, dist, outcome, ending.loaders, ending.started_at, ending.startup,
                        joined=joined)
    recoveries = recovery.gathered(dist) if recovery is not None else []
    if complete is not None:
        if recoveries:
            summary["recoveries"] = recoveries
        complete(summary)
    dist.from_main(lambda: None if joined else write_summary(run_dir / "summary.json", summary))
    if dist.topology.job_record:  # under launch: the one sign of success it trusts under MPI fault tolerance
        dist.from_main(lambda: None if joined else mark_finished(run_dir))
    return summary


def build(cfg: Config, dist: Dist, run_dir: Path, checkpoint_dir: Path, startup: StartupClock,
          members: Any = None) -> tuple[Any, Any, tuple[Path, Any] | None, Any] | None:
    """Collective: (state, loaders, (snapshot path, snapshot) resumed from or None, the datasets: in-job recovery
    splits them again over the survivors) with the data loaded and the model built and restored; None when a
    resumed run has nothing left to train. `members`: in-job recovery's Membership, which the gradient hook polls."""
    from mpiddp.trainer import checkpoint
    from mpiddp.trainer.state import build_state, configure_torch

    mode = resume_mode(cfg.checkpoint, dist, run_dir)
    if mode is None:  # before anything is loaded or written
        dist.from_main(lambda: checkpoint.refuse_reuse(checkpoint_dir))
    configure_torch(cfg.training)
    loaders, channels, datasets = load_data(cfg, dist)
    startup.mark("data")
    state = build_state(cfg, dist, loaders.num_classes, channels, len(loaders.train), members)
    restored = resume(cfg, dist, state, checkpoint_dir, mode)
    startup.mark("model")
    if state.epoch >= cfg.training.epochs and state.pending_epoch is None:  # a pending evaluation is still to do
        log.info("nothing to do: %s already holds all %d epochs (raise --epochs to train further); nothing changed",
                 checkpoint_dir, state.epoch)
        return None
    training = cfg.training
    log.info(
        "training %s on %s: %d train / %d eval samples, global batch %d (%d per rank x %d ranks x %d accumulation)",
        cfg.data.model_name, cfg.data.dataset, loaders.num_train, loaders.num_eval,
        training.batch_size * dist.world_size * training.grad_accum, training.batch_size, dist.world_size,
        training.grad_accum,
    )
    return state, loaders, restored, datasets


def start_logger(cfg: Config, dist: Dist, run_dir: Path, state: Any, restored: tuple[Path, Any] | None,
                 job_started_at: float, startup: StartupClock) -> tuple[Any, str | None]:
    """Collective: (the run's logger, its wandb run id), with the job's start record written."""
    run_logger, wandb_run_id = make_run_logger(
        cfg, run_dir, dist.topology, restored[1].wandb_run_id if restored else None
    )
    # the start-up times only this job knows, for the downtime of a relaunch (mpiddp.failure.downtime)
    run_logger.log({"kind": "start", "epoch": state.epoch, "step": state.step, "world_size": dist.world_size,
                    "resumed_from": str(restored[0]) if restored else None, "time": time.time(),
                    "process_started_at": job_started_at, "rendezvous_at": startup.ends["process_group"],
                    "restored_at": startup.ends["model"]})
    startup.mark("logger")
    return run_logger, wandb_run_id


class Saver:
    """The loop's collective `save`: a snapshot whose parent is the one resumed from, then the last one this job
    saved (its lineage); the watchdog hears of it, and the cost is summed for the summary."""

    def __init__(self, cfg: Config, dist: Dist, checkpoint_dir: Path, watchdog: Any, wandb_run_id: str | None,
                 parent: Path | None) -> None:
        from mpiddp.trainer.saveclock import SaveCost

        self.cfg, self.dist, self.checkpoint_dir, self.watchdog = cfg, dist, checkpoint_dir, watchdog
        self.wandb_run_id, self.parent, self.cost = wandb_run_id, parent, SaveCost()
        self.loaders: Any = None  # the loop's loaders: where in the epoch's order a snapshot stands, in samples

    def save(self, train_state: Any) -> None:
        from mpiddp.trainer import checkpoint
        from mpiddp.trainer.snapshot import Snapshot

        dist = self.dist
        self.watchdog.beat("save", train_state.step)
        started = time.perf_counter()
        snapshot = Snapshot.capture(train_state, dist, self.cfg.data.model_name, self.cfg.to_dict(), self.wandb_run_id)
        if self.loaders is not None:  # an uneven split's micro-batches are not b x W samples each
            snapshot.samples_done = self.loaders.position(train_state.batches_done) if train_state.batches_done else 0
            snapshot.samples_per_step = self.loaders.samples_per_step
        self.parent = checkpoint.save(self.checkpoint_dir, snapshot, dist, self.cfg.checkpoint.keep_last, self.parent)
        # The save ends when every rank has heard `latest` moved: the slowest rank's time is the job's cost.
        seconds, nbytes = dist.reduce([time.perf_counter() - started, file_size(self.parent) if dist.is_main else 0],
                                      "max")
        self.cost.add(seconds, int(nbytes))
        log.info("saved %s in %.2f s (%.1f MB)", self.parent, seconds, nbytes / 1e6)
        self.watchdog.beat("train", train_state.step)


def checkpoint_dir_of(checkpoints: CheckpointSettings, run_dir: Path) -> Path:
    return Path(checkpoints.checkpoint_dir) if checkpoints.checkpoint_dir else default_checkpoint_dir(run_dir)


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
        setup_logging(dist.topology, cfg.outputs.log_level)
        if timeouts_raised and dist.is_main:  # a local log line, no collective
            log.info("%s", timeouts_raised)
        topo = dist.topology
        log.info("%d ranks on %d hosts %s; %s", topo.world_size, topo.num_hosts, topo.hosts_dict, topo.mpi_description)
        startup.mark("mpi_and_topology")
        prepare_nccl(cfg.training.grad_compression)  # before any process group, `check`'s included
        if check is not None:
            return _check(cfg, dist, guard, check)
        log.info("config: %s", cfg.to_dict())
        log.info("every rank runs %s", preflight.check(cfg.to_dict(), dist))
        run_dir = prepare_run_dir(cfg.outputs.run_dir or launch_run_dir(cfg.outputs, topo), cfg.outputs.runs_root, dist)
        if topo.job_record:  # under `launch`: where this job writes, and its global batch
            dist.from_main(lambda: tell_launch(Path(topo.job_record), run_dir, checkpoint_dir_of(cfg.checkpoint, run_dir), cfg.training,
                                               given.training.batch_size, topo.world_size))
        if not topo.failure_file:  # the supervisor manages the file it named; here the record is ours to reset
            dist.from_main(lambda: failure.clear_stale(run_dir))
        guard.set_run_dir(run_dir)
        startup.mark("preflight")
        from mpiddp.trainer.state import device_check

        try:
            with distributed(cfg.dist, dist, guard, trace_dir=run_dir, fits=device_check(cfg.training, topo.label)) as placed:
                summary = run(cfg, placed, run_dir, stop, startup, guard)  # marks the job finished for launch
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


def launch_run_dir(outputs: OutputSettings, topo: Any) -> str | None:
    """Under `launch`, training writes into launch's run dir unless its own --run-dir (checked by the caller) or a
    --runs-root other than the default names another place: launch then learns it from the job record, and a
    relaunch is told that directory (one under --runs-root), which it then keeps."""
    given = topo.launch_run_dir
    if not given:
        return None
    if outputs.runs_root == DEFAULT_RUNS_ROOT or Path(given).resolve().parent == Path(outputs.runs_root).resolve():
        return given
    return None


def tell_launch(path: Path, run_dir: Path, checkpoint_dir: Path, training: TrainingSettings, max_per_rank: int,
                world_size: int) -> None:
    """Rank 0: the job record (mpiddp.contract) that `launch` reads instead of parsing this job's flags."""
    record = JobRecord(str(run_dir), str(checkpoint_dir.resolve()), world_size,
                       training.batch_size * world_size * training.grad_accum, max_per_rank)
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
    from mpiddp.trainer.state import device_check

    with distributed(cfg.dist, dist, guard, fits=device_check(cfg.training, dist.topology.label)) as placed:
        status, text = run_check(cfg, placed, Path(cfg.outputs.run_dir or cfg.outputs.runs_root))
    if dist.is_main:
        print(text, flush=True)
    return status


