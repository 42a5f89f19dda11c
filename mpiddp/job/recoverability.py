"""Whether a job can recover in the job, pure (no MPI, no torch): its device, backend, compression, torch and
NCCL settings (fixed for the whole job: the trainer asks once at start, and `check` asks the same), and whether a
failure can be recovered from where it struck. Each refusal is one line saying why; the caller then takes the
fail-fast path (the job ends and `launch` relaunches it)."""

from __future__ import annotations

from collections.abc import Mapping


def refusal(where: str, stepped: bool, device_type: str, compression: str) -> str | None:
    """None when a failure that struck in `where` (train, eval, save, ...) can be recovered in the job, else one
    line why not. `stepped`: whether this job completed a training step."""
    if not stepped:
        return "a rank failed before the first training step: in-job recovery starts with training"
    if where == "save":
        return "a rank failed during a save: the snapshot may be incomplete"
    if device_type not in ("cpu", "cuda"):
        return f"in-job recovery on {device_type} is not built"
    if compression == "powersgd":
        return POWERSGD
    return None


POWERSGD = "in-job recovery does not carry PowerSGD's per-rank error feedback"
NCCL_ERRORS_ENV = "TORCH_NCCL_ASYNC_ERROR_HANDLING"  # torch's NCCL watchdog: what it does on a NCCL error
NCCL_ERRORS_QUIET = ("0", "2")  # no handling, clean-up only: neither ends the process (1 and 3 do)


def job_refusal(device_type: str, backend: str, compression: str, can_abort_nccl: bool, torch_version: str,
                env: Mapping[str, str]) -> str | None:
    """None when this job's settings let it recover in the job wherever a failure strikes after its first step,
    else one line why not. Fixed for the whole job: the trainer asks once at start, and `check` asks the same.
    `can_abort_nccl`: whether torch can abort a NCCL communicator (distributed_c10d._abort_process_group)."""
    reason = refusal("train", True, device_type, compression)
    if reason is not None or device_type != "cuda" or backend != "nccl":
        return reason  # gloo over CUDA tensors takes the CPU path: the old gloo group is left, not aborted
    if not can_abort_nccl:
        return (f"in-job recovery on GPUs needs torch.distributed's _abort_process_group (torch 2.5 or newer) to "
                f"abort the NCCL communicator that waits on the dead rank; this is torch {torch_version}")
    handling = env.get(NCCL_ERRORS_ENV, "3")  # unset: torch's default, 3, ends the process
    if handling not in NCCL_ERRORS_QUIET:
        return (f"{NCCL_ERRORS_ENV}={handling} makes torch end a rank on a NCCL error, survivors included: set it "
                "to 0 (mpiddp's trainer does when the user has not set it)")
    return None


def nccl_errors_env(env: Mapping[str, str]) -> dict[str, str]:
    """What to set before the NCCL process group starts so that torch's NCCL watchdog does not end a survivor
    when a peer dies (MPI notices the failure, and the survivors abort the communicator themselves); nothing
    where the user chose (job_refusal then says whether their choice allows recovery)."""
    return {} if NCCL_ERRORS_ENV in env else {NCCL_ERRORS_ENV: "0"}
