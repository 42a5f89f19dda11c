"""Gradient communication: the one DDP communication hook mpiddp installs, and what carries it.

It tells the step clock when each gradient bucket is ready, then runs the chosen all-reduce: plain, fp16/bf16
compressed, or PowerSGD, through torch's process group (gloo, NCCL) or through MPI (`--grad-transport`).

Through MPI, each bucket is one blocking MPI_Allreduce inside the hook, which returns an already-completed
future. DDP calls the hook on autograd's thread: on CPU that is the thread that called backward(), MPI's main
thread, the only one MPI_THREAD_FUNNELED (mpiddp's level) lets call MPI. Nonblocking MPI_Iallreduce per bucket,
completed when the last bucket arrives, was left out: Open MPI progresses it only inside MPI calls, so between
hooks nothing moves (measured, 16 MiB, 2 ranks: started, then 50 ms of compute, MPI_Wait still takes 14.2 ms
against 16.5 ms for the blocking call; started and waited at once, 24.0 ms). fp16/bf16 travel as int16
words summed by a user-defined MPI operation (MPI has no half-precision sum) that adds them as torch does (in
fp32, rounded once): half the bytes, and for two ranks bit for bit what gloo computes.

PowerSGD keeps state per DDP bucket (each rank's error feedback, the warm-start Q matrices), in the bucket's
memory layout; DDP's buckets change after the first step of every job (it rebuilds
them in the order gradients became ready), so that state is saved and restored per parameter, and re-laid out
whenever the buckets change. A resumed run then continues as the uninterrupted one would, up to float rounding:
its first step runs on DDP's initial buckets, where tensors sit at other memory offsets, and BLAS rounds
differently by alignment (differences of about 1e-8 in the weights, against about 1e-2 without the state).
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import torch
import torch.distributed as tdist
from torch.nn.parallel import DistributedDataParallel

from mpiddp.errors import UserError

if TYPE_CHECKING:
    from torch.distributed import GradBucket, Work

    from mpiddp.job.collective import Dist

log = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
ParamState = dict[str, torch.Tensor]  # parameter name -> its slice of a per-bucket state tensor
TRANSPORTS = ("auto", "gloo", "nccl", "mpi")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
PROBE_REPEATS = 3


@dataclass(frozen=True)
class TransportChoice:
    """What carries the gradients ('mpi' or the process group's backend), why, and the probe behind `auto`."""

    requested: str
    chosen: str
    reason: str
    thread_level: str | None = None  # MPI's, when MPI carries the gradients
    probe: dict[str, Any] | None = None  # bytes, backend, backend_s, mpi_s (slowest rank's median of each path)

    def record(self) -> dict[str, Any]:
        """For summary.json."""
        return {"requested": self.requested, "chosen": self.chosen, "reason": self.reason,
                "mpi_thread_level": self.thread_level, "probe": self.probe}

    def describe(self) -> str:
        text = f"gradient transport: {self.chosen} (--grad-transport {self.requested}: {self.reason})"
        if self.probe is not None:
            text += (f"; probe, {self.probe['bytes'] / 1e6:.1f} MB all-reduce, slowest rank: "
                     f"{self.probe['backend']} {1e3 * self.probe['backend_s']:.2f} ms, mpi {1e3 * self.probe['mpi_s']:.2f} ms")
        if self.chosen == "mpi":
            text += (f"; one blocking MPI_Allreduce per DDP bucket, on the thread that runs backward; MPI thread "
                     f"level {self.thread_level}")
        return text


def transport_refusal(compression: str, dist: Dist) -> str | None:
    """Why MPI cannot carry this job's gradients (None: it can). Local; the caller agrees on it."""
    if compression == "powersgd":
        return ("--grad-transport mpi cannot carry PowerSGD (it issues its own all-reduces through torch's "
                "process group): drop one of them")
    if dist.device_type == "cuda" and compression in HALF:
        return f"--grad-transport mpi with --grad-compression {compression} works on CPU tensors only: use nccl on GPUs"
    support = dist.gradient_support()
    if dist.device_type == "cuda":  # autograd runs GPU work, and so DDP's hook, on a device thread of its own
        support = replace(support, on_main_thread=False)
    return support.refusal(dist.device_type)


def choose_transport(requested: str, compression: str, dist: Dist, nbytes: int) -> TransportChoice:
    """Collective: what carries the gradient all-reduce, the same on every rank. `auto` probes on CPU: a few
    all-reduces of `nbytes` (one gradient bucket) through the process group and through MPI, timed; MPI
    wins when the slowest rank's median is lower, so every rank decides on the same numbers."""
    assert requested in TRANSPORTS
    backend = dist.backend
    if requested in ("gloo", "nccl"):
        def check() -> None:
            if requested == "nccl" and dist.device_type != "cuda":
                raise UserError("--grad-transport nccl needs GPUs, and this job runs on the CPU: use --grad-transport "
                                "auto, gloo or mpi (or --device cuda on GPU hosts)")
            if requested != backend:
                raise UserError(f"--grad-transport {requested} needs the {requested} process group, and this job's "
                                f"is {backend}: use --backend {requested} too, or --grad-transport auto")
        dist.agree(check)
        return TransportChoice(requested, backend, "the process group")
    level = dist.gradient_support().thread_level
    if requested == "mpi":
        refusal = transport_refusal(compression, dist)

        def check_mpi() -> None:
            if refusal is not None:
                raise UserError(refusal)
        dist.agree(check_mpi)
        return TransportChoice(requested, "mpi", "as asked", level)
    if dist.world_size == 1:
        return TransportChoice(requested, backend, "one rank: nothing to carry")
    if dist.device_type == "cuda" or compression == "powersgd":
        why = "GPUs: NCCL" if dist.device_type == "cuda" else "PowerSGD runs on the process group"
        return TransportChoice(requested, backend, why)
    refusal = transport_refusal(compression, dist)
    (refused,) = dist.reduce([refusal is not None], "max")
    if refused:
        return TransportChoice(requested, backend, "MPI cannot carry them here" + (f" ({refusal})" if refusal else ""))
    probe = probe_transports(dist, nbytes, compression)
    faster = probe["mpi_s"] < probe["backend_s"]
    return TransportChoice(requested, "mpi" if faster else backend,
                           f"the probe measured MPI {'faster' if faster else 'no faster'}", level if faster else None,
                           probe)


def probe_transports(dist: Dist, nbytes: int, compression: str, repeats: int = PROBE_REPEATS) -> dict[str, Any]:
    """Collective: median seconds of one all-reduce of `nbytes` of gradients (compressed as training would
    send them) through the process group and through MPI, each the slowest rank's, after one warm-up each."""
    import torch.distributed as tdist

    dtype = HALF.get(compression, torch.float32)
    buffer = torch.zeros(max(1, nbytes // 4), dtype=dtype)
    through_mpi = mpi_buffer(buffer)
    sum_as = SUM_AS.get(compression)

    def timed(send: Callable[[], object]) -> float:
        send()  # warm-up: connections, registered memory
        times = []
        for _ in range(repeats):
            dist.barrier()  # both ranks start together: the time is the all-reduce's, not the other rank's lag
            started = time.perf_counter()
            send()
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    backend_s = timed(lambda: tdist.all_reduce(buffer))
    mpi_s = timed(lambda: dist.allreduce_inplace(through_mpi, sum_as))
    slowest_backend, slowest_mpi = dist.reduce([backend_s, mpi_s], "max")
    return {"bytes": buffer.numel() * buffer.element_size(), "backend": dist.backend, "backend_s": slowest_backend,
            "mpi_s": slowest_mpi}


SUM_AS = {"fp16": "float16", "bf16": "bfloat16"}


def mpi_buffer(tensor: torch.Tensor) -> Any:
    """What MPI reads and writes for `tensor` in place: a numpy view on CPU (16-bit floats as int16 words), the
    tensor itself on a GPU (mpi4py passes its device pointer to a CUDA-aware MPI)."""
    if tensor.is_cuda:
        return tensor
    if tensor.dtype in HALF.values():
        return tensor.view(torch.int16).numpy()
    return tensor.numpy()


def gradient_bytes(model: torch.nn.Module, bucket_cap_mb: float) -> int:
    """The size of one of DDP's full gradient buckets for this model (at most the whole model's gradients)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return max(4, min(total, int(bucket_cap_mb * 1024 * 1024)))


class FailureWatch(Protocol):
    """What waits for a collective under MPI's failure watch (in-job recovery's Membership): `wait(work)` returns
    once the work completed, or raises (MembersLost) when MPI reports a failed peer first."""

    def wait(self, work: Work) -> None: ...


Lost = TypeVar("Lost", bound=Exception)  # the failure a WatchedAllReduce keeps instead of raising (MembersLost)


class WatchedAllReduce(Generic[Lost]):
    """The mean of each gradient bucket over the process group, as DDP's own all-reduce (default_hooks' allreduce,
    fp16 and bf16 hooks: divided by the world size, then summed; compressed, in the half type and copied back),
    each collective waited for with `wait` (in-job recovery's Membership.wait, which polls MPI's failure notice:
    a peer's death ends the wait, where gloo's own would wait out its timeout). The trainer's hook (GradientHook)
    and mpiddp.DistributedDataParallel's both run it.

    A failed peer, with `absorb` None (the trainer, `watch_gradients`), raises: on CPU out of the bucket's hook
    (through DDP, a RuntimeError from backward), on GPUs out of `settle`. With `absorb` (mpiddp's DDP wrapper:
    MembersLost) it is kept in `lost` instead: the buckets are left complete with this rank's own gradients
    (dropped at the step's end), later buckets are not sent, and `settle` returns it.

    On CPU each bucket is waited for by the next bucket's hook, and every one by the last bucket's, so a bucket's
    all-reduce overlaps the backward of the next as DDP's own waiting does (waiting for each bucket in its own hook
    cost 4% of a gloo step here); DDP finds every future complete when it finalizes. That runs on the thread that
    runs backward, the main thread on CPU, which alone may call MPI. On GPUs DDP runs the hook on autograd's device
    thread, which may not call MPI (MPI_THREAD_FUNNELED): NCCL's future goes to DDP (the GPU stream waits for it,
    the CPU does not) and `settle` waits on the main thread."""

    def __init__(self, wait: Callable[[Work], None], compression: str = "none",
                 absorb: type[Lost] | None = None) -> None:
        assert compression == "none" or compression in HALF
        self.wait = wait
        self.compression = compression
        self.absorb = absorb
        self.lost: Lost | None = None  # the failure `absorb` kept, this step
        self._in_flight: list[tuple[Work, torch.Tensor, torch.Tensor, torch.futures.Future]] = []  # CPU buckets
        self.pending: list[Work] = []  # GPU: the collectives issued this step, waited for by `settle`

    def new_step(self) -> None:
        self.lost, self._in_flight, self.pending = None, [], []

    def run(self, bucket: GradBucket) -> torch.futures.Future:
        if self.lost is not None:  # a peer failed earlier in this step: nothing more is sent
            self._complete(everything=True)  # a bucket still in flight ends with this rank's own gradients
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return self._deferred(bucket) if bucket.buffer().is_cuda else self._watched(bucket)

    def _watched(self, bucket: GradBucket) -> torch.futures.Future:
        """CPU: issued async, waited for under the failure watch by the next bucket's hook (or this one's, the
        last)."""
        if self.absorb is None and bucket.index() == 0:
            self._in_flight.clear()  # left by a backward that raised: its futures were never waited for
        buffer = bucket.buffer()
        payload = self._issue(buffer)
        future: torch.futures.Future = torch.futures.Future()
        self._in_flight.append((tdist.all_reduce(payload, async_op=True), payload, buffer, future))
        self._complete(everything=bucket.is_last())
        return future

    def _deferred(self, bucket: GradBucket) -> torch.futures.Future:
        """GPUs: issued async and handed to DDP as NCCL's future, its work kept for `settle`."""
        if self.absorb is None and bucket.index() == 0:
            self.pending.clear()  # left by a backward that raised before `settle`
        buffer = bucket.buffer()
        payload = self._issue(buffer)
        work = tdist.all_reduce(payload, async_op=True)
        self.pending.append(work)

        def finish(_: torch.futures.Future) -> torch.Tensor:
            if payload is not buffer:
                buffer.copy_(payload)
            return buffer

        return work.get_future().then(finish)

    def _issue(self, buffer: torch.Tensor) -> torch.Tensor:
        """What is summed: the bucket divided by the world size, in place or (compressed) as a half-type copy."""
        world_size = tdist.get_world_size()
        return buffer.div_(world_size) if self.compression == "none" else buffer.to(HALF[self.compression]).div_(world_size)

    def _complete(self, everything: bool) -> None:
        """Wait (under the failure watch) for the buckets in flight: all but the newest, or all."""
        keep = 0 if everything else 1
        while len(self._in_flight) > keep:
            work, payload, buffer, future = self._in_flight[0]
            if self.lost is None:
                self._wait(work)
            self._in_flight.pop(0)
            if payload is not buffer:
                buffer.copy_(payload)
            future.set_result(buffer)

    def _wait(self, work: Work) -> None:
        """`wait(work)`; a failure `absorb` names is kept in `lost`, any other raises."""
        if self.absorb is None:
            self.wait(work)
            return
        try:
            self.wait(work)
        except self.absorb as lost:
            self.lost = lost

    def broadcast_buffers(self, buffers: list[torch.Tensor]) -> None:
        """Before a forward, as DDP's own `broadcast_buffers` does (BatchNorm's running statistics from rank 0),
        one broadcast per dtype, watched: with `absorb`, a failed peer marks the step failed (the forward goes on
        with this rank's own buffers) instead of raising out of the forward. On GPUs the forward waits for it on
        the GPU and `settle` checks it with the step's all-reduces."""
        if self.lost is not None:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in buffers:
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        for group in by_dtype.values():
            flat = torch._utils._flatten_dense_tensors(group)
            work = tdist.broadcast(flat, src=0, async_op=True)
            if flat.is_cuda:
                work.wait()  # the forward's stream waits for it; the CPU does not
                self.pending.append(work)
            else:
                self._wait(work)
                if self.lost is not None:
                    return
            for buffer, synced in zip(group, torch._utils._unflatten_dense_tensors(flat, group)):
                buffer.copy_(synced)

    def take_pending(self) -> list[Work]:
        """The step's collectives still in flight (GPUs), handed over unwaited: the late commit holds them and
        waits for them at the next step (mpiddp.elastic.latecommit)."""
        pending, self.pending = self.pending, []
        return pending

    def settle(self) -> Lost | None:
        """On the main thread once backward returned: the step's collectives done (GPUs: NCCL's work is waited
        for here; CPU: the hook waited), or the failure `absorb` kept (else it raises, before the optimizer uses
        the gradients)."""
        pending, self.pending = self.pending, []
        for work in pending:
            if self.lost is not None:
                break
            self._wait(work)
        return self.lost


    def rebuild_buckets(self, ddp: DistributedDataParallel) -> Lost | None:
        """On the main thread, at the end of a step over `ddp`'s process group (its all-reduces done, `settle`
        returned nothing), on every rank alike, while DDP has yet to lay its buckets out (layout_pending): that one
        re-layout, watched (BucketRebuild). A failed peer raises, or with `absorb` is kept in `lost` and returned;
        then DDP's hooks are off `ddp`'s parameters (a recovery wraps them again)."""
        if self.lost is not None or not layout_pending(ddp):
            return self.lost
        rebuild = BucketRebuild(ddp)
        try:
            self._wait(rebuild)
        except BaseException:
            rebuild.abandon()
            raise
        if self.lost is not None:
            rebuild.abandon()
        elif rebuild.rebuilt:
            ddp._has_rebuilt_buckets = True  # DDP's own mark, as its forward sets it after the re-layout
        else:  # nothing to lay out yet: a static graph's first step, or a step with no synced backward
            _LAYOUT_TRIES[ddp] = _LAYOUT_TRIES.get(ddp, 0) + 1
        return self.lost


