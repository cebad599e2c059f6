"""Weight (and activation) matching: twin recovery over randomised configs, restrictions, bad input."""

from __future__ import annotations

import inspect
import math
import threading

import pytest
import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.config.methods import METHODS
from hf_lmc.matching import Matcher
from hf_lmc.matching import weight as weight_matching
from hf_lmc.matching.solvers import (
    Moments,
    assign,
    assign_product,
    match_gl,
    match_rotary,
    match_rotary_joint_moments,
    match_rotary_moments,
    rotary_pair_constants,
    rotary_pair_objective,
    rotary_pair_scale,
)
from hf_lmc.merging.alignment import matcher_for
from hf_lmc.symmetry.groups import rotary_block
from hf_lmc.symmetry.sample import random_gl
from tests.models import ARCHITECTURES, CONFIGS, build_model, logits, relative_error, sample_inputs, transform_tensors


def _matcher(method: str, config):
    if method == "weight":
        return hf_lmc.WeightMatcher(progress=False)
    calibration = [sample_inputs(config, seed=100 + s) for s in range(4)]
    return hf_lmc.ActivationMatcher(calibration, progress=False)


@pytest.mark.parametrize("method", ["weight", pytest.param("activation", marks=pytest.mark.slow)])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_twin_merge_at_half_computes_a(arch, method):
    """If B is A moved by any random symmetry, the aligned merge at alpha=0.5 is A."""

    @settings(max_examples=6 if method == "weight" else 4, deadline=None)
    @given(config=CONFIGS[arch](), seed=st.integers(0, 2**16))
    def run(config, seed):
        model = build_model(config, seed=seed, dtype=torch.float32)
        a = hf_lmc.canonicalize(model)
        b = hf_lmc.random_symmetry(a.spec, seed=seed + 1, dtype=torch.float32).apply(a).materialize()
        transform = _matcher(method, config).match(a, b)
        merged = hf_lmc.interpolate(a, transform.to(torch.float32).apply(b), 0.5)
        inputs = sample_inputs(config, seed=seed)
        err = relative_error(logits(hf_lmc.to_hf(merged), inputs), logits(model, inputs))
        assert err < 1e-3, f"twin merge off by {err:.2e}"

    run()


def test_alpha_endpoints_give_each_model():
    config = tiny_configs()["llama"]
    model_a, model_b = (
        build_model(config, seed=1, dtype=torch.float32),
        build_model(config, seed=2, dtype=torch.float32),
    )
    a, b = hf_lmc.canonicalize(model_a), hf_lmc.canonicalize(model_b)
    aligned = hf_lmc.WeightMatcher(progress=False).match(a, b).to(torch.float32).apply(b)
    inputs = sample_inputs(config)
    assert (
        relative_error(logits(hf_lmc.to_hf(hf_lmc.interpolate(a, aligned, 0.0)), inputs), logits(model_a, inputs))
        < 1e-5
    )
    assert (
        relative_error(logits(hf_lmc.to_hf(hf_lmc.interpolate(a, aligned, 1.0)), inputs), logits(model_b, inputs))
        < 1e-4
    )


def test_matching_reduces_distance_between_independent_models():
    config = tiny_configs()["gpt_neox"]
    a = hf_lmc.canonicalize(build_model(config, seed=1))
    b = hf_lmc.canonicalize(build_model(config, seed=2))
    matcher = hf_lmc.WeightMatcher(progress=False)
    transform = matcher.match(a, b)
    fitted = matcher.objective(a, b, transform)
    assert fitted < 0.9 * matcher.objective(a, b, hf_lmc.Transform())
    assert fitted == pytest.approx(min(matcher.history))  # the best transform seen is returned


def test_permutation_only_matching_recovers_a_permuted_twin():
    config = tiny_configs()["gpt2"]
    a = hf_lmc.canonicalize(build_model(config))
    b = hf_lmc.random_symmetry(a.spec, seed=3, kinds="permutation").apply(a).materialize()
    transform = hf_lmc.WeightMatcher("permutation", progress=False).match(a, b)
    for name, tensor in transform.apply(b).state_dict().items():
        torch.testing.assert_close(tensor, a[name], msg=name)


