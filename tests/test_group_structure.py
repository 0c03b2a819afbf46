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
from pymc_sgmcmc.tuning.structure import GroupStructure, StructuredCurvature

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


def crossed(slopes=False):
    """Students × lecturers: every row touches one group of each factor."""
    rng = np.random.default_rng(1)
    students = rng.integers(0, J, N)
    lecturers = rng.integers(0, 30, N)
    x = rng.normal(size=N)
    with pm.Model() as model:
        mu = pm.Normal("mu", 0, 5)
        sigma = pm.HalfNormal("sigma", 1)
        s = pm.Normal("s", 0, sigma, shape=J)
        if slopes:
            d = pm.Normal("d", 0, 1, shape=(30, 2))
            mean = mu + s[students] + d[lecturers, 0] + d[lecturers, 1] * x
        else:
            d = pm.Normal("d", 0, 1, shape=30)
            mean = mu + s[students] + d[lecturers]
        pm.Normal("y", mean, 1.0, observed=rng.normal(size=N))
    return model


@pytest.mark.slow  # 20-60 s, compiling (tests/README.md: the loop's budget)
def test_crossed_factors_are_blocks_of_one_arrowhead_without_their_couplings():
    """Two factors: each factor's blocks and its cross terms with the globals are the
    Hessian's, the couplings between the factors are left out (block Jacobi), and nothing
    else differs — checked against the dense Hessian of the potential."""
    import jax
    import jax.numpy as jnp

    step, found = find(crossed())
    assert isinstance(found, GroupStructure), found
    assert "crossed" in found.description and found.n_factors == 2, found.description
    at = offsets(step)
    np.testing.assert_array_equal(found.local_idx[:, 0], np.r_[at["s"], at["d"]])
    np.testing.assert_array_equal(found.factor, np.r_[np.zeros(J), np.ones(30)])

    fns = step.problem.jax_functions()
    ip = step.problem.model.initial_point()
    fixed = step.problem.fixed_values(ip)
    point = np.asarray(step.problem.ravel(ip)) + 0.1 * np.random.default_rng(2).normal(
        size=step.problem.dim
    )
    data = tuple(jnp.asarray(a) for a in step.problem.data)

    def potential(th):
        return -(fns["logprior"](th, fixed) + jnp.sum(fns["loglik_rows"](th, fixed, data)))

    hessian = np.asarray(jax.hessian(potential)(jnp.asarray(point)), dtype=np.float64)
    curvature = step._structured_curvature(point, fixed, found)
    measured = np.stack([curvature.matvec(e) for e in np.eye(step.problem.dim)], axis=1)
    expected = hessian.copy()
    coupling = hessian[np.ix_(at["s"], at["d"])]
    assert np.abs(coupling).max() > 0.1  # there is a coupling, and it is not of rank one
    skeleton = np.outer(coupling.sum(axis=1), coupling.sum(axis=0)) / coupling.sum()
    expected[np.ix_(at["s"], at["d"])] = skeleton
    expected[np.ix_(at["d"], at["s"])] = skeleton.T
    tol = 1e-5 * np.abs(hessian).max()  # the products in the model's precision
    np.testing.assert_allclose(measured, expected, atol=tol)
    # along the ridge where the students' effects rise as the lecturers' fall the likelihood
    # is flat; the skeleton has it exactly
    ridge = np.zeros(step.problem.dim)
    ridge[at["s"]], ridge[at["d"]] = 1.0, -1.0
    np.testing.assert_allclose(curvature.matvec(ridge), hessian @ ridge, atol=tol)


