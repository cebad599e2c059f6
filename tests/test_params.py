"""Trainable group parameterisations stay in their groups and start at their initial element."""

from __future__ import annotations

import math

import pytest
import torch

from hf_lmc.learned.params import GLParam, OrthogonalParam, PermutationParam, sinkhorn
from hf_lmc.matching.solvers import polar
from hf_lmc.symmetry.sample import random_gl, random_orthogonal

F64 = torch.float64


def _perturb(module: torch.nn.Module, seed: int, size: float = 0.5) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(size * torch.randn(p.shape, generator=g, dtype=p.dtype))


@pytest.mark.parametrize(
    ("method", "frame"),
    [
        ("cayley", "own"),
        ("exp", "own"),
        ("polar", "own"),
        ("cayley", "target"),
        ("exp", "target"),
        ("cayley", "both"),
        ("exp", "both"),
    ],
)
@pytest.mark.parametrize("fix_ones", [False, True])
def test_orthogonal_param_starts_at_init_and_stays_orthogonal(method, frame, fix_ones):
    d = 7
    init = random_orthogonal(d, torch.Generator().manual_seed(0))
    if fix_ones:  # an orthogonal map that fixes u: the polar factor restricted to 1-perp
        from hf_lmc.matching.solvers import polar_fixing_ones

        init = polar_fixing_ones(init)
    param = OrthogonalParam(d, init=init, method=method, fix_ones=fix_ones, frame=frame, dtype=F64)
    torch.testing.assert_close(param(), init, rtol=0, atol=1e-12)
    _perturb(param, seed=1)
    o = param()
    torch.testing.assert_close(o.T @ o, torch.eye(d, dtype=F64), rtol=0, atol=1e-12)
    assert (o - init).abs().max() > 1e-3  # it moved
    if fix_ones:
        u = torch.full((d,), 1 / math.sqrt(d), dtype=F64)
        torch.testing.assert_close(o @ u, u, rtol=0, atol=1e-12)


