"""Growing back, the trainer's new ranks: a process spawned by a job that grows back after a recovery joins the
job (mpiddp.elastic.grow.join), takes the state from a survivor's memory (what the trainer's elastic policy hands
over) and trains to the end with it. `python -m mpiddp` starts here (mpiddp.trainer.entry) when this process has
an MPI parent."""

from __future__ import annotations

import hashlib
import logging
import time
from pathlib import Path
from typing import Any

from mpiddp.elastic import grow
from mpiddp.elastic.decide import grow_record
from mpiddp.job.stopping import StopRequest

log = logging.getLogger("mpiddp")


def main(args: list[str], stop: StopRequest | None) -> int:
    """`python -m mpiddp` in a spawned rank: training's stop handlers, then join_main."""
    from mpiddp.job.spares import is_hot_spare
    from mpiddp.elastic.survivors import end_without_finalize, recovered_in_this_process

    stop = stop or StopRequest().install()
    try:
        status = join_main(args, stop)
    finally:
        stop.release()
    # a hot spare taken in (grow.arrive marks it): MPI_Finalize would wait for the failed ranks; one released from
    # a job that lost none must finalise with the workers
    if is_hot_spare() and recovered_in_this_process():
        end_without_finalize(status)
    return status  # a spawned rank is a job of its own: it finalises


def join_main(args: list[str], stop: Any) -> int:
    """A spawned rank: join the job, take the state, train to the end with it, summarise and tear down as every
    rank does (collective with the survivors throughout). Returns the exit status."""
    from mpiddp.job.stopping import Stopped
    from mpiddp.trainer.startup import StartupClock
    from mpiddp.trainer.metrics import process_start_time

    startup = StartupClock(process_start_time())
    while True:
        try:
            joined = Joined.enter(args)
            break
        except grow.Abandoned as exc:
            if grow.wait_again(exc):  # a hot spare whose grow was given up: the next grow may take it in
                continue
            grow.say_abandoned(exc)
            return 0
    try:
        outcome = joined.train(stop)
    except Stopped:
        joined.teardown()
        return 3
    joined.conclude(outcome, startup)
    joined.teardown()
    return 0


