"""Shared models (all written in PyMC) and their closed-form posteriors."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass

import numpy as np
import pymc as pm
import pytest

warnings.filterwarnings("ignore", message=".*BLAS.*")
warnings.filterwarnings("ignore", category=FutureWarning)


def _start_compilation_cache(config):
    """One persistent XLA compilation cache for the whole run, shared by the pytest-xdist
    workers and the subprocesses tests start (they inherit the environment): the tests compile
    many identical programs — the same small models and samplers — which then compile once
    (measured: tests/test_advi_models.py 25 s -> 20 s within one run). Fresh for every run, so
    no result can depend on an earlier run; a JAX_COMPILATION_CACHE_DIR set by the user wins.
    Loading a program from the cache gives the same draws (the golden fixtures pass with it)."""
    if hasattr(config, "workerinput") or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = tempfile.mkdtemp(prefix="pmsg-tests-xla-")
    config._pmsg_xla_cache = path
    os.environ["JAX_COMPILATION_CACHE_DIR"] = path
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    if "jax" in sys.modules:  # already imported (a plugin, or this process runs the tests)
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update(
            "jax_persistent_cache_min_compile_time_secs",
            float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
        )


def pytest_unconfigure(config):
    """Remove this run's compilation cache (see _start_compilation_cache)."""
    path = getattr(config, "_pmsg_xla_cache", None)
    if path:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(autouse=True, scope="module")
def _chain_workers_end_with_their_module():
    """Worker processes a module's tests start end with that module. ``chain_method="auto"``
    takes the workers whenever they are up, so without this every later test in the same
    pytest-xdist worker ran its chains in processes because an earlier module had started
    them (each of its programs then compiled once per worker process, beside the other xdist
    worker on the second CPU)."""
    yield
    import pymc_sgmcmc as pmsg

    pmsg.close_workers()


@dataclass
class ConjugateRegression:
    """y = X β + ε, ε ~ N(0, σ²) with σ known, β ~ N(0, τ² I): a Gaussian posterior."""

    X: np.ndarray
    y: np.ndarray
    noise_sd: float
    prior_sd: float

    @property
    def precision(self) -> np.ndarray:
        d = self.X.shape[1]
        return self.X.T @ self.X / self.noise_sd**2 + np.eye(d) / self.prior_sd**2

    @property
    def cov(self) -> np.ndarray:
        return np.linalg.inv(self.precision)

    @property
    def mean(self) -> np.ndarray:
        return self.cov @ self.X.T @ self.y / self.noise_sd**2

    @property
    def sd(self) -> np.ndarray:
        return np.sqrt(np.diag(self.cov))

    def per_datum_grad_cov(self, beta: np.ndarray) -> np.ndarray:
        """Population covariance over rows of ∇ log p(y_n | β) (the C of the theory)."""
        grads = self.X * ((self.y - self.X @ beta) / self.noise_sd**2)[:, None]
        return np.cov(grads, rowvar=False, bias=True)

    def model(self, dims: bool = True) -> pm.Model:
        n, d = self.X.shape
        coords = {"obs": np.arange(n), "feature": [f"x{i}" for i in range(d)]}
        with pm.Model(coords=coords) as model:
            X = pm.Data("X", self.X, dims=("obs", "feature"))
            beta = pm.Normal("beta", 0.0, self.prior_sd, dims="feature")
            mu = pm.Deterministic("mu_first", (X @ beta)[0])
            del mu
            pm.Normal("y", X @ beta, self.noise_sd, observed=self.y, dims="obs")
        return model


def make_regression(n: int, d: int, seed: int = 0, rho: float = 0.3) -> ConjugateRegression:
    rng = np.random.default_rng(seed)
    cov = (1 - rho) * np.eye(d) + rho * np.ones((d, d))
    X = rng.multivariate_normal(np.zeros(d), cov, size=n)
    beta = rng.normal(size=d)
    y = X @ beta + rng.normal(size=n)
    return ConjugateRegression(X=X, y=y, noise_sd=1.0, prior_sd=1.0)


