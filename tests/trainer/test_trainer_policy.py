"""The trainer's elastic policy (mpiddp.trainer.elastic_policy.TrainerPolicy), in-process with fakes: what it
refuses, what it notes before the shrink and records as a recovery settles, the first step after it, the split of a
grow, the records gathered at the end, and the loop's hooks it wraps. No MPI; the engine is a fake."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from mpiddp.elastic.decide import Resplit
from mpiddp.job.topology import RankRecord, build_topology
from mpiddp.trainer.elastic_policy import TrainerPolicy, TrainingParts


def topology(rank: int, hosts: list[str], failure_file: str = ""):
    import dataclasses

    records = []
    for each, host in enumerate(hosts):
        peers = [r for r, h in enumerate(hosts) if h == host]
        records.append(RankRecord(each, host, peers[0], peers.index(each), len(peers)))
    return dataclasses.replace(build_topology(rank, records), failure_file=failure_file)


class Watchdog:
    def __init__(self, excluded=(), silenced=()) -> None:
        self.excluded, self.silenced, self.suspended, self.followed = set(excluded), set(silenced), 0, []

    def suspend(self) -> None:
        self.suspended += 1

    def follow(self, dist) -> None:
        self.followed.append(dist)


class FakeDist:
    def __init__(self, topo, device_type: str = "cpu", views=None) -> None:
        self.topology, self.device_type, self.views = topo, device_type, views

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_main(self) -> bool:
        return self.topology.is_main

    def gather(self, value):
        return None if self.views is None else [value, *self.views]


def config(batch: int = 16, accumulation: int = 1, compression: str = "none"):
    return SimpleNamespace(training=SimpleNamespace(batch_size=batch, grad_accum=accumulation,
                                                    grad_compression=compression),
                           outputs=SimpleNamespace(log_level="info"))


def policy_on(dist, run_dir: Path, watchdog=None, cfg=None, step: int = 12, loaders=None) -> TrainerPolicy:
    """A TrainerPolicy bound to a fake engine over `dist`, with the run's parts."""
    policy = TrainerPolicy()
    policy.dists, policy.members = [dist], None
    policy.engine = SimpleNamespace(said_reduced=[], initial_world=3)
    policy.engine.say_reduced = policy.engine.said_reduced.append
    state = SimpleNamespace(step=step, batches_done=0, commit=None)
    policy.parts = TrainingParts(cfg or config(), state, loaders, None, watchdog or Watchdog(), None, run_dir,
                                 SimpleNamespace(cfg=None, parent=None, wandb_run_id=None))
    return policy


def test_a_failure_before_the_first_step_or_with_powersgd_is_refused_and_one_after_it_recovers(tmp_path):
    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path)
    policy.where = "train"
    assert "before the first training step" in policy.refusal()
    policy.stepped = True
    assert policy.refusal() is None
    policy.cfg = config(compression="powersgd")  # the survivors' config wins over the run's first
    assert "PowerSGD" in policy.refusal()
    gpu_like = policy_on(FakeDist(topology(0, ["a", "b"]), device_type="xpu"), tmp_path)
    gpu_like.stepped = True
    assert "on xpu is not built" in gpu_like.refusal()


def settle(policy: TrainerPolicy, before, failed, caught_up: bool) -> dict:
    policy.settle(before, failed, {"detect": 0.1, "agree_and_shrink": 0.2, "process_group": 0.3, "ddp": 0.4},
                  (caught_up, Resplit(24, 1, 6)))
    return policy.records[-1]


def test_a_recovery_is_recorded_with_what_was_noted_before_the_shrink(tmp_path):
    before = topology(1, ["a", "b", "c"])
    dist = FakeDist(topology(0, ["a", "c"]))
    watchdog = Watchdog(excluded={1})
    policy = policy_on(dist, tmp_path, watchdog, step=12)
    policy.in_step = True
    policy.before_shrink()
    assert watchdog.suspended == 1
    policy.parts.state.step = 99  # the step at the shrink is the one recorded, not a later one

    record = settle(policy, before, (1,), caught_up=False)
    assert {key: record[key] for key in ("cause", "ranks_lost", "hosts_lost", "step", "steps_lost", "world_before",
                                         "world_after")} == {
        "cause": "hang", "ranks_lost": [1], "hosts_lost": ["b"], "step": 12, "steps_lost": 1, "world_before": 3,
        "world_after": 2}
    assert record["phases"]["first_step"] is None and not policy.in_step
    assert policy.engine.said_reduced == [True]  # the first change of size
    # the new rank 0 puts it in the failures directory as it happens (launch reads it)
    lines = (tmp_path / "failures" / "recoveries.jsonl").read_text().splitlines()
    assert [json.loads(line)["ranks_lost"] for line in lines] == [[1]]


