"""Real multi-host jobs on fake hosts (network namespaces): mpirun typed on nodea launches ranks on every host."""

import json
import subprocess
import sys
import time

import pytest

from conftest import REPO, JobResult, job_env, run_command
from fakehosts import FakeHosts, running_fake_hosts

pytestmark = pytest.mark.mpi
FAST = ("--epochs", "1", "--no-progress", "--wandb", "disabled")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory, mpirun):
    with running_fake_hosts(FakeHosts(["nodea", "nodeb", "nodec"], tmp_path_factory.mktemp("fakehosts"))) as cluster:
        yield cluster


def host_env():
    # Slots come from -H / the hostfile here; a default "oversubscribe" mapping policy would pile ranks on nodea.
    env = job_env()
    env.pop("PRTE_MCA_rmaps_default_mapping_policy")
    return env


def launch(hosts, mpirun, tmp_path, placement, *flags, timeout=240) -> JobResult:
    run_dir = tmp_path / "run"
    command = [mpirun, *hosts.openmpi_args(), *placement, sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *FAST, *flags]
    return run_command(hosts.command_on("nodea", command), run_dir, timeout, env=host_env())


def assert_layout(job, expected_hosts):
    assert job.returncode == 0, job.output[-5000:]
    summary = job.summary
    assert summary["hosts"] == expected_hosts
    assert summary["num_hosts"] == len(expected_hosts)
    assert summary["world_size"] == sum(len(r) for r in expected_hosts.values())
    return summary


