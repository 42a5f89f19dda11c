"""Gradient compression in-process: each hook trains, flags parse and validate."""

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mpiddp.job import compression
from mpiddp.trainer.config import Config, ConfigError, parse_args
from mpiddp.trainer.models import build_model

pytestmark = pytest.mark.usefixtures("solo_group")


def steps(ddp, optimizer, count, seed):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(count):
        optimizer.zero_grad()
        inputs, targets = torch.randn(16, 1, 8, 8, generator=generator), torch.randint(0, 10, (16,), generator=generator)
        torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
        optimizer.step()


def fresh(kind):
    torch.manual_seed(0)
    model = build_model("digits_cnn")
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
    hook = compression.register(ddp, kind, rank=2, warmup_steps=2, backend="gloo")
    return model, ddp, hook, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("kind", ["none", "fp16", "bf16", "powersgd"])
def test_each_compression_trains_and_reports_ready_buckets(kind):
    model, ddp, hook, optimizer = fresh(kind)
    ready = []
    hook.on_ready = lambda: ready.append(1)
    before = copy.deepcopy(model.state_dict())
    steps(ddp, optimizer, 4, seed=1)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert (hook.powersgd is not None) == (kind == "powersgd")
    assert len(ready) >= 4  # at least one ready bucket per step


class UsedInReverse(torch.nn.Module):
    """Layers registered in the opposite order of use: DDP's first buckets (registration order) differ from
    the ones it rebuilds after the first step (gradient order), as in many real models."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(256, 10)
        self.body = torch.nn.Linear(512, 256)
        self.stem = torch.nn.Linear(64, 512)

    def forward(self, x):
        return self.head(torch.relu(self.body(torch.relu(self.stem(x.flatten(1))))))


def powersgd_job(seed=0):
    torch.manual_seed(seed)
    model = UsedInReverse()
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.1)  # several buckets
    hook = compression.register(ddp, "powersgd", rank=2, warmup_steps=2, backend="gloo")
    return model, ddp, hook, torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def test_powersgd_state_survives_a_restart():
    """Error feedback and warm-start Q saved per parameter and restored into a new DDP whose buckets differ
    (its first step runs on the initial buckets): the resumed weights equal the uninterrupted run's up to
    float rounding (BLAS rounds by memory alignment, and the buckets put tensors at other offsets); without
    the state they differ at the scale of the updates."""
    model, ddp, hook, optimizer = powersgd_job()
    steps(ddp, optimizer, 9, seed=1)
    uninterrupted = copy.deepcopy(model.state_dict())

    def resumed(load_hook_state):
        model, ddp, hook, optimizer = powersgd_job()
        steps(ddp, optimizer, 5, seed=1)  # the same first five steps (the data generator is re-seeded below)
        saved = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(optimizer.state_dict()),
                 "hook": copy.deepcopy(hook.state_dict())}
        assert saved["hook"]["error"] and saved["hook"]["q"] and saved["hook"]["iter"] == 5
        model, ddp, hook, optimizer = powersgd_job(seed=7)  # a new job: other initial weights, overwritten
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        if load_hook_state:
            hook.load_state_dict(saved["hook"])
        generator_state = torch.Generator().manual_seed(1)
        for _ in range(5):  # skip the data the first job consumed
            torch.randn(16, 1, 8, 8, generator=generator_state), torch.randint(0, 10, (16,), generator=generator_state)
        for _ in range(4):
            optimizer.zero_grad()
            inputs = torch.randn(16, 1, 8, 8, generator=generator_state)
            targets = torch.randint(0, 10, (16,), generator=generator_state)
            torch.nn.functional.cross_entropy(ddp(inputs), targets).backward()
            optimizer.step()
        return model.state_dict()

    def largest_difference(weights):
        return max(float((uninterrupted[k] - v).abs().max()) for k, v in weights.items())

    assert largest_difference(resumed(load_hook_state=True)) < 1e-6
    assert largest_difference(resumed(load_hook_state=False)) > 1e-4  # the state matters


def test_compression_flags():
    cfg = parse_args(["--grad-compression", "powersgd", "--powersgd-rank", "4", "--bucket-cap-mb", "50", "--static-graph"])
    assert (cfg.training.grad_compression, cfg.training.powersgd_rank, cfg.training.bucket_cap_mb, cfg.training.static_graph) == ("powersgd", 4, 50.0, True)
    with pytest.raises(ConfigError, match="--grad-compression must be one of none, fp16, bf16, powersgd"):
        parse_args(["--grad-compression", "int8"])
    with pytest.raises(ValueError, match="--powersgd-warmup-steps must be at least 2"):
        Config.of(powersgd_warmup_steps=1)


class Bucket:
    """What DDP hands a comm hook: an index, a flat buffer, whether it is the step's last."""

    def __init__(self, index, count):
        self._index, self._count, self._buffer = index, count, torch.full((4,), float(index + 1))

    def index(self):
        return self._index

    def buffer(self):
        return self._buffer

    def is_last(self):
        return self._index == self._count - 1


