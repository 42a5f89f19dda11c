"""The package face: importing mpiddp (and launch, which runs outside MPI) loads nothing heavy; the public names
still resolve."""

import subprocess
import sys

import pytest

from conftest import REPO

HEAVY = ("numpy", "torch", "mpi4py")


@pytest.mark.parametrize("modules", ["mpiddp", "mpiddp.launch.supervisor, mpiddp.launch.cli"])
def test_importing_the_package_or_launch_loads_no_numpy_mpi4py_or_torch(modules):
    code = f"import sys, {modules}; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_public_names_resolve_on_first_use():
    import mpiddp
    from mpiddp.job.api import init
    from mpiddp.job.collective import Dist

    assert mpiddp.init is init and mpiddp.Dist is Dist
    assert set(mpiddp.__all__) <= set(dir(mpiddp))
    with pytest.raises(AttributeError, match="no_such_name"):
        mpiddp.no_such_name  # noqa: B018


def test_comm_hook_finds_the_job_that_named_itself_current():
    from mpiddp.job import collective
    from mpiddp.job.transport import comm_hook

    with pytest.raises(RuntimeError, match="needs mpiddp's job"):
        comm_hook()
    collective.set_current(collective.solo_dist())
    try:
        state, _hook = comm_hook()
        assert state is not None
    finally:
        collective.set_current(None)
