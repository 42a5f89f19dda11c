"""The silent-host watch (mpiddp/job/silenthost.py and the hang watchdog's use of it), in-process: which hosts are
quiet, how a process finds and cuts its own connections, and the watchdogs' protocol through the store. The
end-to-end run (a fake host's processes stopped and its link down) is in test_host_loss.py."""

import json
import socket

import pytest

import mpiddp.job.watchdog as watchdog_module
from mpiddp.job import storekeys
from mpiddp.job.silenthost import QuietHosts, cut_connections, kernel_answers, peers_by_inode
from mpiddp.job.watchdog import Watchdog
from test_launch_record import DictStore

HOSTS = {0: "a", 1: "b", 2: "b", 3: "c"}


def test_a_host_is_quiet_only_when_every_one_of_its_ranks_stopped_advancing_for_the_bound():
    quiet = QuietHosts(HOSTS, own_host="a", bound_s=10)
    assert quiet.observe({r: {"tick": r} for r in HOSTS}, now=0) == []
    # rank 1 stops; rank 2 (same host) goes on: host b is not quiet
    assert quiet.observe({0: {"tick": 10}, 1: {"tick": 1}, 2: {"tick": 12}, 3: {"tick": 13}}, now=11) == []
    # now both of b's ranks stopped; c's too, but not for long enough; a is the observer's own host
    assert quiet.observe({0: {"tick": 20}, 1: {"tick": 1}, 2: {"tick": 12}, 3: {"tick": 21}}, now=20) == []
    assert quiet.observe({0: {"tick": 30}, 1: {"tick": 1}, 2: {"tick": 12}, 3: {"tick": 21}}, now=22) == ["b"]
    assert quiet.observe({1: {"tick": 1}, 2: {"tick": 12}}, now=31) == ["b", "c"]  # a rank absent keeps its tick


def test_a_rank_never_seen_is_never_judged():
    quiet = QuietHosts({0: "a", 1: "b"}, own_host="a", bound_s=0)
    assert quiet.observe({0: {"tick": 1}}, now=100) == []


def test_peers_are_read_from_both_tcp_tables_listening_sockets_left_out():
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    tcp = header + ("   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1\n"
                    "   1: 01004D0A:8A3E 02004D0A:ABCD 01 00000000:00000000 00:00000000 00000000     0        0 222 1\n")
    tcp6 = header + ("   0: 0000000000000000FFFF00000100A8C0:1F90 0000000000000000FFFF00000300A8C0:D431 01 "
                     "00000000:00000000 00:00000000 00000000     0        0 333 1\n"
                     "   1: 00000000000000000000000001000000:1F90 00000000000000000000000001000000:D432 01 "
                     "00000000:00000000 00:00000000 00000000     0        0 444 1\n")
    assert peers_by_inode([tcp, tcp6]) == {222: "10.77.0.2", 333: "192.168.0.3", 444: "::1"}


def test_a_process_cuts_its_own_connections_to_an_address_and_the_peer_sees_the_end():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with client, server:
            assert cut_connections(["127.0.0.2"]) == 0  # another address: nothing of this process goes there
            assert cut_connections(["127.0.0.1"]) == 2  # both ends of the pair are this process's
            assert client.recv(1) == b"" and server.recv(1) == b""  # what MPI and gloo would read: the peer is gone
            with pytest.raises(OSError):
                client.sendall(b"x")


def test_a_host_that_refuses_a_connection_answers():
    with socket.socket() as closed:  # a port bound but not listening: the kernel refuses
        closed.bind(("127.0.0.1", 0))
        assert kernel_answers(["127.0.0.1"], port=closed.getsockname()[1], timeout_s=2)


@pytest.fixture
def three_watchdogs(monkeypatch):
    """Ranks 0-3 on hosts a, b, b, c under in-job recovery, each host with its own address; what each cut."""
    store, cuts = DictStore(), {}
    watchdogs = []
    for rank, host in HOSTS.items():
        dog = Watchdog(60, rank, 4, f"rank {rank}/4 on {host}", store, lambda code: None, HOSTS)
        monkeypatch.setattr(watchdog_module, "host_addresses", lambda host=host: [f"10.0.0.{ord(host) - 96}", "172.17.0.1"])
        dog.exclude_hung = True
        dog.watch_hosts()
        if dog.quiet is not None:
            dog.quiet.bound_s = 1e-6  # any time between two of rank 0's rounds: quiet
        watchdogs.append(dog)
    monkeypatch.setattr(watchdog_module, "cut_connections",
                        lambda addresses: cuts.setdefault(current[0], []).extend(addresses) or 0)
    current = [None]

    def round_of(ranks):
        for rank in ranks:
            current[0] = rank
            assert watchdogs[rank].poll() is None

    return watchdogs, store, cuts, round_of


