"""The nested structure of a hierarchical posterior, found from the rows whatever the model's
parameterisation (pymc_sgmcmc.tuning.structure): which coordinates are globals and which
are each group's locals — or why there is none, where the groups couple beyond the rows'
grouping (then the whitening stays diagonal and says so).

Each model is small (J = 40 groups of 5 rows): finding the structure does not depend on the
size, and these run in a second each.
"""

from __future__ import annotations

import numpy as np
import pymc as pm
import pytest

import pymc_sgmcmc as pmsg
from pymc_sgmcmc.tuning.structure import GroupStructure

J, N_PER = 40, 5
N = J * N_PER


def data(seed=0):
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(J), N_PER)
    x = rng.normal(3.0, 1.0, N)
    y = rng.normal(size=J)[group] + 0.5 * x + rng.normal(size=N)
    return group, x, y


def find(model):
    """The step's structure at the model's initial point (a GroupStructure or the reason)."""
    with model:
        step = pmsg.ConstantSGD()
    ip = model.initial_point()
    position = np.asarray(step.problem.ravel(ip))
    return step, step._find_structure(position, step.problem.fixed_values(ip))


def offsets(step):
    out, start = {}, 0
    for info in step.problem.var_infos:
        out[info.name] = np.arange(start, start + info.size).reshape(info.shape or (1,))
        start += info.size
    return out


def intercepts(index, form):
    group, x, y = data()
    with pm.Model() as model:
        idx = pm.Data("g", group) if index == "data" else group
        mu = pm.Normal("mu", 0, 5)
        sigma = pm.HalfNormal("sigma", 1)
        beta = pm.Normal("beta", 0, 1)
        if form == "centred":
            u = pm.Normal("u", mu, sigma, shape=J)
            mean = u[idx]
        elif form == "noncentred-inside":
            z = pm.Normal("z", 0, 1, shape=J)
            mean = mu + sigma * z[idx]
        elif form == "noncentred-outside":
            z = pm.Normal("z", 0, 1, shape=J)
            mean = (mu + sigma * z)[idx]
        else:  # a one-hot design matrix
            u = pm.Normal("u", mu, sigma, shape=J)
            mean = pm.Data("Z", np.eye(J)[group]) @ u
        pm.Normal("y", mean + beta * x, 1.0, observed=y)
    return model


@pytest.mark.parametrize(
    "index, form",
    [
        ("data", "centred"),
        ("numpy", "centred"),
        ("data", "noncentred-inside"),
        ("numpy", "noncentred-outside"),
        ("data", "one-hot"),
    ],
)
def test_random_intercepts_are_found_whatever_the_parameterisation(index, form):
    step, found = find(intercepts(index, form))
    assert isinstance(found, GroupStructure), found
    at = offsets(step)
    local = "u" if "u" in at else "z"
    assert found.local_idx.shape == (J, 1)
    np.testing.assert_array_equal(found.local_idx[:, 0], at[local])
    globals_ = sorted(int(i) for name, idx in at.items() if name != local for i in idx.ravel())
    assert sorted(found.global_idx.tolist()) == globals_


def test_an_mvnormal_intercept_and_slope_make_blocks_of_two():
    group, x, y = data()
    with pm.Model() as model:
        chol, _, _ = pm.LKJCholeskyCov(
            "chol", n=2, eta=2.0, sd_dist=pm.Exponential.dist(1.0, shape=2)
        )
        ab = pm.MvNormal("ab", mu=np.zeros(2), chol=chol, shape=(J, 2))
        pm.Normal("y", ab[group, 0] + ab[group, 1] * x, 1.0, observed=y)
    step, found = find(model)
    assert isinstance(found, GroupStructure), found
    assert found.local_idx.shape == (J, 2)
    np.testing.assert_array_equal(found.local_idx, offsets(step)["ab"])


def test_two_group_level_variables_on_one_factor_share_its_blocks():
    group, x, y = data()
    with pm.Model() as model:
        a = pm.Normal("a", 0, 1, shape=J)
        b = pm.Normal("b", 0, 1, shape=J)
        pm.Normal("y", a[group] + b[group] * x, 1.0, observed=y)
    step, found = find(model)
    assert isinstance(found, GroupStructure), found
    at = offsets(step)
    np.testing.assert_array_equal(found.local_idx, np.stack([at["a"], at["b"]], axis=1))


def test_crossed_factors_are_not_nested():
    rng = np.random.default_rng(1)
    students = rng.integers(0, J, N)
    lecturers = rng.integers(0, 30, N)
    with pm.Model() as model:
        s = pm.Normal("s", 0, 1, shape=J)
        d = pm.Normal("d", 0, 1, shape=30)
        pm.Normal("y", s[students] + d[lecturers], 1.0, observed=rng.normal(size=N))
    _, found = find(model)
    assert isinstance(found, str) and "crossed" in found, found


def test_a_county_in_state_prior_couples_groups_beyond_the_rows():
    group, x, y = data()
    state = np.arange(J) % 20  # 20 states of two counties each
    with pm.Model() as model:
        s = pm.Normal("s", 0, 1, shape=20)
        c = pm.Normal("c", s[state], 0.5, shape=J)
        pm.Normal("y", c[group], 1.0, observed=y)
    _, found = find(model)
    assert isinstance(found, str) and "s does not enter" in found, found


def test_a_zero_sum_effect_touches_every_coordinate_at_once():
    group, x, y = data()
    with pm.Model() as model:
        u = pm.ZeroSumNormal("u", 1.0, shape=J)
        pm.Normal("y", u[group], 1.0, observed=y)
    _, found = find(model)
    assert isinstance(found, str) and "several coordinates" in found, found