@pytest.mark.parametrize("method", ["weight", "activation"])
def test_pairwise_fit_is_the_identity_and_match(method):
    """The shared contract: one transform per model, A's the identity and B's what match finds;
    any other number of models is refused with the method that takes it."""
    config = tiny_configs()["gpt2"]
    a, b, c = (hf_lmc.canonicalize(build_model(config, seed=s)) for s in (1, 2, 3))
    matched = _matcher(method, config).match(a, b)
    first, second = _matcher(method, config).fit([a, b], [0.3, 0.7])
    assert first.maps == {}
    assert transform_tensors(second).keys() == transform_tensors(matched).keys()
    for name, tensor in transform_tensors(matched).items():
        torch.testing.assert_close(transform_tensors(second)[name], tensor, rtol=0, atol=0, msg=name)
    with pytest.raises(ValueError, match="UniverseMatcher"):
        _matcher(method, config).fit([a, b, c])


def test_different_architectures_are_rejected():
    a = hf_lmc.canonicalize(build_model(tiny_configs()["gpt2"]))
    b = hf_lmc.canonicalize(build_model(tiny_configs()["llama"]))
    with pytest.raises(ValueError, match="differ in architecture"):
        hf_lmc.WeightMatcher(progress=False).match(a, b)


def test_balanced_gl_matching_inverts_any_gl_map():
    g = torch.Generator().manual_seed(0)
    m0, m0_inv = random_gl(5, g, log_scale=1.0)
    vec, cov = torch.randn(5, 30, dtype=torch.float64), torch.randn(5, 20, dtype=torch.float64)
    m, m_inv = match_gl(vec, cov, m0 @ vec, m0_inv.T @ cov)
    torch.testing.assert_close(m, m0_inv)
    torch.testing.assert_close(m @ m_inv, torch.eye(5, dtype=torch.float64))


@pytest.mark.parametrize("head_dim, vec_width, cov_width", [(4, 2, 2), (6, 4, 4), (4, 2, 4)])
def test_gl_matching_inverts_gl_maps_of_rank_deficient_heads(head_dim, vec_width, cov_width):
    """A head wider than its data (``vec^T cov`` of rank below head_dim) has no balanced form;
    the least-squares fallback still recovers a GL map exactly, and a well-conditioned one."""
    g = torch.Generator().manual_seed(head_dim + vec_width + cov_width)
    m0, m0_inv = random_gl(head_dim, g, log_scale=1.0)
    vec = torch.randn(head_dim, vec_width, dtype=torch.float64, generator=g)
    cov = torch.randn(head_dim, cov_width, dtype=torch.float64, generator=g)
    m, m_inv = match_gl(vec, cov, m0 @ vec, m0_inv.T @ cov)
    assert torch.isfinite(m).all() and torch.linalg.cond(m) < 1e3
    torch.testing.assert_close(m @ m0 @ vec, vec)
    torch.testing.assert_close(m_inv.T @ m0_inv.T @ cov, cov)
    torch.testing.assert_close(m @ m_inv, torch.eye(head_dim, dtype=torch.float64))


def test_rotary_matching_inverts_any_rope_commuting_map():
    g = torch.Generator().manual_seed(1)
    m0, m0_inv = rotary_block(
        torch.rand(2, dtype=torch.float64) + 0.5, torch.rand(2, dtype=torch.float64) * 6, 4, 6, random_gl(2, g)
    )
    vec, cov = torch.randn(6, 30, dtype=torch.float64), torch.randn(6, 20, dtype=torch.float64)
    m, _ = match_rotary(vec, cov, m0 @ vec, m0_inv.T @ cov, rotary_dim=4)
    torch.testing.assert_close(m, m0_inv)


