"""The relay layout, in-process: when launch uses it (and why not, in one line), its hostfile and radix, and the
agent wrapper (relays run here; a host's connection that ended after it came up is not a failed start)."""

import subprocess
import textwrap

import pytest

from mpiddp.launch.diagnose import unreachable
from mpiddp.launch.hosts import Host
from mpiddp.launch.relay import (
    AGENT_FILE,
    MARKER,
    agent_failures,
    decide_layout,
    host_of,
    hostfile_text,
    hosts_ended,
    marked_args,
    num_relays,
    relay_command,
    without_agent,
    write_layout,
)

OPEN_MPI_5 = "mpirun (Open MPI) 5.0.11\n"
HOSTS = [Host("nodea", 2), Host("nodeb", 2), Host("nodec", 2)]


@pytest.mark.parametrize("hosts, relays", [(1, 1), (2, 2), (4, 2), (5, 3), (9, 3), (10, 4), (100, 10)])
def test_about_the_square_root_of_the_hosts_relays_each_carrying_at_most_that_many(hosts, relays):
    assert num_relays(hosts) == relays and relays * relays >= hosts


def test_the_hostfile_names_the_launch_host_first_then_the_relays_then_the_other_hosts():
    assert hostfile_text("nodea", HOSTS, 2) == ("nodea slots=2\nmpiddp-relay0 slots=0\nmpiddp-relay1 slots=0\n"
                                                "nodeb slots=2\nnodec slots=2\n")
    # launching from a login node that runs no rank: it is there with no slots (mpirun's own daemon)
    assert hostfile_text("login1.cluster", HOSTS[1:], 2).splitlines()[0] == "login1.cluster slots=0"
    assert hostfile_text("nodea.cluster", HOSTS, 2).splitlines()[0] == "nodea slots=2"  # the same host, short name


def test_the_layout_is_on_for_open_mpi_5_0_with_in_job_recovery_and_two_hosts_or_more_saying_so():
    on = decide_layout(True, "mpirun", "openmpi", OPEN_MPI_5, HOSTS, "nodea", [])
    assert on.on and on.num_relays == 2 and on.why.startswith("relay layout is on: 2 relays on this host carry 2 "
                                                              "hosts") and "\n" not in on.why
    assert decide_layout(True, "mpirun", "openmpi", OPEN_MPI_5, HOSTS[1:], "login1", []).num_relays == 2


@pytest.mark.parametrize("recovery, launcher, flavour, version, hosts, extra, says", [
    (False, "mpirun", "openmpi", OPEN_MPI_5, HOSTS, [], "no in-job recovery"),
    (True, "mpiexec", "mpich", "HYDRA build details", HOSTS, [], "it needs Open MPI's mpirun"),
    (True, "srun", "openmpi", OPEN_MPI_5, HOSTS, [], "it needs Open MPI's mpirun"),
    (True, "mpirun", "openmpi", "mpirun (Open MPI) 5.1.0\n", HOSTS, [], "verified with Open MPI 5.0 only"),
    (True, "mpirun", "openmpi", OPEN_MPI_5, HOSTS[:1], [], "one compute host"),
    (True, "mpirun", "openmpi", OPEN_MPI_5, HOSTS, ["--prtemca", "rml_base_radix", "4"], "rml_base_radix"),
    (True, "mpirun", "openmpi", OPEN_MPI_5, HOSTS, ["--hostfile", "h"], "set the hosts"),
])
def test_where_the_layout_cannot_be_used_it_is_off_saying_why_in_one_line(recovery, launcher, flavour, version, hosts,
                                                                          extra, says):
    off = decide_layout(recovery, launcher, flavour, version, hosts, "nodea", extra)
    assert not off.on and off.why.startswith("relay layout is off") and says in off.why and "\n" not in off.why


