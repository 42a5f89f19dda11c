"""The training loop's parts in-process (one rank, no mpirun): step, accumulation, epochs, stops, resume skipping."""

import copy
import signal

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from mpiddp.job.collective import solo_dist
from mpiddp.job.stopping import Stopped, StopRequest
from mpiddp.trainer.config import Config
from mpiddp.trainer.data import SkippingSampler, SyntheticBatches, build_loaders, load_datasets
from mpiddp.trainer.metrics import NullLogger
from mpiddp.trainer.models import build_model
from mpiddp.trainer.state import TrainState, build_state
from mpiddp.trainer.drills import inject_fault
from mpiddp.trainer.train import Hooks, Meter, micro_batch_groups, train, train_step

pytestmark = pytest.mark.usefixtures("solo_group")


class Recorder(NullLogger):
    def __init__(self):
        self.records = []

    def log(self, record):
        self.records.append(record)


def job(**overrides):
    cfg = Config.of(device="cpu", wandb="disabled", progress="off", **overrides)
    dist = solo_dist()
    datasets = load_datasets(cfg, lambda channels: channels)
    loaders = build_loaders(cfg, datasets, dist)
    state = build_state(cfg, dist, loaders.num_classes, datasets.channels, len(loaders.train))
    return cfg, dist, loaders, state


def hooks(saved, stop=None):
    return Hooks(Recorder(), lambda state: saved.append((state.epoch, state.step, state.batches_done)), stop or StopRequest())


def test_micro_batch_groups_end_with_a_shorter_group():
    assert list(micro_batch_groups(range(5), 2)) == [[0, 1], [2, 3], [4]]
    assert list(micro_batch_groups(range(4), 1)) == [[0], [1], [2], [3]]


def plain_state(model, ddp=None):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainState(ddp or model, ddp, model, optimizer, schedule, torch.amp.GradScaler("cpu", enabled=False))


def test_accumulated_step_equals_one_step_on_the_concatenated_batch():
    torch.manual_seed(0)
    model = build_model("digits_cnn").double()
    reference = copy.deepcopy(model)
    state, reference_state = plain_state(model, DistributedDataParallel(model)), plain_state(reference)
    inputs, targets = torch.randn(24, 1, 8, 8, dtype=torch.float64), torch.randint(0, 10, (24,))
    for _ in range(3):
        loss, images = train_step(state, list(zip(inputs.chunk(3), targets.chunk(3))), torch.device("cpu"))
        train_step(reference_state, [(inputs, targets)], torch.device("cpu"))
    assert images == 24 and state.step == 3 and loss.item() > 0
    for mine, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(mine, theirs, atol=1e-12)


def test_train_logs_every_window_and_epoch_and_saves_at_the_cadence():
    cfg, dist, loaders, state = job(epochs=3, batch_size=64, log_every=5, save_every=2)
    saved = []
    loop_hooks = hooks(saved)
    outcome = train(cfg, state, loaders, dist, loop_hooks)
    steps_per_epoch = len(loaders.train)
    assert [r["epoch"] for r in outcome.epochs] == [1, 2, 3]
    assert saved == [(2, 2 * steps_per_epoch, 0), (3, 3 * steps_per_epoch, 0)]  # every 2nd epoch and the last
    kinds = [r["kind"] for r in loop_hooks.log.records]
    assert kinds.count("epoch") == 3 and kinds.count("step") == 3 * steps_per_epoch // 5
    last = outcome.epochs[-1]
    assert last["eval_accuracy"] > 0.5 and last["train_loss"] < outcome.epochs[0]["train_loss"]
    assert outcome.timing.steps == 3 * steps_per_epoch