def test_cayley_and_exp_agree_to_second_order():
    """The Cayley map is taken at half the angle, so a step of the parameters turns the map as far
    under either parameterisation: ``|cayley(A) - exp(A)| = O(|A|^3)``."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(6, 6, dtype=F64, generator=g)
    gaps = []
    for size in (1e-1, 1e-2):
        maps = []
        for method in ("cayley", "exp"):
            param = OrthogonalParam(6, method=method, dtype=F64)
            with torch.no_grad():
                param.weight.copy_(size * w)
            maps.append(param())
        gaps.append((maps[0] - maps[1]).abs().max().item())
    assert gaps[1] < 2e-3 * gaps[0]  # a tenth of the angle: a thousandth of the gap (third order)


@pytest.mark.parametrize("method", ["cayley", "exp", "polar"])
def test_orthogonal_param_descends_to_a_procrustes_target(method):
    """Gradient steps reach the Procrustes solution while staying orthogonal throughout."""
    d = 5
    target = polar(torch.randn(d, d, dtype=F64, generator=torch.Generator().manual_seed(3)))
    target[:, 0] *= torch.det(target).sign()  # reachable from the identity: the same component, SO(d)
    param = OrthogonalParam(d, method=method, dtype=F64)
    opt = torch.optim.Adam(param.parameters(), lr=0.05)
    for _ in range(400):
        loss = (param() - target).square().sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert (param() - target).abs().max() < 1e-3


@pytest.mark.parametrize("frame", ["own", "target", "both"])
def test_gl_param_returns_exact_inverse_pairs(frame):
    m0, m0_inv = random_gl(4, torch.Generator().manual_seed(2), log_scale=0.5)
    param = GLParam(4, init=(m0, m0_inv), frame=frame, dtype=F64)
    m, m_inv = param()
    torch.testing.assert_close(m, m0, rtol=0, atol=1e-12)
    _perturb(param, seed=4)
    m, m_inv = param()
    torch.testing.assert_close(m @ m_inv, torch.eye(4, dtype=F64), rtol=0, atol=1e-10)


@pytest.mark.parametrize("method", ["ste", "sinkhorn"])
def test_permutation_param(method):
    n = 6
    perm = torch.tensor([2, 0, 1, 5, 3, 4])
    param = PermutationParam(n, init=perm, method=method, scale=1.0, dtype=F64)
    assert torch.equal(param.harden(), perm)
    p = param()
    x = torch.arange(n, dtype=F64)
    expected = torch.empty(n, dtype=F64)
    expected[perm] = x  # y[perm[h]] = x[h]
    if method == "ste":
        torch.testing.assert_close(p @ x, expected)  # forward is the hard permutation
    else:
        torch.testing.assert_close(p.sum(0), torch.ones(n, dtype=F64), rtol=0, atol=1e-6)
        torch.testing.assert_close(p.sum(1), torch.ones(n, dtype=F64), rtol=0, atol=1e-6)
        assert torch.equal(p.argmax(0), perm)
    (p @ x).square().sum().backward()
    assert param.scores.grad is not None and param.scores.grad.abs().sum() > 0  # gradients reach the scores


def test_sinkhorn_is_doubly_stochastic():
    s = sinkhorn(torch.randn(5, 5, generator=torch.Generator().manual_seed(0)), temperature=0.5, iterations=50)
    torch.testing.assert_close(s.sum(0), torch.ones(5), rtol=0, atol=1e-5)
    torch.testing.assert_close(s.sum(1), torch.ones(5), rtol=0, atol=1e-5)


@pytest.mark.parametrize("method", ["cayley", "exp"])
def test_target_frame_is_the_own_frame_conjugated_by_the_start(method):
    """``f(A) O_0 = O_0 f(O_0^T A O_0)``: the two frames reach the same maps, the trained factor
    expressed in the coordinates on either side of the start (only Adam's steps differ)."""
    d = 6
    start = random_orthogonal(d, torch.Generator().manual_seed(5))
    own = OrthogonalParam(d, init=start, method=method, dtype=F64)
    target = OrthogonalParam(d, init=start, method=method, frame="target", dtype=F64)
    _perturb(target, seed=6)
    with torch.no_grad():
        own.weight.copy_(start.T @ target.weight @ start)
    torch.testing.assert_close(target(), own(), rtol=0, atol=1e-12)

    m0, m0_inv = random_gl(4, torch.Generator().manual_seed(7), log_scale=0.5)
    own_gl, target_gl = (GLParam(4, init=(m0, m0_inv), frame=f, dtype=F64) for f in ("own", "target"))
    _perturb(target_gl, seed=8, size=0.2)
    with torch.no_grad():
        own_gl.weight.copy_(m0_inv @ target_gl.weight @ m0)
    for x, y in zip(target_gl(), own_gl()):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-10)


def test_unknown_parameterisations_are_rejected():
    with pytest.raises(ValueError, match="orthogonal parameterisation"):
        OrthogonalParam(3, method="givens")
    with pytest.raises(ValueError, match="unknown frame"):
        GLParam(3, frame="left")
    for frame in ("target", "both"):
        with pytest.raises(ValueError, match="no fixed base"):
            OrthogonalParam(3, method="polar", frame=frame)
    with pytest.raises(ValueError, match="permutation parameterisation"):
        PermutationParam(3, method="gumbel")


def test_polar_gradient_matches_finite_differences_even_at_the_identity():
    from hf_lmc.learned.params import _Polar

    g = torch.Generator().manual_seed(5)
    for m in (torch.randn(4, 4, dtype=F64, generator=g), torch.eye(4, dtype=F64)):
        assert torch.autograd.gradcheck(_Polar.apply, (m.clone().requires_grad_(),))