def test_a_step_some_survivor_finished_loses_nothing_and_a_silent_host_is_its_cause(tmp_path):
    before = topology(0, ["a", "b", "c"])
    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path, Watchdog(silenced={2}))
    policy.in_step = True
    policy.before_shrink()
    record = settle(policy, before, (2,), caught_up=True)
    assert (record["cause"], record["steps_lost"]) == ("silent_host", 0)
    policy.before_shrink()  # a second loss, outside a step, on a quiet watchdog
    record = settle(policy, before, (1,), caught_up=False)
    assert (record["cause"], record["steps_lost"]) == ("process_failed", 0)
    assert policy.engine.said_reduced == [True, False]


def test_the_first_training_step_after_a_recovery_ends_its_first_step_phase_and_allows_a_grow(tmp_path):
    dist = FakeDist(topology(1, ["a", "b"]))  # not rank 0: nothing written
    policy = policy_on(dist, tmp_path)
    policy.stepped = True
    policy.before_shrink()
    record = settle(policy, topology(1, ["a", "b", "c"]), (2,), caught_up=True)
    assert not policy.stepped_since_change
    policy.beat("eval", 12)  # not a training step
    assert record["phases"]["first_step"] is None and not policy.stepped_since_change
    policy.beat("train", 13)
    assert record["phases"]["first_step"] is not None and record["phases"]["first_step"] >= 0
    assert policy.stepped_since_change and policy.alive_at() > 0
    assert not (tmp_path / "failures").exists()


def test_a_grow_takes_the_first_per_rank_batch_back_or_says_why_it_never_can(tmp_path):
    loaders = SimpleNamespace(samples_per_step=48, epoch_end=4800, position=lambda done: done * 24)
    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path, cfg=config(16, 1), loaders=loaders)
    policy.cfg = config(12, 2)  # the survivors' split of 3 x 16 on 2 ranks
    policy.parts.state.batches_done = 12  # sample 288 = 6 steps of 48
    assert policy.grow_split(2, 3) == Resplit(16, 1, 6)
    policy.parts.state.batches_done = 13  # sample 312: not a step boundary of the grown job
    assert policy.grow_split(2, 3) is None
    odd = policy_on(FakeDist(topology(0, ["a"] * 4)), tmp_path, cfg=config(1, 1),
                    loaders=SimpleNamespace(samples_per_step=5, epoch_end=50, position=lambda done: 0))
    said = odd.grow_split(4, 4)
    assert isinstance(said, str) and "cannot keep its global batch on 4 ranks" in said


def test_the_records_gathered_at_the_end_take_each_phase_from_the_slowest_survivor(tmp_path):
    mine = {"cause": "process_failed", "phases": {"detect": 0.5, "ddp": 1.0, "first_step": None}}
    theirs = [([({"detect": 0.2, "ddp": 3.0, "first_step": 0.7}, "hang", None, None)])]
    policy = policy_on(FakeDist(topology(0, ["a", "b"]), views=theirs), tmp_path)
    policy.records = [mine]
    (merged,) = policy.gathered(policy.dists[0])
    assert merged["phases"] == {"detect": 0.2, "ddp": 3.0, "first_step": 0.7}  # detect: the earliest notice
    assert merged["cause"] == "hang"  # a survivor whose watchdog learned of a hang says so
    assert mine["phases"]["detect"] == 0.5  # this rank's own view stays
    elsewhere = policy_on(FakeDist(topology(1, ["a", "b"])), tmp_path)
    elsewhere.records = [mine]
    assert elsewhere.gathered(elsewhere.dists[0]) == []  # the summary is rank 0's


def test_the_trainers_end_gives_a_warming_grow_up_as_the_job_ending(tmp_path):
    """A grow still warming up when training ends never joins: given up as the job's end (its hot spares leave
    with the job; they do not wait again), before the records are gathered."""
    policy = policy_on(FakeDist(topology(0, ["a", "b"]), views=[[]]), tmp_path)
    given_up = []
    policy.grower = SimpleNamespace(abandon=lambda dist, why, job_ends=False: given_up.append((why, job_ends)))
    policy.records = []
    assert policy.gathered(policy.dists[0]) == []
    assert given_up == [("training ended while they warmed up", True)]


def test_the_loop_s_hooks_note_the_step_phase_and_ask_the_grower_at_each_training_step(tmp_path):
    from mpiddp.trainer.train import Hooks

    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path)
    asked, entered = [], []
    policy.grower = SimpleNamespace(at_boundary=asked.append)
    hooks = policy.hooks(Hooks(log=None, save=lambda state: None, stop=None, phase=entered.append))
    assert hooks.in_job == policy.attempt
    hooks.phase("compute")
    assert policy.in_step and asked == []
    policy.where = "eval"
    hooks.phase("data")
    assert asked == [] and not policy.in_step
    policy.where = "train"
    hooks.phase("data")
    assert asked == [policy] and entered == ["compute", "data", "data"]


def test_a_recovery_reruns_the_body_with_the_survivors_config_and_restores_where(tmp_path):
    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path)
    seen = []

    def run(body):
        seen.append((body(), policy.where))
        policy.cfg = config(24)  # recovered: the survivors' split
        return body()

    policy.engine.run = run
    first = config(16)
    policy.where = "train"
    assert policy.attempt(lambda cfg: cfg.training.batch_size, first, "save") == 24
    assert seen == [(16, "save")] and policy.where == "train"