def test_the_users_agent_leaves_the_command_line_for_the_wrapper_which_runs_it():
    extra = ["--mca", "plm_rsh_agent", "/x/agent", "--mca", "btl_tcp_if_include", "10.0.0.0/24",
             "--prtemca", "plm_ssh_agent", "ssh -p 2222"]
    assert without_agent(extra) == ["--mca", "btl_tcp_if_include", "10.0.0.0/24"]


def test_relay_entries_run_here_and_a_hosts_command_gets_the_marker_first():
    assert relay_command(["-x", "mpiddp-relay1", "PRTE_PREFIX=/p;", "prted", "-x"]) == [
        "/bin/sh", "-c", "PRTE_PREFIX=/p; prted -x"]
    assert relay_command(["nodeb", "prted"]) is None
    assert relay_command(["mpiddp-relayX", "prted"]) is None  # only relayN: never a real host's name
    assert marked_args(["-x", "nodeb", "prted", "--x"]) == ["-x", "nodeb", f"echo {MARKER};", "prted", "--x"]


@pytest.mark.parametrize("options", [[], ["-x"], ["-p", "2222"], ["-p2222"], ["-xp", "2222"], ["-q", "-o",
                                     "StrictHostKeyChecking=no", "-p", "2222", "-i", "/k/id"], ["-o", "-x"], ["-P", "tag"],
                                     ["-oStrictHostKeyChecking=no", "-vp", "2222", "-tt", "--"]])
def test_the_host_is_found_after_the_agents_options_and_their_values(options):
    """PRRTE puts plm_ssh_args (`-p 2222`: sshd on another port, as in containers) before the host: an option's
    value is no host, or relays would go to ssh and markers before the host (a start that never works)."""
    relay = [*options, "mpiddp-relay0", "PRTE_PREFIX=/p;", "prted", "-x"]
    assert relay_command(relay) == ["/bin/sh", "-c", "PRTE_PREFIX=/p; prted -x"]
    real = [*options, "nodeb", "prted", "--x"]
    assert relay_command(real) is None and host_of(real) == "nodeb"
    assert marked_args(real) == [*options, "nodeb", f"echo {MARKER};", "prted", "--x"]
    assert host_of(options) == "?"


