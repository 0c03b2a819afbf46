"""Minibatch layout: rows stay aligned across containers; sub-block length rule."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pymc_sgmcmc.minibatch import block_rows, draw_minibatch, layout_data, noise_factor


@pytest.mark.parametrize("scheme", ["blocks", "random"])
def test_rows_of_all_containers_stay_aligned(scheme):
    n, b = 100_000, 200
    X = np.arange(n * 2, dtype=float).reshape(n, 2)
    y = np.arange(n, dtype=float)
    data = tuple(jax.numpy.asarray(a) for a in layout_data([X, y], b, scheme))
    Xb, yb = draw_minibatch(jax.random.key(0), data, n, b, scheme)
    assert Xb.shape == (b, 2) and yb.shape == (b,)
    np.testing.assert_array_equal(np.asarray(Xb[:, 0]), 2 * np.asarray(yb))


def test_block_rows_rule():
    assert block_rows(10_000, 100) == 1  # small data: plain uniform rows
    assert block_rows(1_000_000, 1000) == 50  # √(2·50/10⁶) = 1%
    assert block_rows(1_000_000, 256) == 32  # largest divisor of 256 below 50
    assert noise_factor(10_000, 100, "random") == 1.0
    assert noise_factor(1_000_000, 1000, "blocks") == pytest.approx((10**6 - 50) / (10**6 - 1))


def test_every_row_is_drawn_with_equal_probability():
    n, b = 50_000, 100
    data = (jax.numpy.arange(n + b - 1),)
    counts = np.zeros(n)
    draw = jax.jit(lambda k: draw_minibatch(k, data, n, b, "blocks")[0])
    for key in jax.random.split(jax.random.key(1), 2000):
        np.add.at(counts, np.asarray(draw(key)) % n, 1)
    # 2·10⁵ row draws over 5·10⁴ rows: Poisson(4) counts; the mean is exact, the spread Poisson
    assert counts.sum() == 2000 * b
    assert 3.5 < counts.var() < 4.5