@pytest.mark.parametrize("frame", ["own", "target", "both"])
def test_rotary_param_commutes_with_rope_and_starts_at_init(frame):
    from hf_lmc.learned.params import RotaryParam
    from hf_lmc.symmetry.groups import rotary_block

    g = torch.Generator().manual_seed(7)
    init = rotary_block(
        torch.rand(2, dtype=F64, generator=g) + 0.5, torch.rand(2, dtype=F64, generator=g) * 6, 4, 6, random_gl(2, g)
    )
    param = RotaryParam(6, 4, init=init, frame=frame, dtype=F64)
    m, m_inv = param()
    torch.testing.assert_close(m, init[0], rtol=0, atol=1e-12)
    _perturb(param, seed=8)
    m, m_inv = param()
    torch.testing.assert_close(m @ m_inv, torch.eye(6, dtype=F64), rtol=0, atol=1e-10)
    # Commutes with a RoPE rotation of the first 4 dims (pairs (0, 2) and (1, 3)), any angles.
    rope, _ = rotary_block(
        torch.ones(2, dtype=F64), torch.tensor([0.3, 1.1], dtype=F64), 4, 6, (torch.eye(2, dtype=F64),) * 2
    )
    torch.testing.assert_close(m @ rope, rope @ m, rtol=0, atol=1e-12)
    m.sum().backward()
    assert (
        param.angles.grad is not None
        and param.log_scales.grad is not None
        and param.passthrough.weight.grad is not None
    )
    if frame == "both":
        assert param.left_angles.grad is not None and param.passthrough.left.grad is not None


@pytest.mark.parametrize("role", ["up", "gate", "down"])
def test_straight_through_gather_matches_the_dense_product(role):
    """With a hard permutation, DenseMlpMap gathers instead of multiplying: same values, same gradients."""
    from hf_lmc.symmetry import DenseMlpMap

    n, g = 7, torch.Generator().manual_seed(1)
    param = PermutationParam(n, init=torch.randperm(n, generator=g), method="ste", dtype=F64)
    scale = torch.rand(n, generator=g, dtype=F64) + 0.5
    results = []
    for fast in (False, True):
        param.zero_grad()
        x = torch.randn(5, n, 3, generator=torch.Generator().manual_seed(2), dtype=F64, requires_grad=True)
        matrix, perm = param.matrix_and_perm()
        y = DenseMlpMap(matrix, scale, perm if fast else None).act(x, 1, role)
        (y * torch.linspace(-1, 1, y.numel(), dtype=F64).reshape(y.shape)).sum().backward()
        results.append((y.detach(), x.grad, param.scores.grad.clone()))
    for dense, gathered in zip(*results):
        torch.testing.assert_close(gathered, dense, rtol=0, atol=1e-12)


@pytest.mark.parametrize("role", ["q", "k", "v", "o"])
@pytest.mark.parametrize("method", ["ste", "sinkhorn"])
@pytest.mark.parametrize("within", [(0, 1, 2, 3), (1, 0, 2, 3, 5, 4, 7, 6)], ids=["mha", "gqa"])
def test_trainable_head_order_hardens_to_the_attention_map_it_applies(role, method, within):
    """A DenseAttentionMap at a hard permutation acts exactly as its hardened AttentionMap
    (GQA: 4 KV heads of 2 query heads, query heads reordered inside their groups)."""
    from hf_lmc.symmetry import AttentionMap, BlockMonomial, DenseAttentionMap
    from hf_lmc.symmetry.sample import random_gl

    kv, h, dh, g = 4, len(within), 3, torch.Generator().manual_seed(3)
    pairs = [random_gl(dh, g) for _ in range(2 * kv)]
    blocks, inverses = torch.stack([m for m, _ in pairs]), torch.stack([inv for _, inv in pairs])
    fixed = torch.arange(kv)
    qk = BlockMonomial(fixed, blocks[:kv], inverses[:kv])
    ov = BlockMonomial(fixed, blocks[kv:], inverses[kv:])
    param = PermutationParam(kv, init=torch.tensor([2, 0, 3, 1]), method=method, scale=50.0, dtype=F64)
    matrix, perm = param.matrix_and_perm()
    dense = DenseAttentionMap(AttentionMap(qk, ov, torch.tensor(within)), matrix, perm)
    width = (h if role in "qo" else kv) * dh
    t = torch.randn(width, 5, generator=g, dtype=F64) if role != "o" else torch.randn(5, width, generator=g, dtype=F64)
    axis = 1 if role == "o" else 0
    atol = 1e-12 if method == "ste" else 1e-6  # Sinkhorn at scale 50 / temperature 0.1 is a permutation to ~1e-200
    torch.testing.assert_close(dense.act(t, axis, role), dense.harden().act(t, axis, role), rtol=0, atol=atol)