# DDP wrapper -> the watched re-layouts started that found nothing to lay out yet. DDP lays its buckets out after
# its first synced backward, after its second with a static graph; past MAX_LAYOUT_TRIES, DDP is left to do it.
_LAYOUT_TRIES: weakref.WeakKeyDictionary[DistributedDataParallel, int] = weakref.WeakKeyDictionary()
MAX_LAYOUT_TRIES = 3


def layout_pending(ddp: DistributedDataParallel) -> bool:
    """Whether DDP will still lay its buckets out again, with its broadcast from rank 0: not once it did (here or
    in its own forward), never with find_unused_parameters (unless its graph is static), nor after
    MAX_LAYOUT_TRIES watched tries that found nothing to lay out."""
    if not hasattr(ddp, "reducer") or getattr(ddp, "_has_rebuilt_buckets", False) \
            or _LAYOUT_TRIES.get(ddp, 0) >= MAX_LAYOUT_TRIES:
        return False
    return bool(getattr(ddp, "static_graph", False)) or not getattr(ddp, "find_unused_parameters", False)


# How long an abandoned bucket rebuild may still finish before the recovery goes on (BucketRebuild.abandon)
ABANDON_GRACE_S = 0.2


class BucketRebuild:
    """DDP's re-layout of its buckets (in the order the first backward made the gradients ready), which it does
    inside the next forward with a broadcast of its own from rank 0, outside any failure watch: a peer lost around
    then left a survivor waiting in that broadcast for a live rank 0 gone into the recovery (until
    --collective-timeout; seen in CI). Started here instead, at the end of the first step over a process group, on
    a helper thread (torch lets the GIL go inside it, measured), it is a work like any collective: the main thread
    waits for it under MPI's failure watch (FailureWatch.wait polls `is_completed`), and DDP's next forward finds
    nothing left to rebuild. A wait that ends on a failed peer leaves the thread inside the old process group (it
    ends with that group's timeout) holding DDP's lock, which DDP's autograd hooks on the parameters would then
    wait for in the next backward: `abandon` takes them off. DDP's logger takes that lock too as it is destroyed
    (with the GIL held: the whole process would stand still once the recovery drops the old wrapper, measured):
    the thread keeps it, and it goes with the thread."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        self._reducer = ddp.reducer
        self._logger = getattr(ddp, "logger", None)  # destroyed where the lock is free: see the class
        self.rebuilt = False  # DDP laid its buckets out (False: it had nothing to lay out yet)
        self._done = threading.Event()
        self._error: BaseException | None = None
        device = next((p.device for p in ddp.module.parameters()), torch.device("cpu"))
        self._thread = threading.Thread(target=self._run, args=(device,), name="mpiddp-bucket-rebuild", daemon=True)
        self._thread.start()

    def _run(self, device: torch.device) -> None:
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # NCCL's broadcast runs on this thread's current device
            self.rebuilt = bool(self._reducer._rebuild_buckets())
        except BaseException as exc:  # the old group's timeout, long after an abandon; or the error for `wait`
            self._error = exc
        finally:
            self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        """Once completed: raises the rebuild's error (a peer's death seen by gloo), as a torch work's wait."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def abandon(self) -> None:
        """After a failure: DDP's autograd hooks off the parameters (see the class). A rebuild whose broadcast
        still arrives (rank 0 sent before it saw the failure) lays the old buckets out within moments, pointing
        the gradients at them: that is let end first, not raced by the recovery."""
        self._reducer._remove_autograd_hooks()
        self._thread.join(ABANDON_GRACE_S)