def test_a_stop_signal_saves_mid_epoch_and_stops_at_that_step():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, grad_accum=2)
    stop = StopRequest()
    saved = []
    loop_hooks = hooks(saved, stop)
    loop_hooks.heartbeat = lambda phase, step: setattr(stop, "signum", signal.SIGUSR1)  # as if the handler had run
    with pytest.raises(Stopped) as caught:
        train(cfg, state, loaders, dist, loop_hooks)
    assert caught.value.step == 1 and caught.value.signal_name == "SIGUSR1" and caught.value.saved
    assert saved == [(0, 1, 2)]  # one optimizer step of two micro-batches into epoch 1


def test_a_stop_signal_during_start_up_stops_before_the_first_step_without_saving():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64)
    stop = StopRequest()
    stop.signum = signal.SIGTERM  # arrived while the data and model were being built
    saved = []
    with pytest.raises(Stopped) as caught:
        train(cfg, state, loaders, dist, hooks(saved, stop))
    assert caught.value.step == 0 and not caught.value.saved and saved == []


def test_a_slow_loader_or_device_shows_in_its_own_phase(monkeypatch):
    """Straggler drills in-process: each delay lands in the phase it hit, not in the other one. The step clock
    is a fake that only the injected delay moves, so the split is exact whatever else the machine is doing."""
    from mpiddp.trainer import drills as drills_module
    from mpiddp.trainer.config import FaultInjection

    class StepClock:
        now = 1000.0

        def perf_counter(self):
            return self.now

        def sleep(self, seconds):
            self.now += seconds

    clock = StepClock()
    monkeypatch.setattr(drills_module, "STRAGGLE_S", 0.1)
    monkeypatch.setattr("time.perf_counter", clock.perf_counter)
    monkeypatch.setattr("time.sleep", clock.sleep)
    measured = {}
    for phase in ("data", "compute"):
        cfg, dist, loaders, state = job(epochs=1, batch_size=256)
        cfg = cfg.replace(inject_fault=FaultInjection.parse(f"slow-{phase}:0:0"))
        record = train(cfg, state, loaders, dist, hooks([])).epochs[0]
        measured[phase] = (record["rank_data_wait_s"][0], record["rank_compute_s"][0], record["rank_step_time_s"][0])
    assert measured["data"] == pytest.approx((0.1, 0.0, 0.1))
    assert measured["compute"] == pytest.approx((0.0, 0.1, 0.1))


def test_a_resumed_epoch_skips_what_was_already_trained():
    cfg, dist, loaders, state = job(epochs=1, batch_size=64)
    full = len(loaders.train)
    state.batches_done = 4
    outcome = train(cfg, state, loaders, dist, hooks([]))
    assert outcome.timing.steps == full - 4
    assert state.batches_done == 0 and state.epoch == 1


def test_skipping_sampler_continues_the_same_permutation():
    from torch.utils.data import DistributedSampler

    base = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3)
    sampler = SkippingSampler(base)
    sampler.set_epoch(4)
    whole = list(sampler)
    sampler.skip = 6
    assert list(sampler) == whole[6:] and len(sampler) == len(whole) - 6


def test_synthetic_batches_skip_too():
    batches = SyntheticBatches(torch.zeros(2, 3), torch.zeros(2), steps=5)
    batches.skip = 2
    assert len(batches) == 3 and len(list(batches)) == 3


def test_meter_reduces_to_mean_loss_and_slowest_seconds():
    meter = Meter.on(torch.device("cpu"))
    meter.add(torch.tensor(6.0), 3)
    meter.add(torch.tensor(2.0), 1)
    meter.seconds = 0.75
    assert meter.reduced(solo_dist()) == (2.0, 4, 0.75)


def test_fault_injection_hits_only_its_rank_and_step():
    from mpiddp.trainer.config import FaultInjection

    fault = FaultInjection.parse("raise:1:3")
    inject_fault(fault, 0, 3)
    inject_fault(fault, 1, 2)
    with pytest.raises(RuntimeError, match="injected fault on rank 1 at step 3"):
        inject_fault(fault, 1, 3)
    with pytest.raises(SystemExit) as caught:
        inject_fault(FaultInjection.parse("exit0:all:1"), 5, 1)
    assert caught.value.code == 0