class WatchingMembers:
    """A Membership stand-in that records each wait."""

    def __init__(self):
        self.waited = 0

    def wait(self, work):
        work.wait()
        self.waited += 1


@pytest.mark.parametrize("kind", ["none", "bf16"])
def test_watched_buckets_overlap_the_next_backward_and_all_end_before_ddp_finalizes(kind):
    members = WatchingMembers()
    hook = compression.GradientHook(kind, [], on_ready=lambda: None, members=members)
    buckets = [Bucket(index, 3) for index in range(3)]
    futures = [hook.run(buckets[0])]
    assert not futures[0].done()  # still in flight while the next bucket's backward runs
    futures.append(hook.run(buckets[1]))
    assert futures[0].done() and not futures[1].done()
    futures.append(hook.run(buckets[2]))  # the last bucket: DDP's finalize finds every future complete
    assert all(future.done() for future in futures) and members.waited == 3
    for index, future in enumerate(futures):  # world of one: the sum is the bucket itself
        assert torch.equal(future.wait(), torch.full((4,), float(index + 1)))
    stale = hook.run(Bucket(0, 3))  # a backward that raised left it in flight; the next step starts afresh
    hook.run(Bucket(0, 3))
    assert not stale.done() and len(hook.watched._in_flight) == 1


class LosingMembers(WatchingMembers):
    """A Membership stand-in whose peer has failed: every wait says so, as MPI would."""

    def wait(self, work):
        from mpiddp.elastic.membership import MembersLost

        self.waited += 1
        raise MembersLost((1,), 0.0)


@pytest.mark.parametrize("kind", ["none", "fp16"])
def test_gpu_buckets_are_handed_to_ddp_unwaited_and_settled_on_the_main_thread(kind):
    """The GPU path (run here on CPU tensors through `_deferred` itself): the hook never calls MPI, since DDP runs
    it on autograd's device thread; `settle`, after backward, waits for every bucket under the failure watch."""
    members = WatchingMembers()
    hook = compression.GradientHook(kind, [], on_ready=lambda: None, members=members)
    futures = [hook.watched._deferred(Bucket(index, 3)) for index in range(3)]
    assert members.waited == 0 and len(hook.watched.pending) == 3
    hook.settle()
    assert members.waited == 3 and hook.watched.pending == []
    for index, future in enumerate(futures):  # world of one: the sum is the bucket itself
        assert torch.equal(future.wait(), torch.full((4,), float(index + 1)))
    hook.settle()  # nothing in flight (CPU buckets are waited for in the hook): nothing to do
    assert members.waited == 3


def test_a_peer_lost_during_a_gpu_step_is_raised_by_settle_and_the_next_step_starts_afresh():
    from mpiddp.elastic.membership import MembersLost

    hook = compression.GradientHook("none", [], on_ready=lambda: None, members=LosingMembers())
    hook.watched._deferred(Bucket(0, 2))
    with pytest.raises(MembersLost):
        hook.settle()
    hook.watched._deferred(Bucket(0, 2))
    hook.watched._deferred(Bucket(0, 2))  # a backward that raised before settling: its work is not waited for again
    assert len(hook.watched.pending) == 1


def test_a_peer_lost_in_an_absorbing_watch_marks_the_step_and_sends_no_later_bucket():
    """mpiddp.DistributedDataParallel's use of the one watched all-reduce: the failure is kept, not raised (the
    step is skipped on every survivor), every bucket's future completes with this rank's own gradients, later
    buckets are not sent, and `settle` hands the failure back; a new step starts clean."""
    from mpiddp.elastic.membership import MembersLost

    members = LosingMembers()
    watch = compression.WatchedAllReduce(members.wait, absorb=MembersLost)
    futures = [watch.run(Bucket(index, 3)) for index in range(3)]
    assert isinstance(watch.lost, MembersLost) and members.waited == 1  # the first wait said so: no more waits
    assert all(future.done() for future in futures)  # DDP's finalize finds every future complete
    assert isinstance(watch.settle(), MembersLost)
    watch.new_step()
    assert watch.lost is None and watch.settle() is None


def test_an_absorbing_watch_keeps_a_lost_broadcast_and_leaves_this_ranks_buffers():
    from mpiddp.elastic.membership import MembersLost

    watch = compression.WatchedAllReduce(LosingMembers().wait, absorb=MembersLost)
    running_mean = torch.full((3,), 2.0)
    watch.broadcast_buffers([running_mean])
    assert isinstance(watch.lost, MembersLost) and torch.equal(running_mean, torch.full((3,), 2.0))


def test_the_trainers_hook_and_the_scripts_wrapper_run_the_same_watched_all_reduce():
    from mpiddp.elastic.steps import WatchedAllReduce

    hook = compression.GradientHook("fp16", [], on_ready=lambda: None, members=WatchingMembers())
    assert isinstance(hook.watched, compression.WatchedAllReduce) and WatchedAllReduce is compression.WatchedAllReduce
    assert compression.GradientHook("none", [], on_ready=lambda: None).watched is None  # no recovery: DDP's own
