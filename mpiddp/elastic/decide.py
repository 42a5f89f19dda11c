"""In-job recovery's and growing back's decisions, pure (stdlib only, tested in-process): can this job recover, and
why not (its MPI, its settings, where a failure struck, how many are left); how the global batch splits over the
survivors; whom the survivors take their state from; whether, when and onto which spare slots the job grows.
Each refusal is one line saying why; the caller then takes the fail-fast path (the job ends and `launch`
relaunches it). What `launch` decides outside MPI (mpirun's --with-ft, the spare hosts it names) is its own."""

from __future__ import annotations

import re
import statistics
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from mpiddp.contract import SPARE_HOSTS_ENV, SPARE_RANKS_ENV
from mpiddp.globalbatch import GlobalBatchError, split, uneven_split

# ---- can this job recover, and why not ---------------------------------------------------------------------------

POWERSGD = "in-job recovery does not carry PowerSGD's per-rank error feedback"
NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torch's NCCL watchdog: what it does on a NCCL error
NCCL_ERRORS_QUIET = ("0", "2")  # no handling, clean-up only: neither ends the process (1 and 3 do)


def ulfm_refusal(library_version: str, env: Mapping[str, str], has_api: bool) -> str | None:
    """None when in-job recovery can work with this MPI, else one line why not. `library_version` is
    MPI_Get_library_version's text, `env` the rank's environment, `has_api` whether mpi4py has Comm.Shrink."""
    first = library_version.strip().splitlines()[0] if library_version.strip() else "an unknown MPI"
    if not has_api:
        return "in-job recovery needs mpi4py 4 or newer (Comm.Revoke/Shrink/Agree): this one lacks them"
    if not library_version.startswith("Open MPI"):
        return (f"in-job recovery needs an MPI with ULFM fault tolerance (Open MPI 5 with --with-ft ulfm); "
                f"this job runs {first.split(',')[0]}: a failure ends the job and `launch` relaunches it")
    if env.get("OMPI_MCA_mpi_ft_enable", "").lower() not in ("1", "true", "yes", "t", "y"):
        return ("in-job recovery needs mpirun --with-ft ulfm (Open MPI's fault tolerance is off in this job): "
                "a failure ends the job and `launch` relaunches it")
    return None


def in_job_recovery_refusal(library_version: str, env: Mapping[str, str], has_api: bool, torch_version: str,
                            torch_can_regroup: bool) -> str | None:
    """`check`'s answer: None when this job can recover in the job (a failed rank's survivors carry on), else one
    line why not: the MPI library's ULFM support, whether the job was started with it, mpi4py's
    Comm.Shrink/Revoke/Agree (ulfm_refusal), and whether this torch lets a new default process group replace the
    old one."""
    older = re.match(r"Open MPI v(\d+)\.", library_version)
    if older and int(older.group(1)) < 5:
        return (f"in-job recovery needs Open MPI 5 or newer (ULFM fault tolerance); this job runs Open MPI "
                f"v{older.group(1)}: a failure ends the job and `launch` relaunches it")
    refusal = ulfm_refusal(library_version, env, has_api)
    if refusal is not None:
        return refusal
    if not torch_can_regroup:
        return (f"in-job recovery cannot rebuild torch {torch_version}'s process group over the survivors (it lacks "
                "distributed_c10d._update_default_pg): a failure ends the job and `launch` relaunches it")
    return None


def failure_refusal(where: str, stepped: bool, device_type: str, compression: str) -> str | None:
    """The trainer's: None when a failure that struck in `where` (train, eval, save, ...) can be recovered in the
    job, else one line why not. `stepped`: whether this job completed a training step. A save is recovered too:
    rank 0 writes it atomically and moves `latest` last, so the survivors give it up and save again."""
    if not stepped:
        return "a rank failed before the first training step: in-job recovery starts with training"
    if device_type not in ("cpu", "cuda"):
        return f"in-job recovery on {device_type} is not built"
    if compression == "powersgd":
        return POWERSGD
    return None


