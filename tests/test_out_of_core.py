"""Out-of-core data: memory-maps, zarr and dask arrays read in blocks, never whole.

Peak memory is measured in benchmarks/out_of_core.py, not asserted here.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.out_of_core import FileRowSource, RowSource, as_row_source

N, D = 50_000, 4
SAMPLE = dict(chains=1, cores=1, progressbar=False, compute_convergence_checks=False)


@pytest.fixture(scope="module")
def regression():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(N, D))
    y = X @ rng.normal(size=D) + rng.normal(size=N)
    precision = X.T @ X + np.eye(D)  # noise sd 1, N(0, 1) prior
    cov = np.linalg.inv(precision)
    return X, y, cov @ X.T @ y, np.sqrt(np.diag(cov))


@pytest.fixture(scope="module")
def on_disk(regression, tmp_path_factory):
    X, y, _, _ = regression
    path = tmp_path_factory.mktemp("ooc")
    np.save(path / "X.npy", X)
    np.save(path / "y.npy", y)
    return np.load(path / "X.npy", mmap_mode="r"), np.load(path / "y.npy", mmap_mode="r")


def placeholder_model(X, y, rows=500):
    with pm.Model() as model:
        Xd = pm.Data("X", np.asarray(X[:rows]))
        yd = pm.Data("y_obs", np.asarray(y[:rows]))
        beta = pm.Normal("beta", 0, 1, shape=D)
        pm.Normal("y", Xd @ beta, 1.0, observed=yd)
    return model


# --- readers ------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1, 3, 700])  # gathered through the mapping / preadv
def test_memmap_reader_reads_runs_with_wrap_around(on_disk, regression, length):
    Xm, _ = on_disk
    source = as_row_source(Xm)
    assert isinstance(source, FileRowSource)
    starts = np.array([0, 17, N - 2, N - 1, 12_345])
    rows = (starts[:, None] + np.arange(length)) % N
    np.testing.assert_array_equal(source.read(starts, length), regression[0][rows.reshape(-1)])


def test_a_slice_of_a_memmap_is_read_by_slicing(on_disk, regression):
    Xm, _ = on_disk
    view = Xm[100:]
    source = as_row_source(view)
    assert type(source) is RowSource
    np.testing.assert_array_equal(
        source.read(np.array([0, N - 101]), 2)[2:], regression[0][[N - 1, 100]]
    )


def test_zarr_and_dask_arrays_are_read_by_blocks(regression, tmp_path):
    zarr = pytest.importorskip("zarr")
    da = pytest.importorskip("dask.array")
    X = regression[0]
    z = zarr.create_array(tmp_path / "X.zarr", shape=X.shape, chunks=(4096, D), dtype=X.dtype)
    z[:] = X
    starts = np.array([5, N - 3, 40_000])
    expected = X[((starts[:, None] + np.arange(800)) % N).reshape(-1)]
    for array in (
        zarr.open_array(tmp_path / "X.zarr", mode="r"),
        da.from_array(X, chunks=(4096, D)),
    ):
        np.testing.assert_array_equal(as_row_source(array).read(starts, 800), expected)


# --- sampling -----------------------------------------------------------------------------


@pytest.mark.slow  # 20-60 s, compiling (tests/README.md: the loop's budget)
def test_memmap_posterior_matches_in_memory_and_the_exact_one(on_disk, regression):
    X, y, mean, sd = regression
    Xm, ym = on_disk
    with placeholder_model(X, y):
        step = pmsg.IASG(batch_size=500, data={"X": Xm, "y_obs": ym})
        assert step.streaming and step.problem.data_size == N
        streamed = pm.sample(step=step, draws=400, tune=40, random_seed=3, **SAMPLE)
    with placeholder_model(X, y, rows=N):
        in_memory = pm.sample(
            step=pmsg.IASG(batch_size=500), draws=400, tune=40, random_seed=3, **SAMPLE
        )
    # IASG's draws are close to independent (about one per pass): with 400 draws a mean is off
    # by N(0, 0.05 sd) and an sd by about 3.5%; 0.25 sd and 20% are five such errors.
    for idata in (streamed, in_memory):
        draws = idata.posterior["beta"].values.reshape(-1, D)
        z = (draws.mean(axis=0) - mean) / sd
        assert np.all(np.abs(z) < 0.25), z
        np.testing.assert_allclose(draws.std(axis=0) / sd, 1.0, atol=0.2)


def test_streamed_draws_are_reproducible_and_memory_arrays_use_the_in_memory_path(
    on_disk, regression
):
    X, y, _, _ = regression
    Xm, ym = on_disk

    def run(data, seed):
        with placeholder_model(X, y):
            step = pmsg.SGLD(batch_size=1000, data=data)
            idata = pm.sample(step=step, draws=5, tune=5, random_seed=seed, **SAMPLE)
        return step, idata.posterior["beta"].values

    _, a = run({"X": Xm, "y_obs": ym}, 1)
    _, b = run({"X": Xm, "y_obs": ym}, 1)
    _, c = run({"X": Xm, "y_obs": ym}, 2)
    np.testing.assert_array_equal(a, b)
    assert not np.any(a == c)
    step, _ = run({"X": X, "y": y}, 1)  # plain arrays, by observed name: in memory
    assert not step.streaming and step.problem.data_size == N


def test_out_of_core_data_errors(on_disk, regression):
    X, y, _, _ = regression
    Xm, ym = on_disk
    with placeholder_model(X, y):
        with pytest.raises(pmsg.DataShapeError, match=r"missing: \['y'\]"):
            pmsg.SGLD(data={"X": Xm})
        with pytest.raises(
            pmsg.DataShapeError, match=r"not row-aligned data of this model: \['Z'\]"
        ):
            pmsg.SGLD(data={"X": Xm, "y_obs": ym, "Z": ym})
        with pytest.raises(pmsg.DataShapeError, match="same number of rows"):
            pmsg.SGLD(data={"X": Xm, "y_obs": ym[:-1]})
        with pytest.raises(pmsg.DataShapeError, match=r"rows of shape \(3,\)"):
            pmsg.SGLD(data={"X": Xm[:, :3], "y_obs": ym})
        with pytest.raises(pmsg.DataShapeError, match=f"N={N}"):
            pmsg.SGLD(data={"X": Xm, "y_obs": ym}, batch_size=N + 1)
        with pytest.raises(
            pmsg.ModelNotSupportedError, match="SAGALD.*cannot read its data from disk"
        ):
            pmsg.SAGALD(data={"X": Xm, "y_obs": ym})


def test_non_finite_rows_on_disk_are_named_as_they_are_read(regression, tmp_path):
    # The file is not read up front (it may be larger than memory): every chunk is checked
    # as it is read, and the error names the container, the row and the fix, as in memory.
    X, y, _, _ = regression
    bad = X.copy()
    bad[31_337, 2] = np.nan
    np.save(tmp_path / "X.npy", bad)
    Xm = np.load(tmp_path / "X.npy", mmap_mode="r")
    with placeholder_model(X, y):
        step = pmsg.SGLD(data={"X": Xm, "y_obs": y}, minibatch="random")
        with pytest.raises(
            pmsg.DataShapeError,
            match=r"data\['X'\] \(50000x4\) have non-finite values \(NaN or inf\) at row 31337"
            r".*Missing values are not supported.*pass that as data=",
        ):
            pm.sample(step=step, draws=5, tune=5, random_seed=1, **SAMPLE)
