"""Orchestration only: parse -> bootstrap -> build -> restore -> train -> summarise -> close."""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from mpiddp import preflight
from mpiddp.bootstrap import EXIT_STOPPED, DistContext, FailFast, agree, distributed
from mpiddp.config import Config, parse_args
from mpiddp.log import setup_logging
from mpiddp.metrics import allreduce, build_summary, make_run_logger, process_start_time
from mpiddp.rundir import prepare_run_dir, write_json_atomic
from mpiddp.stopping import Stopped, StopRequest
from mpiddp.watchdog import Watchdog
from mpiddp.topology import check_launcher, discover, init_mpi

log = logging.getLogger("mpiddp")


def _configure_torch(cfg: Config) -> None:
    import torch

    if cfg.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    else:
        torch.backends.cudnn.benchmark = True


def build_state(cfg: Config, ctx: DistContext, loaders: Any, channels: int) -> Any:
    """Model, DDP wrapper, optimizer, schedule and scaler, identical on every rank."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from mpiddp.models import build_model
    from mpiddp.optim import build_optimizer, build_scheduler
    from mpiddp.train import TrainState, optimizer_steps_per_epoch

    torch.manual_seed(cfg.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    model = build_model(cfg.model_name, loaders.num_classes, channels)
    if cfg.sync_bn:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    memory_format = torch.channels_last if cfg.channels_last else torch.contiguous_format
    model = model.to(ctx.device, memory_format=memory_format)
    ddp = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    wrapped = torch.compile(ddp) if cfg.compile else ddp
    optimizer = build_optimizer(cfg, ddp.parameters())
    scheduler = build_scheduler(cfg, optimizer, optimizer_steps_per_epoch(len(loaders.train), cfg.grad_accum))
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.amp == "fp16")
    # Same weights everywhere, but each rank its own stream for augmentation and dropout.
    torch.manual_seed(cfg.seed + 1 + ctx.topology.rank)
    return TrainState(wrapped, ddp, model, optimizer, scheduler, scaler)


def run(cfg: Config, ctx: DistContext, run_dir: Path, stop: Any) -> dict:
    """Collective: build, restore, train and summarise on every rank; rank 0's loggers write the files."""
    import torch

    from mpiddp import checkpoint
    from mpiddp.data import build_loaders, fetch, load_datasets
    from mpiddp.models import check_arch, input_channels
    from mpiddp.train import train

    topo, comm = ctx.topology, ctx.comm
    (job_started_at,) = allreduce(comm, [process_start_time()], "min")
    _configure_torch(cfg)
    agree(comm, lambda: check_arch(cfg.model_name))
    fetch(cfg, topo, comm)
    datasets = agree(comm, lambda: load_datasets(cfg, lambda data_channels: input_channels(cfg.model_name, data_channels)))
    loaders = build_loaders(cfg, datasets, topo, ctx.device)
    state = build_state(cfg, ctx, loaders, datasets.channels)
    checkpoint_dir = Path(cfg.checkpoint_dir) if cfg.checkpoint_dir else run_dir / "checkpoints"

    resume_id = None
    restored = checkpoint.restore(cfg.resume, checkpoint_dir, cfg.model_name, topo, comm) if cfg.resume else None
    if cfg.resume and restored is None:
        log.info("--resume auto: no snapshot in %s yet, starting from scratch", checkpoint_dir)
    if restored is not None:
        path, payload = restored
        state.unwrapped.load_state_dict(payload["model"])
        state.optimizer.load_state_dict(payload["optimizer"])
        state.scheduler.load_state_dict(payload["scheduler"])
        state.scaler.load_state_dict(payload["scaler"])
        state.epoch, state.step = payload["epoch"], payload["step"]
        state.batches_done = payload.get("batches_done", 0)
        resume_id = payload.get("wandb_run_id")
        rng_states = payload["rng"]
        if topo.rank < len(rng_states):
            checkpoint.set_rng_state(rng_states[topo.rank], ctx.device)
        else:
            torch.manual_seed(cfg.seed + topo.rank)
        if payload["world_size"] != topo.world_size and state.batches_done:
            log.warning("the snapshot was taken part-way through epoch %d on another world size: that epoch "
                        "restarts from its beginning", state.epoch + 1)
            state.batches_done = 0
        if payload["world_size"] != topo.world_size:
            log.warning(
                "resuming a %d-rank snapshot on %d ranks: the sampler reshards the data over the new world "
                "(the global batch is now %d)", payload["world_size"], topo.world_size, cfg.batch_size * topo.world_size,
            )
        log.info("resumed from %s: epoch %d, step %d", path, state.epoch, state.step)

    log.info(
        "training %s on %s: %d train / %d eval samples, global batch %d (%d per rank x %d ranks x %d accumulation)",
        cfg.model_name, cfg.dataset, loaders.num_train, loaders.num_eval,
        cfg.batch_size * topo.world_size * cfg.grad_accum, cfg.batch_size, topo.world_size, cfg.grad_accum,
    )
    run_logger, wandb_run_id = make_run_logger(cfg, run_dir, topo, resume_id)
    watchdog = Watchdog.for_job(cfg.hang_timeout_s, topo, ctx.master_addr, ctx.master_port, comm.Abort).start()

    def save(train_state: Any) -> None:
        watchdog.beat("save", train_state.step)
        payload = {
            "arch": cfg.model_name,
            "model": train_state.unwrapped.state_dict(),
            "optimizer": train_state.optimizer.state_dict(),
            "scheduler": train_state.scheduler.state_dict(),
            "scaler": train_state.scaler.state_dict(),
            "epoch": train_state.epoch,
            "step": train_state.step,
            "batches_done": train_state.batches_done,
            "config": cfg.to_dict(),
            "wandb_run_id": wandb_run_id,
        }
        checkpoint.save(
            checkpoint_dir, train_state.epoch, payload, topo, comm, ctx.device, cfg.keep_last, train_state.batches_done
        )
        watchdog.beat("train", train_state.step)

    try:
        outcome = train(cfg, state, loaders, topo, comm, ctx.device, run_logger, save, stop, watchdog.beat)
    finally:
        watchdog.stop()
        run_logger.close()
    if cfg.model_filename:
        checkpoint.save_weights(checkpoint_dir / cfg.model_filename, state.unwrapped.state_dict(), topo, comm)

    timing = outcome.timing
    gathered = comm.allgather(
        (timing.step_times, timing.images_after_warmup, timing.seconds_after_warmup, timing.first_step_done_at)
    )
    (finished_at,) = allreduce(comm, [time.time()], "max")
    summary = build_summary(
        config=cfg.to_dict(),
        topo=topo,
        backend=ctx.backend,
        device=ctx.device.type,
        epochs=outcome.epochs,
        rank_step_times=[g[0] for g in gathered],
        rank_images_after_warmup=[g[1] for g in gathered],
        rank_seconds_after_warmup=[g[2] for g in gathered],
        first_step_done_at=[g[3] for g in gathered],
        job_started_at=job_started_at,
        finished_at=finished_at,
        torch_version=torch.__version__,
    )
    summary.update(
        arch=cfg.model_name,
        dataset=cfg.dataset,
        num_train=loaders.num_train,
        num_eval=loaders.num_eval,
        resumed_from=str(restored[0]) if restored is not None else None,
        checkpoint_dir=str(checkpoint_dir),
        rendezvous={
            "master_addr": ctx.master_addr,
            "master_port": ctx.master_port,
            "interfaces": ctx.interface_per_host,
        },
        wandb_run_id=wandb_run_id,
    )
    if topo.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