@pytest.mark.parametrize("frame", ["own", "target", "both"])
@pytest.mark.parametrize("rotary", [False, True])
def test_a_batch_of_head_maps_is_each_head_map(frame, rotary):
    """A layer's KV-head maps train as one batched module (one matrix_exp per layer, which a GPU
    needs: each call synchronises with the host). Head h of the batch must be exactly the map
    one module for head h alone computes, for the same parameters."""
    from hf_lmc.learned.params import RotaryParam
    from hf_lmc.symmetry.groups import rotary_block

    g = torch.Generator().manual_seed(11)
    if rotary:
        heads = [
            rotary_block(
                torch.rand(2, dtype=F64, generator=g) + 0.5,
                torch.rand(2, dtype=F64, generator=g) * 6,
                4,
                6,
                random_gl(2, g),
            )
            for _ in range(3)
        ]
        make = lambda init: RotaryParam(6, 4, init=init, frame=frame, dtype=F64)
    else:
        heads = [random_gl(5, g) for _ in range(3)]
        make = lambda init: GLParam(5, init=init, frame=frame, dtype=F64)
    batched = make((torch.stack([m for m, _ in heads]), torch.stack([inv for _, inv in heads])))
    _perturb(batched, seed=12)
    m, m_inv = batched()
    assert m.shape[0] == m_inv.shape[0] == 3
    for h, init in enumerate(heads):
        single = make(init)
        with torch.no_grad():
            for (name, p), (_, q) in zip(single.named_parameters(), batched.named_parameters()):
                p.copy_(q[h])
        one, one_inv = single()
        torch.testing.assert_close(m[h], one, rtol=0, atol=1e-13)
        torch.testing.assert_close(m_inv[h], one_inv, rtol=0, atol=1e-13)
        torch.testing.assert_close(m[h] @ m_inv[h], torch.eye(m.shape[-1], dtype=F64), rtol=0, atol=1e-10)


def test_gl_param_refuses_maps_of_another_size():
    with pytest.raises(ValueError, match=r"GLParam\(4\) needs \(\.\.\., 4, 4\) maps"):
        GLParam(4, init=(torch.eye(3), torch.eye(3)))


@pytest.mark.parametrize("frame", ["own", "both"])
@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox", "vit"])
def test_relative_transform_is_the_inverse_composed_layer_by_layer(arch, frame):
    """Dual matching builds ``T_A^-1 T_B`` batched over layers (``TrainableTransform.relative``):
    the same element as ``T_A().inverse().compose(T_B())``, tensor for tensor, and the same
    gradients. Both transforms start at random group elements (non-trivial unit, KV-head and GQA
    query orders, SwiGLU scales) and are then moved off them."""
    from hf_lmc import canonicalize
    from hf_lmc.canonical.exactness import tiny_configs
    from hf_lmc.learned.trainable import TrainableTransform
    from hf_lmc.symmetry.sample import random_symmetry
    from tests.models import build_model

    spec = canonicalize(build_model(tiny_configs()[arch])).spec
    first, second = (TrainableTransform(spec, random_symmetry(spec, seed), frame=frame, dtype=F64) for seed in (3, 4))
    for seed, module in enumerate((first, second)):
        _perturb(module, seed=seed, size=0.05)
    batched = first.relative(second)
    layered = first().inverse().compose(second())
    assert batched.maps.keys() == layered.maps.keys()
    g = torch.Generator().manual_seed(0)
    probes = []
    for space, want in layered.maps.items():
        got = batched.maps[space]
        monomials = [(got.map, want.map)] if hasattr(got, "map") else [(got.qk, want.qk), (got.ov, want.ov)]
        if hasattr(got, "query_perm"):
            assert torch.equal(got.query_perm, want.query_perm), space
        for mine, theirs in monomials:
            assert torch.equal(mine.perm, theirs.perm), space
            for x, y in ((mine.blocks, theirs.blocks), (mine.inverse_blocks, theirs.inverse_blocks)):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-12)
                probes.append((x, y, torch.randn(x.shape, generator=g, dtype=F64)))
    params = [p for p in (*first.parameters(), *second.parameters()) if p.requires_grad]
    got = torch.autograd.grad(sum((x * w).sum() for x, _, w in probes), params)
    want = torch.autograd.grad(sum((y * w).sum() for _, y, w in probes), params)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, rtol=1e-10, atol=1e-12)
    relaxed = TrainableTransform(spec, random_symmetry(spec, 5), permutations="ste", dtype=F64)
    with pytest.raises(ValueError, match="fixed"):
        first.relative(relaxed)


