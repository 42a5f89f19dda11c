"""Gradient communication: the one DDP communication hook mpiddp installs.

It tells the step clock when each gradient bucket is ready, then runs the chosen all-reduce: plain, fp16/bf16
compressed, or PowerSGD. PowerSGD keeps state per DDP bucket (each rank's error feedback, the warm-start Q
matrices), in the bucket's memory layout; DDP's buckets change after the first step of every job (it rebuilds
them in the order gradients became ready), so that state is saved and restored per parameter, and re-laid out
whenever the buckets change. A resumed run then continues as the uninterrupted one would, up to float rounding:
its first step runs on DDP's initial buckets, where tensors sit at other memory offsets, and BLAS rounds
differently by alignment (differences of about 1e-8 in the weights, against about 1e-2 without the state).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

log = logging.getLogger(__name__)

COMPRESSIONS = ("none", "fp16", "bf16", "powersgd")
ParamState = dict[str, torch.Tensor]  # parameter name -> its slice of a per-bucket state tensor


class GradientHook:
    """DDP's hook state: `run(bucket)` is called once per ready bucket, in bucket order."""

    def __init__(self, compression: str, parameters: list[tuple[str, torch.nn.Parameter]], on_ready: Callable[[], None],
                 powersgd: Any = None, one_bucket_at_a_time: bool = False) -> None:
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

    def run(self, bucket: Any) -> torch.futures.Future:
        self.on_ready()
        if self.powersgd is not None:
            self._follow_layout(bucket)
        future = self._inner(self._inner_state, bucket)
        if not self._serial:
            return future
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(future.wait())
        return done

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
             backend: str = "nccl", on_ready: Callable[[], None] = lambda: None) -> GradientHook:
    """Install mpiddp's communication hook for `compression` on `ddp` and return it."""
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
                        one_bucket_at_a_time=powersgd is not None and backend != "nccl")
    ddp.register_comm_hook(hook, _run)
    return hook