def _pair_residual(qa, ka, qb, kb, m, m_inv) -> float:
    """``|Q_A - M Q_B|^2 + |K_A - M^{-T} K_B|^2``: what appendix G.1 minimises per pair."""
    return float((qa - m @ qb).square().sum() + (ka - m_inv.T @ kb).square().sum())


def _brute_force_pair_residual(qa, ka, qb, kb) -> float:
    """The least :func:`_pair_residual` over a dense (log scale, angle) grid, refined around its best cell."""
    best, scales, angles = float("inf"), torch.linspace(-6, 6, 481), torch.linspace(-math.pi, math.pi, 361)
    for _ in range(3):
        r, theta = scales.exp().double()[:, None], angles.double()[None, :]
        a, b = r * theta.cos(), r * theta.sin()  # U = [[a, -b], [b, a]], U^{-T} = U / r^2
        u = torch.stack([torch.stack([a, -b], -1), torch.stack([b, a], -1)], -2)  # (scales, angles, 2, 2)
        q = (qa - u @ qb).square().sum((-1, -2))
        k = (ka - (u / r[..., None, None] ** 2) @ kb).square().sum((-1, -2))
        total = q + k
        i, j = divmod(int(total.argmin()), total.shape[1])
        best = min(best, float(total[i, j]))
        ds, da = float(scales[1] - scales[0]), float(angles[1] - angles[0])
        scales = torch.linspace(float(scales[i]) - ds, float(scales[i]) + ds, 161)
        angles = torch.linspace(float(angles[j]) - da, float(angles[j]) + da, 161)
    return best


@pytest.mark.parametrize("trial", range(12))
def test_the_joint_rotary_solve_finds_the_brute_force_optimum_of_each_pair(trial):
    """Appendix G.1's scalar solve (Brent on ``g(x)``, then the closed-form angle) reaches the least
    residual a dense search over every scale-rotation finds, on random 2 x 2 data of any balance;
    and the residual of the map it returns is ``|Q_A|^2 + |K_A|^2 + g(|U|^2)`` (the fractions of
    ``g``: ``eta`` a squared norm, ``gamma`` the cross block's projection, ``-4``)."""
    g = torch.Generator().manual_seed(trial)
    samples = int(torch.randint(1, 12, (1,), generator=g))
    tilt = math.exp(3 * (2 * float(torch.rand(1, generator=g)) - 1))  # B's Q much larger or smaller than its K
    qa, ka = torch.randn(2, samples, generator=g).double(), torch.randn(2, 9, generator=g).double()
    qb, kb = tilt * torch.randn(2, samples, generator=g).double(), torch.randn(2, 9, generator=g).double() / tilt
    moments = Moments.of(qa, ka, qb, kb)
    m, m_inv = match_rotary_joint_moments(moments, rotary_dim=2)
    torch.testing.assert_close(m @ m_inv, torch.eye(2, dtype=torch.float64))
    solved = _pair_residual(qa, ka, qb, kb, m, m_inv)
    best = _brute_force_pair_residual(qa, ka, qb, kb)
    assert solved <= best + 1e-9 * (1 + best), (solved, best)
    eta_q, eta_k, gamma_q, gamma_k = (x.item() for x in rotary_pair_constants(moments, 2))
    x = float(m[0, 0] ** 2 + m[1, 0] ** 2)
    constant = float(qa.square().sum() + ka.square().sum())
    assert solved == pytest.approx(constant + rotary_pair_objective(x, eta_q, eta_k, gamma_q, gamma_k), rel=1e-9)
    assert x == pytest.approx(rotary_pair_scale(eta_q, eta_k, gamma_q, gamma_k) ** 2, rel=1e-12)
    start, start_inv = match_rotary_moments(moments, rotary_dim=2)
    assert solved <= _pair_residual(qa, ka, qb, kb, start, start_inv) + 1e-12 * (1 + solved)


