"""The job's configuration: Config, in sections (data, training, checkpoint, outputs, dist, drills: torchtitan's
nested dataclasses), whose fields declare their own flags; validated on construction.

Each setting is written once: its field holds the default, the flag names, the help text and the simple
rules (choices, lower bound). The parser and the generic checks are derived from the fields; rules within a
section live in its `__post_init__`, rules across sections (and DistSettings', which its holder checks) in
Config's. `cfg.to_dict()` stays flat, one key per flag, as logs, summaries and snapshots have it.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mpiddp.contract import GLOBAL_BATCH_ENV
from mpiddp.errors import HelpRequested
from mpiddp.globalbatch import GlobalBatchError, split
from mpiddp.runname import DEFAULT_RUNS_ROOT
from mpiddp.job.flags import BACKENDS, DEVICES, DISTRIBUTED, LOG_LEVELS, MASTER_ADDR_ENV, START_METHODS  # noqa: F401 - re-exported
from mpiddp.job.flags import (ConfigError, DistSettings, check_address, check_declared, check_field,  # noqa: F401
                              flat_values, from_flat, option, parse_into, parser_for, section)

__all__ = ["CheckpointSettings", "Config", "ConfigError", "DataSettings", "DistSettings", "DrillSettings",
           "FaultInjection", "OutputSettings", "TrainingSettings", "HelpRequested", "build_parser", "option", "parse_args",
           "parse_duration", "parse_into", "parser_for"]

DATASETS = ("digits", "synthetic", "cifar10", "mnist", "imagefolder")
ON_DISK_DATASETS = ("cifar10", "mnist", "imagefolder")
DOWNLOADABLE = ("cifar10", "mnist")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "step")
AMP_MODES = ("off", "bf16", "fp16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
PROGRESS = ("auto", "on", "off")
FAULT_KINDS = ("raise", "exit0", "exit1", "stall", "kill", "slow-data", "slow-compute", "stall-data", "signal",
               "signal-eval", "stall-eval", "stall-save", "kill-save")
ALL_RANKS = -1
# the hang watchdog fires within one interval (at most 5 s) of --hang-timeout and records at once: a collective
# timeout at least this much later (or a quarter more, for long timeouts) leaves it room on a loaded machine
HANG_REPORT_MARGIN_S = 30.0


@dataclass(frozen=True)
class FaultInjection:
    """A deliberate failure for testing: `KIND:RANK:STEP`; KIND raise, exit0, exit1 or stall, kill (SIGKILL of the
    rank's own process; kill-save: at the start of the save at step STEP), stall-data (blocked
    forever loading the batch after step STEP, while the others wait in the all-reduce; stall-eval and stall-save:
    the same at the start of the evaluation or of the save at step STEP), or a straggler from
    STEP on: slow-data or slow-compute, or a stop drill: signal (SIGUSR1 to the rank's process group after step
    STEP; STEP 0: once the first batch is loaded) or signal-eval (the same in the evaluation at step STEP);
    RANK a number or `all`. Kills, stalls and stop drills fire once per run: not in a resumed or relaunched job
    (drills.ONCE_PER_RUN), so a relaunch gets past them; raise and exit (a program's own error) fire in every job."""

    kind: str
    rank: int
    step: int

    @classmethod
    def parse(cls, spec: str) -> FaultInjection:
        parts = spec.split(":")
        if len(parts) != 3 or parts[0] not in FAULT_KINDS:
            raise ValueError(f"--inject-fault must be KIND:RANK:STEP with KIND in {FAULT_KINDS}, got {spec!r}")
        try:
            rank, step = (ALL_RANKS if parts[1] == "all" else int(parts[1])), int(parts[2])
        except ValueError:
            raise ValueError(f"--inject-fault RANK must be an integer or 'all', STEP an integer, got {spec!r}") from None
        if (rank < 0 and rank != ALL_RANKS) or step < 0:
            raise ValueError(f"--inject-fault RANK and STEP must be >= 0, got {spec!r}")
        return cls(parts[0], rank, step)

    def hits(self, rank: int, step: int) -> bool:
        return self.step == step and self.rank in (rank, ALL_RANKS)


_DURATION = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)$")
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """Seconds in `text`: a number with an optional unit s, m or h (`90s`, `15m`, `1.5h`; a bare number is seconds)."""
    m = _DURATION.match(text.strip().lower())
    if m is None:
        raise ValueError(f"--save-interval must be a duration such as 90s, 15m or 1h (a bare number is seconds), "
                         f"got {text!r}")
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def _tags(text: str) -> tuple[str, ...]:
    return tuple(tag.strip() for tag in text.split(",") if tag.strip())


