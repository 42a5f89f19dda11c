"""Errors that are the user's to fix (reported as one line, never as a traceback), and every exit status of mpiddp."""

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_USER_ERROR = 2
EXIT_STOPPED = 3  # a stop signal: every rank saved a snapshot at the same step; --resume continues
EXIT_HANG = 4  # the hang watchdog fired
EXIT_INTERRUPTED = 130


class UserError(ValueError):
    """A problem with flags, data, files or the environment that the message tells the user how to fix."""


class HostFault(UserError):
    """This host cannot run its ranks (no usable GPU, fewer GPUs than ranks) where other hosts can: the host is at
    fault, not the flags. When every host says so, it is a plain user error."""


class AgreedError(UserError):
    """Raised on every rank at the same point, so the job can end without an abort and rank 0 speaks for all.
    `faulty_ranks`: the ranks whose host is at fault (a HostFault on some hosts only); empty for user errors."""

    def __init__(self, message: str, exit_code: int = 2, to_stdout: bool = False,
                 faulty_ranks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.to_stdout = to_stdout
        self.faulty_ranks = faulty_ranks


class EndDecided(Exception):
    """A peer decided the end of the job (its failure record is on file: a fatal failure, a hang, a stop) before
    this rank recovered from that peer's exit: the peer left on purpose, so this rank recovers nothing, records
    nothing (the deciding record stands alone) and leaves with `status`."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class LostAfterFinish(RuntimeError):
    """Ranks failed after this rank's script had finished (the survivors waiting for every rank to finish): in-job
    recovery covers the training, not what the lost rank had left to do (rank 0's save, say), so the job ends with
    one line (the message quotes MPI_ERR_PROC_FAILED: `launch` reads this rank as a witness) and is relaunched."""


class PeersLost(RuntimeError):
    """The job ends because peers failed and in-job recovery was refused (mpiddp.elastic's NotRecovered): `hosts`
    name where they ran, `ranks` their ranks in the world the job's placement file describes, empty where that file
    already follows the survivors (a refusal after the shrink). FailFast records them as the failure, so `launch`
    blames their hosts, not the rank that raised: the survivors know who was lost, MPI's launcher may say nothing."""

    def __init__(self, message: str, ranks: tuple[int, ...] = (), hosts: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.ranks = ranks
        self.hosts = hosts


class HelpRequested(Exception):
    """`--help` or `--version`: rank 0 prints the text, every rank exits 0."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.text = text


class ScriptExit(Exception):
    """The user's script (`mpiddp run`) exited with a non-zero status on this rank."""

    def __init__(self, script: str, status: int) -> None:
        super().__init__(f"{script} exited with status {status}")
        self.script = script
        self.status = status


class ScriptError(Exception):
    """The user's script (`mpiddp run`) raised on this rank; `report` is its traceback from the script's frame on."""

    def __init__(self, script: str, report: str, last_line: str) -> None:
        super().__init__(last_line)
        self.script = script
        self.report = report