def test_rank_0_names_a_quiet_host_whose_kernel_is_silent_and_every_other_rank_cuts_it_off(three_watchdogs,
                                                                                             monkeypatch, capsys):
    watchdogs, store, cuts, round_of = three_watchdogs
    probed = []
    monkeypatch.setattr(watchdog_module, "kernel_answers", lambda addresses: probed.append(addresses) or False)
    round_of([1, 2, 3, 0])  # everyone reports; rank 0 sees every rank's first tick
    round_of([3, 0])  # b's ranks went silent: rank 0 finds host b quiet (the bound is 0 here), probes and names it
    assert probed == [["10.0.0.2"]]  # b's own address; the docker0 every host carries is rank 0's own too
    (named,) = json.loads(store.get(storekeys.SILENT_HOSTS))
    assert (named["host"], named["addresses"], named["ranks"]) == ("b", ["10.0.0.2"], [1, 2])
    round_of([3])
    assert cuts == {0: ["10.0.0.2"], 3: ["10.0.0.2"]}  # rank 0 and rank 3 cut; b's own ranks never run again
    assert watchdogs[0].silenced == watchdogs[3].silenced == {1, 2}  # the recovery's cause: silent_host
    round_of([0, 3])
    assert cuts == {0: ["10.0.0.2"], 3: ["10.0.0.2"]} and len(probed) == 1  # each host judged and cut once
    assert "host b (ranks 1, 2) went silent" in capsys.readouterr().err


def test_a_quiet_host_whose_kernel_answers_is_never_cut_off(three_watchdogs, monkeypatch, caplog):
    watchdogs, store, cuts, round_of = three_watchdogs
    monkeypatch.setattr(watchdog_module, "kernel_answers", lambda addresses: True)
    round_of([1, 2, 3, 0])
    round_of([3, 0])
    round_of([3, 0])
    assert not store.check([storekeys.SILENT_HOSTS]) and cuts == {} and watchdogs[0].silenced == set()
    assert "host b (ranks 1, 2) stopped reporting" in caplog.text and "answers connections" in caplog.text


def test_without_in_job_recovery_nothing_is_watched_or_cut(monkeypatch):
    store = DictStore()
    dog = Watchdog(60, 0, 2, "rank 0/2 on a", store, lambda code: None, {0: "a", 1: "b"})
    called = []  # the names the watchdog calls (it imported them: patching silenthost's would miss them)
    monkeypatch.setattr(watchdog_module, "cut_connections", lambda addresses: called.append(("cut", addresses)))
    monkeypatch.setattr(watchdog_module, "kernel_answers", lambda addresses: called.append(("probe", addresses)))
    # even a host named silent in the store (as a watching rank 0 would name it) is not cut without the watch
    store.set(storekeys.SILENT_HOSTS, json.dumps([{"host": "b", "addresses": ["10.0.0.2"], "ranks": [1]}]))
    for _ in range(3):  # rank 1 (host b) never reports
        assert dog.poll() is None
    assert called == [] and dog.quiet is None and "addresses" not in json.loads(store.get(storekeys.progress(0)))


def test_a_host_that_reported_again_is_judged_anew_when_it_goes_quiet_later(three_watchdogs, monkeypatch):
    watchdogs, store, cuts, round_of = three_watchdogs
    answers = [True, False]  # the first stall: b's kernel answers (its ranks were busy); later it is really gone
    monkeypatch.setattr(watchdog_module, "kernel_answers", lambda addresses: answers.pop(0))
    round_of([1, 2, 3, 0])
    round_of([3, 0])  # b quiet, but it answers: not cut
    assert not store.check([storekeys.SILENT_HOSTS])
    round_of([1, 2, 3, 0])  # b reports again
    round_of([3, 0])  # and goes quiet for good
    assert json.loads(store.get(storekeys.SILENT_HOSTS))[0]["host"] == "b" and answers == []


def test_a_rank_of_a_host_named_silent_ends_itself_when_its_link_comes_back(three_watchdogs, monkeypatch):
    watchdogs, store, cuts, round_of = three_watchdogs
    monkeypatch.setattr(watchdog_module, "kernel_answers", lambda addresses: False)
    round_of([1, 2, 3, 0])
    round_of([3, 0])  # b named
    ended = watchdogs[1].poll()  # b's rank runs again: the others went on without it
    assert ended is not None and 1 not in cuts


@pytest.mark.parametrize("error, answers", [
    (TimeoutError(), False),
    (OSError(113, "No route to host"), False),
    (OSError(24, "Too many open files"), True),  # this side's own trouble says nothing of the host: never cut
])
def test_only_silence_counts_as_no_answer(monkeypatch, error, answers):
    def connect(*args, **kwargs):
        raise error

    monkeypatch.setattr(socket, "create_connection", connect)
    assert kernel_answers(["10.0.0.2"], timeout_s=0.1) is answers
