"""What one ``pm.sample`` (or ``pmsg.sample``) call with our steps remembers between PyMC's
internals (:mod:`pymc_sgmcmc.adapter.hooks`): context variables, so that calls in other
threads do not see each other's."""

from __future__ import annotations

import contextvars

__all__ = ["DIVERGED", "INTERRUPTED", "STEPS"]

# Our steps among the call's (set by assign_step_methods, read by _sample_return).
STEPS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pmsg_steps", default=None)
# (chain, error) of the chains a DivergenceError stopped in the current call.
DIVERGED: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "pmsg_diverged", default=None
)
# (chain, draws so far) when Ctrl-C stopped one of our chains: the chains after it are not
# started (PyMC's sequential loop would start the next chain and then drop the interrupted one).
INTERRUPTED: contextvars.ContextVar[tuple | None] = contextvars.ContextVar(
    "pmsg_interrupted", default=None
)