def test_a_stop_during_evaluation_saves_the_epoch_without_evaluating_on():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, eval_batch_size=16)
    stop = StopRequest()
    saved, eval_batches = [], []

    def heartbeat(phase, step):
        if phase == "eval":
            eval_batches.append(step)
            stop.signum = signal.SIGTERM  # arrives during the first eval batch

    loop_hooks = hooks(saved, stop)
    loop_hooks.heartbeat = heartbeat
    with pytest.raises(Stopped) as caught:
        train(cfg, state, loaders, dist, loop_hooks)
    steps = len(loaders.train)
    assert caught.value.step == steps and saved == [(1, steps, 0)]  # the whole epoch 1, not one step more
    assert len(eval_batches) == 1  # the evaluation stopped at once
    assert [r["kind"] for r in loop_hooks.log.records].count("epoch") == 0


def test_download_happens_once_per_filesystem(tmp_path):
    from mpiddp.trainer.data import fetch

    calls = []
    cfg = Config.of(dataset="mnist", data_dir=str(tmp_path / "data"), download=True)
    fetch(cfg.data, solo_dist(), download=lambda c: calls.append(c.data_dir))
    assert calls == [str(tmp_path / "data")]
    assert not any(p.name.startswith(".mpiddp-download-") for p in (tmp_path / "data").iterdir())  # marker gone
    fetch(Config().data, solo_dist(), download=lambda c: calls.append("never"))
    assert len(calls) == 1


@pytest.mark.parametrize("arch, size", [("googlenet", 32), ("vit_b_32", 32)])
def test_models_with_aux_heads_or_position_embeddings_train_at_small_sizes(arch, size):
    model = build_model(arch, num_classes=10, in_channels=3, image_size=size)
    model.train()
    logits = model(torch.randn(2, 3, size, size))
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 10)


def test_a_vit_patch_that_does_not_divide_the_image_is_one_clear_error():
    from mpiddp.errors import UserError

    with pytest.raises(UserError, match="use an --image-size that is a multiple of 16"):
        build_model("vit_b_16", 10, 3, image_size=28)


def test_an_operation_without_a_deterministic_version_is_one_line_of_advice():
    from mpiddp.trainer.train import nondeterministic_op

    # torch's own wording (the message of use_deterministic_algorithms(True)'s alert)
    error = RuntimeError(
        "adaptive_avg_pool2d_backward_cuda does not have a deterministic implementation, but you set "
        "'torch.use_deterministic_algorithms(True)'. You can turn off determinism just for this operation, or you "
        "can use the 'warn_only=True' option, if that's acceptable for your application.")
    explained = nondeterministic_op(error, "vgg11", torch.device("cuda", 0))
    assert str(explained) == (
        "--deterministic: --arch vgg11 uses adaptive_avg_pool2d_backward_cuda, which has no deterministic "
        "implementation on cuda; train without --deterministic, or pick a model without that operation")
    assert nondeterministic_op(RuntimeError("CUDA out of memory"), "vgg11", torch.device("cuda", 0)) is None


def test_a_stop_on_an_epochs_last_step_saves_the_epoch_and_the_resumed_job_records_no_empty_epoch():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64)
    steps = len(loaders.train)
    stop, saved = StopRequest(), []

    def heartbeat(phase, step):
        if phase == "train" and step == steps:  # agreed right after the last batch of epoch 1
            stop.signum = signal.SIGUSR1

    loop_hooks = hooks(saved, stop)
    loop_hooks.heartbeat = heartbeat
    with pytest.raises(Stopped) as caught:
        train(cfg, state, loaders, dist, loop_hooks)
    # Saved as the completed epoch 1 (snapshot-epoch0001.pt), not as epoch 0 with all its batches done.
    assert caught.value.step == steps and saved == [(1, steps, 0)]

    resumed_hooks = hooks(saved)
    outcome = train(cfg, state, loaders, dist, resumed_hooks)
    # Epoch 1's evaluation, left undone by the stop, comes first: its record has the training the stop saved,
    # never a record of epoch 1 with 0 steps.
    assert [(r["epoch"], r["step"]) for r in outcome.epochs] == [(1, steps), (2, 2 * steps)]
    assert all(r["train_loss"] > 0 and r["images_per_second"] > 0 and r["eval_accuracy"] is not None
               for r in outcome.epochs)
    assert outcome.timing.steps == steps and state.step == 2 * steps