def test_the_joint_rotary_solve_inverts_any_rope_commuting_map():
    """A twin's per-pair scale-rotations and pass-through GL block come back to rounding (the scale
    polished past Brent's ``sqrt(eps)``)."""
    g = torch.Generator().manual_seed(3)
    m0, m0_inv = rotary_block(
        torch.rand(3, dtype=torch.float64) * 4 + 0.1, torch.rand(3, dtype=torch.float64) * 6, 6, 8, random_gl(2, g)
    )
    vec, cov = (
        torch.randn(8, 30, dtype=torch.float64, generator=g),
        torch.randn(8, 20, dtype=torch.float64, generator=g),
    )
    m, m_inv = match_rotary_joint_moments(Moments.of(vec, cov, m0 @ vec, m0_inv.T @ cov), rotary_dim=6)
    torch.testing.assert_close(m, m0_inv, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(m_inv, m0, rtol=1e-11, atol=1e-11)


_ROTARY_TWINS = {
    "llama-gqa": transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=40,
        max_position_embeddings=32,
    ),
    "llama-mha": transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=40,
        max_position_embeddings=32,
        attention_bias=True,
    ),
    "pythia-partial": transformers.GPTNeoXConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
        rotary_pct=0.25,
    ),
}


@pytest.mark.parametrize("name", list(_ROTARY_TWINS))
def test_weight_matching_with_the_joint_rotary_solve_recovers_a_twin(name):
    """B is A moved by a random full symmetry (per-pair scale-rotations included): with the G.1
    solve, the aligned merge at alpha = 0.5 computes A, under GQA, without it, and with partial rotary."""
    config = _ROTARY_TWINS[name]
    model = build_model(config, seed=5, dtype=torch.float32)
    a = hf_lmc.canonicalize(model)
    b = hf_lmc.random_symmetry(a.spec, seed=6, dtype=torch.float32).apply(a).materialize()
    transform = hf_lmc.WeightMatcher(progress=False, rotary_solve="joint").match(a, b)
    merged = hf_lmc.interpolate(a, transform.to(torch.float32).apply(b), 0.5)
    inputs = sample_inputs(config, seed=5)
    assert relative_error(logits(hf_lmc.to_hf(merged), inputs), logits(model, inputs)) < 1e-5


def test_weight_matching_refuses_an_unknown_rotary_solve():
    with pytest.raises(ValueError, match="rotary_solve"):
        hf_lmc.WeightMatcher(progress=False, rotary_solve="procrustes")


def test_assign_convention_matches_block_monomial():
    sim = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    # target 0 matches source 1, target 1 matches source 2, target 2 matches source 0
    assert assign(sim).tolist() == [2, 0, 1]