COMMANDS = ("train", "check", "report")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args.pop(0) if args and args[0] in COMMANDS else "train"
    if command == "report":  # reads files; no MPI
        from mpiddp import report

        return report.main(args)
    guard = FailFast()
    with guard:
        comm = init_mpi()
        guard.comm = comm
        check_launcher(comm)
        topo = agree(comm, lambda: discover(comm))
        guard.topology = topo
        cfg = agree(comm, lambda: parse_args(args))
        setup_logging(topo, cfg.log_level)
        log.info("%d ranks on %d hosts %s; %s", topo.world_size, topo.num_hosts, topo.hosts_dict, topo.mpi_library)
        if command == "check":
            return _check(cfg, topo, comm, guard)
        log.info("config: %s", cfg.to_dict())
        fingerprint = preflight.check(cfg, topo, comm)
        log.info("every rank runs %s", fingerprint)
        run_dir = prepare_run_dir(cfg.run_dir, cfg.runs_root, topo, comm)
        stop = StopRequest().install()
        try:
            with distributed(cfg, topo, comm, guard) as ctx:
                summary = run(cfg, ctx, run_dir, stop)
        except Stopped as stopped:
            # Every rank saved and left the loop at the same step, and the teardown ran: a clean, agreed exit.
            if topo.is_main:  # one line for the job, not one per rank
                log.warning("%s; snapshot saved in %s. Continue with --resume (exit status %d)",
                            stopped, run_dir, EXIT_STOPPED)
            return EXIT_STOPPED
        accuracy = summary["eval_accuracy"]
        log.info(
            "done: eval accuracy %s, %.0f images/s, wall time %.1f s; outputs in %s",
            "n/a" if accuracy is None else f"{100 * accuracy:.2f}%", summary["images_per_second"],
            summary["wall_time_s"], run_dir,
        )
    return 0


def _check(cfg: Config, topo: Any, comm: Any, guard: FailFast) -> int:
    """Collective: the `check` command; every rank returns the same status."""
    from mpiddp.check import run_check

    with distributed(cfg, topo, comm, guard) as ctx:
        status, text = run_check(cfg, ctx, Path(cfg.run_dir or cfg.runs_root))
    if topo.is_main:
        print(text, flush=True)
    return status


def main_cli() -> None:
    sys.exit(main())