class PointRecorder:
    """A callback that writes down every point of the loop it is called at."""

    def __init__(self):
        self.calls = []

    def on_data_wait(self, step):
        self.calls.append(("data_wait", step))

    def on_batch_loaded(self, step):
        self.calls.append(("batch_loaded", step))

    def on_step_end(self, step):
        self.calls.append(("step_end", step))

    def on_eval_start(self, step):
        self.calls.append(("eval_start", step))

    def on_save_start(self, step):
        self.calls.append(("save_start", step))


def test_the_loop_calls_its_callbacks_once_per_point_of_each_step():
    cfg, dist, loaders, state = job(epochs=1, batch_size=256)
    recorder = PointRecorder()
    loop_hooks = hooks([])
    loop_hooks.callbacks = recorder
    train(cfg, state, loaders, dist, loop_hooks)
    steps = len(loaders.train)
    expected = [call for step in range(steps)
                for call in (("data_wait", step), ("batch_loaded", step), ("step_end", step + 1))]
    assert recorder.calls == expected + [("data_wait", steps), ("eval_start", steps), ("save_start", steps)]


def test_the_drills_are_a_callback_only_with_inject_fault():
    from mpiddp.trainer.callbacks import Callback
    from mpiddp.trainer.config import FaultInjection
    from mpiddp.trainer.drills import Drills, drills_for

    assert drills_for(None, 0, resumed=False) == []
    (drill,) = drills_for(FaultInjection.parse("raise:0:2"), 0, resumed=False)
    assert isinstance(drill, Drills) and isinstance(drill, Callback)
    drill.on_step_end(1)  # not its step: nothing happens
    with pytest.raises(RuntimeError, match="injected fault on rank 0 at step 2"):
        drill.on_step_end(2)


class FailsOnce(PointRecorder):
    """A failure (what a peer's death looks like to the loop) as step `at` + 1 starts, once."""

    def __init__(self, at):
        super().__init__()
        self.at, self.failed = at, False

    def on_batch_loaded(self, step):
        if step == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("a peer failed")


def run_again_once(body, current, where):
    """The loop's `in_job` for an in-job recovery on the same rank: after a failure the epoch runs again from its
    position."""
    try:
        return body(current)
    except RuntimeError:
        return body(current)


def test_an_epoch_run_again_after_an_in_job_recovery_counts_its_steps_before_the_failure():
    cfg, dist, loaders, state = job(epochs=1, batch_size=64, log_every=1000)
    straight = train(cfg, copy.deepcopy(state), loaders, dist, hooks([]))
    cfg, dist, loaders, state = job(epochs=1, batch_size=64, log_every=1000)
    loop_hooks = hooks([])
    loop_hooks.callbacks = FailsOnce(3)
    loop_hooks.in_job = run_again_once
    outcome = train(cfg, state, loaders, dist, loop_hooks)
    assert loop_hooks.callbacks.failed
    assert outcome.timing.steps == straight.timing.steps == loaders.num_train // 64  # summary.json's `steps`
    (record,), (expected,) = outcome.epochs, straight.epochs
    images = round(record["images_per_second"] * record["epoch_time_s"])
    assert images == round(expected["images_per_second"] * expected["epoch_time_s"]) == loaders.num_train // 64 * 64
    assert record["train_loss"] == pytest.approx(expected["train_loss"], rel=1e-6)  # the same steps, every one


