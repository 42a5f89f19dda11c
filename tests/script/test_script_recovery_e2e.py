"""In-job recovery of a script written against `mpiddp.init()` and `mpiddp.run_recoverable`, on three fake hosts
(nodea, nodeb, nodec; one rank each): a rank is SIGKILLed mid-training while its peers wait for it in DDP's gloo
all-reduce, and the survivors (the same processes) finish the training on 2 ranks with the same model; without
`--with-ft ulfm` the script says why in one line and the job fails fast as before. The script is
tests/programs/recoverable_script.py (the example of docs/run-script.md)."""

import json
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import REPO, STARTUP_RACE_RETRIES, find_mpirun, launcher_never_started
from fakehosts import FakeHosts, running_fake_hosts
from test_leftovers import assert_nothing_left, marked_env
from test_recovery_e2e import _ulfm_missing

pytestmark = pytest.mark.mpi
HOSTS = "nodea:1,nodeb:1,nodec:1"
PROGRAM = REPO / "tests" / "programs" / "recoverable_script.py"
STEPS, AT_STEP = 30, 5


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    reason = _ulfm_missing()
    if reason:
        pytest.skip(reason)
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path_factory.mktemp("script-hosts"),
                                      tag="s")) as cluster:
        yield cluster


class Script:
    """`mpirun [--with-ft ulfm] -np 3` of the example script on the three hosts, started on nodea."""

    def __init__(self, hosts: FakeHosts, tmp_path: Path, victim: int, ft: bool = True, where: str = "step",
                 command: Callable[[Path], list[str]] | None = None, launch_run_dir: Path | None = None,
                 **env_extra: str) -> None:
        """`command(out)`: another command line (tests/script/test_script_grow_e2e.py); `launch_run_dir`: where
        that command's launch keeps its records (a launch run again after the start-up race starts afresh)."""
        self.out, self.log = tmp_path / "out", tmp_path / "job.log"
        self.out.mkdir(parents=True)
        env, self.mark = marked_env(PYTHONPATH=str(REPO), **env_extra)
        env.pop("PRTE_MCA_rmaps_default_mapping_policy")  # slots come from -H
        command_line = command(self.out) if command is not None else [
            find_mpirun(), *hosts.openmpi_args(), *(["--with-ft", "ulfm"] if ft else []), "-np", "3", "-H", HOSTS,
            sys.executable, str(PROGRAM), str(self.out), str(STEPS), str(victim), str(AT_STEP), where]
        self.command, self.env = hosts.command_on("nodea", command_line), env
        self.relaunches = 0  # Open MPI's start-up race, before any rank ran, is met by launches more
        self.launch_run_dir = launch_run_dir
        self._start()

    def _start(self) -> None:
        with self.log.open("w") as out:
            self.process = subprocess.Popen(self.command, cwd=REPO, env=self.env, stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def kill_victim(self, deadline_s: float = 180) -> dict[int, int]:
        """SIGKILL the victim once it stalls (its peers then wait in the all-reduce); every start rank's pid."""
        victim = self.out / "victim"
        deadline = time.monotonic() + deadline_s
        while not victim.exists() and time.monotonic() < deadline:
            if self.process.poll() is not None and not self._launched_again():
                break
            time.sleep(0.1)  # polling a condition with a deadline, not synchronising
        if not victim.exists():
            self.process.kill()
            assert_nothing_left(self.mark)
            pytest.fail(f"the victim never stalled:\n{self.output()[-5000:]}")
        subprocess.run(["kill", "-KILL", victim.read_text()], check=False)
        return {rank: int((self.out / f"pid.{rank}").read_text()) for rank in range(3)}

    def _launched_again(self) -> bool:
        """Launched once more where the launcher ended in Open MPI's start-up race (nothing of mpiddp ran), at most
        STARTUP_RACE_RETRIES times."""
        if (self.relaunches >= STARTUP_RACE_RETRIES or self.process.returncode == 0
                or not launcher_never_started(self.output())):
            return False
        self.relaunches += 1
        if self.launch_run_dir is not None:
            shutil.rmtree(self.launch_run_dir, ignore_errors=True)
        self._start()
        return True

    def finish(self, timeout: float = 240) -> int:
        try:
            status = self.process.wait(timeout=timeout)
            while status != 0 and self._launched_again():  # a job awaited only at its end meets the race here
                status = self.process.wait(timeout=timeout)
            return status
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=30)
            pytest.fail(f"the job did not end:\n{self.output()[-5000:]}")
        finally:
            assert_nothing_left(self.mark)

    def finals(self) -> dict[int, dict]:
        return {int(path.suffixes[0][1:]): json.loads(path.read_text()) for path in self.out.glob("final.*.json")}


