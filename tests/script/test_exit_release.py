"""`mpiddp run` after the script returned: no gloo worker thread still holds a Python object torch stashed for a
backward (mpiddp.script.run.stashed_objects_released). One let go during the interpreter's exit aborts the rank
("terminate called without an active exception" from ProcessGroupGloo::runLoop, status 134: seen in CI)."""

import threading
import time

import pytest
import torch
import torch.distributed as tdist

from mpiddp.script.run import stashed_objects_released

# torch 2.12 began to stash each backward's contextvars.Context for the threads its collectives run on; before it
# nothing is stashed so (the runner waits for nothing), and stashing None crashes torch 2.4's interpreter
pytestmark = pytest.mark.skipif(torch.torch_version.TorchVersion(torch.__version__) < "2.12",
                                reason="torch < 2.12 stashes nothing for other threads")


class Probe:
    """Says which thread let it go, and when."""

    def __init__(self, freed: list[tuple[bool, float]]) -> None:
        self.freed = freed

    def __del__(self) -> None:
        self.freed.append((threading.current_thread() is threading.main_thread(), time.monotonic()))


def test_the_runner_returns_once_the_gloo_threads_let_go_of_what_a_backward_stashed(solo_group):
    """A backward's stash, copied by the all-reduces it issued (as DDP's), still queued in gloo's worker threads as
    the script ends: the runner waits for them, so the stashed object goes in this thread, before it returns."""
    freed: list[tuple[bool, float]] = []
    payload = torch.ones(4_000_000)
    with stashed_objects_released():
        torch._C._stash_obj_in_tls("probe", Probe(freed))  # as torch.autograd's backward stashes its context
        futures = [tdist.all_reduce(payload, async_op=True).get_future() for _ in range(20)]  # copies of the state
        torch._C._stash_obj_in_tls("probe", None)  # this thread lets go of it (torch >= 2.12 removes the key)
        del futures  # never waited for: they run on in gloo's threads
        if freed:
            pytest.skip("this torch's collectives do not copy the thread-local state")
    returned = time.monotonic()
    assert len(freed) == 1 and freed[0][0] and freed[0][1] <= returned, freed


def test_an_object_held_past_the_deadline_does_not_hold_the_runner_up(solo_group):
    kept_here = []
    started = time.monotonic()
    with stashed_objects_released(deadline_s=0.2):
        torch._C._stash_obj_in_tls("probe", Probe(kept_here))
        kept_here.append(torch._C._get_obj_in_tls("probe"))  # held for good, as by a collective that never ends
        torch._C._stash_obj_in_tls("probe", None)
    assert 0.2 <= time.monotonic() - started < 5
