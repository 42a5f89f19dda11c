"""What the training loop calls at fixed points of a step (pytorch/tnt's callbacks): one call per point, so
what is not training (the test drills, for one) stays out of the loop's body."""

from __future__ import annotations

from collections.abc import Iterable


class Callback:
    """Hooks of the loop, each doing nothing unless overridden. `step`: the optimizer steps done so far."""

    def on_data_wait(self, step: int) -> None:
        """This rank is about to load the next step's batches (the hang watchdog's phase is "data")."""

    def on_batch_loaded(self, step: int) -> None:
        """The step's batches are here and its compute starts (phase "compute", the step clock counting it)."""

    def on_step_end(self, step: int) -> None:
        """The optimizer step is done (`step` counts it), before its metrics and the agreement on a stop."""

    def on_eval_start(self, step: int) -> None:
        """The evaluation at `step` has loaded its first batch."""

    def on_save_start(self, step: int) -> None:
        """A snapshot at `step` is about to be saved (collective: every rank is here)."""

    def on_recovered(self, rank: int) -> None:
        """In-job recovery: this process goes on as `rank` of the survivors (mpiddp.trainer.elastic_policy)."""


class Callbacks(Callback):
    """Several callbacks as one, called in the order given."""

    def __init__(self, callbacks: Iterable[Callback] = ()) -> None:
        self.callbacks = tuple(callbacks)

    def add(self, *callbacks: Callback) -> None:
        """More callbacks, called after those already here (in place: copies of the loop's hooks share them)."""
        self.callbacks = (*self.callbacks, *callbacks)

    def on_data_wait(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_data_wait(step)

    def on_batch_loaded(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_batch_loaded(step)

    def on_step_end(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_step_end(step)

    def on_eval_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_eval_start(step)

    def on_save_start(self, step: int) -> None:
        for callback in self.callbacks:
            callback.on_save_start(step)

    def on_recovered(self, rank: int) -> None:
        for callback in self.callbacks:
            callback.on_recovered(rank)
