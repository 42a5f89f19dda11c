"""In-job recovery's decisions, in-process: what is recoverable, the global batch and data position re-split over
the survivors (with the trainer's real samplers), and the survivors' topology. The end-to-end runs on fake hosts
are in test_recovery_e2e.py."""

import itertools

import pytest

from mpiddp.elastic.decide import old_group_plan
from mpiddp.elastic.survivors import shrunk_topology
from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.elastic.decide import failure_refusal as refusal
from mpiddp.elastic.decide import job_refusal, nccl_errors_env
from mpiddp.elastic.decide import Resplit, resplit


def test_a_failure_in_training_evaluation_or_a_save_after_the_first_step_is_recoverable():
    assert refusal("train", True, "cpu", "none") is None
    assert refusal("eval", True, "cpu", "fp16") is None
    assert refusal("save", True, "cpu", "none") is None  # rank 0 writes atomically: the save is given up, done again


@pytest.mark.parametrize("where, stepped, device, compression, says", [
    ("train", False, "cpu", "none", "before the first training step"),
    ("save", False, "cpu", "none", "before the first training step"),
    ("train", True, "xpu", "none", "on xpu is not built"),
    ("train", True, "cpu", "powersgd", "PowerSGD"),
])
def test_what_falls_back_says_why_in_one_line(where, stepped, device, compression, says):
    reason = refusal(where, stepped, device, compression)
    assert reason is not None and says in reason and "\n" not in reason


QUIET = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}


def test_a_gpu_job_on_nccl_can_recover_where_torch_can_abort_the_communicator():
    assert job_refusal("cuda", "nccl", "none", True, "2.15.0", QUIET) is None
    assert job_refusal("cuda", "nccl", "fp16", True, "2.15.0", {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}) is None
    assert job_refusal("cuda", "gloo", "none", False, "2.4.1", {}) is None  # gloo over CUDA tensors: nothing to abort
    assert job_refusal("cpu", "gloo", "none", False, "2.4.1", {}) is None


