"""Constant SGD kernel: exact one-step updates against hand computation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pymc_sgmcmc.kernels import sgd

jax.config.update("jax_enable_x64", True)


def quadratic(position):
    # ∇ log p for log p = -0.5 xᵀ diag(1, 4) x
    scale = jnp.array([1.0, 4.0])
    return -scale * position


def test_one_plain_step_matches_hand_computation():
    state = sgd.init(jnp.array([1.0, -2.0]))
    new, info = sgd.step(jax.random.key(0), state, quadratic, 0.1)
    # θ - P ĝ with ĝ = -∇log p = (1, -8): (1 - 0.1, -2 + 0.8)
    np.testing.assert_allclose(new.position, [0.9, -1.2], rtol=1e-15)
    np.testing.assert_allclose(info.grad_norm, np.hypot(1.0, 8.0), rtol=1e-15)
    assert int(new.iteration) == 1


def test_momentum_and_preconditioner():
    state = sgd.init(jnp.array([1.0, -2.0]))._replace(velocity=jnp.array([0.5, 0.5]))
    precond = jnp.array([[2.0, 0.0], [1.0, 1.0]])
    new, _ = sgd.step(None, state, quadratic, 0.1, preconditioner=precond, momentum=0.25)
    grad = np.array([-1.0, 8.0])
    velocity = 0.75 * np.array([0.5, 0.5]) + 0.1 * precond @ grad
    np.testing.assert_allclose(new.velocity, velocity, rtol=1e-15)
    np.testing.assert_allclose(new.position, np.array([1.0, -2.0]) + velocity, rtol=1e-15)


def test_jit_and_vmap_over_chains():
    states = jax.vmap(sgd.init)(jnp.ones((3, 2)))
    step = jax.jit(jax.vmap(lambda s: sgd.step(None, s, quadratic, 0.1)))
    new, _ = step(states)
    np.testing.assert_allclose(new.position, np.tile([0.9, 0.6], (3, 1)), rtol=1e-15)


def test_pre_drawn_injected_noise_equals_its_factor_times_the_normal():
    # Drivers with a dense noise factor L pass e = L z (multiplied for a whole draw at once)
    # instead of L and z: the step is the same up to rounding.
    state = sgd.init(jnp.array([1.0, -2.0]))
    precond = jnp.array([[2.0, 0.5], [0.5, 1.0]])
    factor = jnp.array([[0.3, 0.0], [0.2, 0.4]])
    z = jnp.array([0.7, -1.1])
    by_factor, _ = sgd.step(
        None, state, quadratic, 0.1, preconditioner=precond, injected_noise_scale=factor, normal=z
    )
    pre_drawn, _ = sgd.step(
        None, state, quadratic, 0.1, preconditioner=precond, injected_noise=factor @ z
    )
    expected = np.array([1.0, -2.0]) + 0.1 * precond @ (np.array([-1.0, 8.0]) + factor @ z)
    np.testing.assert_allclose(pre_drawn.position, expected, rtol=1e-14)
    np.testing.assert_allclose(pre_drawn.position, by_factor.position, rtol=1e-14)
    with pytest.raises(ValueError, match="not both"):
        sgd.step(None, state, quadratic, 0.1, injected_noise_scale=factor, injected_noise=z)