def test_openmpi_hostfile_and_uneven_hosts(hosts, mpirun, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# Open MPI syntax\nnodea slots=1\nnodeb slots=3\n")
    job = launch(hosts, mpirun, tmp_path, ["--hostfile", str(hostfile), "-np", "4"])
    assert_layout(job, {"nodea": [0], "nodeb": [1, 2, 3]})


def test_three_hosts_round_robin_with_a_master_addr_override(hosts, mpirun, tmp_path):
    """One job for two checks (one start-up, not two): the ranks' placement comes from mpirun alone, the
    rendezvous address from --master-addr alone (the automatic one: the multinode script's test)."""
    job = launch(hosts, mpirun, tmp_path, ["-np", "3", "-H", "nodea:1,nodeb:1,nodec:1"], "--master-addr", "nodea")
    summary = assert_layout(job, {"nodea": [0], "nodeb": [1], "nodec": [2]})
    # the name as the hosts resolve it: rank 0 binds the store there and every rank connects to that address
    assert summary["rendezvous"]["master_addr"] == hosts.address("nodea")
    assert "rendezvous on 10.77.0.1 (--master-addr nodea)" in job.output


def test_unreachable_master_addr_is_one_clear_line(hosts, mpirun, tmp_path):
    # docker0's 172.17.0.1 is nodea's, but nodeb carries it too: nodeb's ranks would only reach themselves
    job = launch(hosts, mpirun, tmp_path, ["-np", "2", "-H", "nodea:1,nodeb:1"], "--master-addr", "172.17.0.1",
                 "--rendezvous-timeout", "10", timeout=120)
    assert job.returncode == 2, job.output[-3000:]
    lines = [line for line in job.output.splitlines() if "error: --master-addr 172.17.0.1" in line]
    assert len(lines) == 1, job.output[-3000:]
    assert "nodeb" in lines[0] and "10.77.0.1" in lines[0]  # the host that cannot reach it, and what to pass
    assert "Traceback" not in job.output


@pytest.fixture(scope="module")
def debian(tmp_path_factory, mpirun):
    """Two hosts whose /etc/hosts map their own name to 127.0.1.1, as Debian and Ubuntu install it."""
    cluster = FakeHosts(["nodea", "nodeb"], tmp_path_factory.mktemp("debianhosts"), debian_hosts=True, tag="d")
    with running_fake_hosts(cluster, lambda up: up.private_network("nodea", "10.99.0.1/24")) as running:
        yield running


@pytest.mark.parametrize("master", ["10.77.0.1", "nodea"])
def test_master_addr_on_debian_hosts(debian, mpirun, tmp_path, master):
    # gloo left to itself takes the address its host name resolves to: 127.0.1.1 on a Debian host. The
    # interface that carries the rendezvous address must be used instead. A name that resolves to loopback on
    # rank 0's own host stands for the address the other hosts resolve it to.
    job = launch(debian, mpirun, tmp_path, ["-np", "2", "-H", "nodea:1,nodeb:1"], "--master-addr", master)
    summary = assert_layout(job, {"nodea": [0], "nodeb": [1]})
    assert summary["rendezvous"]["master_addr"] == debian.address("nodea")
    assert summary["rendezvous"]["interfaces"] == {"nodea": "eth0", "nodeb": "eth0"}


def test_own_script_with_master_addr_on_debian_hosts(debian, mpirun, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = REPO / "tests" / "programs" / "torchrun_style.py"
    command = [mpirun, *debian.openmpi_args(), "-np", "2", "-H", "nodea:1,nodeb:1", sys.executable, "-m", "mpiddp",
               "run", "--master-addr", debian.address("nodea"), str(script), str(out)]
    job = run_command(debian.command_on("nodea", command), tmp_path, 240, env=host_env())
    assert job.returncode == 0, job.output[-5000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["hostname"] for r in records] == ["nodea", "nodeb"]
    assert {r["env"]["MASTER_ADDR"] for r in records} == {debian.address("nodea")}
    assert records[0]["weights"] == records[1]["weights"]


def assert_no_process_left(marker: str, within_s: float) -> None:
    """Ranks being torn down may outlive mpirun by a moment; none may survive `within_s`."""
    deadline = time.monotonic() + within_s
    while True:
        leftovers = subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout.strip()
        if not leftovers:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"processes of the job still running {within_s} s after it ended:\n{leftovers}")
        time.sleep(0.2)  # polling a condition with a deadline, not synchronising


def test_a_host_that_dies_ends_the_job(hosts, mpirun, tmp_path):
    run_dir = tmp_path / "run"
    command = [mpirun, *hosts.openmpi_args(), "-np", "4", "-H", "nodea:2,nodeb:2", sys.executable, "-m", "mpiddp",
               "--run-dir", str(run_dir), "--epochs", "200", "--no-progress", "--wandb", "disabled", "--log-every", "1"]
    process = subprocess.Popen(hosts.command_on("nodea", command), cwd=REPO, env=host_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in process.stdout:  # wait until training is under way and one snapshot is saved
            seen.append(line)
            if "saved " in line and "snapshot-epoch0001.pt" in line:
                break
        assert hosts.kill_host("nodeb") > 0
        output, _ = process.communicate(timeout=120)  # what this catches: a job left hanging by a dead host
    finally:
        if process.poll() is None:
            process.kill()
    everything = "".join(seen) + output
    # Open MPI 5.0.11's prterun itself exits 0 when it loses a daemon (its own message above says why);
    # what mpiddp guarantees is the end of the job, quickly, with no rank left behind.
    assert "nodeb" in everything.split("snapshot-epoch0001.pt", 1)[1], everything[-3000:]
    assert_no_process_left(str(run_dir), within_s=15)
    assert not (run_dir / "summary.json").exists()
    assert (run_dir / "checkpoints" / "snapshot-epoch0001.pt").exists()  # what was saved survives


def test_two_hosts_two_ranks_each_through_the_multinode_script(hosts, tmp_path):
    """run/multinode.sh with a host list: the mpirun line it builds, and what two hosts of two ranks each make
    of the job (one job for both: a plain mpirun across hosts runs in the tests above)."""
    run_dir = tmp_path / "run"
    env = host_env()
    env["MPIRUN_ARGS"] = " ".join(hosts.transport_args())
    env["PYTHON"] = sys.executable
    command = [str(REPO / "run" / "multinode.sh"), "nodea:2,nodeb:2", "4", "--run-dir", str(run_dir), *FAST]
    job = run_command(hosts.command_on("nodea", command), run_dir, 240, env=env)
    summary = assert_layout(job, {"nodea": [0, 1], "nodeb": [2, 3]})
    assert "mpirun -np 4 -H nodea:2,nodeb:2 --bind-to none --map-by slot -x PATH" in job.output
    # nodea's address on the shared link: not loopback, not the decoy docker0 that every host carries
    assert summary["rendezvous"]["master_addr"] == hosts.address("nodea")
    assert summary["rendezvous"]["interfaces"] == {"nodea": "eth0", "nodeb": "eth0"}
    assert "rendezvous on 10.77.0.1" in job.output
    assert summary["eval_accuracy"] is not None and summary["images_per_second"] > 0


def test_mpich_hydra_across_hosts(hosts, mpich, tmp_path):
    from conftest import mpich_env

    run_dir = tmp_path / "run"
    # Hydra calls its launcher like ssh: AGENT [-x] HOST COMMAND; FI_TCP_IFACE keeps MPICH's own traffic off docker0.
    command = [str(mpich / "bin" / "mpiexec"), "-n", "4", "-hosts", "nodea:2,nodeb:2", "-launcher", "ssh",
               "-launcher-exec", str(hosts.agent), sys.executable, "-m", "mpiddp", "--run-dir", str(run_dir), *FAST]
    job = run_command(hosts.command_on("nodea", command), run_dir, 240, env=mpich_env(mpich, FI_TCP_IFACE="eth0"))
    summary = assert_layout(job, {"nodea": [0, 1], "nodeb": [2, 3]})
    assert summary["mpi_library"].startswith("MPICH")
    assert summary["rendezvous"]["master_addr"] == hosts.address("nodea")


def test_check_on_two_hosts(hosts, mpirun, tmp_path):
    command = [mpirun, *hosts.openmpi_args(), "-np", "2", "-H", "nodea:1,nodeb:1", sys.executable, "-m", "mpiddp",
               "check", "--runs-root", str(tmp_path / "runs"), "--wandb", "disabled"]
    job = run_command(hosts.command_on("nodea", command), tmp_path, 120, env=host_env())
    assert job.returncode == 0, job.output[-3000:]
    assert "nodea" in job.output and "nodeb" in job.output
    assert "interfaces {'nodea': 'eth0', 'nodeb': 'eth0'}" in job.output


def test_own_script_on_two_hosts_uses_the_shared_network(hosts, mpirun, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    script = REPO / "tests" / "programs" / "torchrun_style.py"
    command = [mpirun, *hosts.openmpi_args(), "-np", "4", "-H", "nodea:2,nodeb:2", sys.executable, "-m", "mpiddp",
               "run", str(script), str(out)]
    job = run_command(hosts.command_on("nodea", command), tmp_path, 240, env=host_env())
    assert job.returncode == 0, job.output[-5000:]
    records = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    assert [r["hostname"] for r in records] == ["nodea", "nodea", "nodeb", "nodeb"]
    assert [r["env"]["LOCAL_RANK"] for r in records] == ["0", "1", "0", "1"]
    assert [r["env"]["GROUP_RANK"] for r in records] == ["0", "0", "1", "1"]
    assert {r["env"]["MASTER_ADDR"] for r in records} == {hosts.address("nodea")}  # not loopback
    assert all(r["weights"] == records[0]["weights"] for r in records)


def test_master_addr_on_a_network_of_rank_0s_host_alone(debian, mpirun, tmp_path):
    job = launch(debian, mpirun, tmp_path, ["-np", "2", "-H", "nodea:1,nodeb:1"], "--master-addr", "10.99.0.1",
                 timeout=120)
    assert job.returncode == 2, job.output[-3000:]
    lines = [line for line in job.output.splitlines() if "error: --master-addr 10.99.0.1" in line]
    assert len(lines) == 1, job.output[-3000:]
    assert "cannot be reached from nodeb" in lines[0] and "e.g. 10.77.0.1" in lines[0]