@pytest.mark.parametrize(
    "structure, candidates",
    [
        ("independent", 32),  # no structure: the optimum leaves the candidates, certificate rounds add edges
        ("independent", 1),  # candidates with no full matching: widened
        ("permuted", 2),  # a noisy permutation, the shape of real MLP unit similarities
        ("ties", 4),  # bfloat16 similarities with many exact ties
    ],
)
def test_sparse_assignment_is_as_good_as_dense(structure, candidates):
    """``assign_product`` solves on a few candidates per row and certifies the result by LP
    duality: its total similarity equals the dense optimum (permutations may differ at ties)."""
    n, width = 1024, 48
    gen = torch.Generator().manual_seed(len(structure) + candidates)
    left = torch.randn(n, width, generator=gen)
    right = (
        left[torch.randperm(n, generator=gen)] + torch.randn(n, width, generator=gen)
        if structure == "permuted"
        else torch.randn(n, width, generator=gen)
    )
    if structure == "ties":
        left, right = left.sign().bfloat16(), right.sign().bfloat16()
    similarity = (left @ right.T).double()
    total = lambda perm: similarity[perm, torch.arange(n)].sum().item()
    sparse = assign_product(left, right, candidates=candidates, dense_bytes=0)  # the sparse path at any size
    assert sorted(sparse.tolist()) == list(range(n))
    assert total(sparse) == pytest.approx(total(assign(left @ right.T)), rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("d", [2, 5, 16])
def test_centred_polar_is_the_best_orthogonal_map_fixing_ones(d):
    """The Householder route equals polar on an explicit basis of 1-perp, and beats any other map."""
    from hf_lmc.matching.solvers import polar, polar_fixing_ones
    from hf_lmc.symmetry.sample import centred_basis, orthogonal_fixing_ones, random_orthogonal

    m = torch.randn(d, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    basis, u = centred_basis(d), torch.full((d, 1), d**-0.5, dtype=torch.float64)
    expected = basis @ polar(basis.T @ m @ basis) @ basis.T + u @ u.T
    r = polar_fixing_ones(m)
    torch.testing.assert_close(r, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(r.T @ r, torch.eye(d, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(r @ u, u, rtol=0, atol=1e-12)
    for seed in range(5):
        other = orthogonal_fixing_ones(random_orthogonal(d - 1, torch.Generator().manual_seed(seed)))
        assert (other * m).sum() <= (r * m).sum() + 1e-12


def test_unit_covariance_keeps_its_digits_under_large_means():
    """MLP unit correlations come from a float32 cross moment; units with a mean far above their
    spread (a unit that sees two distinct inputs, say) must not lose the covariance to cancellation."""
    from hf_lmc.matching.activation import _Units

    g = torch.Generator().manual_seed(0)
    xa = 100.0 + 0.01 * torch.randn(600, 6, dtype=torch.float64, generator=g)
    xb = 100.0 + 0.01 * torch.randn(600, 6, dtype=torch.float64, generator=g)
    units = _Units(6)
    for chunk_a, chunk_b in zip(xa.split(200), xb.split(200)):
        units.add(chunk_a, chunk_b)
    expected = (xa - xa.mean(0)).T @ (xb - xb.mean(0)) / 600
    torch.testing.assert_close(units.covariance(), expected, rtol=0, atol=1e-4 * 0.01**2)


@pytest.mark.parametrize("fixing_ones", [False, True])
@pytest.mark.parametrize("rank", [1, 3, 9])
def test_completed_polar_recovers_a_rotation_its_target_leaves_partly_free(rank, fixing_ones):
    """``tr(R^T m)`` with ``m = R S`` of rank r < n fixes R only on r directions; two-sided pairs
    ``R B R^T`` recover the rest exactly (at r = 0 only up to sign: ``-R`` moves them alike), and
    a full-rank target gives polar's answer to the bit."""
    from hf_lmc.matching.solvers import CompletedPolar, polar, polar_fixing_ones
    from hf_lmc.symmetry.sample import orthogonal_fixing_ones, random_orthogonal

    n, g = 12, torch.Generator().manual_seed(rank)
    r = orthogonal_fixing_ones(random_orthogonal(n - 1, g)) if fixing_ones else random_orthogonal(n, g)
    ones = torch.full((n, 1), n**-0.5, dtype=torch.float64)
    centre = torch.eye(n, dtype=torch.float64) - ones @ ones.T if fixing_ones else torch.eye(n, dtype=torch.float64)
    data = centre @ torch.randn(n, rank, dtype=torch.float64, generator=g)
    completion = CompletedPolar(r @ data @ data.T, fixing_ones=fixing_ones)
    assert completion.free == n - rank - fixing_ones
    for _ in range(3):
        b = centre @ torch.randn(n, n, dtype=torch.float64, generator=g) @ centre
        completion.add(r @ b @ r.T, b)
    torch.testing.assert_close(completion.solve(), r, rtol=0, atol=1e-10)

    full = torch.randn(n, n, dtype=torch.float64, generator=g)
    solve = polar_fixing_ones if fixing_ones else polar
    assert torch.equal(CompletedPolar(full, fixing_ones=fixing_ones).solve(), solve(full))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_layer_circuits_move_only_with_the_residual_map(arch):
    """Every map but the residual one cancels inside the circuits that complete the first residual
    estimate: ``C(T(b)) = R C(b) R^T`` for a random element T of the full group."""
    from hf_lmc.matching.weight import _circuits

    b = hf_lmc.canonicalize(build_model(tiny_configs()[arch], seed=3))
    transform = hf_lmc.random_symmetry(b.spec, seed=4)
    moved, r = transform.apply(b), transform.maps["residual"].matrix
    for i in range(b.spec.num_layers):
        for before, after in zip(_circuits(b.spec, i, b.group(i)), _circuits(b.spec, i, moved.group(i)), strict=True):
            torch.testing.assert_close(after, r @ before @ r.T, rtol=1e-9, atol=1e-9 * before.abs().max().item())


@pytest.mark.slow
def test_weight_matching_recovers_a_twin_whose_embeddings_span_less_than_the_stream():
    """5 tokens in a 32-wide stream fix the first residual estimate on 10 of 31 directions; with the
    rest left to the SVD, coordinate descent stalled in a local optimum 0.14 off (a hypothesis draw).
    The layer circuits complete it."""
    config = transformers.GPTNeoXConfig(
        vocab_size=5,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=8,
        layer_norm_eps=1e-5,
        attention_bias=False,
        tie_word_embeddings=False,
        use_parallel_residual=False,
        max_position_embeddings=32,
        rope_parameters={"rope_theta": 10000, "partial_rotary_factor": 0.25, "rope_type": "default"},
    )
    model = build_model(config, seed=136, dtype=torch.float32)
    a = hf_lmc.canonicalize(model)
    b = hf_lmc.random_symmetry(a.spec, seed=137, dtype=torch.float32).apply(a).materialize()
    transform = hf_lmc.WeightMatcher(progress=False).match(a, b)
    merged = hf_lmc.interpolate(a, transform.to(torch.float32).apply(b), 0.5)
    inputs = sample_inputs(config, seed=136)
    assert relative_error(logits(hf_lmc.to_hf(merged), inputs), logits(model, inputs)) < 1e-5


def test_per_head_solves_side_by_side_give_the_sequential_transform_bit_for_bit():
    """Weight matching solves a layer's heads on up to torch.get_num_threads() threads at once,
    each single-threaded: the transform must not depend on how many ran together."""
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=48,
        max_position_embeddings=32,
    )
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s, dtype=torch.float32)) for s in (1, 2))
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 4):
            torch.set_num_threads(n)
            results.append(hf_lmc.WeightMatcher(progress=False, device="cpu").match(a, b))
    finally:
        torch.set_num_threads(threads)
    sequential, side_by_side = (transform_tensors(t) for t in results)
    assert sequential.keys() == side_by_side.keys()
    assert all(torch.equal(sequential[name], side_by_side[name]) for name in sequential)