@pytest.mark.parametrize("grew", [True, False])
def test_an_epoch_run_again_after_a_grow_asks_rank_0_for_no_caught_up_line(grew, monkeypatch):
    """A grow takes the new ranks in at a step boundary, after the last step's line, so the epoch that runs again
    asks rank 0 nothing (the new rank asks nothing either: the collective held every survivor until it came,
    5-25 ms of the take-in's stand-still); after a failure it asks whether a line was left unwritten."""
    cfg, dist, loaders, state = job(epochs=1, batch_size=64, log_every=1)
    asked = []
    real = type(dist).from_main
    monkeypatch.setattr(type(dist), "from_main", lambda self, attempt: asked.append(attempt) or real(self, attempt))
    loop_hooks = hooks([])
    loop_hooks.callbacks = FailsOnce(3)  # what both look like to the loop: the step's body left, run again
    loop_hooks.in_job = run_again_once
    loop_hooks.again_after_failure = lambda: not grew
    outcome = train(cfg, state, loaders, dist, loop_hooks)
    assert loop_hooks.callbacks.failed and outcome.timing.steps == loaders.num_train // 64
    assert len(asked) == (0 if grew else 1)


@pytest.mark.parametrize("grad_accum", [1, 2, 3])
def test_synthetic_data_takes_as_many_optimizer_steps_an_epoch_at_any_accumulation(grad_accum):
    from mpiddp.trainer.state import optimizer_steps_per_epoch

    cfg, dist, loaders, _ = job(dataset="synthetic", arch="digits_cnn", batch_size=4, steps_per_epoch=6,
                                grad_accum=grad_accum, image_size=8, num_classes=10)
    assert optimizer_steps_per_epoch(len(loaders.train), grad_accum) == 6


class ExchangeFailsOnce(StopRequest):
    """A failure in step `at`'s exchanges after its update (the stop agreement: a peer died there), once."""

    def __init__(self, at):
        super().__init__()
        self.at, self.failed, self.steps = at, False, 0

    def agreed_with_save(self, dist, save_due):
        self.steps += 1
        if self.steps == self.at and not self.failed:
            self.failed = True
            raise RuntimeError("a peer failed")
        return super().agreed_with_save(dist, save_due)


@pytest.mark.parametrize("log_every", [1, 3])
def test_a_step_caught_up_after_a_failure_in_its_exchanges_gets_its_metric_line_once(log_every):
    """The failure strikes after step 3's update, before its line: the epoch runs again from step 4 (the step is
    not trained again), and step 3's line is written then: the lines of a run with no failure, none twice."""
    cfg, dist, loaders, state = job(epochs=1, batch_size=64, log_every=log_every)
    straight = hooks([])
    train(cfg, copy.deepcopy(state), loaders, dist, straight)
    stop = ExchangeFailsOnce(3)
    loop_hooks = hooks([], stop)
    loop_hooks.in_job = run_again_once
    outcome = train(cfg, state, loaders, dist, loop_hooks)
    assert stop.failed and outcome.timing.steps == loaders.num_train // 64
    lines = [record for record in loop_hooks.log.records if record["kind"] == "step"]
    expected = [record["step"] for record in straight.log.records if record["kind"] == "step"]
    assert [record["step"] for record in lines] == expected and 3 in expected[:3]
    assert all(record["images_per_second"] > 0 for record in lines)  # the caught-up line carries its images