class Joined:
    """A new rank inside the job: its Dist, config, state, loaders and in-job recovery."""

    @classmethod
    def enter(cls, args: list[str]) -> Joined:
        """The new rank's half of GrowBack's two steps: arrive (collective), warm up while the survivors train
        (local), then join when they take it in (collective). Abandoned when the grow was given up meanwhile."""
        arrival = grow.arrive()
        joined = cls()
        try:
            joined.warm(args, arrival)
        except Exception as exc:  # noqa: BLE001 - any: the survivors learn why, and this rank ends
            grow.cannot_warm_up(arrival, exc)
            raise grow.CouldNotWarmUp() from None
        joining = grow.enter(arrival)
        joined.members, joined.hello, joined.added = joining.members, joining.hello, joining.added
        joined.dist = grow.joined_dist(joining, joined.num_threads)
        payload = grow.receive(joining)
        joined.build(payload, joining.phases)
        return joined

    def warm(self, args: list[str], arrival: grow.Arrival) -> None:
        """Local, while the survivors train: the config, logging, data, and the model and optimizer (their state
        comes with the survivors' word, in `build`): what kept the survivors waiting, before."""
        import torch

        from mpiddp.job.bootstrap import set_threads
        from mpiddp.job.log import setup_logging
        from mpiddp.trainer.data import load_datasets
        from mpiddp.trainer.models import build_model, input_channels
        from mpiddp.trainer.optim import build_optimizer
        from mpiddp.trainer.run import parse_for_world

        _, cfg = parse_for_world(args, arrival.hello["initial_world"])
        self.cfg, _ = cfg.replace(inject_fault=None).ordered_timeouts()  # drills name ranks of the first job
        setup_logging(arrival.topology, self.cfg.outputs.log_level)
        self.num_threads = set_threads(self.cfg.dist, arrival.topology)
        self.datasets = load_datasets(self.cfg, lambda channels: input_channels(self.cfg.data.model_name, channels))
        torch.manual_seed(self.cfg.training.seed)
        model = build_model(self.cfg.data.model_name, self.datasets.num_classes, self.datasets.channels,
                            self.cfg.data.input_size).to(arrival.device)
        self.model, self.optimizer = model, build_optimizer(self.cfg.training, model.parameters())
        rehearse(self.cfg, model, self.optimizer, self.datasets, arrival.device)
        warm_modules()

    def build(self, payload: dict[str, Any], phases: dict[str, float | None]) -> None:
        """Collective (DDP): the state from `payload` in DDP over the grown job, the loaders at the same sample."""
        from mpiddp.trainer.data import build_loaders

        cfg, dist, split = self.cfg, self.dist, payload["split"]
        self.run_dir = Path(payload["run_dir"])
        started = time.monotonic()
        self.current = cfg.replace(batch_size=split.batch_size, grad_accum=split.grad_accum)
        self.loaders = build_loaders(self.current, self.datasets, dist, global_batch=split.global_batch,
                                     epoch_end=payload["epoch_end"])
        self.state = restored_state(cfg, self.current, dist, (self.model, self.optimizer), payload, self.members)
        self.state.batches_done = split.batches_done
        own_rng(payload["rng"], dist.rank)
        phases["ddp"] = time.monotonic() - started
        ranks, hosts, before, after = self.added
        step = payload["position"][0]
        self.records = [*payload["records"], grow_record(step, ranks, hosts, before, after, phases)]
        self.payload = payload

    def train(self, stop: Any) -> Any:
        """Collective: the rest of the run, entered at the survivors' epoch and batch."""
        from mpiddp.trainer.metrics import NullLogger
        from mpiddp.elastic.engine import Engine
        from mpiddp.trainer.elastic_policy import TrainerPolicy, TrainingParts
        from mpiddp.trainer.run import Saver, checkpoint_dir_of, start_watchdog
        from mpiddp.trainer.saveclock import SaveClock
        from mpiddp.trainer.train import Hooks, train

        cfg, dist, state = self.cfg, self.dist, self.state
        self.watchdog = start_watchdog(cfg, dist, self.run_dir, recovery_on=True)  # as the survivors' own
        parent, wandb_run_id = self.payload["saver"]
        saver = Saver(self.current, dist, checkpoint_dir_of(cfg.checkpoint, self.run_dir), self.watchdog,
                      wandb_run_id, Path(parent) if parent else None)
        saver.loaders = self.loaders
        hooks = Hooks(NullLogger(), saver.save, stop, self.watchdog.beat, SaveClock(cfg.checkpoint.save_interval_s),
                      self.watchdog.enter)
        self.recovery = recovery = TrainerPolicy()
        recovery.grower.joined(self.hello["grower"])
        Engine(self.members, [dist], self.hello["min_size"], recovery).initial_world = self.hello["initial_world"]
        recovery.records, recovery.cfg, recovery.stepped = self.records, self.current, True
        recovery.keep_full_epoch_end(self.payload["epoch_end"])  # the survivors' (the first split's), not its own
        recovery.changed_size()  # the grow's first step is this rank's too
        recovery.parts = TrainingParts(cfg, state, self.loaders, self.datasets, self.watchdog, None, self.run_dir,
                                       saver)
        recovery.arm_commit(state, dist)
        try:
            return train(self.current, state, self.loaders, dist, recovery.hooks(hooks), joined=True)
        finally:
            self.watchdog.stop()

    def conclude(self, outcome: Any, startup: Any) -> None:
        """Collective: the survivors' end of `run` (mpiddp.trainer.run.finish: final weights, summary, records, the
        finished mark), with the job's own rank 0 writing."""
        from mpiddp.trainer.run import Ending, checkpoint_dir_of, finish

        cfg, dist = self.cfg, self.dist  # rebound by every recovery and grow
        finish(Ending(cfg, dist, self.state, self.loaders, checkpoint_dir_of(cfg.checkpoint, self.run_dir),
                      self.run_dir, startup.started_at, startup, self.recovery, summary_cfg=self.recovery.cfg),
               outcome)

    def teardown(self) -> None:
        """Collective: as the bootstrap's teardown (every rank arrives, then the process group goes)."""
        import torch.distributed as tdist

        from mpiddp.trainer.data import stop_workers

        if hasattr(self, "loaders"):
            stop_workers(self.loaders)  # they ignore SIGTERM: Python's exit would wait for them forever
        dist = self.dist
        dist.barrier()
        if tdist.is_initialized():
            tdist.destroy_process_group()
        self.members.release()  # before MPI_Finalize, which would wait for the survivors (gone by then)