@pytest.fixture
def float64():
    """JAX's float64 for a test that calls the bridge's JAX functions itself (the package's
    own entry points enter it; see pymc_sgmcmc._precision)."""
    from pymc_sgmcmc import float64_scope

    with float64_scope():
        yield


@pytest.fixture(scope="session")
def small_regression() -> ConjugateRegression:
    return make_regression(2_000, 3, seed=1)


@pytest.fixture(scope="session")
def regression_10k() -> ConjugateRegression:
    return make_regression(10_000, 5, seed=2)


@pytest.fixture(scope="session")
def regression_d10() -> ConjugateRegression:
    """Mandt et al. §7.2's setting: linear regression, D = 10, known noise (A = C holds)."""
    return make_regression(10_000, 10, seed=3)


# -- both drivers: pm.sample(step=...) and pmsg.sample(step=...) ----------------------------


class SamplePath:
    """Runs a step method through one of the two drivers with pm.sample's arguments.

    ``"pm.sample"``: ``pm.sample(step=..., **kwargs)``. ``"pmsg.sample"``: the vectorised
    driver with the same arguments; ``cores`` keeps its meaning (cores used: one group of
    vmapped chains per core), so ``cores=1`` runs all chains as one vmapped batch."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, **kwargs):
        if self.name == "pm.sample":
            return pm.sample(**kwargs)
        import pymc_sgmcmc as pmsg

        return pmsg.sample(**kwargs)

    def __repr__(self) -> str:
        return self.name


# The statistical tests run through one driver: the two give the same draws (to 1e-9) for the
# same seed — every sampler, temperature and local variables are checked draw for draw in
# test_sampling.py (test_same_seed_same_draws_as_pm_sample) — so a second run of each
# statistical test through the other driver tested nothing new and cost ~3 minutes of CI.
# pmsg.sample is the faster of the two (the chains vmapped). A test that exercises something
# only one driver does parametrizes ``sample_path`` itself (``indirect=True``).
SAMPLE_PATHS = ("pm.sample", "pmsg.sample")
STATISTICAL_PATH = "pmsg.sample"


@pytest.fixture(params=[STATISTICAL_PATH])
def sample_path(request) -> SamplePath:
    """The driver a statistical test runs through (see ``STATISTICAL_PATH``)."""
    return SamplePath(request.param)


# -- the self-check's false-alarm rate over a test session ---------------------------------
# Every run of a step method appends its self-check verdict to $PMSG_CHECK_LOG
# (pymc_sgmcmc.diagnostics). The controller sets it before the xdist workers start (they
# inherit it), and the terminal summary counts the runs and lists the tests whose runs
# warned: those that provoke it on purpose (tests/test_diagnostics.py, the bad-input and
# fixed-step tests) and any false alarm.


def pytest_configure(config):
    _start_compilation_cache(config)
    if hasattr(config, "workerinput") or os.environ.get("PMSG_CHECK_LOG"):
        return
    fd, path = tempfile.mkstemp(prefix="pmsg_check_", suffix=".jsonl")
    os.close(fd)
    os.environ["PMSG_CHECK_LOG"] = path
    config._pmsg_check_log = path


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import json

    path = getattr(config, "_pmsg_check_log", None) or os.environ.get("PMSG_CHECK_LOG")
    if not path or not os.path.exists(path):
        return
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    if not records:
        return
    warned = [r for r in records if not r["ok"]]
    tests = sorted({r["test"].split(" ")[0] for r in warned})
    terminalreporter.write_sep("-", "sgmcmc self-check")
    terminalreporter.write_line(
        f"{len(records)} sampler runs checked, {len(warned)} warned, in {len(tests)} tests"
    )
    for test in tests:
        terminalreporter.write_line(f"  warned: {test}")