@pytest.mark.parametrize("device, backend, compression, can_abort, env, says", [
    ("cuda", "nccl", "none", False, QUIET, "_abort_process_group (torch 2.5 or newer)"),
    ("cuda", "nccl", "none", True, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=1"),
    ("cuda", "nccl", "none", True, {}, "TORCH_NCCL_ASYNC_ERROR_HANDLING=3"),  # torch's default ends the process
    ("cuda", "nccl", "powersgd", True, QUIET, "PowerSGD"),
    ("cpu", "gloo", "powersgd", True, {}, "PowerSGD"),
])
def test_a_job_whose_settings_rule_out_recovery_says_why_in_one_line(device, backend, compression, can_abort, env,
                                                                     says):
    reason = job_refusal(device, backend, compression, can_abort, "2.4.1", env)
    assert reason is not None and says in reason and "\n" not in reason


def test_nccl_error_handling_is_quieted_unless_the_user_chose():
    assert nccl_errors_env({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}
    assert nccl_errors_env({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}) == {}


def test_the_old_nccl_group_is_aborted_and_a_gloo_group_left_behind():
    assert old_group_plan("nccl", True) == "abort"
    assert old_group_plan("gloo", True) == "forget"
    assert old_group_plan("gloo", False) == "forget"


def test_the_global_batch_is_kept_with_more_accumulation_and_the_position_converted():
    # 16 x 3 ranks x 1 = 48 after 5 steps (80 micro-batches... 5 per rank) -> 12 x 2 ranks x 2 at the same sample 240
    assert resplit(16, 1, 3, 2, 5) == Resplit(12, 2, 10)
    # the per-rank batch stays when it divides: 8 x 4 x 1 = 32 -> 8 x 2 x 2, position 3 x 8 x 4 = 96 = 6 x 8 x 2
    assert resplit(8, 1, 4, 2, 3) == Resplit(8, 2, 6)
    # 64 over 3 ranks: uneven (22, 21, 21 a step, in 3 micro-batches of at most 8), at the same step
    assert resplit(8, 2, 4, 3, 4) == Resplit(8, 3, 6, 64)
    assert resplit(8, 2, 4, 3, 4).describe(3) == ("21 or 22 per rank, each rank's gradient weighted by its share, in "
                                                  "3 micro-batches")


def test_a_failure_after_an_epochs_last_step_leaves_nothing_of_the_epoch_to_train():
    """1438 samples, 32 x 3 ranks: 15 batches each reach position 1440 (the last round padded with repeats). On 2
    ranks (24 x 2 x 2) the epoch is over: the skip covers each survivor's whole shard, and the sampler is empty."""
    from torch.utils.data import DistributedSampler

    from mpiddp.trainer.data import SkippingSampler

    split = resplit(32, 1, 3, 2, 15, epoch_samples=1438)
    assert isinstance(split, Resplit) and (split.batch_size, split.grad_accum) == (24, 2)
    sampler = SkippingSampler(DistributedSampler(range(1438), num_replicas=2, rank=1, shuffle=True, seed=0))
    sampler.skip = split.batches_done * split.batch_size
    assert len(sampler) == 0 and list(sampler) == []
    # mid-epoch positions are converted as before, and a global batch that does not split is still refused
    assert resplit(16, 1, 3, 2, 5, epoch_samples=1438) == Resplit(12, 2, 10)
    # 15 samples a step do not split evenly over 2 ranks: past the epoch's end the uneven split has nothing left
    end = resplit(5, 1, 3, 2, 96, epoch_samples=1438)
    assert isinstance(end, Resplit) and end.uneven and end.batches_done == 192


def test_a_batch_that_cannot_be_split_is_refused_in_one_line():
    # 5 samples a step over 4 ranks of at most 1 a micro-batch: a rank would get an empty micro-batch
    reason = resplit(1, 1, 5, 4, 0)
    assert isinstance(reason, str) and "5" in reason and "empty micro-batch" in reason and "\n" not in reason
    # half-way through a step (a position no step of 30 starts at) is refused too
    reason = resplit(5, 2, 3, 2, 1)
    assert isinstance(reason, str) and "not at the start of an optimizer step of 30 samples" in reason


def _positions_trained(n: int, world: int, per_rank: int, seed: int, epoch: int, skip_batches: int,
                       batches: int | None) -> list[int]:
    """Sample indices the trainer's samplers hand ranks 0..world-1 for `batches` full batches each (None: to the
    end, dropping a trailing short batch as the trainer's loader does), after `skip_batches`."""
    from torch.utils.data import DistributedSampler

    from mpiddp.trainer.data import SkippingSampler

    trained = []
    for rank in range(world):
        sampler = SkippingSampler(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=seed))
        sampler.set_epoch(epoch)
        sampler.skip = skip_batches * per_rank
        indices = [index for index, _ in sampler]
        full = len(indices) // per_rank if batches is None else batches
        trained += indices[:full * per_rank]
    return trained


def test_survivors_continue_the_epoch_at_the_same_sample_none_skipped_or_repeated():
    """With the real samplers: 5 steps of 16 x 3 ranks, then the survivors' split from the converted position,
    to the end of the epoch. Together they train a prefix of the epoch's order once each, the same prefix an
    uninterrupted run on 2 ranks would reach."""
    import torch

    n, seed, epoch = 1438, 0, 1
    before = _positions_trained(n, 3, 16, seed, epoch, 0, 5)
    split = resplit(16, 1, 3, 2, 5)
    after = _positions_trained(n, 2, split.batch_size, seed, epoch, split.batches_done, None)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    assert len(set(before + after)) == len(before + after)  # nothing repeated
    assert sorted(before + after) == sorted(order[:len(before) + len(after)])  # nothing skipped: a prefix
    assert (len(before), len(after)) == (240, 1176)
    assert sorted(before + after) == sorted(_positions_trained(n, 2, 12, seed, epoch, 0, None))


def _records(hosts: list[str]) -> list[RankRecord]:
    records = []
    for rank, host in enumerate(hosts):
        peers = [r for r, h in enumerate(hosts) if h == host]
        records.append(RankRecord(rank, host, peers[0], peers.index(rank), len(peers)))
    return records


def test_the_survivors_topology_renumbers_ranks_hosts_and_local_ranks():
    old = build_topology(2, _records(["nodea", "nodea", "nodeb", "nodeb", "nodec"]), "Open MPI v5")
    new = shrunk_topology(old, (0, 2, 3, 4), 1)  # rank 1 (nodea's second) died; old rank 2 is now rank 1
    assert (new.rank, new.world_size, new.hostname, new.local_rank, new.local_world_size) == (1, 4, "nodeb", 0, 2)
    assert new.hosts == (("nodea", (0,)), ("nodeb", (1, 2)), ("nodec", (3,)))
    assert new.mpi_library == "Open MPI v5"
    gone = shrunk_topology(old, (2, 3, 4), 0)  # all of nodea lost
    assert (gone.num_hosts, gone.host_index, gone.is_main) == (2, 0, True)


def test_every_survivor_derives_the_same_world():
    old = [build_topology(rank, _records(["a", "b", "c"])) for rank in range(3)]
    alive = (0, 2)
    worlds = {shrunk_topology(old[o], alive, new).hosts for new, o in enumerate(alive)}
    assert worlds == {(("a", (0,)), ("c", (1,)))}
    assert list(itertools.chain.from_iterable(r for _, r in worlds.pop())) == [0, 1]


class DictStore:
    """The few TCPStore calls the watchdog makes, in a dict; `timing_out` makes each one time out as a store
    whose process died or stopped would."""

    def __init__(self, timing_out: bool = False) -> None:
        self.data: dict[str, bytes] = {}
        self.timing_out = timing_out
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        if self.timing_out:
            raise RuntimeError("Socket Timeout")

    def add(self, key: str, amount: int) -> int:
        self._call()
        value = int(self.data.get(key, b"0")) + amount
        self.data[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self._call()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys: list[str]) -> bool:
        self._call()
        return all(key in self.data for key in keys)

    def get(self, key: str) -> bytes:
        self._call()
        return self.data[key]


def _poll(condition, seconds: float = 20.0) -> bool:
    import time

    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)  # polling a condition with a deadline, not synchronising
    return condition()


