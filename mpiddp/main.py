"""Orchestration only: parse -> bootstrap -> build -> train -> summarise -> close."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from mpiddp.bootstrap import DistContext, FailFast, agree, distributed
from mpiddp.config import Config, parse_args
from mpiddp.log import setup_logging
from mpiddp.metrics import allreduce, build_summary, make_run_logger, process_start_time
from mpiddp.rundir import prepare_run_dir, write_json_atomic
from mpiddp.topology import check_launcher, discover, init_mpi

log = logging.getLogger("mpiddp")


def run(cfg: Config, ctx: DistContext, run_dir: Path) -> dict:
    """Collective: build, train and summarise on every rank; rank 0's logger writes the files."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from mpiddp.data import digits_loaders
    from mpiddp.models import build_model
    from mpiddp.train import train

    topo, comm = ctx.topology, ctx.comm
    (job_started_at,) = allreduce(comm, [process_start_time()], "min")
    torch.manual_seed(cfg.seed)  # identical initial weights everywhere (DDP also broadcasts rank 0's)
    loaders = digits_loaders(topo, cfg.batch_size, cfg.eval_batch_size, cfg.seed)
    model = build_model("digits_cnn", loaders.num_classes).to(ctx.device)
    ddp_model = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    optimizer = torch.optim.SGD(
        ddp_model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay
    )
    log.info(
        "training digits_cnn on %d train / %d test digits, global batch %d (%d per rank x %d ranks)",
        loaders.num_train, loaders.num_eval, cfg.batch_size * topo.world_size, cfg.batch_size, topo.world_size,
    )
    run_logger = make_run_logger(run_dir, topo)
    try:
        outcome = train(cfg, ddp_model, optimizer, loaders, topo, comm, ctx.device, run_logger)
    finally:
        run_logger.close()

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
    if topo.is_main:
        write_json_atomic(run_dir / "summary.json", summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    guard = FailFast()
    with guard:
        comm = init_mpi()
        guard.comm = comm
        check_launcher(comm)
        topo = agree(comm, lambda: discover(comm))
        guard.topology = topo
        cfg = agree(comm, lambda: parse_args(argv))
        setup_logging(topo, cfg.log_level)
        log.info("mpiddp: %d ranks on %d hosts %s; %s", topo.world_size, topo.num_hosts, topo.hosts_dict, topo.mpi_library)
        log.info("config: %s", cfg.to_dict())
        run_dir = agree(comm, lambda: prepare_run_dir(cfg.run_dir, cfg.runs_root, topo, comm))
        with distributed(cfg, topo, comm) as ctx:
            summary = run(cfg, ctx, run_dir)
        log.info(
            "done: eval accuracy %.2f%%, %.0f images/s, wall time %.1f s; outputs in %s",
            100 * summary["eval_accuracy"], summary["images_per_second"], summary["wall_time_s"], run_dir,
        )
    return 0


def main_cli() -> None:
    sys.exit(main())
