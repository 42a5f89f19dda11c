"""The training loader in-process: augmentation seeded per sample position, helper processes that ignore stop
signals, the global generators left alone."""

import multiprocessing.forkserver
import os
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from mpiddp.trainer.data import HelperSafeLoader, PositionSeeded, SkippingSampler, _worker_init, prepare_forkserver

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


class RandomlyAugmented(Dataset):
    """Sample i is i plus a draw from the global generators, as torchvision's random transforms make."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        return torch.tensor([float(index)]), torch.rand(1)


def loader(num_workers, skip=0, epoch=2, method=None):
    sampler = SkippingSampler(DistributedSampler(range(24), num_replicas=2, rank=1, shuffle=True, seed=5))
    sampler.set_epoch(epoch)
    sampler.skip = skip
    options = {"multiprocessing_context": method, "worker_init_fn": _worker_init} if num_workers else {}
    return HelperSafeLoader(PositionSeeded(RandomlyAugmented(), reseed=True), batch_size=3, sampler=sampler,
                            num_workers=num_workers, generator=torch.Generator().manual_seed(0), **options)


def samples(batches):
    return [(int(i), float(r)) for indices, draws in batches for i, r in zip(indices.flatten(), draws.flatten())]


def test_augmentation_depends_on_position_only_not_on_workers_or_a_skip():
    whole = samples(loader(0))
    assert samples(loader(2, method="fork")) == whole  # other workers, same draws
    assert samples(loader(2, skip=6, method="fork")) == whole[6:]  # resumed part-way: a batch lands on another worker
    assert samples(loader(0, epoch=3)) != whole  # a new epoch draws anew


def test_the_rank_s_generators_do_not_move():
    torch.manual_seed(11)
    expected = torch.rand(3)
    torch.manual_seed(11)
    samples(loader(0))  # augmentation in this process, and iter() drawing the workers' seed
    assert torch.equal(torch.rand(3), expected)


def ignored_signals(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            mask = int(line.split()[1], 16)
            return {signum for signum in STOP_SIGNALS if mask & (1 << (signum - 1))}
    raise AssertionError(f"no SigIgn for {pid}")


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_helper_processes_ignore_stop_signals(method):
    if method == "forkserver":
        prepare_forkserver()
    batches = loader(1, method=method)
    iterator = iter(batches)
    next(iterator)
    helpers = [worker.pid for worker in iterator._workers]
    if method == "forkserver":
        helpers.append(multiprocessing.forkserver._forkserver._forkserver_pid)
    for pid in helpers:
        assert ignored_signals(pid) == set(STOP_SIGNALS), pid
    os.kill(helpers[0], signal.SIGUSR1)  # as mpirun's forwarding to the process group would
    assert len(list(iterator)) == 3  # the worker lives on
    assert signal.pthread_sigmask(signal.SIG_BLOCK, []) == set()  # the rank's block ended with the start


@pytest.mark.parametrize("method", ["forkserver", "spawn", "fork"])
def test_helper_processes_die_with_a_killed_rank(method, tmp_path):
    """A rank killed outright (SIGKILL: the OOM killer) takes its helpers with it: the forkserver and the workers,
    which ignore every stop signal, would otherwise live on, orphaned, holding the launcher's output open."""
    import subprocess
    import sys
    import time

    from conftest import REPO

    program = (
        "import multiprocessing.forkserver, os, signal, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "from test_loader_helpers import loader\n"
        "from mpiddp.job.helper_signals import mark_helper_parent\n"
        "from mpiddp.trainer.data import prepare_forkserver\n"
        "if __name__ == '__main__':\n"
        f"    mark_helper_parent()\n"
        f"    if {method!r} == 'forkserver':\n"
        "        prepare_forkserver()\n"
        f"    iterator = iter(loader(2, method={method!r}))\n"
        "    next(iterator)\n"
        "    pids = [w.pid for w in iterator._workers]\n"
        f"    if {method!r} == 'forkserver':\n"
        "        pids.append(multiprocessing.forkserver._forkserver._forkserver_pid)\n"
        "    print(*pids, flush=True)\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    (tmp_path / "rank.py").write_text(program)
    done = subprocess.run([sys.executable, str(tmp_path / "rank.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    helpers = [int(pid) for pid in done.stdout.split()]
    assert len(helpers) == (3 if method == "forkserver" else 2), done.stdout
    deadline = time.monotonic() + 30
    while (alive := [pid for pid in helpers if _alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.1)  # polling a condition with a deadline, not synchronising
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive, f"helpers outlived their rank: {alive}"


def _alive(pid):
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_a_rank_s_forkserver_imports_what_workers_need_once_and_never_mpi(tmp_path):
    """On-disk datasets: the forkserver imports torch, torchvision and the data module before it forks a worker,
    so each worker starts with them instead of importing them again (about 2 s of CPU per worker, on the cores
    the ranks compute on); it never loads MPI, which a helper must not start."""
    import subprocess
    import sys

    from conftest import REPO

    program = (
        "import multiprocessing.forkserver, os, sys\n"
        f"sys.path[:0] = [{str(REPO)!r}, {str(REPO / 'tests')!r}, {str(Path(__file__).resolve().parent)!r}]\n"
        "from pathlib import Path\n"
        "from datagen import write_cifar10\n"
        "from mpiddp.job.collective import solo_dist\n"
        "from mpiddp.trainer.config import Config\n"
        "from mpiddp.trainer.data import build_loaders, load_datasets\n"
        "if __name__ == '__main__':\n"
        f"    data = write_cifar10(Path({str(tmp_path / 'data')!r}))\n"
        "    cfg = Config.of(dataset='cifar10', data_dir=str(data), num_workers=1, batch_size=4)\n"
        "    loaders = build_loaders(cfg, load_datasets(cfg, lambda channels: channels), solo_dist())\n"
        "    next(iter(loaders.train))\n"
        "    pid = multiprocessing.forkserver._forkserver._forkserver_pid\n"
        "    print(open(f'/proc/{pid}/maps').read(), flush=True)\n"
        "    os._exit(0)  # as a finished rank does; its helpers die with it\n"
    )
    (tmp_path / "rank.py").write_text(program)
    done = subprocess.run([sys.executable, str(tmp_path / "rank.py")], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    libraries = {Path(line.split()[-1]).name for line in done.stdout.splitlines() if line.count("/")}
    assert any(name.startswith("libtorch_cpu") for name in libraries), sorted(libraries)
    assert any("torchvision" in line and "_C" in line for line in done.stdout.splitlines())
    assert not any(name.startswith("libmpi") for name in libraries), sorted(libraries)
