"""Starting MPI: the thread level, and Open MPI's libfabric BTL left out when nobody chose the BTLs; and ending
a finished job's rank without the interpreter's teardown.

Open MPI's libfabric BTL (btl/ofi) sleeps one second whenever it is closed, which happens inside MPI_Init on
every machine where it is built but not used. mpiddp's own MPI traffic (start-up, agreement, metrics,
shutdown, and gradients with --grad-transport mpi on one host or over TCP) goes through shared memory and TCP,
and fast networks are reached through Open MPI's matching transports (UCX, the libfabric MTL), which this
leaves alone; so unless the user or the site chose the BTLs, mpiddp excludes btl/ofi before MPI starts and
every rank starts a second sooner.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from mpiddp.errors import EXIT_USER_ERROR, UserError
from mpiddp.job.orphan import watch_launcher_daemon
from mpiddp.job.spares import spare_count, split_off_spares
from mpiddp.job.topology import launcher_info, mpi_library_version

SKIP_OFI_BTL = "^ofi"


def btl_chosen_in(text: str) -> bool:
    """Whether an Open MPI parameter file sets `btl` (comments and other parameters do not count)."""
    for line in text.splitlines():
        key, sep, _ = line.split("#", 1)[0].partition("=")
        if sep and key.strip() == "btl":
            return True
    return False


def parameter_files(env: Mapping[str, str], library_dir: Path | None) -> list[Path]:
    """The Open MPI parameter files that could set `btl` for this process: the user's, the installation's
    (next to the library, or under OPAL_PREFIX / OPAL_SYSCONFDIR) and the distributions' usual place."""
    listed = env.get("OMPI_MCA_mca_base_param_files")
    if listed:
        return [Path(os.path.expanduser(name)) for name in listed.split(os.pathsep) if name]
    config_dirs = [Path(env["OPAL_SYSCONFDIR"])] if env.get("OPAL_SYSCONFDIR") else []
    if env.get("OPAL_PREFIX"):
        config_dirs.append(Path(env["OPAL_PREFIX"]) / "etc")
    if library_dir is not None:
        config_dirs += [library_dir.parent / "etc", library_dir.parent.parent / "etc"]
    config_dirs += [Path("/etc/openmpi"), Path("/etc")]
    home = Path(env["HOME"]) if env.get("HOME") else Path.home()
    return [home / ".openmpi" / "mca-params.conf"] + [d / "openmpi-mca-params.conf" for d in config_dirs]


def btl_already_chosen(env: Mapping[str, str], files: list[Path]) -> bool:
    """Whether the environment (mpirun's --mca arrives there too) or a parameter file already chooses the BTLs."""
    if "OMPI_MCA_btl" in env:
        return True
    for path in files:
        try:
            if btl_chosen_in(path.read_text(errors="replace")):
                return True
        except OSError:  # absent or unreadable: it chooses nothing
            continue
    return False


def _loaded_library_dir(prefix: str) -> Path | None:
    """Where the already-loaded shared library named prefix* lives (Linux); None elsewhere or when not found."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if Path(path).name.startswith(prefix):
                    return Path(path).parent
    except OSError:
        pass
    return None


_initialised_with = ""  # what init_mpi set for MPI, once it ran
_job_comm: Any = None  # COMM_WORLD, or the workers' part of it where the job has hot spares (mpiddp.job.spares)
_world_failed = False  # this process's MPI world holds failed processes (mark_world_failed)


def init_mpi() -> tuple[Any, str]:
    """Initialise MPI and return (COMM_WORLD, what mpiddp set for MPI, '' when nothing). Importing mpiddp alone
    never initialises MPI."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:  # else the user's code imported it first and chose for itself
        mpi4py.rc.initialize = False  # so Open MPI's parameters can be settled first
        mpi4py.rc.finalize = True
    from mpi4py import MPI

    global _initialised_with, _job_comm
    watch_launcher_daemon()  # a rank whose launcher's daemon ends without ending it ends too
    count = _spare_count_or_exit()
    if MPI.Is_initialized():
        if _job_comm is None:  # the user's code started MPI: the spares are split off all the same
            _job_comm = _split_or_exit(MPI.COMM_WORLD, count)
        return _job_comm, _initialised_with
    adjusted = ""
    if mpi_library_version().startswith("Open MPI"):  # callable before MPI_Init
        if not btl_already_chosen(os.environ, parameter_files(os.environ, _loaded_library_dir("libmpi.so"))):
            os.environ["OMPI_MCA_btl"] = SKIP_OFI_BTL
            adjusted = f"btl={SKIP_OFI_BTL}"
    # Only the main thread calls MPI; MPI_THREAD_MULTIPLE disables fast transports in some MPIs.
    MPI.Init_thread(MPI.THREAD_FUNNELED)
    _initialised_with = adjusted  # a second call (after growing back's check for an MPI parent) says the same
    _job_comm = _split_or_exit(MPI.COMM_WORLD, count)
    return _job_comm, adjusted


def mark_world_failed() -> None:
    """This process's MPI world holds failed processes (it went on without them: ULFM). MPI_Finalize's fence would
    wait for them, so whatever ends this process must end it without (world_failed)."""
    global _world_failed
    _world_failed = True


def world_failed() -> bool:
    return _world_failed


def mpi() -> ModuleType:
    """mpi4py's MPI, for the modules that call MPI without importing mpi4py (mpiddp.elastic.spawning): the job
    layer's MPI home hands it out. Call it once MPI is started (init_mpi): importing it first starts MPI with
    mpi4py's settings instead of mpiddp's."""
    from mpi4py import MPI

    return MPI


def _spare_count_or_exit() -> int:
    """MPIDDP_SPARE_RANKS; a value that is no count ends every rank with one line (status 2) before MPI starts."""
    try:
        return spare_count()
    except UserError as exc:
        print(f"mpiddp: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def _split_or_exit(world: Any, count: int) -> Any:
    """The job's communicator (mpiddp.job.spares); every rank ends with one line (status 2) where the spares
    leave no rank to train."""
    launcher = launcher_info(os.environ)
    if not count or (world.Get_size() == 1 and launcher is not None and launcher.size > 1):
        return world  # each process alone in its world: topology.check_launcher names that mismatch, not the spares
    try:
        return split_off_spares(world, count, mpi())
    except UserError as exc:
        print(f"mpiddp: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None


def exit_without_teardown(status: int) -> NoReturn:
    """End this process with `status` as Python's own exit would (other threads joined, exit handlers run, output
    flushed, MPI finalised), less the interpreter's teardown. For a rank whose job is over and that runs only
    mpiddp's code: tearing down torch's modules and objects, then its libraries' static destructors, costs a
    rank more than half a second of CPU (measured: 0.6-0.9 s of a one-step job), on every start and relaunch."""
    current = threading.current_thread()
    for thread in threading.enumerate():  # what Python waits for before its exit handlers
        if thread is not current and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # logging's flush, wandb's and torch's handlers, coverage's
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: Python's own exit ignores it too
            pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and sys.modules["mpi4py"].rc.finalize is not False and mpi.Is_initialized() \
            and not mpi.Is_finalized():
        mpi.Finalize()  # what mpi4py does at exit; a rank that ends without it counts as failed for the launcher
    os._exit(status)
