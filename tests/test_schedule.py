"""Learning-rate schedules (multipliers of optimizer.lr, indexed by 0-based optimizer step)."""
import math

import pytest

from megasparse.config import OptimizerConfig
from megasparse.train.schedule import LearningRateSchedule


def schedule(kind, **kw):
    return LearningRateSchedule(OptimizerConfig(lr=1.0, min_lr=0.1, schedule=kind, warmup_steps=10, **kw), 110)


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_linear_warmup(kind):
    s = schedule(kind)
    assert [s(i) for i in range(10)] == pytest.approx([(i + 1) / 10 for i in range(10)])


def test_cosine_from_peak_to_floor():
    s = schedule("cosine")
    assert s(10) == pytest.approx(1.0)
    assert s(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_wsd_is_stable_then_decays_linearly():
    s = schedule("wsd", decay_fraction=0.2)  # the last 22 of 110 steps decay
    assert all(s(i) == 1.0 for i in range(10, 88))
    assert s(88) == pytest.approx(1 - 0.9 / 22)
    assert s(98) == pytest.approx(1 - 0.9 * 11 / 22)
    assert s(109) == pytest.approx(0.1)


def test_constant_after_warmup():
    s = schedule("constant")
    assert s(10) == s(109) == 1.0