@pytest.fixture
def wrapper(tmp_path):
    """The agent wrapper written by write_layout over a fake agent: it records each host it is asked to reach,
    fails like ssh (255) for host `down`, and runs the command here otherwise."""
    calls = tmp_path / "calls"
    agent = tmp_path / "agent.sh"
    agent.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
        host="$1"; shift
        echo "$host" >> {calls}
        [ "$host" = down ] && {{ echo "ssh: connect to host down port 22: No route to host" >&2; exit 255; }}
        exec /bin/sh -c "$*"
        """))
    agent.chmod(0o755)
    args = write_layout(tmp_path, [str(agent), "-x"], "nodea", HOSTS, 2)
    assert args[args.index("--prtemca") + 1:args.index("--prtemca") + 3] == ("plm_ssh_agent", str(tmp_path / AGENT_FILE))
    assert args[-2:] == ("rml_base_radix", "2") and args[:2] == ("--hostfile", str(tmp_path / "mpiddp-hostfile"))

    def run(*argv):
        done = subprocess.run([str(tmp_path / AGENT_FILE), *argv], check=False, capture_output=True, text=True,
                              timeout=60)
        run.stderr = done.stderr
        return done.returncode, done.stdout, calls.read_text().split() if calls.exists() else []
    return run


def test_the_wrapper_runs_a_relay_here_without_the_agent(wrapper):
    assert wrapper("mpiddp-relay0", "echo relayed; exit 4") == (4, "relayed\n", [])


def test_a_connection_that_ended_after_it_came_up_is_reported_as_a_clean_end_and_recorded(wrapper, tmp_path):
    # the daemon's host crashed: ssh would exit 255; PRRTE must not take it for a daemon that failed to start
    assert hosts_ended(tmp_path) == []
    status, out, calls = wrapper("nodeb", "echo from-nodeb; kill -KILL $$")
    assert (status, out, calls) == (0, "from-nodeb\n", ["nodeb"])  # the marker itself is not passed on
    assert wrapper("nodec", "echo 'prted: not found' >&2; exit 127")[0] == 0 and wrapper("nodeb", "exit 0")[0] == 0
    assert wrapper("noded", "exit 0")[0] == 0
    # launch's account of the ended connections (it ends an attempt whose daemon ended before the job started)
    assert hosts_ended(tmp_path) == [("nodeb", "the agent exited -9"),
                                     ("nodec", "the agent exited 127: prted: not found"),
                                     ("noded", "the agent exited 0")]
    assert (tmp_path / "mpiddp-agent-ended").read_text().splitlines() == [
        "nodeb -9", "nodec 127 prted: not found", "nodeb 0", "noded 0"]
    assert agent_failures(tmp_path) == ""  # none of them failed to start
    write_layout(tmp_path, ["agent"], "nodea", HOSTS, 2)  # the next attempt's layout
    assert hosts_ended(tmp_path) == []


def test_a_host_that_cannot_be_reached_still_fails_the_start_and_is_named_for_launch(wrapper, tmp_path):
    status, out, calls = wrapper("down", "prted")
    assert (status, out, calls) == (255, "", ["down"])
    # under the relays mpirun exits 255 saying nothing: the wrapper's file names the host, with the agent's word
    said = ("mpiddp agent: could not reach down: the agent exited 255 before the host's daemon started (ssh: connect "
            "to host down port 22: No route to host)\n")
    assert agent_failures(tmp_path) == said and said in wrapper.stderr
    assert unreachable(agent_failures(tmp_path)) == ("down",)  # what launch's diagnosis reads
    assert wrapper("nodeb", "exit 3")[0] == 0 and agent_failures(tmp_path) == said  # a host reached: nothing
    assert [host for host, _ in hosts_ended(tmp_path)] == ["nodeb"]  # the host not reached never came up


def test_launch_uses_the_layout_for_training_by_default_and_for_a_script_when_asked_saying_so_in_one_line(
        tmp_path, capsys):
    from test_launch_recovery import fake_open_mpi

    from mpiddp.launch.cli import make_plan

    launcher = fake_open_mpi(tmp_path / "bin", "yes", tmp_path / "calls")  # Open MPI 5.0.3 with ULFM
    flags = ["-H", "nodea:1,nodeb:1,nodec:1", "--launcher-path", str(launcher), "--run-dir", str(tmp_path / "r")]

    def layout_and_line(*args):
        plan = make_plan([*flags, *args], {})
        said = [line for line in capsys.readouterr().err.splitlines() if "relay layout" in line]
        assert len(said) <= 1, said
        return plan.relay_layout, (said or [""])[0]

    layout, line = layout_and_line("--", "--epochs", "1")  # training: on (its hang watchdog cuts a silent host off)
    assert layout.on and layout.num_relays == 2 and line.startswith("mpiddp launch: relay layout is on: 2 relays")
    assert "a silent one is cut off by the trainer's hang watchdog" in line
    layout, line = layout_and_line("--no-host-crash-relays", "--", "--epochs", "1")
    assert not layout.on and "relay layout is off (--no-host-crash-relays)" in line
    ulfm = ["--launcher-args", "--with-ft ulfm"]  # a script's in-job recovery is its author's choice
    layout, line = layout_and_line(*ulfm, "--", "run", "train.py")
    assert not layout.on and "relay layout is off for a script (launch --host-crash-relays turns it on)" in line
    layout, line = layout_and_line(*ulfm, "--host-crash-relays", "--", "run", "train.py")
    assert layout.on and line.startswith("mpiddp launch: relay layout is on")
    assert "a silent one is noticed only by the script's own timeouts" in line
    layout, line = layout_and_line("--no-in-job-recovery", "--", "--epochs", "1")
    assert not layout.on and line == ""  # the in-job recovery line says why it is off
