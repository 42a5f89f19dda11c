"""torch's flight recorder, in-process: the variables that turn it on, reading dumps safely, what the dumps of
every rank show, and the hang file's section on them (the NCCL job itself is in the GPU tier)."""

import json
import pickle
import threading
import time

import pytest

from mpiddp.job.bootstrap import flight_recorder_env
from mpiddp.job.flightrec import describe_traces, load_trace, slim, trace_path, write_trace
from mpiddp.job.storekeys import HANG_REQUEST as REQUEST_KEY
from mpiddp.job.watchdog import Watchdog
from test_launch_record import DictStore


def entry(seq, state="completed", op="nccl:all_reduce", group=("0", "default_pg"), pg_id=0, sizes=((1024,),)):
    """One collective as torch's recorder pickles it (the keys of torch 2.4's TraceUtils.h and 2.14's
    FlightRecorder.hpp)."""
    sizes = [list(size) for size in sizes]
    return {"record_id": seq - 1, "pg_id": pg_id, "process_group": group, "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": op, "time_created_ns": 1000 * seq, "input_sizes": sizes,
            "input_dtypes": ["Float"], "output_sizes": sizes, "output_dtypes": ["Float"], "state": state,
            "time_discovered_started_ns": None, "time_discovered_completed_ns": None, "retired": state == "completed",
            "is_p2p": False, "frames": [{"name": "all_reduce", "filename": "distributed_c10d.py", "line": 1}]}


def dump(*entries, version="2.1", ranks="[0, 1, 2, 3]"):
    return {"version": version, "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
            "entries": list(entries)}


def test_the_recorder_is_turned_on_under_the_names_each_torch_reads_unless_the_user_set_them(tmp_path):
    old = flight_recorder_env("2.4.1+cu121", tmp_path, {})
    assert old == {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path.resolve() / "nccl-trace-rank")}
    new = flight_recorder_env("2.14.1+cu130", tmp_path, {})
    assert new == {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                   "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path.resolve() / "nccl-trace-rank")}
    # a name the user set, old or new, leaves that setting alone
    assert flight_recorder_env("2.14.1", tmp_path, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
                                                    "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/x/t"}) == \
        {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    assert flight_recorder_env("2.4.1", None, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}) == \
        {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}  # no run dir (`run` unsupervised): torch's default place


def test_ranks_in_step_have_nothing_pending():
    dumps = {rank: dump(entry(56), entry(57)) for rank in range(2)}
    lines = describe_traces(dumps, 2)
    assert lines[0] == ("pg 0 (default_pg): no collective pending (last completed #57): the ranks are stuck outside "
                        "collectives, see their stacks")
    assert lines[1] == ("rank 0, pg 0 (default_pg): last entered nccl:all_reduce #57 (in [[1024]] Float, completed); "
                        "last completed #57")


def test_the_rank_that_never_entered_the_collective_the_others_wait_in_is_named():
    waiting = dump(entry(55), entry(56), entry(57, state="scheduled"))
    dumps = {0: waiting, 1: dump(entry(55), entry(56)), 2: waiting, 3: dump(entry(55), entry(56), entry(57, "started"))}
    lines = describe_traces(dumps, 4)
    assert lines[0] == ("ranks 0,2,3 wait in nccl:all_reduce #57 of pg 0 (default_pg), in [[1024]] Float; "
                        "rank 1's last entered is #56: it never entered #57")
    assert "rank 1, pg 0 (default_pg): last entered nccl:all_reduce #56 (in [[1024]] Float, completed); " \
           "last completed #56" in lines
    assert "rank 3, pg 0 (default_pg): last entered nccl:all_reduce #57 (in [[1024]] Float, started); " \
           "last completed #56" in lines


