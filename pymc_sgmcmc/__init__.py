"""Stochastic-gradient MCMC for PyMC."""