def restored_state(cfg: Any, current: Any, dist: Any, built: tuple[Any, Any], payload: dict[str, Any],
                   members: Any) -> Any:
    """Collective (DDP): a TrainState from a survivor's state in memory (into the model and optimizer `built` while
    warming up, on this rank's device), wrapped in DDP over the grown job."""
    import torch

    from mpiddp.trainer.optim import build_scheduler
    from mpiddp.trainer.state import TrainState, optimizer_steps_per_epoch, wrap

    step, epoch, batches_per_epoch, pending = payload["position"]
    model, optimizer = built
    model.load_state_dict(payload["model"])
    optimizer.load_state_dict(payload["optimizer"])
    # the schedule's length is the job's first split's (its steps per epoch), as on the survivors
    scheduler = build_scheduler(cfg.training, optimizer, optimizer_steps_per_epoch(batches_per_epoch, cfg.training.grad_accum))
    scheduler.load_state_dict(payload["scheduler"])
    scaler = torch.amp.GradScaler(dist.device.type, enabled=cfg.training.amp == "fp16")
    scaler.load_state_dict(payload["scaler"])
    # the survivors wrap again without DDP's broadcast (recovery._rewrap): this rank holds rank 0's weights already,
    # and a broadcast on one side only would never match
    ddp, hook, wrapped = wrap(current, dist, model, members, payload["transport"], replicas_agree=True)
    return TrainState(wrapped, ddp, model, optimizer, scheduler, scaler, hook, epoch=epoch, step=step,
                      batches_per_epoch=batches_per_epoch, pending_epoch=pending)


def own_rng(survivor_state: Any, rank: int) -> None:
    """This new rank's RNG stream for augmentation and dropout: derived from the survivor's, its own per rank."""
    import torch

    digest = hashlib.sha256(bytes(survivor_state.numpy()) + rank.to_bytes(4, "little")).digest()
    torch.manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))


def warm_modules() -> None:
    """Local, in the warm-up: what the new rank imports between rank 0's state and its first step (the hang
    watchdog, the training loop and its policy), imported now. The survivors' first step waits for that path:
    measured, 0.02-0.04 s of imports out of a 0.04 s path."""
    import mpiddp.elastic.engine  # noqa: F401
    import mpiddp.job.silenthost  # noqa: F401
    import mpiddp.job.watchdog  # noqa: F401
    import mpiddp.trainer.commit  # noqa: F401
    import mpiddp.trainer.elastic_policy  # noqa: F401
    import mpiddp.trainer.metrics  # noqa: F401
    import mpiddp.trainer.run  # noqa: F401
    import mpiddp.trainer.saveclock  # noqa: F401
    import mpiddp.trainer.train  # noqa: F401


def rehearse(cfg: Any, model: Any, optimizer: Any, datasets: Any, device: Any) -> None:
    """Local, in the warm-up: one forward, backward and optimizer step of a training batch, thrown away. The first
    step after the take-in, which the survivors wait for, then runs on warm kernels (oneDNN's primitives, the
    allocator, the thread pool, autograd's first graph, the optimizer's first step and what torch imports for it)
    instead of paying for them while they wait (measured: that step took 2-4 ordinary steps before). The weights,
    buffers, optimizer state and RNG state it touched come from rank 0 at the take-in."""
    import torch
    from torch.utils.data import default_collate

    from mpiddp.trainer.train import autocast_for

    batch = cfg.training.batch_size
    if datasets.train is None:  # synthetic: random images of the configured size
        size = cfg.data.image_size or 32
        inputs = torch.rand((batch, datasets.channels, size, size))
        targets = torch.randint(0, datasets.num_classes, (batch,))
    else:
        inputs, targets = default_collate([datasets.train[i] for i in range(min(batch, len(datasets.train)))])
    memory_format = torch.channels_last if cfg.training.channels_last else torch.contiguous_format
    model.train()
    try:
        with autocast_for(cfg.training.amp, device):
            loss = torch.nn.functional.cross_entropy(model(inputs.to(device, memory_format=memory_format)),
                                                     targets.to(device))
        loss.backward()
        optimizer.step()
    except (RuntimeError, ValueError) as exc:  # only a head start: the job's own first step says what is wrong
        log.warning("grow: this rank's rehearsal step failed (%s); its first step in the job starts cold", exc)
    optimizer.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)