DATA, TRAINING, CHECKPOINTS, OUTPUTS = "data and model", "training", "checkpoints", "outputs"


@dataclass(frozen=True)
class DataSettings:
    """The data and the model (--help's "data and model")."""

    dataset: str = option("digits", "--dataset", group=DATA, choices=DATASETS, help=f"one of {', '.join(DATASETS)}")
    data_dir: str | None = option(None, "--data-dir", group=DATA,
                                  help="cifar10/mnist: torchvision's layout; imagefolder: DIR/train, DIR/val")
    download: bool = option(False, "--download", group=DATA, help="fetch cifar10/mnist once per host (local rank 0)")
    arch: str | None = option(None, "--arch", group=DATA,
                              help="digits_cnn or any torchvision classification model (resnet18, resnet50, ...); "
                              "default: digits_cnn for digits, resnet18 otherwise")
    image_size: int | None = option(None, "--image-size", "--image_size", group=DATA, parse=int,
                                    help="input size for synthetic/imagefolder")
    num_classes: int = option(1000, "--num-classes", group=DATA, parse=int, at_least=1, help="classes of synthetic data")
    steps_per_epoch: int = option(20, "--steps-per-epoch", "--steps_syn", group=DATA, parse=int, at_least=1,
                                  help="optimizer steps per epoch of synthetic data (each of --grad-accum micro-batches)")
    num_workers: int = option(4, "--num-workers", group=DATA, parse=int, at_least=0,
                              help="DataLoader workers per rank (on-disk data)")
    worker_start_method: str = option("forkserver", "--worker-start-method", group=DATA, choices=START_METHODS,
                                      help=f"how loader workers start: {', '.join(START_METHODS)} (fork is unsafe after MPI_Init)")

    def __post_init__(self) -> None:
        check_declared(self)
        if self.dataset in ON_DISK_DATASETS and not self.data_dir:
            raise ValueError(f"--dataset {self.dataset} reads files: give --data-dir DIR")
        if self.download and self.dataset not in DOWNLOADABLE:
            raise ValueError(f"--download works for {' and '.join(DOWNLOADABLE)}, not --dataset {self.dataset}")
        if self.image_size is not None and not 8 <= self.image_size <= 1024:
            raise ValueError(f"--image-size must be in [8, 1024], got {self.image_size}")

    @property
    def model_name(self) -> str:
        if self.arch is not None:
            return self.arch
        return "digits_cnn" if self.dataset == "digits" else "resnet18"

    @property
    def input_size(self) -> int:
        """The side of the images the model sees."""
        defaults = {"digits": 8, "synthetic": 32, "cifar10": 32, "mnist": 28, "imagefolder": 224}
        return self.image_size or defaults[self.dataset]

    @property
    def has_eval(self) -> bool:
        return self.dataset != "synthetic"