def test_the_crossed_whitening_is_the_factor_of_the_arrowhead_with_its_couplings():
    """``StructuredWhitening`` of a crossed arrowhead: ``(CP)(CP)ᵀ`` is the measured matrix
    (blocks, cross terms and the factors' couplings), and its operators, inverse diagonal and
    whitened noise diagonals agree with dense linear algebra."""
    import jax

    from pymc_sgmcmc.tuning.structure import StructuredWhitening

    rng = np.random.default_rng(3)
    g, js, jd = 2, 12, 9
    dim = g + js + jd
    structure = crossed_layout(g, js, jd)
    rows = [(rng.integers(js), rng.integers(jd)) for _ in range(200)]
    design = np.zeros((len(rows), dim))
    for i, (a, b) in enumerate(rows):
        design[i, :g] = rng.normal(size=g)
        design[i, g + a] = design[i, g + js + b] = 1.0
    prior = np.diag(rng.uniform(0.5, 2.0, dim))
    hessian = design.T @ design + prior
    curvature = structure.curvature_from_products(structure.probes() @ hessian)
    dense = np.stack([curvature.matvec(e) for e in np.eye(dim)], axis=1)
    whitening = StructuredWhitening.from_curvature(curvature)
    op = whitening.operator()
    with jax.enable_x64(True):  # the operators are JAX's; in double precision as a run is
        factor = np.asarray(op.multiply(np.eye(dim))).T  # columns C P e_i
        inverse = np.asarray(op.solve(np.eye(dim))).T
        gram = op.gram_diagonal(d := rng.uniform(0.1, 1.0, dim))
    np.testing.assert_allclose(factor @ factor.T, dense, rtol=1e-8, atol=1e-8 * dense.max())
    np.testing.assert_allclose(inverse, np.linalg.inv(factor), atol=1e-8)
    covariance = np.linalg.inv(dense)
    np.testing.assert_allclose(whitening.covariance_diagonal(), np.diag(covariance), rtol=1e-8)
    ell = np.linalg.inv(factor).T  # L = (CP)⁻ᵀ
    m = rng.uniform(0.1, 1.0, dim)
    np.testing.assert_allclose(
        whitening.to_whitened(m), np.diag(ell.T @ np.diag(m) @ ell), rtol=1e-8
    )
    # a gradient noise in the same layout, with and without its couplings between factors
    coupled = structure.curvature_from_products(structure.probes() @ (design.T @ design))
    for noise in (coupled, StructuredCurvature(structure, coupled.gg, coupled.ug, coupled.uu)):
        noise_dense = np.stack([noise.matvec(e) for e in np.eye(dim)], axis=1)
        np.testing.assert_allclose(
            whitening.to_whitened(noise), np.diag(ell.T @ noise_dense @ ell), rtol=1e-8
        )
    np.testing.assert_allclose(gram, np.diag(factor @ np.diag(d) @ factor.T), rtol=1e-8)


def test_crossed_factors_need_the_same_block_size():
    _, found = find(crossed(slopes=True))
    assert isinstance(found, str) and "different numbers of coordinates" in found, found


def counties_in_states(where):
    """40 counties in 20 states: the states' effects on the rows beside the counties'
    (``"rows"``: nested factors) or only in the counties' prior (``"prior"``)."""
    group, x, y = data()
    state = np.arange(J) % 20  # 20 states of two counties each
    with pm.Model() as model:
        s = pm.Normal("s", 0, 1, shape=20)
        if where == "rows":
            c = pm.Normal("c", 0, 1, shape=J)
            pm.Normal("y", s[state[group]] + 0.5 * c[group], 1.0, observed=y)
        else:
            c = pm.Normal("c", s[state], 0.5, shape=J)
            pm.Normal("y", c[group], 1.0, observed=y)
    return model


@pytest.mark.parametrize(
    "where, label",
    [("rows", "s: 20 groups of 1 (outer, nested)"), ("prior", "s (in a prior only)")],
)
def test_counties_in_states_put_the_states_among_the_globals(where, label):
    """Each county meets its own state only, so the states' effects join the globals and the
    counties are the blocks; the arrowhead passes ``verify`` against the model's
    Hessian-vector products (in ``_find_structure``)."""
    step, found = find(counties_in_states(where))
    assert isinstance(found, GroupStructure), found
    at = offsets(step)
    np.testing.assert_array_equal(found.local_idx[:, 0], at["c"])
    np.testing.assert_array_equal(found.global_idx, at["s"])
    assert label in found.description, found.description


def test_a_level_above_the_groups_too_large_for_the_globals_is_refused():
    """300 prior-level effects (more than PROMOTED_GLOBALS_MAX) would make the dense globals'
    block too large: refused, with the reason."""
    rng = np.random.default_rng(0)
    groups, per = 600, 2
    group = np.repeat(np.arange(groups), per)
    state = np.arange(groups) % 300
    with pm.Model() as model:
        s = pm.Normal("s", 0, 1, shape=300)
        c = pm.Normal("c", s[state], 0.5, shape=groups)
        pm.Normal("y", c[group], 1.0, observed=rng.normal(size=groups * per))
    _, found = find(model)
    assert isinstance(found, str) and "would make 300 globals" in found, found


def test_a_zero_sum_effect_touches_every_coordinate_at_once():
    group, x, y = data()
    with pm.Model() as model:
        u = pm.ZeroSumNormal("u", 1.0, shape=J)
        pm.Normal("y", u[group], 1.0, observed=y)
    _, found = find(model)
    assert isinstance(found, str) and "several coordinates" in found, found


