"""The learning-rate schedule against values worked out by hand (linear warm-up, then cosine to min_lr_ratio * lr).

Layout-invariance tests cannot see a wrong schedule (the reference run uses the same one), so its values are pinned
here."""

import math

import pytest

from trickles.optim import lr_at


def test_warmup_is_linear_and_reaches_the_peak_on_its_last_step():
    assert [lr_at(s, 1.0, 4, 20, 0.1) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]


def test_cosine_decays_from_the_peak_to_the_floor_and_stays_there():
    lr, warmup, steps, r = 3e-3, 2, 12, 0.1
    assert lr_at(warmup, lr, warmup, steps, r) == pytest.approx(lr, rel=1e-15)  # p = 0: the peak
    assert lr_at(warmup + 5, lr, warmup, steps, r) == pytest.approx(
        lr * (r + (1 - r) * 0.5), rel=1e-12
    )  # p = 1/2: halfway
    quarter = lr * (r + (1 - r) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lr_at(warmup + 2.5, lr, warmup, steps, r) == pytest.approx(quarter, rel=1e-12)  # p = 1/4
    assert lr_at(steps, lr, warmup, steps, r) == pytest.approx(lr * r, rel=1e-12)  # the floor at the last step
    assert lr_at(steps + 7, lr, warmup, steps, r) == pytest.approx(lr * r, rel=1e-12)  # and after it
    values = [lr_at(s, lr, warmup, steps, r) for s in range(warmup, steps + 1)]
    assert all(a > b for a, b in zip(values, values[1:]))  # strictly decreasing over the decay


def test_no_warmup_and_warmup_as_long_as_the_run():
    assert lr_at(0, 2.0, 0, 10, 0.0) == 2.0
    assert lr_at(10, 2.0, 0, 10, 0.0) == pytest.approx(0.0, abs=1e-15)
    assert lr_at(4, 1.0, 5, 5, 0.5) == 1.0  # warm-up only: the peak at the last step
    assert lr_at(6, 1.0, 5, 5, 0.5) == 0.5  # past a zero-length decay (a span of one step): the floor


def test_poly_decays_as_the_power_of_the_remaining_fraction_and_auto_picks_it_for_lars():
    from types import SimpleNamespace

    from trickles.optim.schedule import schedule_kind

    lr, warmup, steps, r = 2.0, 4, 24, 0.1
    assert lr_at(3, lr, warmup, steps, r, "poly", 2.0) == lr  # the warm-up is the same linear ramp
    assert lr_at(warmup, lr, warmup, steps, r, "poly", 2.0) == pytest.approx(lr, rel=1e-15)
    assert lr_at(warmup + 5, lr, warmup, steps, r, "poly", 2.0) == pytest.approx(
        lr * (r + (1 - r) * 0.75**2), rel=1e-12
    )
    assert lr_at(warmup + 10, lr, warmup, steps, r, "poly", 1.0) == pytest.approx(lr * (r + (1 - r) * 0.5), rel=1e-12)
    assert lr_at(steps, lr, warmup, steps, r, "poly", 2.0) == pytest.approx(lr * r, rel=1e-12)
    kinds = {o: schedule_kind(SimpleNamespace(schedule="auto", optimizer=o)) for o in ("adamw", "lamb", "lars", "sgd")}
    assert kinds == {"adamw": "cosine", "lamb": "cosine", "lars": "poly", "sgd": "cosine"}
    assert schedule_kind(SimpleNamespace(schedule="cosine", optimizer="lars")) == "cosine"
