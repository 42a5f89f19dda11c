"""The stand-ins a script's new rank runs its own start on before it joins the grown job (mpiddp.elastic.standin):
torch's default group and mpiddp's Dist answer where this rank stands, a barrier returns at once, and any other
collective raises BeforeJoining with one line saying what to do; removing the group puts torch back as it was."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from mpiddp.elastic.standin import BeforeJoining, StandInTransport


# torch's default group is one per process, and this test process may hold conftest's solo_group (destroying
# the stand-in destroys every group): the group's checks run in a fresh interpreter, as on a new rank
CHECK_GROUP = """
import json, torch, torch.distributed as tdist
from torch.distributed import distributed_c10d
from mpiddp.elastic.standin import BeforeJoining, StandInGroup
names = ("all_reduce", "broadcast", "barrier", "all_gather_object")
originals = {name: getattr(tdist, name) for name in names}
standin = StandInGroup()
standin.install(rank=2, world_size=3)
taken_all_reduce, taken_barrier = tdist.all_reduce, tdist.barrier  # as `from torch.distributed import ...` does
seen = {"place": [tdist.get_rank(), tdist.get_world_size()], "refused": {}}
tdist.barrier()
tdist.monitored_barrier()
calls = {"all_reduce": lambda: tdist.all_reduce(torch.ones(2)), "broadcast": lambda: tdist.broadcast(torch.ones(2), 0),
         "broadcast_object_list": lambda: tdist.broadcast_object_list([None], 0),
         "all_gather_object": lambda: tdist.all_gather_object([None] * 3, 1),
         "distributed_c10d.all_gather": lambda: distributed_c10d.all_gather([torch.ones(1)] * 3, torch.ones(1))}
for name, call in calls.items():
    try:
        call()
    except BeforeJoining as exc:
        seen["refused"][name] = str(exc)
standin.remove()
seen["after"] = [tdist.is_initialized(), all(getattr(tdist, name) is originals[name] for name in names),
                 all(getattr(distributed_c10d, name) is originals[name] for name in names)]
# the join: a real group at the same place; what the script took by name during its start now reaches it
tdist.init_process_group("gloo", store=tdist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
total = torch.ones(2)
taken_all_reduce(total)
taken_barrier()
seen["taken_after_join"] = total.tolist()
tdist.destroy_process_group()
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def seen():
    done = subprocess.run([sys.executable, "-c", CHECK_GROUP], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_the_stand_in_group_answers_where_this_rank_will_stand_and_a_barrier_returns(seen):
    assert seen["place"] == [2, 3]  # and both barriers returned (else no output)


@pytest.mark.parametrize("name", ["all_reduce", "broadcast", "broadcast_object_list", "all_gather_object",
                                  "distributed_c10d.all_gather"])
def test_any_other_collective_says_in_one_line_that_the_others_are_past_it_and_what_to_do(seen, name):
    line = seen["refused"][name]
    assert "\n" not in line and "before the first training step" in line and "mpiddp.keep" in line, line
    assert line.startswith(f"torch.distributed.{name.split('.')[-1]}() before"), line


def test_removing_it_puts_torch_distributed_back_as_it_was(seen):
    assert seen["after"] == [False, True, True]


def test_a_collective_taken_by_name_during_the_start_reaches_the_real_group_after_the_join(seen):
    assert seen["taken_after_join"] == [1.0, 1.0]  # it raised BeforeJoining here before the fix (the job ended)


def test_the_dist_before_the_join_passes_barriers_and_refuses_the_rest_without_ending_anything():
    ended = []
    transport = StandInTransport(2, 3, lambda code: ended.append(code))  # type: ignore[arg-type,return-value]
    transport.barrier()
    transport.idle_barrier(0.1)
    for call in (lambda: transport.bcast(1), lambda: transport.allgather(1), lambda: transport.gather(1)):
        with pytest.raises(BeforeJoining, match="^mpiddp's [a-z]+(\\(\\)| \\(from_main or agree\\)) before"):
            call()
    assert transport.failed_ranks() == () and ended == []
    transport.abort(3)
    assert ended == [3]  # an abort before the join ends this process alone (grow.LateJoin)