def test_mlp_assignments_on_worker_threads_give_the_in_line_transform_bit_for_bit(monkeypatch):
    """Weight matching solves each layer's MLP assignment on a worker thread while the next
    layers' products run: the transform must be the one of solving each in turn, in line."""
    config = transformers.GPTNeoXConfig(
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=32,
        rotary_pct=0.5,
    )
    a, b = (hf_lmc.canonicalize(build_model(config, seed=s, dtype=torch.float32)) for s in (1, 2))
    solved_on: dict[int, list[str]] = {}
    solve = weight_matching.assign_similarity

    def recording(similarity):
        solved_on[threads].append(threading.current_thread().name)
        return solve(similarity)

    monkeypatch.setattr(weight_matching, "assign_similarity", recording)
    results = {}
    for threads in (0, 3):
        solved_on[threads] = []
        results[threads] = transform_tensors(
            hf_lmc.WeightMatcher(progress=False, device="cpu", solver_threads=threads).match(a, b)
        )
    in_line, on_workers = results[0], results[3]
    assert in_line.keys() == on_workers.keys()
    assert all(torch.equal(in_line[name], on_workers[name]) for name in in_line)
    assert len(solved_on[0]) == len(solved_on[3]) >= config.num_hidden_layers  # one per layer and sweep
    assert set(solved_on[0]) == {threading.main_thread().name}
    assert threading.main_thread().name not in solved_on[3]
    with pytest.raises(ValueError, match="solver_threads"):
        hf_lmc.WeightMatcher(solver_threads=-1)


