"""The job's configuration: one dataclass, validated on construction, built from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from mpiddp.errors import UserError

DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "gloo", "nccl", "mpi")
DATASETS = ("digits", "synthetic", "cifar10", "mnist", "imagefolder")
ON_DISK_DATASETS = ("cifar10", "mnist", "imagefolder")
DOWNLOADABLE = ("cifar10", "mnist")
OPTIMIZERS = ("sgd", "adamw")
SCHEDULES = ("constant", "cosine", "step")
AMP_MODES = ("off", "bf16", "fp16")
WANDB_MODES = ("auto", "online", "offline", "disabled")
START_METHODS = ("forkserver", "spawn", "fork")
PROGRESS = ("auto", "on", "off")
LOG_LEVELS = ("debug", "info", "warning", "error")
FAULT_KINDS = ("raise", "exit0", "exit1", "stall")
MASTER_ADDR_ENV = "MPIDDP_MASTER_ADDR"


class ConfigError(UserError):
    """A bad flag or flag combination: reported as one line, exit status 2."""


class HelpRequested(Exception):
    """`--help` or `--version`: rank 0 prints the text, every rank exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


ALL_RANKS = -1


@dataclass(frozen=True)
class FaultInjection:
    """A deliberate failure for testing: `KIND:RANK:STEP`; KIND raise, exit0, exit1 or stall; RANK a number or `all`."""

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


