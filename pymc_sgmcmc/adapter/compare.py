"""Compare stochastic-gradient draws with a reference posterior (usually NUTS).

:func:`compare` puts our draws next to reference draws parameter by parameter (mean, sd, the
mean error in reference sds, the sd ratio, bulk ESS per second and per data pass) and adds
two whole-posterior numbers: the Gaussian KL divergence and the energy distance.
:func:`plot_compare` overlays the marginal densities and draws a forest plot of both.

The reference may be a result of ``pm.sample()`` (e.g. with NUTS: an ``xarray.DataTree`` with
PyMC 6, an ``arviz.InferenceData`` with PyMC 5), its ``posterior`` group, or a mapping of variable names to arrays of exact draws (e.g. from a
closed-form posterior). It is aligned to ``idata``'s posterior variable by variable:

- a Dataset variable with the same dimension names is matched by dimension name and
  coordinate value (so a reordered coordinate is still compared element by element);
- any other array is matched by shape: its trailing axes must equal the shape of our
  variable, and all leading axes are draws (``(draw, *shape)`` and
  ``(chain, draw, *shape)`` both work).

Note: ``pymc_sgmcmc.adapter.compare`` is the function :func:`compare` at package level; import the
helpers from the module, ``from pymc_sgmcmc.adapter.compare import gaussian_kl``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import arviz as az
import numpy as np
import pandas as pd
import xarray as xr
from scipy.spatial.distance import cdist

from pymc_sgmcmc.adapter.results import ARVIZ_1, as_dataset, get_group, is_result

if ARVIZ_1:
    import arviz_plots
    from arviz_base.labels import BaseLabeller
else:
    from arviz.labels import BaseLabeller

__all__ = [
    "ComparisonFigures",
    "compare",
    "data_passes",
    "energy_distance",
    "gaussian_kl",
    "plot_compare",
]

SAMPLE_DIMS = ("chain", "draw")


def compare(
    idata: Any,
    reference: Any,
    var_names: str | Sequence[str] | None = None,
    *,
    max_draws: int = 1000,
    seed: int = 0,
) -> pd.DataFrame:
    r"""Parameter-by-parameter and whole-posterior comparison of draws with reference draws.

    Parameters
    ----------
    idata
        Our draws: any result of ``pm.sample`` with a ``posterior`` (an SG-MCMC run, or a
        NUTS one, in which case ``ess_per_pass`` is NaN).
    reference
        The reference draws: a result of ``pm.sample`` (its ``posterior`` is used), a
        posterior group (Dataset), or a mapping ``{name: array}`` whose trailing axes are the variable's shape
        and whose leading axes are draws (see the module docstring for the alignment).
    var_names
        Variables to compare. ``None``: every variable in both posteriors, in ``idata``'s
        order, deterministics included (they are what a user reads off the posterior, and
        their agreement is part of the comparison; a deterministic that is an affine function
        of other variables makes the joint covariance singular, which the Gaussian KL
        handles, see :func:`~pymc_sgmcmc.adapter.compare.gaussian_kl`).
    max_draws
        At most this many draws of each set (a random subset without replacement, the same
        ``seed`` for both) enter the energy distance, whose cost is quadratic in the draws.
    seed
        Seed of that subset.

    Returns
    -------
    pandas.DataFrame
        One row per scalar parameter, indexed by ArviZ's flat labels (``beta[x0]`` with the
        posterior's coordinates, ``beta[0]`` without), with the columns

        ``mean``, ``sd``
            of our pooled draws (``sd`` with ``ddof=1``, as :func:`arviz.summary`);
        ``ref_mean``, ``ref_sd``
            of the reference draws;
        ``mean_diff_sd``
            :math:`(\text{mean} - \text{ref\_mean}) / \text{ref\_sd}`;
        ``sd_ratio``
            :math:`\text{sd} / \text{ref\_sd}`;
        ``ess``
            bulk ESS of our draws, ``az.ess(method="bulk")``;
        ``ess_per_second``
            ``ess`` over ``idata.posterior.attrs["sampling_time"]`` (the wall time
            ``pm.sample`` writes, tuning included); NaN without it;
        ``ess_per_pass``
            ``ess`` over the data passes spent on the kept draws, summed over chains
            (:func:`~pymc_sgmcmc.adapter.compare.data_passes`); NaN without a ``data_passes`` stat.

        and ``attrs``:

        ``gaussian_kl``
            :math:`\mathrm{KL}(q \,\|\, p)` between Gaussians with the means and covariances
            (``ddof=1``) of our draws (:math:`q`) and the reference draws (:math:`p`) over
            all rows jointly, :func:`~pymc_sgmcmc.adapter.compare.gaussian_kl`; ``inf`` when one of them is degenerate in
            a direction where the other is not;
        ``gaussian_kl_dim``
            the dimension it was computed in (below the number of rows when the reference
            covariance is singular);
        ``energy_distance``
            :func:`~pymc_sgmcmc.adapter.compare.energy_distance` between the two sets of draws, each coordinate divided by
            its reference sd first, so it is in units of reference sds and scale-free;
        ``energy_distance_draws``
            the number of draws of (ours, reference) it used;
        ``sampling_time``, ``data_passes``
            the denominators of ``ess_per_second`` and ``ess_per_pass`` (NaN if absent);
        ``var_names``
            the variables compared.

    Raises
    ------
    ValueError
        If a requested variable is missing from either posterior, the two posteriors share
        no variable, or a reference array does not end in the variable's shape.

    Examples
    --------
    >>> import numpy as np
    >>> import xarray as xr
    >>> import pymc_sgmcmc as pmsg
    >>> rng = np.random.default_rng(0)
    >>> reference = {"mu": rng.normal(size=4000)}
    >>> mu = 0.5 + reference["mu"].reshape(2, 2000)
    >>> idata = xr.DataTree.from_dict({"posterior": xr.Dataset({"mu": (("chain", "draw"), mu)})})
    >>> df = pmsg.compare(idata, reference)
    >>> round(float(df.loc["mu", "sd_ratio"]), 12)
    1.0
    >>> bool(np.isclose(df.loc["mu", "mean_diff_sd"] * df.loc["mu", "ref_sd"], 0.5))
    True
    """
    posterior, ref_posterior, names = _aligned(idata, reference, var_names)
    labels, draws = _flat_draws(posterior, names)
    _, ref_draws = _flat_draws(ref_posterior, names)

    mean = draws.mean(axis=0)
    ref_mean = ref_draws.mean(axis=0)
    sd = draws.std(axis=0, ddof=1) if len(draws) > 1 else np.full(len(labels), np.nan)
    ref_sd = ref_draws.std(axis=0, ddof=1) if len(ref_draws) > 1 else np.full(len(labels), np.nan)
    bulk = az.ess(posterior[names], method="bulk")
    if isinstance(bulk, xr.DataTree):
        bulk = bulk.to_dataset()
    _, ess = _flat_draws(bulk.expand_dims(SAMPLE_DIMS), names)
    ess = ess[0]

    sampling_time = _sampling_time(idata)
    passes = data_passes(idata)
    with np.errstate(divide="ignore", invalid="ignore"):
        frame = pd.DataFrame(
            {
                "mean": mean,
                "ref_mean": ref_mean,
                "sd": sd,
                "ref_sd": ref_sd,
                "mean_diff_sd": (mean - ref_mean) / ref_sd,
                "sd_ratio": sd / ref_sd,
                "ess": ess,
                "ess_per_second": ess / sampling_time,
                "ess_per_pass": ess / passes,
            },
            index=pd.Index(labels),
        )
    # Both sets in reference-sd units (KL is invariant under a common affine map; the
    # distance becomes scale-free). A coordinate constant in the reference keeps its units.
    scale = np.where(ref_sd > 0, ref_sd, 1.0)
    standardised = (draws - ref_mean) / scale
    ref_standardised = (ref_draws - ref_mean) / scale
    kl, kl_dim = gaussian_kl(standardised, ref_standardised)
    sub = min(len(draws), max_draws), min(len(ref_draws), max_draws)
    frame.attrs = {
        "gaussian_kl": kl,
        "gaussian_kl_dim": kl_dim,
        "energy_distance": energy_distance(
            standardised, ref_standardised, max_draws=max_draws, seed=seed
        ),
        "energy_distance_draws": sub,
        "sampling_time": sampling_time,
        "data_passes": passes,
        "var_names": list(names),
    }
    return frame


def gaussian_kl(
    draws: np.ndarray, ref_draws: np.ndarray, *, rtol: float = 1e-10
) -> tuple[float, int]:
    r"""KL divergence between the Gaussians fitted to two sets of draws, ours to reference.

    .. math::

        \mathrm{KL}(q\,\|\,p) = \tfrac12\bigl[\operatorname{tr}(\Sigma_p^{-1}\Sigma_q)
            + (\mu_p - \mu_q)^\top \Sigma_p^{-1} (\mu_p - \mu_q) - k
            + \ln\det\Sigma_p - \ln\det\Sigma_q\bigr]

    with :math:`\mu, \Sigma` the sample mean and covariance (``ddof=1``) of the draws.

    Singular covariances: the eigenvalues of :math:`\Sigma_p` below ``rtol`` times the
    largest span its null space (an affine deterministic, or fewer draws than coordinates).
    If our draws also stay there (variance and mean offset along every null direction below
    the same threshold), both Gaussians live on the same affine subspace and the KL is
    computed exactly within it, in the remaining ``k`` dimensions. Otherwise, or if
    :math:`\Sigma_q` is singular within that subspace, the KL is ``inf`` (one distribution
    puts mass where the other has none).

    Parameters
    ----------
    draws, ref_draws
        ``(n_draws, k)`` arrays of our and the reference draws.
    rtol
        Eigenvalues at most ``rtol`` times the largest eigenvalue of :math:`\Sigma_p` count as
        zero. The default is far above float32 round-off of a deterministic (relative
        variance ~1e-14) and far below any posterior correlation a finite run can resolve.

    Returns
    -------
    kl : float
        The divergence (NaN with fewer than two draws in either set).
    dim : int
        The dimension it was computed in.

    Examples
    --------
    >>> import numpy as np
    >>> from pymc_sgmcmc.adapter.compare import gaussian_kl
    >>> rng = np.random.default_rng(0)
    >>> x = rng.normal(size=(1000, 2))
    >>> gaussian_kl(x, x)[0] < 1e-12
    True
    """
    draws = np.asarray(draws, dtype=np.float64).reshape(len(draws), -1)
    ref_draws = np.asarray(ref_draws, dtype=np.float64).reshape(len(ref_draws), -1)
    k = draws.shape[1]
    if len(draws) < 2 or len(ref_draws) < 2:
        return float("nan"), k
    delta = draws.mean(axis=0) - ref_draws.mean(axis=0)
    cov = np.atleast_2d(np.cov(draws, rowvar=False, ddof=1))
    ref_cov = np.atleast_2d(np.cov(ref_draws, rowvar=False, ddof=1))
    ref_eig, basis = np.linalg.eigh(ref_cov)
    tol = rtol * max(float(ref_eig.max()), 0.0)
    keep = ref_eig > tol
    if not keep.any():
        return float("nan"), 0
    null = basis[:, ~keep]
    if null.size and (
        np.any(np.einsum("ij,ik,kj->j", null, cov, null) > tol)
        or np.any((null.T @ delta) ** 2 > tol)
    ):
        return float("inf"), int(keep.sum())
    basis, ref_eig = basis[:, keep], ref_eig[keep]
    cov = basis.T @ cov @ basis
    delta = basis.T @ delta
    eig = np.linalg.eigvalsh(cov)
    if eig.min() <= tol:
        return float("inf"), len(ref_eig)
    kl = 0.5 * (
        np.sum(np.diag(cov) / ref_eig)
        + np.sum(delta**2 / ref_eig)
        - len(ref_eig)
        + np.sum(np.log(ref_eig))
        - np.sum(np.log(eig))
    )
    return float(kl), len(ref_eig)


def energy_distance(
    draws: np.ndarray, ref_draws: np.ndarray, *, max_draws: int = 1000, seed: int = 0
) -> float:
    r"""Energy distance between two sets of draws (Székely & Rizzo 2013).

    .. math::

        D(q, p) = \bigl(2\,\mathbb E\|X - Y\| - \mathbb E\|X - X'\| - \mathbb E\|Y - Y'\|
        \bigr)^{1/2},\qquad X, X' \sim q,\; Y, Y' \sim p

    over the empirical distributions (the V-statistic: nonnegative, zero for identical sets,
    and in one dimension equal to :func:`scipy.stats.energy_distance`). It is a metric on
    distributions, sensitive to every difference, not only to the first two moments.

    Parameters
    ----------
    draws, ref_draws
        ``(n_draws, k)`` (or ``(n_draws,)``) arrays of the two sets, in common units.
    max_draws
        Each set larger than this is replaced by a random subset of ``max_draws`` draws
        (without replacement, from ``numpy.random.default_rng(seed)``, the same generator
        state for both sets) so that the cost, quadratic in the draws, stays bounded.
    seed
        Seed of the subsets.

    Returns
    -------
    float
        The distance, in the units of the draws.

    Examples
    --------
    >>> import numpy as np
    >>> from pymc_sgmcmc.adapter.compare import energy_distance
    >>> energy_distance(np.zeros((3, 1)), np.ones((2, 1)))
    1.4142135623730951
    """
    sets = []
    for x in (draws, ref_draws):
        x = np.asarray(x, dtype=np.float64).reshape(len(x), -1)
        if len(x) > max_draws:
            x = x[np.sort(np.random.default_rng(seed).choice(len(x), max_draws, replace=False))]
        sets.append(x)
    x, y = sets
    squared = 2 * cdist(x, y).mean() - cdist(x, x).mean() - cdist(y, y).mean()
    return float(np.sqrt(max(squared, 0.0)))


def data_passes(idata: Any) -> float:
    """Data passes spent on the kept draws, summed over chains.

    The ``data_passes`` stat is cumulative per chain (tuning included) and recorded after
    each draw. Per chain, the passes of the kept draws are

    1. with ``warmup_sample_stats`` (``discard_tuned_samples=False``): the last value minus
       the last warmup value;
    2. else, if the attrs say ``tuning_steps == 0``: the last value (everything the chain
       did, e.g. SAGA-LD's initial table fill);
    3. else (tuning discarded): the last minus the first value, times ``n / (n - 1)`` for
       ``n`` kept draws, i.e. the first draw's own passes estimated by the mean of the others
       (exact for the constant cost per draw of our samplers); NaN for a single draw.

    NaN entries (a padded, stopped chain) are ignored.

    Parameters
    ----------
    idata
        The result of ``pm.sample``.

    Returns
    -------
    float
        The total; NaN when ``sample_stats`` has no ``data_passes`` (e.g. NUTS).

    Examples
    --------
    >>> import numpy as np
    >>> import xarray as xr
    >>> from pymc_sgmcmc.adapter.compare import data_passes
    >>> def stats(x):
    ...     return xr.Dataset({"data_passes": (("chain", "draw"), np.array([x]))})
    >>> idata = xr.DataTree.from_dict(
    ...     {"sample_stats": stats([3.0, 4.0, 5.0]), "warmup_sample_stats": stats([1.0, 2.0])}
    ... )
    >>> data_passes(idata)
    3.0
    """
    stats = get_group(idata, "sample_stats")
    if stats is None or "data_passes" not in stats:
        return float("nan")
    kept = _per_chain(stats["data_passes"])
    warmup = get_group(idata, "warmup_sample_stats")
    if warmup is not None and "data_passes" in warmup and warmup.sizes.get("draw", 0) > 0:
        tuned = _per_chain(warmup["data_passes"])
        return float(sum(np.nanmax(k) - np.nanmax(t) for k, t in zip(kept, tuned, strict=True)))
    posterior = get_group(idata, "posterior")
    tuning_steps = stats.attrs.get(
        "tuning_steps", None if posterior is None else posterior.attrs.get("tuning_steps")
    )
    if tuning_steps is not None and int(tuning_steps) == 0:
        return float(sum(np.nanmax(k) for k in kept))
    total = 0.0
    for k in kept:
        n = int(np.sum(np.isfinite(k)))
        if n < 2:
            return float("nan")
        total += (np.nanmax(k) - np.nanmin(k)) * n / (n - 1)
    return float(total)


class ComparisonFigures(NamedTuple):
    """The figures of :func:`~pymc_sgmcmc.plot_compare`."""

    density: Any
    """Marginal densities of both sets, one panel per scalar parameter (matplotlib Figure)."""
    forest: Any
    """Forest plot of both sets (matplotlib Figure)."""


def plot_compare(
    idata: Any,
    reference: Any,
    var_names: str | Sequence[str] | None = None,
    *,
    labels: tuple[str, str] = ("SG", "NUTS"),
    hdi_prob: float = 0.94,
    density_kwargs: Mapping[str, Any] | None = None,
    forest_kwargs: Mapping[str, Any] | None = None,
) -> ComparisonFigures:
    """Overlay the marginal densities of our and the reference draws, and a forest plot.

    The reference is aligned to ``idata`` as in :func:`compare`, so both sets share labels.
    Both sets are plotted with the same number of draws (a random subset of the larger).

    Parameters
    ----------
    idata, reference, var_names
        As in :func:`compare`.
    labels
        Legend labels of (ours, reference).
    hdi_prob
        Credible interval drawn in both plots (HDI).
    density_kwargs, forest_kwargs
        Further keyword arguments to ArviZ's density and forest plots: with ArviZ 1,
        ``arviz_plots.plot_dist`` and ``arviz_plots.plot_forest`` (e.g.
        ``figure_kwargs={"figsize": (8, 6)}``); with ArviZ 0.x, ``arviz.plot_density`` and
        ``arviz.plot_forest`` (e.g. ``figsize``).

    Returns
    -------
    ComparisonFigures
        ``(density, forest)`` matplotlib figures; ``fig.axes`` are the panels, and each
        figure's legend names the two sets.

    Examples
    --------
    >>> import matplotlib
    >>> matplotlib.use("Agg")
    >>> import numpy as np
    >>> import xarray as xr
    >>> import pymc_sgmcmc as pmsg
    >>> rng = np.random.default_rng(0)
    >>> draws = xr.Dataset({"mu": (("chain", "draw"), rng.normal(size=(2, 500)))})
    >>> idata = xr.DataTree.from_dict({"posterior": draws})
    >>> figures = pmsg.plot_compare(idata, {"mu": rng.normal(size=2000)}, labels=("IASG", "exact"))
    >>> len(figures.forest.axes) >= 1
    True
    """
    posterior, ref_posterior, names = _aligned(idata, reference, var_names)
    ours, theirs = _equal_draws([posterior[names], ref_posterior[names]])
    if ARVIZ_1:
        models = {labels[0]: ours, labels[1]: theirs}
        density = arviz_plots.plot_dist(
            models,
            var_names=names,
            ci_kind="hdi",
            ci_prob=hdi_prob,
            **dict(density_kwargs or {}),
        )
        forest = arviz_plots.plot_forest(
            models,
            var_names=names,
            combined=True,
            ci_kind="hdi",
            ci_probs=(0.5, hdi_prob),
            **dict(forest_kwargs or {}),
        )
        for collection in (density, forest):
            collection.add_legend("model")
        return ComparisonFigures(
            density=density.viz["figure"].item(), forest=forest.viz["figure"].item()
        )
    density_axes = az.plot_density(
        [ours, theirs],
        data_labels=list(labels),
        var_names=names,
        hdi_prob=hdi_prob,
        **dict(density_kwargs or {}),
    )
    forest_axes = az.plot_forest(
        [ours, theirs],
        model_names=list(labels),
        var_names=names,
        combined=True,
        hdi_prob=hdi_prob,
        **dict(forest_kwargs or {}),
    )
    density_axes = np.ravel(density_axes)
    for ax in density_axes:
        if not ax.axison:  # ArviZ's unused grid cells: drop them so fig.axes are the panels
            ax.remove()
    return ComparisonFigures(density=density_axes[0].figure, forest=np.ravel(forest_axes)[0].figure)


def _equal_draws(datasets: Sequence[xr.Dataset], seed: int = 0) -> list[xr.Dataset]:
    """The datasets as one chain each of the same number of draws (a random subset of the
    larger, in order): ArviZ plots several models as one array along a ``model`` dimension,
    which pads unequal (chain, draw) sizes with NaN."""
    flat = [ds.stack(sample=SAMPLE_DIMS) for ds in datasets]
    n = min(f.sizes["sample"] for f in flat)
    out = []
    for f in flat:
        idx = np.sort(np.random.default_rng(seed).choice(f.sizes["sample"], n, replace=False))
        f = f.isel(sample=idx).drop_vars(["sample", *SAMPLE_DIMS])
        f = f.rename(sample="draw").expand_dims(chain=[0]).assign_coords(draw=np.arange(n))
        out.append(f.transpose(*SAMPLE_DIMS, ...))
    return out


def _aligned(
    idata: Any,
    reference: Any,
    var_names: str | Sequence[str] | None,
) -> tuple[xr.Dataset, xr.Dataset, list[str]]:
    """(our posterior, reference posterior with our dims and coords, variable names)."""
    posterior = get_group(idata, "posterior") if is_result(idata) else None
    if posterior is None:
        raise ValueError("idata has no posterior group: pass the result of pm.sample.")
    reference = as_dataset(reference)  # a group of a result (idata.posterior)
    if is_result(reference):
        found = get_group(reference, "posterior")
        if found is None:
            raise ValueError("The reference result has no posterior group.")
        reference = found
    ours = list(posterior.data_vars)
    theirs = list(reference.keys())
    if var_names is None:
        names = [name for name in ours if name in theirs]
        if not names:
            raise ValueError(
                f"idata's posterior ({', '.join(ours)}) and the reference "
                f"({', '.join(map(str, theirs))}) share no variable; pass var_names with the "
                "reference's names renamed to ours."
            )
    else:
        names = [var_names] if isinstance(var_names, str) else list(var_names)
        for name in names:
            if name not in posterior:
                raise ValueError(
                    f"var_names: {name!r} is not in idata's posterior (its variables: "
                    f"{', '.join(ours)})."
                )
            if name not in reference:
                raise ValueError(
                    f"var_names: {name!r} is not in the reference (its variables: "
                    f"{', '.join(map(str, theirs))})."
                )
    aligned = {name: _align_variable(name, posterior[name], reference[name]) for name in names}
    return posterior, xr.Dataset(aligned), names


def _align_variable(name: str, ours: xr.DataArray, ref: Any) -> xr.DataArray:
    """The reference draws of one variable as a (chain, draw, *our dims) DataArray."""
    dims = [dim for dim in ours.dims if dim not in SAMPLE_DIMS]
    coords = {dim: ours.coords[dim] for dim in dims if dim in ours.coords}
    if isinstance(ref, xr.DataArray) and set(ref.dims) == set(dims) | set(SAMPLE_DIMS):
        try:
            selected = ref.sel({dim: ours.coords[dim].values for dim in coords})
        except (KeyError, ValueError) as error:
            raise ValueError(
                f"{name!r}: the reference's coordinates {dict(ref.coords)} do not contain "
                f"ours ({coords}): {error}"
            ) from None
        return xr.DataArray(
            selected.transpose(*SAMPLE_DIMS, *dims).values,
            dims=(*SAMPLE_DIMS, *dims),
            coords=coords,
        )
    values = np.asarray(ref)
    shape = tuple(ours.sizes[dim] for dim in dims)
    if values.ndim <= len(shape) or values.shape[values.ndim - len(shape) :] != shape:
        raise ValueError(
            f"{name!r}: the reference array has shape {values.shape}, which does not end in "
            f"the variable's shape {shape} after its draw axes; pass (draw, *shape) or "
            "(chain, draw, *shape) arrays."
        )
    return xr.DataArray(values.reshape(1, -1, *shape), dims=(*SAMPLE_DIMS, *dims), coords=coords)


def _flat_draws(dataset: xr.Dataset, names: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """(ArviZ flat labels, (chain * draw, n_labels) float64 draws) in row-major order."""
    labeller = BaseLabeller()
    labels: list[str] = []
    columns = []
    for name in names:
        array = dataset[name]
        dims = [dim for dim in array.dims if dim not in SAMPLE_DIMS]
        values = np.asarray(array.transpose(*SAMPLE_DIMS, *dims).values, dtype=np.float64)
        values = values.reshape(-1, *values.shape[2:])
        for index in np.ndindex(*values.shape[1:]):
            isel = dict(zip(dims, index, strict=True))
            sel = {
                dim: (array.coords[dim].values[i].item() if dim in array.coords else i)
                for dim, i in isel.items()
            }
            labels.append(labeller.make_label_flat(name, sel, isel))
            columns.append(values[(slice(None), *index)])
    return labels, np.stack(columns, axis=1)


def _per_chain(stat: xr.DataArray) -> list[np.ndarray]:
    values = np.asarray(stat.transpose("chain", "draw", ...).values, dtype=np.float64)
    return [row.ravel() for row in values]


def _sampling_time(idata: Any) -> float:
    for group in ("posterior", "sample_stats"):
        dataset = get_group(idata, group)
        if dataset is not None and "sampling_time" in dataset.attrs:
            return float(dataset.attrs["sampling_time"])
    return float("nan")