def _rows_touching_groups(rng, sizes, g=3, k=2, rows=400):
    """Per-row gradients of ``g`` globals and ``k`` slots (an intercept and a slope) of one
    group per factor (``sizes`` groups each; crossed when several), 10% of the rows touching
    no group of a factor; and the structure."""
    offsets = np.cumsum([g] + [j * k for j in sizes])
    dim = int(offsets[-1])
    local_idx = np.concatenate(
        [np.arange(o, o + j * k).reshape(j, k) for o, j in zip(offsets[:-1], sizes, strict=True)]
    )
    factor = np.repeat(np.arange(len(sizes)), sizes) if len(sizes) > 1 else None
    structure = GroupStructure(np.arange(g), local_idx, "u", factor)
    grads = np.zeros((rows, dim))
    grads[:, :g] = rng.normal(size=(rows, g))
    first = 0
    for j in sizes:
        group = first + rng.integers(j, size=rows)
        residual = rng.normal(size=rows) * (rng.random(rows) > 0.1)
        x = rng.choice([-1.0, 1.0, -0.618034, 2.0], size=rows)  # ±1 and a cancelling value
        grads[np.arange(rows), local_idx[group, 0]] = residual
        grads[np.arange(rows), local_idx[group, 1]] = x * residual
        first += j
    return structure, grads


@pytest.mark.parametrize("sizes", [[23], [15, 11]], ids=["one factor", "crossed"])
def test_the_noise_moments_from_directional_derivatives_equal_the_per_row_gradients(sizes):
    """``arrowhead_moments_along`` — the rows' derivatives along the structure's probes and
    the probes that number the groups, no per-row gradients — gives the arrowhead moments of
    the per-row gradients (the blocks, cross terms and crossed factors' couplings) exactly:
    two slots per group (an intercept and a slope whose covariate is ±1, 2 or −0.618, where a
    slot-weighted sum would cancel), rows that touch no group of a factor, several chunks
    with a clamped last one."""
    import jax
    import jax.numpy as jnp

    from pymc_sgmcmc.tuning.averaging import arrowhead_moments_along

    structure, grads = _rows_touching_groups(np.random.default_rng(7), sizes)
    rows = grads.shape[0]
    with jax.enable_x64(True):
        table = jnp.asarray(grads)
        parts = arrowhead_moments_along(
            lambda start, size, t: t @ jax.lax.dynamic_slice_in_dim(table, start, size).T,
            rows,
            jnp.asarray(structure.probes()),
            jnp.asarray(structure.id_probes()),
            jnp.asarray(structure.local_idx),
            tuple(structure.pairs()),
            64 * 16 * 14,  # chunks of 64 rows (14 tangents at most), the last one clamped
        )
    measured = StructuredCurvature(structure, *(np.asarray(p) for p in parts))
    expected = structure.curvature_from_products(structure.probes() @ (grads.T @ grads / rows))
    for got, want in zip(measured._parts(), expected._parts(), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-12)


def test_the_rows_groups_are_read_exactly_in_float32_among_many_groups():
    """The group a row touches, read from the ratio of its derivative along the numbered
    probe to its own slot's, in float32 among 100 000 groups, by forward mode through a PyMC
    model's row log-likelihood (``a[g] + b[g]·x`` with a covariate where a slot-weighted sum
    would cancel): every row's block lands in its own group (each group's ``uu`` block equals
    the sum of its rows' outer products)."""
    import jax
    import jax.numpy as jnp

    from pymc_sgmcmc.tuning.averaging import arrowhead_moments_along

    rng = np.random.default_rng(8)
    groups, rows = 100_000, 3000
    g = rng.integers(groups, size=rows)
    x = rng.choice([-0.618034, 1.0, -1.0], size=rows).astype(np.float32)
    y = rng.normal(size=rows).astype(np.float32)
    a = rng.normal(size=groups).astype(np.float32)
    b = rng.normal(size=groups).astype(np.float32)
    position = jnp.asarray(np.concatenate([[0.3], np.stack([a, b], 1).ravel()]), jnp.float32)
    structure = GroupStructure(np.array([0]), 1 + np.arange(2 * groups).reshape(groups, 2), "ab")

    def loglik_rows(th, start, size):
        ab = th[1:].reshape(groups, 2)
        gi, xi, yi = (jax.lax.dynamic_slice_in_dim(v, start, size) for v in (g, x, y))
        mu = th[0] + ab[gi, 0] + ab[gi, 1] * xi
        return -0.5 * (yi - mu) ** 2

    def along(start, size, tangents):
        def one(t):
            return jax.jvp(lambda th: loglik_rows(th, start, size), (position,), (t,))[1]

        return jax.vmap(one)(tangents)

    parts = arrowhead_moments_along(
        along,
        rows,
        jnp.asarray(structure.probes(np.float32)),
        jnp.asarray(structure.id_probes(np.float32)),
        jnp.asarray(structure.local_idx),
        (),
        2**20,
    )
    uu = np.asarray(parts[2], dtype=np.float64) * rows
    residual = (y - (0.3 + a[g] + b[g] * x)).astype(np.float64)
    row_grad = np.stack([residual, residual * x], 1)
    expected = np.zeros((groups, 2, 2))
    np.add.at(expected, g, row_grad[:, :, None] * row_grad[:, None, :])
    np.testing.assert_allclose(uu, expected, rtol=1e-4, atol=1e-4)