def test_the_watchdog_keeps_quiet_while_recovering_and_then_watches_the_survivors_new_store():
    """Rank 0's store died with rank 0: while the survivors recover, its timeouts name no hang (before: the
    watchdog ended the job, EXIT_HANG); afterwards the same watchdog reports under the new rank to the new store."""
    from types import SimpleNamespace

    from mpiddp.job.collective import Rendezvous, solo_dist
    from mpiddp.job.watchdog import Watchdog

    aborted: list[int] = []
    dead = DictStore(timing_out=True)
    dog = Watchdog(60.0, 2, 3, "rank 2", dead, aborted.append)
    dog.interval = 0.01
    dog.suspend()  # (in a job: when the survivors learn of the failure, the thread already running)
    dog.start()
    new = DictStore()
    dist = solo_dist()
    dist.rebind(dist.topology, dist.transport, Rendezvous("127.0.0.1", 1, {}, SimpleNamespace(store=new)))
    old_thread = dog.thread
    dog.follow(dist)
    dog.interval = 0.01
    assert _poll(lambda: "mpiddp/progress/0" in new.data)
    assert _poll(lambda: not old_thread.is_alive())
    assert aborted == [] and (dog.rank, dog.world_size) == (0, 1)
    dog.stop()


@pytest.mark.usefixtures("solo_group")
@pytest.mark.parametrize("replicas_agree", [False, True])
def test_a_recovery_rewraps_without_broadcasting_the_model_where_torch_allows(monkeypatch, replicas_agree):
    """The survivors hold the same weights: at 16k GPUs the broadcast of a model of many GB is not needed."""
    import types

    import torch
    import torch.nn.parallel.distributed as ddp_module

    from mpiddp.job.compression import TransportChoice
    from mpiddp.trainer import state
    from mpiddp.trainer.config import Config

    if replicas_agree and not state.DDP_CAN_SKIP_INIT_SYNC:
        pytest.skip(f"torch {torch.__version__}'s DDP has no init_sync: it always broadcasts")
    synced = []
    real = ddp_module._sync_module_states
    monkeypatch.setattr(ddp_module, "_sync_module_states", lambda *a, **k: (synced.append(1), real(*a, **k))[1])
    dist = types.SimpleNamespace(device=torch.device("cpu"), backend="gloo")
    state.wrap(Config.of(dataset="digits"), dist, torch.nn.Linear(4, 2), transport=TransportChoice("gloo", "gloo", "test"),
               replicas_agree=replicas_agree)
    assert bool(synced) is not replicas_agree


class AgreeingMembers:
    """Membership's part of a save's agreement: what MPI_Comm_agree answers, and the failed ranks MPI reports."""

    def __init__(self, agreed, failed=()):
        self.agreed, self.failed_ranks, self.asked = agreed, failed, []

    def all_completed(self, completed):
        self.asked.append(completed)
        return self.agreed and completed

    def confirm(self, grace_s):
        return self.failed_ranks or None


def test_a_save_that_completed_here_but_not_on_every_survivor_is_given_up_here_too():
    """A save's collectives can complete on some ranks only: its outcome is agreed, so a rank whose save returned
    gives it up with the others (MembersLost: the engine recovers, every survivor saves again); before, it went on
    into the next body while the others redid the save."""
    from mpiddp.elastic.membership import MembersLost
    from mpiddp.trainer.elastic_policy import TrainerPolicy

    policy, saved = TrainerPolicy(), []
    policy.members = AgreeingMembers(agreed=True)
    policy.around_save(saved.append)("state")
    assert saved == ["state"] and policy.members.asked == [True]
    policy.members = AgreeingMembers(agreed=False, failed=(2,))
    with pytest.raises(MembersLost) as caught:
        policy.around_save(saved.append)("state")
    assert caught.value.ranks == (2,) and policy.members.asked == [True]
    lost = MembersLost((1,), 0.0)

    def peer_died(state):
        raise lost

    policy.members = AgreeingMembers(agreed=True)
    with pytest.raises(MembersLost) as caught:
        policy.around_save(peer_died)("state")
    assert caught.value is lost and policy.members.asked == [False]  # this rank's word: not completed