def job_refusal(device_type: str, backend: str, compression: str, can_abort_nccl: bool, torch_version: str,
                env: Mapping[str, str]) -> str | None:
    """The trainer's: None when this job's settings let it recover in the job wherever a failure strikes after its
    first step, else one line why not. Fixed for the whole job: the trainer asks once at start, and `check` asks
    the same. `can_abort_nccl`: whether torch can abort a NCCL communicator (distributed_c10d._abort_process_group)."""
    reason = failure_refusal("train", True, device_type, compression)
    if reason is not None or device_type != "cuda" or backend != "nccl":
        return reason  # gloo over CUDA tensors takes the CPU path: the old gloo group is left, not aborted
    return nccl_refusal(can_abort_nccl, torch_version, env)


def nccl_refusal(can_abort_nccl: bool, torch_version: str, env: Mapping[str, str]) -> str | None:
    """None when a NCCL process group can be aborted and rebuilt over the survivors, else one line why not."""
    if not can_abort_nccl:
        return (f"in-job recovery on GPUs needs torch.distributed's _abort_process_group (torch 2.5 or newer) to "
                f"abort the NCCL communicator that waits on the dead rank; this is torch {torch_version}")
    handling = env.get(NCCL_ERRORS_ENV, "3")  # unset: torch's default, 3, ends the process
    if handling not in NCCL_ERRORS_QUIET:
        return (f"{NCCL_ERRORS_ENV}={handling} makes torch end a rank on a NCCL error, survivors included: set it "
                "to 0 (mpiddp does before the process group starts when the user has not set it)")
    return None


def script_refusal(own_job: bool, ulfm: str | None, device_type: str, backend: str, can_abort_nccl: bool = False,
                   torch_version: str = "", env: Mapping[str, str] | None = None) -> str | None:
    """A script's (mpiddp's wrappers, `mpiddp.run_recoverable`): None when its job can recover in the job, else
    one line why not. gloo on CPU, or NCCL on GPUs (`can_abort_nccl`, `env`: as nccl_refusal)."""
    if not own_job:
        return ("in-job recovery for scripts needs mpiddp's job: `python -m mpiddp run` or `mpiddp.init()` under "
                "`mpirun --with-ft ulfm`: a failure ends the job and `launch` relaunches it")
    if ulfm is not None:
        return ulfm
    if (device_type, backend) == ("cuda", "nccl"):
        return nccl_refusal(can_abort_nccl, torch_version, env or {})
    if (device_type, backend) != ("cpu", "gloo"):
        return (f"in-job recovery rebuilds gloo on CPU or NCCL on GPUs, and this job runs {backend} on "
                f"{device_type}: a failure ends the job")
    return None


def nccl_errors_env(env: Mapping[str, str]) -> dict[str, str]:
    """What to set before the NCCL process group starts so that torch's NCCL watchdog does not end a survivor
    when a peer dies (MPI notices the failure, and the survivors abort the communicator themselves); nothing
    where the user chose (job_refusal then says whether their choice allows recovery)."""
    return {} if NCCL_ERRORS_ENV in env else {NCCL_ERRORS_ENV: "0"}


def old_group_plan(backend: str, can_abort: bool) -> str:
    """How the survivors let go of the old default group: "abort" its NCCL communicators (torch's
    _abort_process_group; a NCCL group cannot be left waiting: its kernel holds the GPU stream), else "forget"
    it (gloo: kept alive, never destroyed, see Membership._retire_default_group). A NCCL job on a torch that
    cannot abort is refused up front (job_refusal), so "forget" on NCCL is never reached in a recovery."""
    return "abort" if backend == "nccl" and can_abort else "forget"


# ---- who goes on, and from whose state --------------------------------------------------------------------------

def recovery_cause(failed: Iterable[int], hung: set[int], silent: set[int]) -> str:
    """A recovery's cause on record: "hang" where the hang watchdog ended a failed rank, "silent_host" where it cut
    one off with its host, else "process_failed"."""
    lost = set(failed)
    return "hang" if hung & lost else "silent_host" if silent & lost else "process_failed"


def survivors(old_size: int, failed: tuple[int, ...] | list[int]) -> tuple[int, ...]:
    """Old ranks that are left, in the order of their new ranks (Shrink keeps the old order)."""
    gone = set(failed)
    return tuple(rank for rank in range(old_size) if rank not in gone)


def new_rank_of(old_size: int, failed: tuple[int, ...] | list[int]) -> dict[int, int]:
    """Old rank -> new rank of each survivor."""
    return {old: new for new, old in enumerate(survivors(old_size, failed))}