def crossed_layout(g: int, js: int, jd: int) -> GroupStructure:
    """``g`` globals, then ``js`` and ``jd`` one-coordinate groups of two crossed factors."""
    dim = g + js + jd
    return GroupStructure(
        np.arange(g), np.arange(g, dim)[:, None], "s × d", np.repeat([0, 1], [js, jd])
    )


def test_the_injected_noise_completes_the_minibatch_noise_beyond_its_diagonal():
    """``StructuredWhitening.injection_factor``: on a nested arrowhead (two globals, 40 groups
    of two coordinates) whose gradient noise is correlated across the whitened coordinates,
    the injected noise ``F Fᵀ`` is ``L (diag(budgets) − P_z S P_z) Lᵀ`` with ``S = Lᵀ N L``
    whole, so the chain's stationary covariance (the discrete Lyapunov equation of
    ``z' = (I − P_z) z − P_z ξ_S + ξ_Q``) is ``A⁻¹`` exactly; the diagonal injection
    (``diag(Q)``) is not, on the globals."""
    import jax
    from scipy.linalg import solve_discrete_lyapunov

    from pymc_sgmcmc.tuning.rates import langevin_rule
    from pymc_sgmcmc.tuning.structure import StructuredWhitening

    rng = np.random.default_rng(5)
    g, j, k = 2, 40, 2
    dim = g + j * k
    structure = GroupStructure(np.arange(g), np.arange(g, dim).reshape(j, k), "group")
    group = rng.integers(j, size=400)
    design = np.zeros((group.size, dim))
    design[:, :g] = rng.normal(3.0, 1.0, (group.size, g))  # uncentred: globals ~ groups
    for slot in range(k):
        design[np.arange(group.size), g + group * k + slot] = rng.normal(1.0, 1.0, group.size)
    residual = rng.normal(size=group.size)
    # a hierarchical prior, u_j0 ~ N(θ_0, 0.5): curvature without noise, coupling θ_0 to
    # every group
    tie = np.zeros((j, dim))
    tie[np.arange(j), g + np.arange(j) * k] = 1.0
    tie[:, 0] = -1.0
    prior = tie.T @ tie / 0.25 + np.eye(dim)
    curvature = structure.curvature_from_products(structure.probes() @ (design.T @ design + prior))
    grads = design * residual[:, None]
    noise = structure.curvature_from_products(structure.probes() @ (grads.T @ grads)) * 20.0
    whitening = StructuredWhitening.from_curvature(curvature)
    rates = langevin_rule(whitening.to_whitened(noise), noise_share=0.25, step_cap=0.25)
    factor, excess = whitening.injection_factor(rates.steps, rates.budgets, noise)
    assert excess < 1.0
    with jax.enable_x64(True):
        f = np.asarray(factor.apply(np.eye(dim))).T  # columns F e_i
        ell = np.asarray(whitening.operator().solve_transpose(np.eye(dim))).T  # L = C⁻ᵀ
    noise_dense = np.stack([noise.matvec(e) for e in np.eye(dim)], axis=1)
    s_z = ell.T @ noise_dense @ ell
    p_z = np.diag(rates.steps)
    q_z = np.diag(rates.budgets) - p_z @ s_z @ p_z
    want = ell @ q_z @ ell.T
    np.testing.assert_allclose(f @ f.T, want, atol=1e-9 * np.abs(want).max())
    dense_a = np.stack([curvature.matvec(e) for e in np.eye(dim)], axis=1)
    target = np.diag(np.linalg.inv(dense_a))
    for q, exact in ((q_z, True), (np.diag(rates.injected), False)):
        sigma = solve_discrete_lyapunov(np.eye(dim) - p_z, q + p_z @ s_z @ p_z)
        ratio = np.sqrt(np.diag(ell @ sigma @ ell.T) / target)
        if exact:
            np.testing.assert_allclose(ratio, 1.0, atol=1e-8)
        else:
            assert ratio[0] < 0.99, ratio[:g]  # the global tied to every group: 0.98
