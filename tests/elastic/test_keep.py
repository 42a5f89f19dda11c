"""mpiddp.keep: the variables that hold a step loop's position, which a grow hands to a new rank (Kept): plain values
written into the new rank's namespace, objects with a state dict loaded in place; what a script cannot declare
(a function's locals, names not set yet, two namespaces) is a ValueError in one line."""

import pytest
import torch

from mpiddp.elastic.api import Kept, Manager
from mpiddp.script import recovery


class Progress:
    step = 3


def scheduler() -> torch.optim.lr_scheduler.StepLR:
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)


def test_rank_0s_values_are_written_into_the_new_ranks_namespace_and_objects_loaded_in_place():
    survivor_scheduler = scheduler()
    for _ in range(5):
        survivor_scheduler.optimizer.step()
        survivor_scheduler.step()
    survivor = {"iter_num": 41, "best_val_loss": 0.25, "scheduler": survivor_scheduler}
    handed = Kept(survivor, ("iter_num", "best_val_loss", "scheduler")).values()
    new_scheduler = scheduler()
    new = {"iter_num": 0, "best_val_loss": 1e9, "scheduler": new_scheduler}
    Kept(new, ("iter_num", "best_val_loss", "scheduler")).load(handed)
    assert (new["iter_num"], new["best_val_loss"]) == (41, 0.25)
    assert new["scheduler"] is new_scheduler and new_scheduler.last_epoch == 5
    assert new_scheduler.get_last_lr() == survivor_scheduler.get_last_lr()


def test_an_objects_attributes_can_hold_the_position():
    progress = Progress()
    progress.step = 12
    handed = Kept(progress, ("step",)).values()
    other = Progress()
    Kept(other, ("step",)).load(handed)
    assert other.step == 12


def test_names_the_new_rank_did_not_declare_end_its_join_with_one_line():
    with pytest.raises(RuntimeError, match="'epoch'.*did not declare"):
        Kept({"iter_num": 0}, ("iter_num",)).load({"iter_num": ("value", 1), "epoch": ("value", 2)})


def test_a_name_not_set_yet_is_a_value_error():
    with pytest.raises(ValueError, match="'iter_num' is not set there yet: call it after"):
        Kept({}, ("iter_num",))


def test_keep_adds_names_but_one_namespace_only():
    manager, namespace = Manager(), {"iter_num": 0, "best": 1.0}
    manager.keep(namespace, ("iter_num",))
    manager.keep(namespace, ("best", "iter_num"))
    assert manager.kept is not None and manager.kept.names == ("iter_num", "best")
    with pytest.raises(ValueError, match="already kept in another namespace"):
        manager.keep({"other": 1}, ("other",))


def test_a_functions_locals_cannot_be_kept(monkeypatch):
    monkeypatch.setattr(recovery, "_manager", Manager())
    iter_num = 0

    with pytest.raises(ValueError, match=r"mpiddp.keep\(locals\(\), ...\): a function's local variables"):
        recovery.keep(locals(), "iter_num")
    with pytest.raises(ValueError, match="names are the variables' names as strings"):
        recovery.keep(globals(), iter_num)
    recovery.keep(globals(), "Progress")  # a module's globals are written back
    assert recovery.manager().kept.names == ("Progress",)


def test_keep_after_the_loops_first_step_is_a_value_error_unless_it_repeats_what_is_kept():
    """Whether a loop grows back is decided at its first step (its spares kept or released), and a new rank takes
    the kept variables at its own first step: a name declared later would come too late, so it is refused in one
    line; the same keep again (a keep inside the loop) changes nothing and passes."""
    manager, namespace = Manager(), {"iter_num": 0, "best": 1.0}
    manager.keep(namespace, ("iter_num",))
    manager.release_spares_of_step_loop()  # the loop's first step (no recovery here: nothing else happens)
    manager.keep(namespace, ("iter_num",))
    with pytest.raises(ValueError, match=r"after the loop's first optimizer.step\(\).*call mpiddp.keep before the loop"):
        manager.keep(namespace, ("best",))
    late = Manager()
    late.release_spares_of_step_loop()
    with pytest.raises(ValueError, match="after the loop's first optimizer.step"):
        late.keep(namespace, ("iter_num",))