@pytest.mark.parametrize("log_every", [1, 2, 3])
@pytest.mark.parametrize("where", ["mid-epoch", "the epoch's last step"])
def test_a_stopped_and_resumed_run_has_one_metric_line_per_due_step(log_every, where):
    """A stop after a step due a line writes that line before its save (the resume starts after the step, so a
    line left for later is lost): stopped and resumed, the run has the lines of a run with no stop, none twice."""
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, log_every=log_every)
    steps_per_epoch = len(loaders.train)
    stop_at = 3 if where == "mid-epoch" else steps_per_epoch
    straight = hooks([])
    train(cfg, copy.deepcopy(state), loaders, dist, straight)
    expected = [record["step"] for record in straight.log.records if record["kind"] == "step"]

    events = []
    stop = StopRequest()
    stopped = hooks([], stop)
    stopped.log.log = lambda record: events.append((record["kind"], record["step"]))
    stopped.save = lambda state: events.append(("save", state.step))
    stopped.heartbeat = lambda phase, step: setattr(stop, "signum", signal.SIGTERM) if step == stop_at else None
    with pytest.raises(Stopped):
        train(cfg, state, loaders, dist, stopped)
    due = stop_at % log_every == 0
    assert events[-1] == ("save", stop_at) and (events[-2] == ("step", stop_at)) == due  # the line, then the save
    resumed = hooks([])
    train(cfg, state, loaders, dist, resumed)
    lines = [step for kind, step in events if kind == "step"]
    lines += [record["step"] for record in resumed.log.records if record["kind"] == "step"]
    assert lines == expected and (stop_at in lines) == due


@pytest.mark.parametrize("deterministic", [True, False])
def test_deterministic_training_keeps_ddps_first_bucket_layout(deterministic):
    """DDP lays its buckets out again after a job's first step: a resumed job's first step would then all-reduce
    another layout than the uninterrupted run's, which 3 ranks' ring all-reduce sums in another order
    (test_exact_resume.py). --deterministic keeps the first layout in every job."""
    cfg, dist, loaders, state = job(epochs=1, batch_size=256, deterministic=deterministic)
    train(cfg, state, loaders, dist, hooks([]))
    assert state.ddp._get_ddp_logging_data()["has_rebuilt_buckets"] == (0 if deterministic else 1)


def test_a_snapshot_by_time_mid_epoch_comes_after_its_steps_metric_line():
    """A --save-interval snapshot mid-epoch is taken after its step's line: a resume from it (the job lost as a
    whole meanwhile) starts after that step, so a line left until after the save would be lost."""
    from mpiddp.trainer.saveclock import SaveClock

    cfg, dist, loaders, state = job(epochs=1, batch_size=64, log_every=1)
    clock = [0.0]
    events = []
    loop_hooks = hooks([])
    loop_hooks.save_clock = SaveClock(10.0, now=lambda: clock[0])
    loop_hooks.log.log = lambda record: events.append((record["kind"], record["step"]))
    loop_hooks.save = lambda state: events.append(("save", state.step))
    loop_hooks.heartbeat = lambda phase, step: clock.__setitem__(0, 100.0) if step == 2 else None
    train(cfg, state, loaders, dist, loop_hooks)
    at = events.index(("save", 2))
    assert events[at - 1] == ("step", 2), events[:at + 1]


class SaveFailsOnce:
    """The loop's `save` where a peer dies during the first one (in-job recovery then gives it up)."""

    def __init__(self):
        self.saved, self.failed = [], False

    def __call__(self, state):
        if not self.failed:
            self.failed = True
            raise RuntimeError("a peer failed during the save")
        self.saved.append((state.epoch, state.step, state.batches_done))


def recorded_in_job(calls):
    def in_job(body, current, where):
        calls.append(where)
        return run_again_once(body, current, where)

    return in_job