def test_every_rank_in_the_collective_points_at_the_network_not_a_rank_and_missing_dumps_are_said():
    stuck = dump(entry(9), entry(10, state="started", op="nccl:broadcast", sizes=((3, 4), (5,))))
    lines = describe_traces({0: stuck, 1: stuck, 2: "no dump (stopped, dead, or its watchdog did not answer in time)"}, 3)
    assert lines[0] == ("ranks 0,1 wait in nccl:broadcast #10 of pg 0 (default_pg), in [[3, 4], [5]] Float: every rank "
                        "with a dump entered it (a stuck network, GPU or NCCL rather than a rank behind); no dump from "
                        "rank 2")
    assert lines[-1] == "rank 2: no dump (stopped, dead, or its watchdog did not answer in time)"


def test_a_rank_that_entered_no_collective_yet_is_named_from_the_group_config():
    lines = describe_traces({0: dump(entry(1, "scheduled")), 1: dump()}, 2)
    assert lines[0] == ("rank 0 waits in nccl:all_reduce #1 of pg 0 (default_pg), in [[1024]] Float; rank 1 entered "
                        "none: it never entered #1")
    assert "rank 1, pg 0 (default_pg): last entered none; last completed #0" in lines


def test_subgroups_are_judged_apart_and_sends_are_left_out():
    tp = ("1", "tp")
    send = {**entry(3, state="scheduled", op="nccl:send"), "is_p2p": True}
    dumps = {0: dump(entry(4), entry(1, group=tp, pg_id=1), entry(2, "scheduled", group=tp, pg_id=1), send),
             1: dump(entry(4), entry(1, group=tp, pg_id=1))}
    lines = describe_traces(dumps, 2)
    assert lines[0].startswith("pg 0 (default_pg): no collective pending (last completed #4)")
    assert lines[1].startswith("rank 0 waits in nccl:all_reduce #2 of pg 1 (tp), in [[1024]] Float; rank 1's last "
                               "entered is #1: it never entered #2")
    assert not any("send" in line for line in lines)


def test_the_analysis_reads_the_same_from_a_slim_copy_of_each_dump():
    tp = ("1", "tp")
    full = dump(*[entry(seq) for seq in range(1, 41)], entry(41, "scheduled"), entry(1, group=tp, pg_id=1),
                entry(2, "started", group=tp, pg_id=1))
    small = slim(full)
    assert len(small["entries"]) == 16 + 2 and not any("frames" in e for e in small["entries"])
    assert min(e["collective_seq_id"] for e in small["entries"] if e["pg_id"] == 0) == 26  # the newest 16
    others = dump(*[entry(seq) for seq in range(1, 41)], entry(1, group=tp, pg_id=1))
    assert describe_traces({0: small, 1: slim(others)}, 2) == describe_traces({0: full, 1: others}, 2)
    assert slim("no dump") == "no dump"


def test_a_slim_copy_keeps_how_far_a_group_got_when_many_collectives_are_in_flight():
    """Before torch 2.8 (no pg_status) the newest completed entry is the only word on progress: 17 started
    buckets must not push it out of the slim copy."""
    busy = dump(*[entry(seq) for seq in range(1, 31)], *[entry(seq, "started") for seq in range(31, 48)])
    peer = dump(*[entry(seq) for seq in range(1, 31)])
    small = slim(busy)
    assert len(small["entries"]) == 18 and max(e["collective_seq_id"] for e in small["entries"]
                                              if e["state"] == "completed") == 30
    assert describe_traces({0: small, 1: slim(peer)}, 2) == describe_traces({0: busy, 1: peer}, 2)
    assert any("#31" in line for line in describe_traces({0: small, 1: slim(peer)}, 2))


def test_the_recorders_own_counters_count_as_completed():
    """torch 2.8+ dumps pg_status; some backends never mark their entries completed (gloo's stay scheduled)."""
    gloo = {**dump(entry(1, "scheduled", op="gloo:all_reduce")), "pg_status": {"0": {
        "last_enqueued_collective": 1, "last_started_collective": -1, "last_completed_collective": 1}}}
    assert describe_traces({0: gloo}, 1)[0].startswith("pg 0 (default_pg): no collective pending (last completed #1)")