@dataclass(frozen=True)
class TrainingSettings:
    """Steps, batches, optimizer and schedule, precision and DDP's gradient all-reduce."""

    epochs: int = option(15, "--epochs", "--num_epochs", group=TRAINING, parse=int, at_least=1,
                         help="passes over the training set")
    batch_size: int = option(32, "--batch-size", "--batch_size", group=TRAINING, parse=int, at_least=1,
                             help="samples per rank per step")
    eval_batch_size: int = option(256, "--eval-batch-size", group=TRAINING, parse=int, at_least=1,
                                  help="samples per rank per eval step")
    optimizer: str = option("sgd", "--optimizer", group=TRAINING, choices=OPTIMIZERS, help=f"one of {', '.join(OPTIMIZERS)}")
    lr: float = option(0.05, "--lr", "--learning_rate", group=TRAINING, parse=float,
                       help="peak learning rate for the global batch (batch size x ranks x grad accum)")
    momentum: float = option(0.9, "--momentum", group=TRAINING, parse=float, help="SGD momentum")
    weight_decay: float = option(5e-4, "--weight-decay", group=TRAINING, parse=float, at_least=0, help="weight decay")
    schedule: str = option("cosine", "--schedule", group=TRAINING, choices=SCHEDULES,
                           help=f"after warm-up: {', '.join(SCHEDULES)}")
    warmup_epochs: float = option(0.0, "--warmup-epochs", group=TRAINING, parse=float, at_least=0,
                                  help="linear warm-up from 0")
    lr_step_epochs: int = option(30, "--lr-step-epochs", group=TRAINING, parse=int, at_least=1,
                                 help="step schedule: epochs per decay")
    lr_gamma: float = option(0.1, "--lr-gamma", group=TRAINING, parse=float, help="step schedule: decay factor")
    grad_accum: int = option(1, "--grad-accum", group=TRAINING, parse=int, at_least=1,
                             help="micro-batches per optimizer step")
    global_batch: int | None = option(
        None, "--global-batch", group=TRAINING, parse=int, at_least=1, env=GLOBAL_BATCH_ENV,
        help="samples per optimizer step, kept on any number of ranks: --grad-accum is derived from it (and "
        "--batch-size lowered only where needed to keep it exact); a world size it does not divide is refused "
        f"(env {GLOBAL_BATCH_ENV}, which launch --min-np sets for a relaunch on fewer ranks)")
    amp: str = option("off", "--amp", group=TRAINING, choices=AMP_MODES,
                      help=f"autocast: {', '.join(AMP_MODES)} (fp16 uses a GradScaler)")
    grad_compression: str = option(
        "none", "--grad-compression", group=TRAINING, choices=("none", "fp16", "bf16", "powersgd"),
        help="gradient all-reduce: none (fp32), fp16 or bf16 (half the bytes), powersgd (low-rank, with error "
        "feedback): for networks slower than the GPUs")
    grad_transport: str = option(
        "auto", "--grad-transport", group=TRAINING, choices=("auto", "gloo", "nccl", "mpi"),
        help="what carries DDP's gradient all-reduce: mpi (MPI_Allreduce in DDP's hook: CPU tensors; the trainer "
        "starts MPI funneled, so on GPUs it is refused), gloo or nccl (torch's process group, the --backend), auto (mpi on CPU "
        "when a start-up probe measures it faster, else the process group)")
    commit: str = option(
        "auto", "--commit", group=TRAINING, choices=("auto", "late", "strict"),
        help="under in-job recovery, when a step's update may use its gradients: strict (the CPU waits for the "
        "step's all-reduces first: on GPUs 6-12%% of a step), late (committed at the next step, undone on every "
        "survivor from a copy on the device where a rank failed: free on the GPU, one copy of the parameters and "
        "optimizer state in memory), auto (late on GPUs where the copy fits, strict on CPU)")
    powersgd_rank: int = option(1, "--powersgd-rank", group=TRAINING, parse=int, at_least=1,
                                help="PowerSGD: rank of the gradient approximation (higher: closer, more bytes)")
    powersgd_warmup_steps: int = option(10, "--powersgd-warmup-steps", group=TRAINING, parse=int, at_least=2,
                                        help="PowerSGD: optimizer steps with plain all-reduce before compressing")
    bucket_cap_mb: float = option(25.0, "--bucket-cap-mb", group=TRAINING, parse=float,
                                  help="DDP gradient bucket size in MB (fewer, larger all-reduces when raised)")
    static_graph: bool = option(False, "--static-graph", group=TRAINING,
                                help="tell DDP the model uses the same parameters every step (enables optimisations)")
    channels_last: bool = option(False, "--channels-last", group=TRAINING, help="NHWC memory format (faster convs on GPUs)")
    sync_bn: bool = option(False, "--sync-bn", group=TRAINING, help="synchronise BatchNorm statistics across ranks")
    compile: bool = option(False, "--compile", group=TRAINING, help="torch.compile the model")
    deterministic: bool = option(False, "--deterministic", group=TRAINING, help="deterministic algorithms (slower)")
    seed: int = option(0, "--seed", "--random_seed", group=TRAINING, parse=int,
                       help="initial weights (same on every rank), data split and order")

    def __post_init__(self) -> None:
        check_declared(self)
        if not 0 < self.lr_gamma <= 1:
            raise ValueError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if self.compile and self.deterministic:
            raise ValueError("--compile and --deterministic contradict each other: choose one")
        if not 0 < self.lr <= 10:
            raise ValueError(f"--lr must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.grad_transport == "mpi" and self.grad_compression == "powersgd":
            raise ValueError("--grad-transport mpi cannot carry PowerSGD (it issues its own all-reduces through "
                             "torch's process group): drop one of them (auto keeps PowerSGD on the process group)")
        if not 0 < self.bucket_cap_mb <= 4096:
            raise ValueError(f"--bucket-cap-mb must be in (0, 4096], got {self.bucket_cap_mb:g}")

    def for_world(self, world_size: int) -> TrainingSettings:
        """With --global-batch: the per-rank batch and accumulation that give exactly that many samples per step
        on `world_size` ranks (--batch-size is then the largest per-rank batch); unchanged without."""
        if self.global_batch is None:
            return self
        try:
            per_rank, accumulation = split(self.global_batch, world_size, self.batch_size)
        except GlobalBatchError as exc:
            raise ConfigError(f"--global-batch: {exc}: run on a number of ranks that divides it, or change it") from None
        return dataclasses.replace(self, batch_size=per_rank, grad_accum=accumulation)


@dataclass(frozen=True)
class CheckpointSettings:
    """Where snapshots go, how often, how many are kept, and what a run resumes from."""

    checkpoint_dir: str | None = option(None, "--checkpoint-dir", "--model_dir", group=CHECKPOINTS,
                                        help="snapshots (default: RUN_DIR/checkpoints)")
    save_every: int = option(1, "--save-every", group=CHECKPOINTS, parse=int, at_least=1, help="epochs between snapshots")
    save_interval_s: float = option(0.0, "--save-interval", group=CHECKPOINTS, parse=parse_duration, metavar="DURATION",
                                    help="also save a snapshot (mid-epoch if need be) once this much wall time has "
                                    "passed since the last one or the start: 90s, 15m, 1h; a bare number is seconds "
                                    "(0: by epoch only)")
    keep_last: int = option(3, "--keep-last", group=CHECKPOINTS, parse=int, at_least=1, help="snapshots kept")
    resume: str | None = option(None, "--resume", group=CHECKPOINTS, nargs="?", const="auto",
                                help="continue from a snapshot: bare --resume (or 'auto') takes the newest in the checkpoint dir")
    model_filename: str | None = option(None, "--model-filename", "--model_filename", group=CHECKPOINTS,
                                        help="also write the final weights (a state_dict) to CHECKPOINT_DIR/NAME")

    def __post_init__(self) -> None:
        check_declared(self)
        if self.resume is not None and not self.resume.strip():
            raise ValueError("--resume is empty: give 'auto' or a snapshot path")
        if not math.isfinite(self.save_interval_s) or self.save_interval_s < 0:
            raise ValueError(f"--save-interval must be a duration >= 0 such as 15m (0 turns it off), "
                             f"got {self.save_interval_s}")


@dataclass(frozen=True)
class OutputSettings:
    """The run directory, metric lines, wandb, progress bar and log level."""

    wandb: str = option("auto", "--wandb", group=OUTPUTS, choices=WANDB_MODES,
                        help="auto: online with credentials, else offline; online; offline; disabled")
    wandb_project: str = option("mpiddp", "--wandb-project", group=OUTPUTS, help="wandb project")
    wandb_name: str | None = option(None, "--wandb-name", group=OUTPUTS,
                                    help="wandb run name (default: the run directory's name)")
    wandb_group: str | None = option(None, "--wandb-group", group=OUTPUTS, help="wandb group")
    wandb_tags: tuple[str, ...] = option((), "--wandb-tags", group=OUTPUTS, parse=_tags, help="comma-separated wandb tags")
    run_dir: str | None = option(None, "--run-dir", group=OUTPUTS,
                                 help="where metrics.jsonl and summary.json go (default: runs/<timestamp>; under "
                                 "launch, launch's run dir unless --runs-root is given)")
    runs_root: str = option(DEFAULT_RUNS_ROOT, "--runs-root", group=OUTPUTS, help="parent of the default run directory")
    log_every: int = option(10, "--log-every", group=OUTPUTS, parse=int, at_least=1, help="steps between metric lines")
    throughput_warmup_steps: int = option(5, "--throughput-warmup-steps", group=OUTPUTS, parse=int, at_least=0,
                                          help="first steps left out of images/s")
    progress: str = option("auto", "--progress", group=OUTPUTS, choices=PROGRESS,
                           help="rank 0's progress bar: auto (on a terminal, not in CI), on, off")
    log_level: str = option("info", "--log-level", group=OUTPUTS, choices=LOG_LEVELS,
                            help="rank 0's level; others log warnings")

    def __post_init__(self) -> None:
        check_declared(self)


@dataclass(frozen=True)
class DrillSettings:
    """Deliberate failures for tests (drills.py runs them as a callback of the loop)."""

    # For tests of the abort path; documented in the README, kept out of --help.
    inject_fault: FaultInjection | None = option(None, "--inject-fault", group=DISTRIBUTED, parse=FaultInjection.parse,
                                                 help=argparse.SUPPRESS)



@dataclass(frozen=True)
class Config:
    """Everything one training job needs; every rank builds the same one from the same flags. The sections
    declare the flags (in this order in --help); rules that span sections are checked here."""

    data: DataSettings = section(DataSettings)
    training: TrainingSettings = section(TrainingSettings)
    checkpoint: CheckpointSettings = section(CheckpointSettings)
    outputs: OutputSettings = section(OutputSettings)
    dist: DistSettings = section(DistSettings)
    drills: DrillSettings = section(DrillSettings)

    def __post_init__(self) -> None:
        dist = self.dist
        check_declared(dist)  # DistSettings is checked by its holder
        if dist.device == "cpu" and dist.backend == "nccl":
            raise ValueError("--backend nccl needs GPUs: use --device cuda (or auto on a GPU host), or --backend gloo")
        if dist.device == "cpu" and self.training.sync_bn:
            raise ValueError("--sync-bn needs GPUs (torch's SyncBatchNorm is GPU-only): drop it with --device cpu")
        if dist.hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout must be >= 0 seconds (0 turns it off), got {dist.hang_timeout_s}")
        if dist.rendezvous_timeout_s <= 0 or dist.collective_timeout_s <= 0:
            raise ValueError("--rendezvous-timeout and --collective-timeout must be positive seconds")
        check_address(dist)
        if dist.device == "cpu" and self.training.grad_transport == "nccl":
            raise ValueError("--grad-transport nccl needs GPUs: use --grad-transport gloo, mpi or auto with --device cpu")

    @classmethod
    def of(cls, **settings: Any) -> Config:
        """A Config from flat settings (`Config.of(device="cpu", lr=0.1)`), each put into its section."""
        return from_flat(cls, settings)

    def replace(self, **settings: Any) -> Config:
        """This config with some flat settings changed (`cfg.replace(resume="auto")`), each in its section."""
        return from_flat(Config, {**flat_values(self), **settings})

    def ordered_timeouts(self) -> tuple[Config, str]:
        """This config with --collective-timeout comfortably above --hang-timeout, and what was changed ('' for
        nothing). A rank waiting for a stalled peer must not time out first: its timeout would blame itself (a
        witness), where the hang watchdog, firing first, names the rank that stopped."""
        dist = self.dist
        if dist.hang_timeout_s <= 0:
            return self, ""
        needed = dist.hang_timeout_s + max(HANG_REPORT_MARGIN_S, dist.hang_timeout_s / 4)
        if dist.collective_timeout_s >= needed:
            return self, ""
        return dataclasses.replace(self, dist=dataclasses.replace(dist, collective_timeout_s=needed)), (
            f"--collective-timeout {dist.collective_timeout_s:g} s raised to {needed:g} s, so the hang watchdog "
            f"(--hang-timeout {dist.hang_timeout_s:g} s) names a stalled rank before a collective times out on "
            f"the ranks that wait for it")

    def for_world(self, world_size: int) -> Config:
        """With --global-batch: this config with the training section for `world_size` ranks (see
        TrainingSettings.for_world); unchanged without."""
        training = self.training.for_world(world_size)
        return self if training is self.training else dataclasses.replace(self, training=training)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready flat view (one key per flag, as before the sections) for logs, summaries, snapshots and wandb."""
        out = copy.deepcopy(flat_values(self))
        out["wandb_tags"] = list(self.outputs.wandb_tags)
        fault = self.drills.inject_fault
        out["inject_fault"] = None if fault is None else dataclasses.asdict(fault)
        return out


# Flags that set another field to a fixed value (the classic scripts' spellings and negations).
SHORTCUTS = (
    (("--use_syn", "--use-syn"), "dataset", "synthetic", "same as --dataset synthetic"),
    (("--no-progress",), "progress", "off", "same as --progress off"),
)


def build_parser() -> argparse.ArgumentParser:
    parser = parser_for(
        Config,
        prog="mpirun -np N python -m mpiddp",
        description="Train a model with PyTorch DDP on every rank that mpirun started. Underscore flags of "
        "the classic DDP example script (--num_epochs, --batch_size, --use_syn, ...) are accepted as aliases. "
        "Other commands: `python -m mpiddp run [options] SCRIPT [args]` (your own script, torchrun's "
        "environment), `python -m mpiddp check [flags]` (under the same mpirun line: topology, versions, "
        "bandwidth, run dir, wandb) and `python -m mpiddp report RUN_DIR` (plots and a summary of a run).",
        shortcuts=SHORTCUTS,
    )
    # Accepted for scripts written for torch.distributed.launch, which passes it; mpiddp takes the local rank from MPI.
    parser.add_argument("--local-rank", "--local_rank", dest="ignored_local_rank", default=None, help=argparse.SUPPRESS)
    return parser


def wandb_mode(requested: str, env: dict[str, str], netrc: Path) -> str:
    """What --wandb means on this host (the trainer and `check` ask alike): auto -> online when credentials
    exist (WANDB_API_KEY or a netrc entry for wandb), else offline."""
    if requested != "auto":
        return requested
    if env.get("WANDB_MODE") in ("offline", "disabled"):
        return env["WANDB_MODE"]
    if env.get("WANDB_API_KEY"):
        return "online"
    try:
        if "api.wandb.ai" in netrc.read_text():
            return "online"
    except OSError:
        pass
    return "offline"


def parse_args(argv: list[str] | None = None) -> Config:
    """Build the Config from flags. Raises ConfigError (one-line message) or HelpRequested."""
    return parse_into(Config, build_parser(), argv)
