"""Averages of tuning measurements over doubling windows."""

from __future__ import annotations

from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

__all__ = ["NoiseEstimate", "WindowedMean", "gradient_noise"]


def gradient_noise(per_example_grads, full: bool = False):
    """Unbiased sample (co)variance of per-example gradients ``(B, D)``: ``(D,)`` or ``(D, D)``."""
    centred = per_example_grads - per_example_grads.mean(axis=0)
    denom = max(per_example_grads.shape[0] - 1, 1)
    if full:
        return centred.T @ centred / denom
    return jnp.sum(centred * centred, axis=0) / denom


@dataclass
class WindowedMean:
    """Running mean of measurements over doubling windows, on the host.

    Early measurements are taken far from the posterior's bulk, so the mean is restarted after
    1, 2, 4, 8, … updates (as Stan restarts its adaptation windows). The value in force pools
    the last completed window with the current one, so that it does not jump back to a single
    noisy measurement when a window starts.
    """

    count: int = 0
    window: int = 1
    current: np.ndarray | None = field(default=None)
    previous: np.ndarray | None = field(default=None)
    previous_count: int = 0

    @property
    def value(self) -> np.ndarray | None:
        if self.current is None:
            return self.previous
        if self.previous is None:
            return self.current
        total = self.count + self.previous_count
        return (self.count * self.current + self.previous_count * self.previous) / total

    def update(self, estimate: np.ndarray) -> np.ndarray:
        estimate = np.asarray(estimate, dtype=np.float64)
        if self.count >= self.window:
            self.previous, self.previous_count = self.current, self.count
            self.current, self.count, self.window = None, 0, 2 * self.window
        self.count += 1
        if self.current is None:
            self.current = estimate.copy()
        else:
            self.current = self.current + (estimate - self.current) / self.count
        return self.value

    def reset(self) -> None:
        self.count, self.window, self.current = 0, 1, None
        self.previous, self.previous_count = None, 0


NoiseEstimate = WindowedMean  # the former name (pymc_sgmcmc.tuning.NoiseEstimate)