def test_a_script_whose_global_batch_splits_over_no_rank_count_ends_with_the_uninterrupted_runs_model(hosts, tmp_path):
    """A global batch of 25: 9, 8, 8 a rank on 3, then 13 and 12 on the 2 survivors of rank 1, each rank's loss
    weighted by its share (mpiddp.share_global_batch). The survivors end with the model the run without a failure
    ends with (to float32 summation order): an unweighted or uneven split would take another trajectory."""
    runs = {}
    for victim in (-1, 1):
        script = Script(hosts, tmp_path / f"victim{victim}", victim, MPIDDP_TEST_GLOBAL_BATCH="25")
        if victim >= 0:
            script.kill_victim()
        assert script.finish() == 0, script.output()[-5000:]
        runs[victim] = script.finals()
    (straight,) = {tuple(final["parameters"]) for final in runs[-1].values()}  # the same on its 3 ranks
    survivors = runs[1]
    assert sorted(survivors) == [0, 2] and {final["world_size"] for final in survivors.values()} == {2}, survivors
    assert len({final["digest"] for final in survivors.values()}) == 1, survivors
    got = torch.tensor(survivors[0]["parameters"], dtype=torch.float64)
    torch.testing.assert_close(got, torch.tensor(straight, dtype=torch.float64), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("victim, host, where", [(1, "nodeb", "step"), (0, "nodea", "step"), (2, "nodec", "reduce")])
def test_a_script_killed_once_finishes_on_the_survivors_with_the_same_model(hosts, tmp_path, victim, host, where):
    """The rank on `host` (rank 0 holds the rendezvous store) SIGKILLed while its peers wait in the gradient
    all-reduce of step 5 (gloo, under MPI's watch), or in the script's own dist.reduce after it (MPI): the two other
    processes recover in the job, run the training function again from where they were, and end at step 30 with
    bit-identical parameters; the job exits 0."""
    script = Script(hosts, tmp_path, victim, where=where)
    pids = script.kill_victim()
    status = script.finish()
    output = script.output()
    assert status == 0, output[-5000:]
    finals = script.finals()
    survivors = [rank for rank in range(3) if rank != victim]
    assert sorted(finals) == survivors, output[-5000:]
    for new_rank, start_rank in enumerate(survivors):
        final = finals[start_rank]
        assert (final["pid"], final["rank"], final["world_size"]) == (pids[start_rank], new_rank, 2), final
        assert (final["step"], final["losses"]) == (STEPS, STEPS), final  # every step once, its loss once
        (change,) = final["changes"]
        assert (change["world_before"], change["world_size"], change["ranks_lost"], change["hosts_lost"]) == \
            (3, 2, [victim], [host]), change
        assert set(change["phases"]) == {"detect", "agree_and_shrink", "process_group", "state", "first_step"}, change
        assert all(isinstance(value, float) and value >= 0 for value in change["phases"].values()), change
    assert len({final["digest"] for final in finals.values()}) == 1, finals  # the same model on every survivor
    assert f"ranks [{victim}] on {host} failed; 2 ranks go on" in output, output[-5000:]
    assert "running at reduced size 2 of 3 ranks" in output


def test_without_fault_tolerance_the_script_says_why_once_and_the_job_fails_fast(hosts, tmp_path):
    """A plain mpirun (no --with-ft ulfm): rank 0 says in one line that a failure ends the job, and the kill ends
    it as it did before the API existed (a non-zero status for `launch` to relaunch), nothing left running."""
    script = Script(hosts, tmp_path, 1, ft=False)
    script.kill_victim()
    status = script.finish()
    output = script.output()
    assert status != 0, output[-5000:]
    assert output.count("in-job recovery needs mpirun --with-ft ulfm") == 1, output[-5000:]
    assert "goes on as rank" not in output and not script.finals(), output[-5000:]


def test_too_few_survivors_for_the_job_end_it_saying_why(hosts, tmp_path):
    """MPIDDP_MIN_NP=3 (what `launch --min-np 3` sets): after the kill 2 ranks are left, too few; each survivor
    says why in one line and the job ends with a non-zero status (for `launch` to relaunch), nothing left running."""
    script = Script(hosts, tmp_path, 1, MPIDDP_MIN_NP="3")
    script.kill_victim()
    status = script.finish()
    output = script.output()
    assert status != 0, output[-5000:]
    assert "in-job recovery not possible: 2 of 3 ranks are left, fewer than the 3 the job needs" in output, \
        output[-5000:]
    assert "goes on as rank" not in output and not script.finals(), output[-5000:]
