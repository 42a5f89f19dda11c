"""What a snapshot holds and how it is taken from and put back into a training job: the one place that knows."""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpiddp.errors import UserError
from mpiddp.globalbatch import describe
from mpiddp.job.collective import Dist
from mpiddp.trainer.state import TrainState

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
# Settings that do not change what is trained: they may differ freely between a run and its resumption.
RUN_LOCAL_SETTINGS = frozenset({
    "run_dir", "runs_root", "resume", "checkpoint_dir", "model_filename", "save_every", "keep_last", "wandb",
    "wandb_project", "wandb_name", "wandb_group", "wandb_tags", "log_every", "throughput_warmup_steps", "progress",
    "log_level", "master_addr", "iface", "rendezvous_timeout_s", "collective_timeout_s", "hang_timeout_s",
    "num_threads", "inject_fault", "save_interval_s", "data_dir", "download", "num_workers", "worker_start_method",
    "eval_batch_size", "device", "backend", "commit",
})
# Settings whose change makes the snapshot's state unusable: another model, optimizer state or loss scaling, or
# (the seed) another train/eval split and data order, which the restored position and RNG streams belong to.
# Every other setting a resume changes is applied: see main.resume and optim.apply_on_resume.
INCOMPATIBLE_SETTINGS = frozenset({"arch", "dataset", "num_classes", "optimizer", "amp", "sync_bn", "seed"})
# Settings that act only together with another one's value: a change listed on resume says when it has no effect.
ONLY_WITH = {"momentum": ("optimizer", "sgd"), "lr_step_epochs": ("schedule", "step"), "lr_gamma": ("schedule", "step"),
             "powersgd_rank": ("grad_compression", "powersgd"), "powersgd_warmup_steps": ("grad_compression", "powersgd")}


def _without_effect(key: str, config: dict[str, Any]) -> str:
    if key not in ONLY_WITH or config.get(ONLY_WITH[key][0]) == ONLY_WITH[key][1]:
        return ""
    other, value = ONLY_WITH[key]
    return f" (no effect: it acts only with --{other.replace('_', '-')} {value})"


def rng_state(device: torch.device) -> dict[str, Any]:
    """This rank's global random generators (torch's CPU and CUDA ones, Python's, numpy's): restoring them makes
    a resumed run draw the same numbers. Loader workers need none: each sample's augmentation has its own seed."""
    version, internal, gauss = random.getstate()
    name, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "python": [version, list(internal), gauss],
        "numpy": [name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached_gauss],
    }


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"], device)
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if state.get("numpy") is not None:  # snapshots written before it was saved lack it
        name, keys, position, has_gauss, cached_gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, cached_gauss))