def test_unreadable_old_and_hostile_dumps_are_one_line_each_never_a_crash(tmp_path):
    good = tmp_path / "nccl-trace-rank0"
    good.write_bytes(pickle.dumps(dump(entry(1)), protocol=2))
    assert load_trace(good)["entries"][0]["profiling_name"] == "nccl:all_reduce"
    (tmp_path / "old").write_bytes(pickle.dumps(dump(entry(1), version="1.0")))
    (tmp_path / "torn").write_bytes(pickle.dumps(dump(entry(1)))[:40])
    (tmp_path / "list").write_bytes(pickle.dumps([1, 2]))
    marker = tmp_path / "executed"
    (tmp_path / "hostile").write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    reasons = {name: load_trace(tmp_path / name) for name in ("old", "torn", "list", "hostile", "absent")}
    assert all(isinstance(reason, str) for reason in reasons.values())
    assert "has dump format version 1.0; mpiddp reads 2.x" in reasons["old"]
    assert "is not a readable flight-recorder dump" in reasons["torn"]
    assert "not a flight-recorder dump with entries" in reasons["list"]
    assert "refused os.system" in reasons["hostile"] and not marker.exists()  # never run what a file says
    assert reasons["absent"] == f"no file {tmp_path / 'absent'}"
    odd = {"version": "2.1", "entries": [{"collective_seq_id": "not a number"}]}
    lines = describe_traces({0: load_trace(good), 1: reasons["torn"], 2: odd}, 3)
    assert lines[-2].startswith("rank 1: ") and "is not a readable flight-recorder dump" in lines[-2]
    assert lines[-1].startswith("rank 2: unexpected content (ValueError")


def test_writing_a_dump_reports_failures_and_gives_up_on_one_that_never_returns(tmp_path):
    path = tmp_path / "nccl-trace-rank3"
    assert write_trace(path, lambda: b"bytes") is None and path.read_bytes() == b"bytes"

    def broken():
        raise RuntimeError("no NCCL here")

    assert write_trace(tmp_path / "b", broken) == "the dump failed (RuntimeError: no NCCL here)"
    release = threading.Event()
    assert write_trace(tmp_path / "c", lambda: release.wait() and b"", timeout_s=0.2) == \
        "the dump did not finish within 0.2 s"
    release.set()
    assert write_trace(tmp_path / "missing" / "d", lambda: b"x").startswith(f"writing {tmp_path / 'missing' / 'd'} failed")


def test_a_real_dump_of_this_torch_reads_back_and_names_its_collective(tmp_path, solo_group):
    import torch
    import torch.distributed as tdist
    from torch._C import _distributed_c10d

    if not hasattr(_distributed_c10d, "_dump_fr_trace"):  # the generic recorder (gloo too) is newer than 2.4
        pytest.skip(f"torch {torch.__version__} records NCCL collectives only (the GPU tier tests those)")
    tensor = torch.ones(5)
    tdist.all_reduce(tensor)
    path = trace_path(tmp_path, 0)
    assert write_trace(path, _distributed_c10d._dump_fr_trace) is None
    loaded = load_trace(path)  # torch's own pickle passes the plain-data unpickler
    assert isinstance(loaded, dict), loaded
    lines = describe_traces({0: loaded}, 1)
    last = next(line for line in lines if line.startswith("rank 0, "))
    assert "last entered gloo:all_reduce #" in last and "in [[5]] Float" in last
    assert any("no collective pending" in line for line in lines)


def hang_watchdog(store, rank, tmp_path, trace, world_size=2):
    return Watchdog(0.1, rank, world_size, f"rank {rank}/{world_size} on host{rank}", store, lambda code: None,
                    {r: f"host{r}" for r in range(world_size)}, tmp_path / "failures", tmp_path, trace)