def test_a_failure_during_an_epochs_save_saves_it_again_and_evaluates_it_once():
    """A rank lost during epoch 1's save: the save is given up and done again once recovered (the epoch's record is
    written once, its evaluation not redone), and training goes on. Before: the evaluation's body ran again, the
    epoch's record already gone from the state (an AssertionError)."""
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, log_every=1000)
    loop_hooks = hooks([])
    loop_hooks.save, calls = SaveFailsOnce(), []
    loop_hooks.in_job = recorded_in_job(calls)
    outcome = train(cfg, state, loaders, dist, loop_hooks)
    steps = len(loaders.train)
    assert loop_hooks.save.failed and loop_hooks.save.saved == [(1, steps, 0), (2, 2 * steps, 0)]
    assert [r["epoch"] for r in outcome.epochs] == [1, 2]
    assert [r["epoch"] for r in loop_hooks.log.records if r["kind"] == "epoch"] == [1, 2]
    assert calls == ["train", "eval", "save", "train", "eval", "save"]


def test_a_failure_during_a_stops_save_saves_it_again_then_stops():
    cfg, dist, loaders, state = job(epochs=2, batch_size=64, grad_accum=2)
    stop = StopRequest()
    loop_hooks = hooks([], stop)
    loop_hooks.save = SaveFailsOnce()
    loop_hooks.in_job = run_again_once
    loop_hooks.heartbeat = lambda phase, step: setattr(stop, "signum", signal.SIGUSR1)
    with pytest.raises(Stopped) as caught:
        train(cfg, state, loaders, dist, loop_hooks)
    assert caught.value.step == 1 and loop_hooks.save.saved == [(0, 1, 2)]  # saved where it stopped, once


def test_every_drill_but_a_programs_own_error_fires_once_per_run(monkeypatch):
    """A resumed or relaunched job (the same flags) goes past a kill, stall or stop drill (before: a stall-save
    stalled the relaunch's save again); raise fires in every job, as a program's own error would."""
    from mpiddp.trainer import drills
    from mpiddp.trainer.config import FaultInjection

    for kind in drills.ONCE_PER_RUN:
        (drill,) = drills.drills_for(FaultInjection.parse(f"{kind}:0:2"), 0, resumed=True)
        assert drill.fault is None, kind
        (drill,) = drills.drills_for(FaultInjection.parse(f"{kind}:0:2"), 0, resumed=False)
        assert drill.fault is not None, kind
    (drill,) = drills.drills_for(FaultInjection.parse("raise:0:2"), 0, resumed=True)
    with pytest.raises(RuntimeError, match="injected fault"):
        drill.on_step_end(2)
    (drill,) = drills.drills_for(FaultInjection.parse("slow-compute:0:2"), 0, resumed=True)
    assert drill.fault is not None


def test_kill_save_kills_the_rank_at_the_start_of_its_save_only(monkeypatch):
    from mpiddp.trainer import drills
    from mpiddp.trainer.config import FaultInjection

    killed = []
    monkeypatch.setattr(drills.os, "kill", lambda pid, signum: killed.append(signum))
    (drill,) = drills.drills_for(FaultInjection.parse("kill-save:1:30"), 1, resumed=False)
    drill.on_step_end(30)
    drill.on_eval_start(30)
    drill.on_save_start(29)
    assert killed == []
    with pytest.raises(SystemExit):  # os.kill patched: the drill's process goes on to its exit
        drill.on_save_start(30)
    assert killed == [signal.SIGKILL]


def test_drills_count_a_run_as_resumed_only_when_a_snapshot_was_restored(monkeypatch):
    """A first run started with --resume auto (a batch script always passes it) restores nothing: its once-per-run
    drills fire; a job that restored a snapshot (its steps), or a relaunch, has had them."""
    import mpiddp.trainer.train as loop

    asked = []
    monkeypatch.setattr(loop, "drills_for", lambda fault, rank, resumed: asked.append(resumed) or [])
    cfg, dist, loaders, state = job(epochs=1, batch_size=256, resume="auto")
    train(cfg, state, loaders, dist, hooks([]))
    train(cfg.replace(epochs=2), state, loaders, dist, hooks([]))  # state.step > 0: as after a restore
    assert asked == [False, True]