def recovery_refusal(old_size: int, failed: tuple[int, ...] | list[int], min_size: int) -> str | None:
    """None when the job can go on without `failed`, else one line why not."""
    if not failed:
        return "no rank failed"
    if any(rank < 0 or rank >= old_size for rank in failed):
        return f"failed ranks {sorted(failed)} are not ranks of a {old_size}-rank job"
    left = old_size - len(set(failed))
    if left < max(1, min_size):
        return (f"{left} of {old_size} ranks are left, fewer than the {max(1, min_size)} the job needs "
                f"(--min-np): the job ends and `launch` relaunches it")
    return None


# where a survivor stands, compared by its first item: (step, epoch, batches done), or a script's (commits, digest)
Position = tuple[int, ...] | tuple[int, Hashable]


def furthest(positions: Sequence[Position]) -> int | None:
    """The rank whose state every survivor takes: the greatest position (its first item: commits, or steps),
    the lowest rank among equals; None when all hold the same (nothing to send)."""
    if len(set(positions)) <= 1:
        return None
    return max(range(len(positions)), key=lambda rank: (positions[rank][0], -rank))


def store_address(env: Mapping[str, str], interfaces: list[tuple[str, str]]) -> str:
    """The address this host's new rendezvous store listens on: the interface gloo uses (GLOO_SOCKET_IFNAME,
    set by mpiddp's rendezvous), else the first non-loopback one, else loopback. `interfaces`: (name, address)."""
    chosen = env.get("GLOO_SOCKET_IFNAME")
    for name, address in interfaces:
        if chosen and name == chosen:
            return address
    outside = [address for _, address in interfaces if not address.startswith("127.")]
    return outside[0] if outside else "127.0.0.1"


# ---- how the global batch splits ----------------------------------------------------------------------------------

PHASES = ("detect", "agree_and_shrink", "process_group", "ddp", "first_step")  # a trainer recovery's, in order


@dataclass(frozen=True)
class Resplit:
    """The survivors' per-rank batch (the most a rank takes in one micro-batch), accumulation and data position
    (micro-batches done in the epoch). `global_batch` non-zero: an uneven split, where the ranks' shares of each
    step differ by one sample (globalbatch.share) and each rank weighs its gradient by its share."""

    batch_size: int
    grad_accum: int
    batches_done: int
    global_batch: int = 0

    @property
    def uneven(self) -> bool:
        return self.global_batch > 0

    def describe(self, world_size: int) -> str:
        """How each rank takes the global batch, for the line that says the job went on."""
        if not self.uneven:
            return f"{self.batch_size} per rank x {self.grad_accum} accumulation"
        fewer = self.global_batch // world_size
        return (f"{fewer} or {fewer + 1} per rank, each rank's gradient weighted by its share, in "
                f"{self.grad_accum} micro-batch{'es' if self.grad_accum > 1 else ''}")