class HeldStep:
    """The late commit's undo record as the trainer's StepCommit sees it: held, then restored (or not)."""

    def __init__(self) -> None:
        self.held, self.restored = False, 0

    def take(self) -> None:
        self.held = True

    def restore(self) -> None:
        self.restored += 1

    def drop(self) -> None:
        self.held = False


def test_under_the_late_commit_the_held_step_and_its_position_are_undone_before_the_shrink(tmp_path):
    """Every survivor rolls back the step it holds (mpiddp.trainer.commit) before the furthest one is looked for:
    the step and position recorded are the ones before it, and it counts as lost; with nothing held, nothing."""
    from mpiddp.elastic.latecommit import LateCommit
    from mpiddp.trainer.commit import StepCommit

    policy = policy_on(FakeDist(topology(0, ["a", "b", "c"])), tmp_path, step=12)
    state = policy.parts.state
    undo = HeldStep()
    state.commit = commit = StepCommit(LateCommit(SimpleNamespace(), undo))
    commit.strict_next = False
    state.gradient_hook = None
    state.batches_done = 12
    commit.before_step(state)  # nothing held yet: no agreement, step 13 held
    state.step, state.batches_done = 13, 13
    policy.before_shrink()
    assert undo.restored == 1 and (state.step, state.batches_done) == (12, 12) and commit.strict_next
    record = settle(policy, topology(0, ["a", "b", "c"]), (1,), caught_up=True)
    assert (record["step"], record["steps_lost"]) == (12, 1)
    policy.before_shrink()  # a second loss with nothing held
    assert undo.restored == 1 and settle(policy, topology(0, ["a", "b"]), (1,), caught_up=True)["steps_lost"] == 0


def test_the_loop_learns_whether_its_epoch_runs_again_after_a_failure_or_after_a_grow(tmp_path):
    """The epoch run again after a grow asks rank 0 for no caught-up line (train.log_caught_up_step); after a
    failure it does: every survivor and every new rank must tell the two alike, or one waits in a broadcast the
    others never make (a hang)."""
    from mpiddp.job.stopping import StopRequest
    from mpiddp.trainer.metrics import NullLogger
    from mpiddp.trainer.train import Hooks

    policy = policy_on(FakeDist(topology(0, ["a", "b"])), tmp_path)
    loop_hooks = policy.hooks(Hooks(NullLogger(), lambda state: None, StopRequest()))
    assert loop_hooks.again_after_failure()
    policy.regrown()
    assert not loop_hooks.again_after_failure()
    policy.before_shrink()  # a failure after the grow
    assert loop_hooks.again_after_failure()


class CountingHook:
    """The trainer's gradient hook as StepCommit uses it: settles, and rebuilds DDP's buckets when asked."""

    def __init__(self, pending: int = 1) -> None:
        self.calls: list[str] = []
        self.pending = pending  # rebuilds until DDP's buckets are laid out (a static graph: two)

    def settle(self) -> None:
        self.calls.append("settle")

    def rebuild_buckets(self) -> None:
        self.calls.append("rebuild")
        self.pending -= 1

    def layout_pending(self) -> bool:
        return self.pending > 0


@pytest.mark.parametrize("late", [False, True], ids=["strict", "late"])
def test_the_first_step_over_a_process_group_rebuilds_ddps_buckets_watched_after_settling_and_later_ones_do_not(
        late):
    """DDP's bucket re-layout is started where the first step over a process group ends (its all-reduces settled),
    watched, not left to DDP's next forward, unwatched; again after a roll back (the recovery's new group)."""
    from mpiddp.elastic.latecommit import LateCommit
    from mpiddp.trainer.commit import StepCommit

    commit = StepCommit(LateCommit(SimpleNamespace(agree=lambda: True, holding=False), HeldStep()) if late else None)
    hook = CountingHook()
    state = SimpleNamespace(gradient_hook=hook, step=0, batches_done=0)
    commit.before_step(state)
    assert hook.calls == ["settle", "rebuild"] and not commit.strict_next
    hook.calls.clear()
    if not late:
        commit.before_step(state)
        assert hook.calls == ["settle"]
    commit.roll_back(state)
    hook.calls.clear()
    commit.before_step(state)
    assert hook.calls == ["settle", "rebuild"]


def test_with_a_static_graph_the_steps_stay_strict_until_ddp_has_laid_its_buckets_out():
    """DDP lays a static graph's buckets out after its second step: the commit stays strict (and asks for the
    watched re-layout) until it is done, then goes late."""
    from mpiddp.elastic.latecommit import LateCommit
    from mpiddp.trainer.commit import StepCommit

    commit = StepCommit(LateCommit(SimpleNamespace(agree=lambda: True, holding=False), HeldStep()))
    hook = CountingHook(pending=2)
    state = SimpleNamespace(gradient_hook=hook, step=0, batches_done=0)
    commit.before_step(state)
    assert hook.calls == ["settle", "rebuild"] and commit.strict_next
    commit.before_step(state)
    assert hook.calls == ["settle", "rebuild"] * 2 and not commit.strict_next