def test_the_hang_file_says_what_the_dumps_show(tmp_path, monkeypatch, capsys):
    import mpiddp.job.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "GRACE_S", 0.1)
    store = DictStore()
    store.set("mpiddp/progress/0", json.dumps({"step": 5, "phase": "train", "idle_s": 9}))
    store.set("mpiddp/progress/1", json.dumps({"step": 4, "phase": "train", "idle_s": 12}))
    trace_path(tmp_path, 1).write_bytes(pickle.dumps(dump(entry(1), ranks="[0, 1]")))  # an earlier job's: not read
    watchdog = hang_watchdog(store, 0, tmp_path, lambda: pickle.dumps(dump(entry(1), entry(2, "scheduled"), ranks="[0, 1]")))
    watchdog._fire()
    assert store.check([REQUEST_KEY])  # every other rank is asked for its stacks and dump
    (hang_file,) = tmp_path.glob("hang-*.txt")
    text = hang_file.read_text()
    assert f"==== collectives by rank (torch's flight recorder, dumps in {tmp_path}/nccl-trace-rank<rank>)" in text
    assert "rank 0 waits in nccl:all_reduce #2 of pg 0 (default_pg), in [[1024]] Float: every rank with a dump " \
           "entered it" in text
    assert "rank 1: no dump (stopped, dead, or its watchdog did not answer in time)" in text
    assert load_trace(trace_path(tmp_path, 0))["entries"][1]["state"] == "scheduled"  # written before the abort


def test_a_rank_asked_for_the_hang_report_gives_its_dump_and_stacks_and_keeps_going(tmp_path):
    store = DictStore()
    rank_1 = hang_watchdog(store, 1, tmp_path, lambda: pickle.dumps(dump(entry(1), ranks="[0, 1]")))
    rank_1.timeout_s, rank_1.interval = 3600, 0.05  # its own timeout is far away: it only answers
    rank_1.start()
    try:
        store.set(REQUEST_KEY, "rank 0/2 on host0")
        deadline = time.monotonic() + 30
        while not store.check(["mpiddp/stacks/1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        rank_1.stop()
    assert store.get("mpiddp/trace/1") == b""  # written, no error
    assert load_trace(trace_path(tmp_path, 1))["entries"][0]["collective_seq_id"] == 1
    assert "its own watchdog had not fired" in store.get("mpiddp/stacks/1").decode()
    # the first rank's hang file then describes both dumps
    rank_0 = hang_watchdog(store, 0, tmp_path, lambda: pickle.dumps(dump(entry(1), entry(2, "started"), ranks="[0, 1]")))
    rank_0.answered = True
    trace_path(tmp_path, 0).write_bytes(rank_0.trace())
    store.set("mpiddp/trace/0", "")
    assert rank_0._describe_traces()[0] == ("rank 0 waits in nccl:all_reduce #2 of pg 0 (default_pg), in [[1024]] "
                                            "Float; rank 1's last entered is #1: it never entered #2")


def test_reading_the_dumps_of_a_big_job_stops_at_its_time_budget(tmp_path, monkeypatch):
    import mpiddp.job.watchdog as watchdog_module

    monkeypatch.setattr(watchdog_module, "READ_DUMPS_S", -1.0)  # spent before the first file
    store = DictStore()
    watchdog = hang_watchdog(store, 0, tmp_path, lambda: b"", world_size=3)
    assert watchdog._describe_traces()[-1] == "rank 2: not read (the hang report's -1 s for reading dumps ran out)"


def test_enabling_the_recorder_sets_this_torchs_names_in_the_process(tmp_path, monkeypatch):
    import os

    import torch

    from mpiddp.job.bootstrap import enable_flight_recorder

    monkeypatch.setattr(os, "environ", {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})  # the user's choice stays
    wanted = enable_flight_recorder(tmp_path)
    assert os.environ == {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0", **wanted}
    assert wanted == flight_recorder_env(torch.__version__, tmp_path, {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})
    assert len(wanted) == 2 and str(tmp_path.resolve() / "nccl-trace-rank") in wanted.values()
