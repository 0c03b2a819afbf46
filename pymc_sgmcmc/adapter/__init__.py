"""The PyMC adapter: the only code of this package that imports PyMC, PyTensor or ArviZ.

Everything below it (kernels, tuning, the chain engine, the self-check) works on a
:class:`~pymc_sgmcmc.adapter.bridge.MinibatchProblem` — JAX functions, arrays and the raveling
of the sampled variables — and NumPy values. The adapter turns a PyMC model into that problem
(:mod:`.bridge`), is the step method ``pm.sample`` calls (:mod:`.step`), runs
``pmsg.sample``'s front end (:mod:`.sampling`), builds results as the host PyMC returns them
(:mod:`.results`: ``arviz.InferenceData`` with PyMC 5, ``xarray.DataTree`` with PyMC 6), and
calls ArviZ's ESS and LOO (:mod:`.stats`). None of PyMC's, PyTensor's or ArviZ's objects is
re-exported from here.

Which PyMC is supported, and every private PyMC name used, with the versions it was checked
against and why no public one serves: :mod:`.internals` (checked when the package is
imported: an unsupported PyMC gets one message naming the supported versions).
"""

from __future__ import annotations

from pymc_sgmcmc.adapter.internals import check_versions

check_versions()