@pytest.mark.parametrize(
    "config",
    [
        transformers.LlamaConfig(
            hidden_size=256,
            num_attention_heads=8,
            num_key_value_heads=2,
            num_hidden_layers=2,
            intermediate_size=704,
            vocab_size=512,
        ),
        transformers.GPTNeoXConfig(
            hidden_size=256,
            num_attention_heads=4,
            num_hidden_layers=2,
            intermediate_size=1024,
            vocab_size=512,
            rotary_pct=0.25,
        ),
    ],
    ids=["llama", "gpt_neox"],
)
def test_the_merge_speed_floor_counts_the_products_weight_matching_runs(config):
    """benchmarks/merge_speed.py's floor (``--floor``) must count what the matcher actually multiplies:
    at least 85 % of the FLOPs torch counts (the rest: per-head moments, self products), never more."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.merge_speed import parts

    models = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        model_class = (
            transformers.LlamaForCausalLM
            if isinstance(config, transformers.LlamaConfig)
            else transformers.GPTNeoXForCausalLM
        )
        models.append(hf_lmc.canonicalize(model_class(config), dtype=torch.float32))
    matcher = hf_lmc.WeightMatcher(progress=False, device="cpu")
    with FlopCounterMode(display=False) as counter:
        matcher.match(*models)
    counted = counter.get_total_flops() / 1e9
    floor = sum(gflop for part, gflop, _ in parts(config, len(matcher.history) // 2) if "export" not in part)
    assert 0.85 * counted <= floor <= counted


def _answers_the_matcher_contract(fit) -> bool:
    """Whether a bound ``fit`` takes ``(models, weights)``, as :class:`hf_lmc.matching.Matcher`'s does."""
    return list(inspect.signature(fit).parameters)[:2] == ["models", "weights"]


@pytest.mark.parametrize("count", [2, 3])
@pytest.mark.parametrize("method", [name for name, entry in METHODS.items() if entry.pair_class is not None])
def test_every_registry_method_builds_a_matcher(method, count):
    """What the registry builds for a method, trained ones included, is a Matcher: ``fit(models, weights)``."""
    entry = METHODS[method]
    if count > 2 and not entry.multi:
        pytest.skip(f"{method} aligns two models")
    matcher = matcher_for(method, count, batches=[] if entry.needs_data else None, progress=False)
    assert isinstance(matcher, Matcher)
    assert _answers_the_matcher_contract(matcher.fit)


@pytest.mark.parametrize("matcher_class", [hf_lmc.LearnedMatcher, hf_lmc.DualMatcher, hf_lmc.SimplexMatcher])
def test_a_trained_matcher_trains_in_a_users_loop_and_answers_a_merge_through_trained_matcher(matcher_class):
    """The class a training script imports (``from hf_lmc import DualMatcher``) is the trainable
    path itself: an ``nn.Module`` whose ``fit`` trains it on batches; a merge's one call
    (``fit(models)``) reaches it through :class:`~hf_lmc.learned.TrainedMatcher`, one name each."""
    assert issubclass(matcher_class, torch.nn.Module) and matcher_class.__name__.endswith("Matcher")
    assert list(inspect.signature(matcher_class.fit).parameters)[:2] == ["path", "batches"]
    assert getattr(hf_lmc, matcher_class.__name__) is matcher_class
    assert _answers_the_matcher_contract(hf_lmc.TrainedMatcher(matcher_class, []).fit)
