"""SGLD / pSGLD kernel: exact one-step updates with a fixed key, and reproducibility."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pymc_sgmcmc.kernels import sgld

jax.config.update("jax_enable_x64", True)


def quadratic(position):
    scale = jnp.array([1.0, 4.0])
    return -scale * position


def test_one_step_matches_hand_computation():
    key = jax.random.key(42)
    state = sgld.init(jnp.array([1.0, -2.0]))
    eps, temperature = 0.01, 2.0
    new, info = sgld.step(key, state, quadratic, eps, temperature=temperature)
    xi = np.asarray(jax.random.normal(key, (2,), dtype=jnp.float64))
    expected = (
        np.array([1.0, -2.0]) + 0.5 * eps * np.array([-1.0, 8.0]) + np.sqrt(eps * temperature) * xi
    )
    np.testing.assert_allclose(new.position, expected, rtol=1e-14)
    np.testing.assert_allclose(info.step_size, eps)


def test_one_rmsprop_step_matches_hand_computation():
    key = jax.random.key(7)
    state = sgld.init(jnp.array([1.0, -2.0]))._replace(square_avg=jnp.array([4.0, 9.0]))
    eps, alpha, damping = 0.01, 0.9, 1e-3
    new, _ = sgld.step(key, state, quadratic, eps, rmsprop=True, alpha=alpha, damping=damping)
    grad = np.array([-1.0, 8.0])
    v = alpha * np.array([4.0, 9.0]) + (1 - alpha) * grad**2
    g = 1.0 / (damping + np.sqrt(v))
    xi = np.asarray(jax.random.normal(key, (2,), dtype=jnp.float64))
    expected = np.array([1.0, -2.0]) + 0.5 * eps * g * grad + np.sqrt(eps * g) * xi
    np.testing.assert_allclose(new.square_avg, v, rtol=1e-15)
    np.testing.assert_allclose(new.position, expected, rtol=1e-14)


def test_same_key_same_step_different_key_different_step():
    state = sgld.init(jnp.zeros(3))
    grad = lambda x: -x  # noqa: E731
    a, _ = sgld.step(jax.random.key(1), state, grad, 0.1)
    b, _ = sgld.step(jax.random.key(1), state, grad, 0.1)
    c, _ = sgld.step(jax.random.key(2), state, grad, 0.1)
    np.testing.assert_array_equal(a.position, b.position)
    assert not np.allclose(a.position, c.position)


def test_stationary_variance_of_a_gaussian_with_exact_gradients():
    # With exact gradients the only bias is discretisation: for log p = -x²/2 the chain
    # θ' = (1 - ε/2) θ + √ε ξ has stationary variance 1 / (1 - ε/4), exactly.
    eps, n = 0.1, 200_000

    def body(state, key):
        state, _ = sgld.step(key, state, lambda x: -x, eps)
        return state, state.position

    _, xs = jax.lax.scan(body, sgld.init(jnp.zeros(1)), jax.random.split(jax.random.key(0), n))
    xs = np.asarray(xs[1000:, 0])
    # Autocorrelation ρ = 1 - ε/2 → ESS ≈ n (1-ρ)/(1+ρ) ≈ 5000; var's relative MC sd ≈ √(2/ESS) = 2%.
    np.testing.assert_allclose(xs.var(), 1.0 / (1.0 - eps / 4.0), rtol=0.08)


def test_pre_drawn_normal_equals_drawing_from_the_key():
    # Drivers draw a whole scan's noise at once and pass it as `normal`.
    key = jax.random.key(3)
    state = sgld.init(jnp.array([1.0, -2.0]))
    z = jax.random.normal(key, (2,), dtype=jnp.float64)
    a, _ = sgld.step(key, state, quadratic, 0.05)
    b, _ = sgld.step(None, state, quadratic, 0.05, normal=z)
    np.testing.assert_array_equal(a.position, b.position)