@dataclass
class Snapshot:
    """One training job at one step. Stored as a plain dict of tensors and containers (weights_only loads)."""

    arch: str
    model: dict[str, Any]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    epoch: int  # completed epochs
    step: int  # completed optimizer steps
    rng: list[dict[str, Any] | None]  # every rank's generators, in rank order
    world_size: int
    scaler: dict[str, Any] = field(default_factory=dict)
    batches_done: int = 0  # batches of epoch `epoch + 1` already trained (a stop part-way through)
    config: dict[str, Any] = field(default_factory=dict)
    # Samples of epoch `epoch + 1`'s order trained, and per optimizer step: under an uneven split (in-job recovery
    # on a world the global batch does not divide) batches are not batch_size x world_size samples. None in
    # snapshots of an older mpiddp: derived from batches_done.
    samples_done: int | None = None
    samples_per_step: int | None = None
    wandb_run_id: str | None = None
    # Every rank's gradient-communication state (PowerSGD's error feedback and warm start), in rank order: in the
    # file only for snapshots of an older mpiddp. Now each rank saves its own in a side file (checkpoint.side_path)
    # and `side_ranks` says how many ranks' side files belong to the snapshot; at resume, this list holds this
    # rank's own entry alone.
    communication: list[dict[str, Any] | None] = field(default_factory=list)
    launch_id: str = ""  # the `launch` whose job saved it ('' outside launch): its relaunches prefer it
    side_ranks: int = 0
    # Epoch `epoch`'s record without its evaluation, when a stop came between its last step and the end of its
    # evaluation: the resume evaluates it and writes the record (older snapshots: None, the epoch counts as done).
    pending_epoch: dict[str, Any] | None = None
    format: int = FORMAT_VERSION
    # This rank's own side state (PowerSGD's), for its side file: never in the snapshot file itself.
    own_side: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def capture(cls, state: TrainState, dist: Dist, arch: str, config: dict[str, Any],
                wandb_run_id: str | None) -> Snapshot:
        """Collective: every rank's RNG (a few KB) goes to global rank 0, whose snapshot is the complete one; each
        rank keeps its own PowerSGD state (as large as the gradients) for its own side file, never gathered."""
        rng = dist.gather(rng_state(dist.device)) or []
        own = state.gradient_hook.state_dict() if state.gradient_hook else {}
        return cls(
            arch=arch,
            model=state.unwrapped.state_dict(),
            optimizer=state.optimizer.state_dict(),
            scheduler=state.scheduler.state_dict(),
            scaler=state.scaler.state_dict(),
            epoch=state.epoch,
            step=state.step,
            batches_done=state.batches_done,
            rng=rng,
            world_size=dist.world_size,
            config=config,
            wandb_run_id=wandb_run_id,
            launch_id=dist.topology.launch_id,
            side_ranks=dist.world_size if own else 0,  # the same on every rank: PowerSGD or not
            pending_epoch=state.pending_epoch,
            own_side=own or None,
        )

    def split_per_rank(self, world_size: int) -> tuple[Snapshot, list[tuple[Any, Any]]]:
        """(this snapshot without any rank's own state, and one (RNG, communication state) per rank of a job of
        `world_size` ranks, None where the saved job had no such rank). The lists keep their length, so a
        rank can still tell whether the saved job had it."""
        parts = [(self.rng[rank] if rank < len(self.rng) else None,
                  self.communication[rank] if rank < len(self.communication) else None) for rank in range(world_size)]
        shared = dataclasses.replace(self, rng=[None] * len(self.rng), communication=[None] * len(self.communication))
        return shared, parts

    def take_own_part(self, rank: int, part: tuple[Any, Any]) -> None:
        """Put this rank's own state, from `split_per_rank`, back where `restore_into` reads it."""
        rng, communication = part
        if rank < len(self.rng):
            self.rng[rank] = rng
        if rank < len(self.communication):
            self.communication[rank] = communication

    def take_own_side(self, rank: int, own: dict[str, Any] | None) -> None:
        """Put this rank's side state, read from its own side file (None: it has none), where `restore_into`
        reads it; a rank beyond the saved job's `side_ranks` has none, as with the older in-file list."""
        self.communication = [None] * self.side_ranks
        if own is not None and rank < self.side_ranks:
            self.communication[rank] = own

    def to_payload(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "own_side"}

    @classmethod
    def from_payload(cls, payload: object, path: Path) -> Snapshot:
        """Check a loaded file: a UserError says what is wrong with it."""
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if not isinstance(payload, dict) or any(key not in payload for key in [*required, "format"]):
            raise UserError(f"{path} is not an mpiddp snapshot (a plain state_dict? those cannot resume training)")
        if payload["format"] != FORMAT_VERSION:
            raise UserError(f"{path} has snapshot format {payload['format']}; this mpiddp reads format {FORMAT_VERSION}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in payload.items() if k in known})

    def check_settings(self, config: dict[str, Any]) -> list[str]:
        """Settings this job changes against the snapshot's: a UserError for those that cannot continue the
        run, warning lines for the rest."""
        if not self.config:  # written before snapshots carried their config
            return []
        changed = {key: (self.config.get(key), value) for key, value in config.items()
                   if key not in RUN_LOCAL_SETTINGS and key in self.config and self.config[key] != value}
        refused = [f"--{key.replace('_', '-')} {old!r} -> {new!r}" for key, (old, new) in changed.items()
                   if key in INCOMPATIBLE_SETTINGS]
        if refused:
            raise UserError(
                f"the snapshot was trained with other settings that it cannot continue under: {', '.join(refused)}. "
                f"Resume with the snapshot's settings, or start a new run without --resume"
            )
        return [f"--{key.replace('_', '-')} changed from {old!r} to {new!r}{_without_effect(key, config)}"
                for key, (old, new) in sorted(changed.items())]

    def _restore_communication(self, state: TrainState, dist: Dist) -> None:
        hook = state.gradient_hook
        if hook is None or hook.powersgd is None or not self.communication:
            return  # no PowerSGD now, or none then: nothing to carry over
        if dist.rank < len(self.communication) and self.communication[dist.rank]:
            saved = self.communication[dist.rank]
            if self.config.get("powersgd_rank", hook.powersgd.matrix_approximation_rank) != \
                    hook.powersgd.matrix_approximation_rank:
                saved = {**saved, "q": {}}  # warm-start matrices of the old rank do not fit; error feedback does
                if dist.is_main:
                    log.warning("--powersgd-rank changed: PowerSGD's warm start restarts, its error feedback carries over")
            hook.load_state_dict(saved)
        elif dist.is_main:  # a local log line, no collective
            log.warning("ranks beyond the snapshot's %d start PowerSGD's error feedback from zero", len(self.communication))
        if dist.is_main and dist.world_size < len(self.communication):  # a local log line, no collective
            log.warning("resuming on %d of the snapshot's %d ranks: the PowerSGD error feedback of ranks %d-%d (gradient "
                        "residue not yet sent) is dropped; the others keep theirs", dist.world_size,
                        len(self.communication), dist.world_size, len(self.communication) - 1)

    def global_batch(self) -> int | None:
        """Samples per optimizer step of the job that took the snapshot; None when its config is unknown."""
        if self.samples_per_step is not None:
            return self.samples_per_step
        if "batch_size" not in self.config:
            return None
        return int(self.config["batch_size"]) * self.world_size * int(self.config.get("grad_accum") or 1)

    def position_on(self, world_size: int, batch_size: int, grad_accum: int) -> tuple[int, str]:
        """(batches of epoch `epoch + 1` already trained, in a job of `world_size` ranks of `batch_size`, and why
        that epoch restarts from its beginning instead, or "").

        The ranks take a DistributedSampler's interleaved shards of one permutation per epoch (rank r: perm[r::W]),
        so after `batches_done` batches of b on W ranks they have trained exactly perm[:batches_done x b x W],
        whatever W. At the same global batch, a job on W' ranks of b' continues at perm[that:] by skipping
        that / (b' x W') batches per rank: no sample twice, none left out."""
        done, epoch = self.batches_done, self.epoch + 1
        if not done:
            return 0, ""
        saved_batch = int(self.config.get("batch_size", batch_size))
        uneven = self.samples_done is not None and self.samples_done != done * saved_batch * self.world_size
        if self.world_size == world_size and not uneven:
            if saved_batch == batch_size:
                return done, ""
            return 0, (f"the snapshot was taken part-way through epoch {epoch} with --batch-size {saved_batch}: that "
                       f"epoch restarts from its beginning with {batch_size}")
        samples = done * saved_batch * self.world_size if self.samples_done is None else self.samples_done
        if self.global_batch() == batch_size * world_size * grad_accum and samples % (batch_size * world_size) == 0:
            return samples // (batch_size * world_size), ""
        return 0, (f"the snapshot was taken part-way through epoch {epoch} on another world size: that epoch "
                   f"restarts from its beginning")

    def restore_into(self, state: TrainState, dist: Dist, seed: int, batch_size: int, grad_accum: int = 1) -> None:
        """Put the snapshot back on every rank: weights, optimizer, schedule, scaler, counters, this rank's RNG."""
        state.unwrapped.load_state_dict(self.model)
        state.optimizer.load_state_dict(self.optimizer)
        state.scheduler.load_state_dict(self.scheduler)
        if self.scaler:
            state.scaler.load_state_dict(self.scaler)
        state.epoch, state.step = self.epoch, self.step
        state.pending_epoch = self.pending_epoch
        state.batches_done, restarts = self.position_on(dist.world_size, batch_size, grad_accum)
        if restarts and (dist.is_main or self.world_size != dist.world_size):  # a local log line, no collective
            log.warning("%s", restarts)
        self._restore_communication(state, dist)
        if dist.rank < len(self.rng):  # on fewer ranks, rank r keeps saved rank r's stream; the others' end
            set_rng_state(self.rng[dist.rank], dist.device)
        else:  # a rank the snapshot's job did not have: the stream a fresh start gives it, which no old rank has
            torch.manual_seed(seed + 1 + dist.rank)
        if self.world_size == dist.world_size:
            return
        now = batch_size * dist.world_size * grad_accum
        if self.global_batch() == now:
            if dist.is_main:
                log.info("resuming a %d-rank snapshot on %d ranks at the same global batch %s%s", self.world_size,
                         dist.world_size, describe(batch_size, dist.world_size, grad_accum),
                         f": epoch {state.epoch + 1} continues after its first {state.batches_done * batch_size * dist.world_size} samples"
                         if state.batches_done else "")
            return
        log.warning(
            "resuming a %d-rank snapshot on %d ranks: the sampler reshards the data over the new world "
            "(the global batch is now %d)", self.world_size, dist.world_size, now,
        )