def _element_tensors(element) -> dict[str, torch.Tensor]:
    monomials = {"": element.map} if hasattr(element, "map") else {"qk.": element.qk, "ov.": element.ov}
    out = {
        f"{k}{field}": getattr(m, field) for k, m in monomials.items() for field in ("perm", "blocks", "inverse_blocks")
    }
    if hasattr(element, "query_perm"):
        out["query_perm"] = element.query_perm
    return out


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_in_order_transforms_compose_and_track_their_order(arch):
    """Matchers train in-order maps (their fixed assignments applied to the stored model once):
    the relative map of two in-order transforms skips its gathers, stays ordered, and still equals
    the layered inverse/compose; ``ordered`` follows the buffers through ``load_state_dict``."""
    from hf_lmc import canonicalize
    from hf_lmc.canonical.exactness import tiny_configs
    from hf_lmc.learned.trainable import TrainableTransform
    from hf_lmc.symmetry.sample import random_symmetry
    from tests.models import build_model

    spec = canonicalize(build_model(tiny_configs()[arch])).spec
    first = TrainableTransform(spec, None, dtype=F64)
    second = TrainableTransform(spec, random_symmetry(spec, 4).split()[0], dtype=F64)
    assert first.attention.ordered and second.attention.ordered and second.mlp.ordered
    for seed, module in enumerate((first, second)):
        _perturb(module, seed=seed, size=0.05)
    batched, layered = first.relative(second), first().inverse().compose(second())
    for space, element in layered.maps.items():
        if space != "residual":
            assert batched.maps[space].map.ordered if hasattr(element, "map") else batched.maps[space].ordered, space
        got, want = _element_tensors(batched.maps[space]), _element_tensors(element)
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-12, msg=f"{space} {name}")
    reversed_order = {
        k: v.flip(-1) if k.endswith(("kv_perm", "query_perm", "mlp.perm")) else v
        for k, v in second.state_dict().items()
    }
    first.load_state_dict(reversed_order)
    assert not first.attention.ordered and not first.mlp.ordered
    assert not TrainableTransform(spec, random_symmetry(spec, 5), dtype=F64).mlp.ordered
    first.load_state_dict(second.state_dict())
    assert first.attention.ordered and first.mlp.ordered


def test_a_residual_map_saved_with_its_dense_frame_loads_and_saves_none():
    """Paths saved when the Householder frame was a d x d buffer ("frame") load as they were
    saved; the map saves no d x d frame now (its reflection is a function of d)."""
    d = 6
    old = OrthogonalParam(d, fix_ones=True, dtype=F64)
    with torch.no_grad():
        old.weight.add_(0.1 * torch.randn(old.weight.shape, dtype=F64))
    state = old.state_dict()
    assert set(state) == {"base", "weight"}
    eye = torch.eye(d, dtype=F64)
    state["frame"] = eye  # what such a checkpoint holds beside the rest
    new = OrthogonalParam(d, fix_ones=True, dtype=F64)
    new.load_state_dict(state)
    torch.testing.assert_close(new(), old(), rtol=0, atol=0)
