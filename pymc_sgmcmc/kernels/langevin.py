r"""The Langevin move shared by the Langevin kernels (SGLD, SAGA-LD, SVRG-LD): one step of the
discretised diffusion from an estimate :math:`\hat g` of the log-posterior gradient,

.. math::

    \theta' = \theta + \tfrac{h}{2}\,\hat g + \sqrt{h\,T}\;\xi
    \qquad\text{or, in the tuned form,}\qquad
    \theta' = \theta + P\,\hat g + R\,\xi,

with :math:`\xi \sim \mathcal N(0, I)`. In the tuned form (``pymc_sgmcmc.tuning.rates``) the
preconditioner :math:`P` holds :math:`h/2` and the factor :math:`R` of the injected noise
holds :math:`\sqrt{hT}`. A kernel with a preconditioner of its own in the first form
(pSGLD's RMSprop, SGLD's fixed ``G``) passes :math:`G\hat g` and :math:`S\xi` (``S Sᵀ = G``).
The gradient estimator — the minibatch, SAGA's table, SVRG's anchor — is the kernel's; the
move is this one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pymc_sgmcmc.kernels.preconditioning import apply_preconditioner

__all__ = ["move"]


def move(
    position: jax.Array,
    grad: jax.Array,
    noise: jax.Array,
    step_size: jax.Array | float,
    temperature: float = 1.0,
    preconditioner: jax.Array | None = None,
    noise_factor: jax.Array | None = None,
) -> jax.Array:
    """``θ + (h/2) ĝ + √(hT) ξ``; with ``preconditioner`` ``P`` (and ``noise_factor`` ``R``)
    the tuned form ``θ + P ĝ + R ξ``, ``step_size`` and ``temperature`` then unused.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> float(move(jnp.zeros(1), jnp.ones(1), jnp.zeros(1), 0.2)[0])
    0.1
    """
    if preconditioner is None:
        return position + 0.5 * step_size * grad + jnp.sqrt(step_size * temperature) * noise
    return (
        position
        + apply_preconditioner(preconditioner, grad)
        + apply_preconditioner(noise_factor, noise)
    )