@dataclass(frozen=True)
class Config:
    """Everything one training job needs; every rank builds the same one from the same flags."""

    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    arch: str | None = None  # None: digits_cnn for digits, resnet18 otherwise
    image_size: int | None = None  # None: the dataset's own size (224 for imagefolder, 32 for synthetic)
    num_classes: int = 1000  # synthetic data only
    steps_per_epoch: int = 20  # synthetic data only
    num_workers: int = 4  # on-disk datasets only
    worker_start_method: str = "forkserver"
    epochs: int = 15
    batch_size: int = 32
    eval_batch_size: int = 256
    optimizer: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    schedule: str = "cosine"
    warmup_epochs: float = 0.0
    lr_step_epochs: int = 30
    lr_gamma: float = 0.1
    grad_accum: int = 1
    amp: str = "off"
    channels_last: bool = False
    sync_bn: bool = False
    compile: bool = False
    deterministic: bool = False
    seed: int = 0
    checkpoint_dir: str | None = None  # None: RUN_DIR/checkpoints
    save_every: int = 1
    keep_last: int = 3
    resume: str | None = None  # "auto" or a snapshot path
    model_filename: str | None = None  # final weights (state_dict) written here, relative to checkpoint_dir
    wandb: str = "auto"
    wandb_project: str = "mpiddp"
    wandb_name: str | None = None
    wandb_group: str | None = None
    wandb_tags: tuple[str, ...] = ()
    run_dir: str | None = None
    runs_root: str = "runs"
    log_every: int = 10
    throughput_warmup_steps: int = 5
    device: str = "auto"
    backend: str = "auto"
    master_addr: str | None = None
    iface: str | None = None
    rendezvous_timeout_s: float = 120.0
    collective_timeout_s: float = 600.0
    hang_timeout_s: float = 600.0  # 0 turns the watchdog off
    num_threads: int | None = None
    progress: str = "auto"
    log_level: str = "info"
    inject_fault: FaultInjection | None = None

    def __post_init__(self) -> None:
        positive = {
            "--epochs": self.epochs,
            "--batch-size": self.batch_size,
            "--eval-batch-size": self.eval_batch_size,
            "--log-every": self.log_every,
            "--steps-per-epoch": self.steps_per_epoch,
            "--num-classes": self.num_classes,
            "--grad-accum": self.grad_accum,
            "--save-every": self.save_every,
            "--keep-last": self.keep_last,
            "--lr-step-epochs": self.lr_step_epochs,
        }
        for flag, value in positive.items():
            if value < 1:
                raise ValueError(f"{flag} must be at least 1, got {value}")
        choices = {
            "--dataset": (self.dataset, DATASETS),
            "--optimizer": (self.optimizer, OPTIMIZERS),
            "--schedule": (self.schedule, SCHEDULES),
            "--amp": (self.amp, AMP_MODES),
            "--wandb": (self.wandb, WANDB_MODES),
            "--worker-start-method": (self.worker_start_method, START_METHODS),
        }
        for flag, (value, allowed) in choices.items():
            if value not in allowed:
                raise ValueError(f"{flag} must be one of {', '.join(allowed)}, got {value!r}")
        if self.dataset in ON_DISK_DATASETS and not self.data_dir:
            raise ValueError(f"--dataset {self.dataset} reads files: give --data-dir DIR")
        if self.download and self.dataset not in DOWNLOADABLE:
            raise ValueError(f"--download works for {' and '.join(DOWNLOADABLE)}, not --dataset {self.dataset}")
        if self.image_size is not None and not 8 <= self.image_size <= 1024:
            raise ValueError(f"--image-size must be in [8, 1024], got {self.image_size}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.warmup_epochs < 0:
            raise ValueError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs}")
        if not 0 < self.lr_gamma <= 1:
            raise ValueError(f"--lr-gamma must be in (0, 1], got {self.lr_gamma}")
        if self.compile and self.deterministic:
            raise ValueError("--compile and --deterministic contradict each other: choose one")
        if self.resume is not None and not self.resume.strip():
            raise ValueError("--resume is empty: give 'auto' or a snapshot path")
        if not 0 < self.lr <= 10:
            raise ValueError(f"--lr must be in (0, 10], got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"--momentum must be in [0, 1), got {self.momentum}")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        if self.throughput_warmup_steps < 0:
            raise ValueError(f"--throughput-warmup-steps must be >= 0, got {self.throughput_warmup_steps}")
        if self.device not in DEVICES:
            raise ValueError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.device == "cpu" and self.backend == "nccl":
            raise ValueError("--backend nccl needs GPUs: use --device cuda (or auto on a GPU host), or --backend gloo")
        if self.device == "cpu" and self.sync_bn:
            raise ValueError("--sync-bn needs GPUs (torch's SyncBatchNorm is GPU-only): drop it with --device cpu")
        if self.hang_timeout_s < 0:
            raise ValueError(f"--hang-timeout must be >= 0 seconds (0 turns it off), got {self.hang_timeout_s}")
        if self.rendezvous_timeout_s <= 0 or self.collective_timeout_s <= 0:
            raise ValueError("--rendezvous-timeout and --collective-timeout must be positive seconds")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"--num-threads must be at least 1, got {self.num_threads}")
        if self.progress not in PROGRESS:
            raise ValueError(f"--progress must be one of {', '.join(PROGRESS)}, got {self.progress!r}")
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.master_addr is not None and not self.master_addr.strip():
            raise ValueError("--master-addr is empty: give a host name or IP address, or leave it out")

    @property
    def model_name(self) -> str:
        if self.arch is not None:
            return self.arch
        return "digits_cnn" if self.dataset == "digits" else "resnet18"

    @property
    def has_eval(self) -> bool:
        return self.dataset != "synthetic"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready view for logs, summaries and wandb."""
        out = dataclasses.asdict(self)
        out["wandb_tags"] = list(self.wandb_tags)
        out["inject_fault"] = None if self.inject_fault is None else dataclasses.asdict(self.inject_fault)
        return out


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing and exiting, so the caller decides which rank speaks."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see --help)")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        raise HelpRequested(message or "")

    def print_help(self, file: Any = None) -> None:
        raise HelpRequested(self.format_help())


def build_parser() -> argparse.ArgumentParser:
    from mpiddp import __version__

    parser = _Parser(
        prog="mpirun -np N python -m mpiddp",
        description="Train a model with PyTorch DDP on every rank that mpirun started. Underscore flags of "
        "the classic DDP example script (--num_epochs, --batch_size, --use_syn, ...) are accepted as aliases. "
        "Other commands: `python -m mpiddp check [flags]` (under the same mpirun line: topology, versions, "
        "bandwidth, run dir, wandb) and `python -m mpiddp report RUN_DIR` (plots and a summary of a run).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mpiddp {__version__}")
    d = Config()

    data = parser.add_argument_group("data and model")
    data.add_argument("--dataset", default=d.dataset, help=f"one of {', '.join(DATASETS)}")
    data.add_argument("--use_syn", "--use-syn", dest="dataset", action="store_const", const="synthetic",
                      help="same as --dataset synthetic")
    data.add_argument("--data-dir", default=None, help="cifar10/mnist: torchvision's layout; imagefolder: DIR/train, DIR/val")
    data.add_argument("--download", action="store_true", help="fetch cifar10/mnist once per host (local rank 0)")
    data.add_argument("--arch", default=None, help="digits_cnn or any torchvision classification model "
                      "(resnet18, resnet50, ...); default: digits_cnn for digits, resnet18 otherwise")
    data.add_argument("--image-size", "--image_size", type=int, default=None, help="input size for synthetic/imagefolder")
    data.add_argument("--num-classes", type=int, default=d.num_classes, help="classes of synthetic data")
    data.add_argument("--steps-per-epoch", "--steps_syn", type=int, default=d.steps_per_epoch,
                      help="steps per epoch of synthetic data")
    data.add_argument("--num-workers", type=int, default=d.num_workers, help="DataLoader workers per rank (on-disk data)")
    data.add_argument("--worker-start-method", default=d.worker_start_method,
                      help=f"how loader workers start: {', '.join(START_METHODS)} (fork is unsafe after MPI_Init)")

    train = parser.add_argument_group("training")
    train.add_argument("--epochs", "--num_epochs", type=int, default=d.epochs, help="passes over the training set")
    train.add_argument("--batch-size", "--batch_size", type=int, default=d.batch_size, help="samples per rank per step")
    train.add_argument("--eval-batch-size", type=int, default=d.eval_batch_size, help="samples per rank per eval step")
    train.add_argument("--optimizer", default=d.optimizer, help=f"one of {', '.join(OPTIMIZERS)}")
    train.add_argument("--lr", "--learning_rate", type=float, default=d.lr,
                       help="peak learning rate for the global batch (batch size x ranks x grad accum)")
    train.add_argument("--momentum", type=float, default=d.momentum, help="SGD momentum")
    train.add_argument("--weight-decay", type=float, default=d.weight_decay, help="weight decay")
    train.add_argument("--schedule", default=d.schedule, help=f"after warm-up: {', '.join(SCHEDULES)}")
    train.add_argument("--warmup-epochs", type=float, default=d.warmup_epochs, help="linear warm-up from 0")
    train.add_argument("--lr-step-epochs", type=int, default=d.lr_step_epochs, help="step schedule: epochs per decay")
    train.add_argument("--lr-gamma", type=float, default=d.lr_gamma, help="step schedule: decay factor")
    train.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step")
    train.add_argument("--amp", default=d.amp, help=f"autocast: {', '.join(AMP_MODES)} (fp16 uses a GradScaler)")
    train.add_argument("--channels-last", action="store_true", help="NHWC memory format (faster convs on GPUs)")
    train.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across ranks")
    train.add_argument("--compile", action="store_true", help="torch.compile the model")
    train.add_argument("--deterministic", action="store_true", help="deterministic algorithms (slower)")
    train.add_argument("--seed", "--random_seed", type=int, default=d.seed,
                       help="initial weights (same on every rank), data split and order")

    ckpt = parser.add_argument_group("checkpoints")
    ckpt.add_argument("--checkpoint-dir", "--model_dir", default=None, help="snapshots (default: RUN_DIR/checkpoints)")
    ckpt.add_argument("--save-every", type=int, default=d.save_every, help="epochs between snapshots")
    ckpt.add_argument("--keep-last", type=int, default=d.keep_last, help="snapshots kept")
    ckpt.add_argument("--resume", nargs="?", const="auto", default=None,
                      help="continue from a snapshot: bare --resume (or 'auto') takes the newest in the checkpoint dir")
    ckpt.add_argument("--model-filename", "--model_filename", default=None,
                      help="also write the final weights (a state_dict) to CHECKPOINT_DIR/NAME")

    out = parser.add_argument_group("outputs")
    out.add_argument("--run-dir", default=None, help="where metrics.jsonl and summary.json go (default: runs/<timestamp>)")
    out.add_argument("--runs-root", default=d.runs_root, help="parent of the default run directory")
    out.add_argument("--log-every", type=int, default=d.log_every, help="steps between metric lines")
    out.add_argument("--throughput-warmup-steps", type=int, default=d.throughput_warmup_steps,
                     help="first steps left out of images/s")
    out.add_argument("--progress", default=d.progress, help="rank 0's progress bar: auto (on a terminal, not in CI), on, off")
    out.add_argument("--no-progress", dest="progress", action="store_const", const="off", help="same as --progress off")
    out.add_argument("--log-level", default=d.log_level, choices=LOG_LEVELS, help="rank 0's level; others log warnings")
    out.add_argument("--wandb", default=d.wandb, help="auto: online with credentials, else offline; online; offline; disabled")
    out.add_argument("--wandb-project", default=d.wandb_project, help="wandb project")
    out.add_argument("--wandb-name", default=None, help="wandb run name (default: the run directory's name)")
    out.add_argument("--wandb-group", default=None, help="wandb group")
    out.add_argument("--wandb-tags", default="", help="comma-separated wandb tags")

    dist = parser.add_argument_group("distributed")
    dist.add_argument("--device", default=d.device, help=f"one of {', '.join(DEVICES)}")
    dist.add_argument("--backend", default=d.backend, help=f"one of {', '.join(BACKENDS)} (mpi: only if torch was built with it)")
    dist.add_argument("--master-addr", default=os.environ.get(MASTER_ADDR_ENV),
                      help=f"address rank 0 advertises for the rendezvous (env {MASTER_ADDR_ENV}; default: chosen automatically)")
    dist.add_argument("--iface", default=None,
                      help="network interface for the rendezvous and gloo/NCCL on every host (default: chosen automatically)")
    dist.add_argument("--rendezvous-timeout", dest="rendezvous_timeout_s", type=float, default=d.rendezvous_timeout_s,
                      help="seconds a rank waits to reach rank 0's store")
    dist.add_argument("--collective-timeout", dest="collective_timeout_s", type=float, default=d.collective_timeout_s,
                      help="seconds before a stuck gloo/NCCL collective fails")
    dist.add_argument("--hang-timeout", dest="hang_timeout_s", type=float, default=d.hang_timeout_s,
                      help="seconds without progress on a rank before the watchdog dumps stacks and aborts (0: off)")
    dist.add_argument("--num-threads", type=int, default=None, help="torch CPU threads per rank (default: fair share)")
    # Accepted for scripts written for torch.distributed.launch, which passes it; mpiddp takes the local rank from MPI.
    dist.add_argument("--local-rank", "--local_rank", dest="ignored_local_rank", default=None, help=argparse.SUPPRESS)
    # For tests of the abort path; documented in the README, kept out of --help.
    dist.add_argument("--inject-fault", default=None, help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None = None) -> Config:
    """Build the Config from flags. Raises ConfigError (one-line message) or HelpRequested."""
    namespace = build_parser().parse_args(argv)
    values = vars(namespace)
    values.pop("ignored_local_rank")
    values["wandb_tags"] = tuple(tag.strip() for tag in values["wandb_tags"].split(",") if tag.strip())
    try:
        if values["inject_fault"] is not None:
            values["inject_fault"] = FaultInjection.parse(values["inject_fault"])
        return Config(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
