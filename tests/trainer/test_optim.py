"""Learning-rate schedule arithmetic."""

import pytest

from mpiddp.trainer.optim import lr_factor

COMMON = dict(steps_per_epoch=10, total_steps=100, lr_step_epochs=3, lr_gamma=0.1)


def test_linear_warmup_then_cosine_to_zero():
    factors = [lr_factor(s, warmup_steps=10, schedule="cosine", **COMMON) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert factors[10] == pytest.approx(1.0)
    assert factors[55] == pytest.approx(0.5, abs=0.02)
    assert factors[99] < 0.01
    assert all(a >= b for a, b in zip(factors[10:], factors[11:]))


def test_step_schedule_decays_every_n_epochs():
    assert lr_factor(29, warmup_steps=0, schedule="step", **COMMON) == 1.0
    assert lr_factor(30, warmup_steps=0, schedule="step", **COMMON) == pytest.approx(0.1)
    assert lr_factor(65, warmup_steps=0, schedule="step", **COMMON) == pytest.approx(0.01)


def test_constant():
    assert lr_factor(50, warmup_steps=0, schedule="constant", **COMMON) == 1.0