class GradientHook:
    """DDP's hook state: `run(bucket)` is called once per ready bucket, in bucket order."""

    def __init__(self, compression: str, parameters: list[tuple[str, torch.nn.Parameter]], on_ready: Callable[[], None],
                 powersgd: Any = None, one_bucket_at_a_time: bool = False, mpi: Dist | None = None,
                 members: FailureWatch | None = None, wrapper: DistributedDataParallel | None = None) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        assert compression in COMPRESSIONS
        self.compression = compression
        self.on_ready = on_ready
        self.powersgd = powersgd
        self._names = {id(p): name for name, p in parameters}  # DDP's buckets hold parameters; state is kept by name
        self._shapes = {name: p.shape for name, p in parameters}
        self._inner: Callable[[Any, Any], torch.futures.Future] = {
            "none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook, "powersgd": powerSGD_hook.powerSGD_hook,
        }[compression]
        self._inner_state = powersgd  # None for the others: the default process group
        # PowerSGD issues its second all-reduce from a callback of the first; with several buckets in flight,
        # ranks can issue those in different orders, which gloo (matching collectives by order) cannot survive
        # ("Received data size doesn't match expected size"). Finishing each bucket before the next keeps the
        # order the same on every rank; on CPU the overlap it gives up is small.
        self._serial = one_bucket_at_a_time
        self._layout: dict[int, tuple[str, ...]] = {}  # bucket index -> its parameters, as last seen
        self._pending_error: ParamState = {}  # restored or re-laid-out state, waiting for its bucket
        self._pending_q: ParamState = {}
        assert mpi is None or powersgd is None, "PowerSGD stays on the process group"
        self.mpi = mpi  # set: MPI carries the all-reduce
        # set (in-job recovery's Membership): the process group's all-reduce is waited for under MPI's failure
        # watch, so a peer's death ends the wait (DDP's own wait would not end); PowerSGD stays DDP's own
        self.watched = (WatchedAllReduce(members.wait, compression)
                        if members is not None and powersgd is None else None)
        self.transport: TransportChoice | None = None  # what the trainer chose, for the log and summary.json
        # the wrapper it is registered on (its bucket rebuild): weakly, as DDP holds its hook
        self._ddp = weakref.ref(wrapper) if wrapper is not None else None
        self._reduced = False  # a bucket went through `run`: a backward that DDP lays its buckets out after
        self._mpi_thread: int | None = None  # the thread MPI was last checked from

    def run(self, bucket: Any) -> torch.futures.Future:
        self.on_ready()
        self._reduced = True
        if self.mpi is not None:
            return self._through_mpi(bucket.buffer())
        if self.watched is not None:
            return self.watched.run(bucket)
        if self.powersgd is not None:
            self._follow_layout(bucket)
        future = self._inner(self._inner_state, bucket)
        if not self._serial:
            return future
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(future.wait())
        return done

    def _through_mpi(self, buffer: torch.Tensor) -> torch.futures.Future:
        """The all-reduce of default_hooks' allreduce/fp16/bf16 hooks (divide by the world size first, then sum;
        compressed: in the half type, then copied back), carried by one blocking MPI_Allreduce."""
        assert self.mpi is not None
        if self._mpi_thread != threading.get_ident():  # a user's hook may run on a GPU's autograd thread
            refusal = self.mpi.gradient_support().refusal(buffer.device.type)
            if buffer.is_cuda and self.compression in HALF:
                refusal = f"MPI sums {self.compression} gradients on CPU tensors only: use NCCL on GPUs"
            if refusal is not None:
                raise RuntimeError(refusal)
            self._mpi_thread = threading.get_ident()
        world_size = self.mpi.world_size
        payload = buffer.div_(world_size) if self.compression == "none" else buffer.to(HALF[self.compression]).div_(world_size)
        if payload.is_cuda:
            torch.cuda.current_stream(payload.device).synchronize()  # MPI reads the memory outside torch's streams
        self.mpi.allreduce_inplace(mpi_buffer(payload), SUM_AS.get(self.compression))
        if payload is not buffer:
            buffer.copy_(payload)
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(buffer)
        return done

    def settle(self) -> None:
        """On the main thread after backward (GPUs under in-job recovery): MembersLost when a peer failed, before
        the optimizer uses the gradients (WatchedAllReduce.settle). A no-op where nothing is in flight."""
        if self.watched is not None:
            self.watched.settle()

    def rebuild_buckets(self) -> None:
        """Under in-job recovery, on the main thread after a step over the wrapper's process group settled, on
        every rank alike: DDP's bucket re-layout while it is pending, watched (WatchedAllReduce.rebuild_buckets;
        MembersLost when a peer failed). Nothing before a bucket went through this hook, nor once done."""
        ddp = self._wrapper()
        if self.watched is not None and ddp is not None and self._reduced:
            self.watched.rebuild_buckets(ddp)

    def layout_pending(self) -> bool:
        """Under in-job recovery: whether the wrapper's bucket re-layout is still to come (layout_pending)."""
        ddp = self._wrapper()
        return self.watched is not None and ddp is not None and layout_pending(ddp)

    def _wrapper(self) -> DistributedDataParallel | None:
        """The DDP wrapper this hook is registered on, while it lives (None: unknown, or gone)."""
        return self._ddp() if self._ddp is not None else None

    # PowerSGD state, per parameter -------------------------------------------------------------------

    def _follow_layout(self, bucket: Any) -> None:
        """Before PowerSGD reads bucket `index`'s state: when DDP has changed the buckets, move the state of
        this and every later bucket (none of which ran this step: buckets run in order) to its parameters,
        then lay it out again for the bucket at hand."""
        index = bucket.index()
        names = tuple(self._names[id(p)] for p in bucket.parameters())
        if self._layout.get(index, names) != names:
            for stale in [i for i in self._layout if i >= index]:
                self._unpack(stale)
        self._layout[index] = names
        if index not in self.powersgd.error_dict and (self._pending_error or self._pending_q):
            self._pack(index, bucket)

    def _unpack(self, index: int) -> None:
        state, names = self.powersgd, self._layout.pop(index)
        shapes = [self._shapes[name] for name in names]
        error = state.error_dict.pop(index, None)
        if error is not None:
            self._pending_error.update(zip(names, split(error, [s.numel() for s in shapes])))
        q = state.q_memory_dict.pop(index, None)
        state.p_memory_dict.pop(index, None)
        layout = q_layout(names, shapes, state)
        if q is not None and sum(layout.values()) == q.numel():
            self._pending_q.update(zip(layout, split(q, list(layout.values()))))
        elif q is not None:  # a torch whose PowerSGD lays out Q otherwise: only the warm start is lost
            log.warning("PowerSGD's warm start restarts for %d parameters (unknown Q layout in torch %s)",
                        len(layout), torch.__version__)

    def _pack(self, index: int, bucket: Any) -> None:
        state, names = self.powersgd, self._layout[index]
        buffer = bucket.buffer()
        if any(name in self._pending_error for name in names):
            state.error_dict[index] = torch.cat([
                self._pending_error.pop(name, torch.zeros(g.numel(), dtype=buffer.dtype)).to(buffer)
                for name, g in zip(names, bucket.gradients())
            ])
        layout = q_layout(names, [g.shape for g in bucket.gradients()], state)
        if layout and all(name in self._pending_q for name in layout):
            state.q_memory_dict[index] = torch.cat([self._pending_q.pop(name).to(buffer) for name in layout])
            state.p_memory_dict[index] = torch.empty(p_length(names, [g.shape for g in bucket.gradients()], state),
                                                     dtype=buffer.dtype, device=buffer.device)

    def state_dict(self) -> dict[str, Any]:
        """This rank's PowerSGD state per parameter, on the CPU (empty for the other compressions). The live
        state moves to its parameters; the next step lays it out again, in whatever buckets DDP then has."""
        if self.powersgd is None:
            return {}
        for index in list(self._layout):
            self._unpack(index)
        state = self.powersgd
        keys, position, has_gauss, cached_gaussian = state.rng.get_state()[1:]
        return {
            "iter": state.iter,
            "rng": {"keys": torch.from_numpy(keys.astype("int64")), "position": int(position),
                    "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
            "error": {name: t.cpu() for name, t in self._pending_error.items()},
            "q": {name: t.cpu() for name, t in self._pending_q.items()},
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        assert self.powersgd is not None and not self._layout, "load before the first step"
        state, rng = self.powersgd, saved["rng"]
        state.iter = saved["iter"]
        state.rng.set_state(("MT19937", rng["keys"].numpy().astype("uint32"), rng["position"], rng["has_gauss"],
                             rng["cached_gaussian"]))
        self._pending_error = dict(saved["error"])
        self._pending_q = dict(saved["q"])


def split(flat: torch.Tensor, lengths: list[int]) -> list[torch.Tensor]:
    return [part.clone() for part in torch.split(flat.detach(), lengths)]


def _compressed(names: tuple[str, ...], shapes: list[torch.Size], state: Any) -> list[tuple[str, int, int, int]]:
    """(name, rows, columns, rank) of the bucket's tensors PowerSGD compresses, in the order its P and Q
    memories hold them: grouped by shape in order of first appearance, as powerSGD_hook iterates them."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

    by_shape: dict[tuple[int, int], list[tuple[str, int, int, int]]] = defaultdict(list)
    for name, shape in zip(names, shapes):
        rows = shape[0] if len(shape) else 1
        columns = max(1, int(torch.Size(shape).numel()) // max(1, rows))
        rank = min(rows, columns, state.matrix_approximation_rank)
        if _should_compress(rows, columns, rank, state.min_compression_rate)[0]:
            by_shape[(rows, columns)].append((name, rows, columns, rank))
    return [entry for group in by_shape.values() for entry in group]


def q_layout(names: tuple[str, ...], shapes: list[torch.Size], state: Any) -> dict[str, int]:
    """Parameter name -> its length in the bucket's Q memory."""
    return {name: columns * rank for name, _, columns, rank in _compressed(names, shapes, state)}


def p_length(names: tuple[str, ...], shapes: list[torch.Size], state: Any) -> int:
    return sum(rows * rank for _, rows, _, rank in _compressed(names, shapes, state))


def _run(hook: GradientHook, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations: none here
    return hook.run(bucket)


def register(ddp: DistributedDataParallel, compression: str, rank: int = 1, warmup_steps: int = 10,
             backend: str = "nccl", on_ready: Callable[[], None] = lambda: None, mpi: Dist | None = None,
             members: FailureWatch | None = None) -> GradientHook:
    """Install mpiddp's communication hook for `compression` on `ddp` and return it; with `mpi`, MPI carries
    the all-reduce (the caller checked that it can: `transport_refusal`)."""
    powersgd = None
    if compression == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        # Plain all-reduce for the first `warmup_steps` steps, then rank-`rank` approximations with error
        # feedback (what the approximation missed is added to the next step's gradient) and warm start.
        powersgd = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=warmup_steps,
            use_error_feedback=True, warm_start=True, random_seed=0,
        )
    hook = GradientHook(compression, list(ddp.module.named_parameters()), on_ready, powersgd,
                        one_bucket_at_a_time=powersgd is not None and backend != "nccl", mpi=mpi, members=members,
                        wrapper=ddp)
    ddp.register_comm_hook(hook, _run)
    return hook