def resplit(batch_size: int, grad_accum: int, world_before: int, world_after: int,
            batches_done: int, max_per_rank: int | None = None, epoch_samples: int | None = None, *,
            global_batch: int | None = None, position: int | None = None) -> Resplit | str:
    """The same global batch and the same global sample position on `world_after` ranks, or one line why not.
    `max_per_rank`: the most samples a rank takes at once (default `batch_size`; the per-rank batch the job started
    with). `epoch_samples`: the positions an epoch trains (None: synthetic batches). `global_batch`, `position`
    (samples of the epoch trained): given where the split running now is uneven; else batch_size x world_before x
    grad_accum and batches_done x batch_size x world_before.

    Ranks take the epoch's order interleaved (rank r's i-th sample is position r + i x W), so after
    `batches_done` micro-batches of `batch_size` on each of `world_before` ranks the job has trained exactly the
    first batches_done x batch_size x world_before positions; the survivors continue at that position. Where the
    global batch splits evenly at that position the split is even; otherwise each optimizer step's positions are
    shared out interleaved, some ranks taking one sample more (Resplit.uneven), which any number of ranks can do
    at a step's start. A position at or past the epoch's end is the epoch's end: no sample is left."""
    global_batch = global_batch or batch_size * world_before * grad_accum
    position = batches_done * batch_size * world_before if position is None else position
    most = max_per_rank or batch_size
    try:
        per_rank, accumulation = split(global_batch, world_after, most)
        even: tuple[int, int] | None = (per_rank, accumulation)
    except GlobalBatchError:
        even = None
    if even is not None and (position % (even[0] * world_after) == 0
                             or (epoch_samples is not None and position >= epoch_samples)):
        return Resplit(even[0], even[1], -(-position // (even[0] * world_after)))
    try:
        cap, accumulation = uneven_split(global_batch, world_after, most)
    except GlobalBatchError as exc:
        return f"{exc}: the job cannot keep its global batch on the survivors"
    if epoch_samples is not None and position >= epoch_samples:  # skips every rank's whole shard: nothing left
        return Resplit(cap, accumulation, -(-position // global_batch) * accumulation, global_batch)
    if position % global_batch:  # steps are whole global batches; only an epoch's last may be shorter
        return (f"the data position {position} is not at the start of an optimizer step of {global_batch} samples: "
                "the survivors cannot continue at the same sample")
    return Resplit(cap, accumulation, position // global_batch * accumulation, global_batch)


class BatchSettings(Protocol):
    """What a split reads of a training config's batch (the trainer's TrainingSettings)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def grad_accum(self) -> int: ...


class BatchConfig(Protocol):
    """A training config, as a split reads it (the trainer's Config: its `training` section)."""

    @property
    def training(self) -> BatchSettings: ...


def split_for_growth(cfg: BatchConfig, first: BatchConfig, world: int, grown: int, batches_done: int, *,
                     global_batch: int | None = None, position: int | None = None,
                     epoch_samples: int | None = None) -> tuple[Resplit | None, str | None]:
    """(the split on `grown` ranks at this position, None) when the job can grow now; (None, None) when not at
    this position but at an epoch's start; (None, why) when never (the global batch cannot be kept). `cfg`: the
    config the job trains with now; `first`: the one it started with (its per-rank batch is the most a rank takes);
    `global_batch`, `position`, `epoch_samples`: as resplit's."""
    batch, accumulation, most = cfg.training.batch_size, cfg.training.grad_accum, first.training.batch_size
    at_start = resplit(batch, accumulation, world, grown, 0, most, global_batch=global_batch, position=0)
    if isinstance(at_start, str):
        return None, at_start
    here = resplit(batch, accumulation, world, grown, batches_done, most, epoch_samples,
                   global_batch=global_batch, position=position)
    return (None, None) if isinstance(here, str) else (here, None)


# ---- growing back ----------------------------------------------------------------------------------------------

GROW_PHASES = ("spawn", "merge", "process_group", "state_transfer", "ddp", "first_step")


def parse_spare_hosts(text: str) -> list[tuple[str, int]]:
    """`nodea:2,nodeb` -> [("nodea", 2), ("nodeb", 1)]; ValueError (one line) for a malformed entry."""
    hosts = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        name, _, slots = entry.partition(":")
        if not name or (slots and (not slots.isdigit() or int(slots) < 1)):
            raise ValueError(f"{SPARE_HOSTS_ENV}: '{entry}' is not HOST or HOST:SLOTS (SLOTS a positive number)")
        hosts.append((name, int(slots) if slots else 1))
    return hosts


def format_spare_hosts(hosts: Sequence[tuple[str, int]]) -> str:
    """The inverse of parse_spare_hosts."""
    return ",".join(name if slots == 1 else f"{name}:{slots}" for name, slots in hosts)


def spare_hosts_in(env: Mapping[str, str]) -> list[tuple[str, int]] | str:
    """The spare hosts this job was given, or one line why they cannot be read."""
    try:
        return parse_spare_hosts(env.get(SPARE_HOSTS_ENV, ""))
    except ValueError as exc:
        return str(exc)


@dataclass(frozen=True)
class GrowPlan:
    """Where the new ranks start: one host name per new rank, in rank order."""

    hosts: tuple[str, ...]

    @property
    def count(self) -> int:
        return len(self.hosts)


def plan_growth(world: int, full: int, spares: Sequence[tuple[str, int]], used: Mapping[str, int]) -> GrowPlan | str:
    """Which spare slots the job grows onto, to get from `world` ranks back to `full`, or one line why it cannot.
    `used`: slots of each spare host that an earlier grow took (a grown rank that died gives its slot back only
    when the host is named again)."""
    missing = full - world
    if missing <= 0:
        return "the job runs at full size"
    hosts: list[str] = []
    for name, slots in spares:
        free = slots - used.get(name, 0)
        hosts.extend([name] * max(0, min(free, missing - len(hosts))))
    if not hosts:
        named = format_spare_hosts(spares) if spares else "none"
        return (f"no spare slot to grow onto ({SPARE_HOSTS_ENV}: {named}; give `launch` hosts beyond -np, where it "
                f"runs hot spares, or with plain mpirun run -np N+S with {SPARE_RANKS_ENV}=S, or name spare hosts "
                f"in -H and in {SPARE_HOSTS_ENV})")
    return GrowPlan(tuple(hosts))


def regrow_refusal(library_version: str, lost_after_grow: bool) -> str | None:
    """None when the job may grow again, else one line why not. Open MPI 5.0's launcher (PRRTE 3.0) cannot spawn
    into a job that lost a rank after it grew: the new rank's Intercomm_merge fails (opal_modex_recv -46, its
    address never reaches the survivors: PRRTE's connect_release drops the spawn's process data, the "PMIX ERROR
    ... pmix_server_dyn.c at line 1113") and prterun then crashes or hangs (3 of 3 e2e runs, Open MPI 5.0.11):
    the job would be lost where it can go on at reduced size."""
    if lost_after_grow and re.match(r"Open MPI v5\.0\.", library_version):
        return (f"{library_version.split(',')[0]} cannot spawn again into a job that lost a rank after it grew "
                "(its launcher fails in MPI_Comm_spawn: docs/recovery.md)")
    return None


def grow_due(stepped_since: bool, world: int, full: int, off: bool) -> bool:
    """Whether the job grows at this step boundary: while a recovery has left it below full size, once it has
    trained a step since the last change of size (that change's first step is recorded), and while growing is
    not off."""
    return stepped_since and world < full and not off


def grow_record(step: int, ranks: list[int], hosts: list[str], before: int, after: int,
                phases: Mapping[str, float | None]) -> dict[str, Any]:
    """A grow as summary.json's `recoveries` list holds it, next to the recoveries (cause "grew"); its
    `survivors_stall` (the slowest survivor's stand-still: from the step boundary where the grow stopped it to the
    end of its next step, less the `ordinary_step` it would have taken anyway) is filled in once known."""
    return {"cause": "grew", "ranks_lost": [], "hosts_lost": [], "ranks_added": ranks, "hosts_added": hosts,
            "step": step, "steps_lost": 0, "world_before": before, "world_after": after,
            "phases": {name: phases.get(name) for name in GROW_PHASES}, "survivors_stall": None,
            "ordinary_step": None}



ORDINARY_STEPS = 20  # recent steps at a size that a grow's stand-still is weighed against (their median)


class StepTimes:
    """A rank's recent ordinary training steps, by world size: each from its start, past its boundary's work (a
    grow's take-in), to its end; never the first step after a recovery or grow. An evaluation, a save, the
    per-step agreements and the metric line fall between two steps, outside both."""

    def __init__(self, keep: int = ORDINARY_STEPS) -> None:
        self._keep = keep
        self._seconds: dict[int, list[float]] = {}
        self._started: float | None = None

    def started(self, now: float) -> None:
        self._started = now

    def ended(self, size: int, now: float, ordinary: bool) -> None:
        if ordinary and self._started is not None:
            kept = self._seconds.setdefault(size, [])
            kept.append(now - self._started)
            del kept[:-self._keep]
        self._started = None

    def at(self, size: int) -> list[float]:
        return list(self._seconds.get(size, ()))


def stand_still(seconds: float, ordinary: Iterable[float]) -> dict[str, float | None]:
    """A survivor's stand-still in a grow: `seconds` run from the step boundary where the grow stopped it to the end
    of its next step, so they hold one step of training; less an ordinary step at this size (the median of its
    recent ones, `ordinary_step`) they are the time the grow cost. With no ordinary step at this size known to this
    rank (a failure in the job's first step; a rank that joined in an earlier grow and has not stepped since) the
    whole span, the upper bound, and `ordinary_step` None."""
    known = list(ordinary)
    step = statistics.median(known) if known else None
    return {"survivors_stall": max(0.0, seconds - step) if step is not None else seconds, "ordinary_step": step}
