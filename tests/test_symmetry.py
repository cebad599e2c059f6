"""The group algebra: compose, inverse, structure of sampled elements, and the axes table."""

from __future__ import annotations

import math

import pytest
import torch

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.symmetry import BlockMonomial, axes_of, random_symmetry
from hf_lmc.symmetry.sample import random_gl, rotary_block
from tests.models import build_model

TINY = tiny_configs()


def _spec(**overrides) -> ArchSpec:
    base = {
        "model_type": "llama",
        "num_layers": 2,
        "hidden_size": 12,
        "num_heads": 6,
        "num_kv_heads": 2,
        "head_dim": 4,
        "intermediate_size": 10,
        "output_size": 7,
        "norm": "rmsnorm",
        "gated_mlp": True,
        "rotary_dim": 4,
        "norm_eps": 1e-6,
        "embedding_names": ("embed.tokens",),
    }
    return ArchSpec(**(base | overrides))


def _random_block_monomial(n, b, seed) -> BlockMonomial:
    g = torch.Generator().manual_seed(seed)
    pairs = [random_gl(b, g) for _ in range(n)]
    return BlockMonomial(
        torch.randperm(n, generator=g), torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])
    )


def test_block_monomial_matches_its_dense_matrix():
    a, b = _random_block_monomial(3, 2, 0), _random_block_monomial(3, 2, 1)
    x = torch.randn(5, 6, dtype=torch.float64)
    torch.testing.assert_close(a.vector(x, 1), x @ a.dense().T)
    torch.testing.assert_close(a.covector(x, 1), x @ torch.linalg.inv(a.dense()))
    torch.testing.assert_close(a.compose(b).dense(), a.dense() @ b.dense())
    torch.testing.assert_close(a.inverse().dense(), torch.linalg.inv(a.dense()))
    eye = torch.eye(2, dtype=torch.float64).expand(3, 2, 2)
    torch.testing.assert_close(a.permute(x, 1), x @ BlockMonomial(a.perm, eye, eye).dense().T)


def test_a_dense_map_copies_its_matrix_once_for_all_the_tensors_it_moves():
    """A residual map moves every weight of a model, most along their second axis, where the
    product's right factor is the matrix's transpose made contiguous. Made once in ``prepare``
    (not once per tensor), the factors give the values and the gradient of the direct products."""
    from torch.utils._python_dispatch import TorchDispatchMode

    d = 6
    matrix = (
        torch.linalg.qr(torch.randn(d, d, dtype=torch.float64))[0].contiguous().requires_grad_()
    )  # as a parameter is
    tensors = [torch.randn(d, 4, dtype=torch.float64), torch.randn(3, d, dtype=torch.float64)]
    tensors.append(torch.randn(2, d, 5, dtype=torch.float64))

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Copies.count += func.overloadpacket in (torch.ops.aten.clone, torch.ops.aten.copy_) and any(
                isinstance(a, torch.Tensor) and a.shape == (d, d) for a in args
            )
            return func(*args, **(kwargs or {}))

    element = BlockMonomial.orthogonal(matrix)
    element.prepare()
    with Copies():
        moved = [
            move(t, axis)
            for t in tensors
            for axis in range(t.dim())
            if t.shape[axis] == d
            for move in (element.vector, element.covector)
        ]
        moved.append(element.vector(tensors[0], 0, rows=slice(2, 5)))
    assert Copies.count == 0
    direct = [  # the vector's and the covector's moves alike (O^-T = O)
        torch.tensordot(matrix, t, ([1], [axis])).movedim(0, axis)
        for t in tensors
        for axis in range(t.dim())
        if t.shape[axis] == d
        for _ in range(2)
    ]
    direct.append((matrix @ tensors[0])[2:5])
    for got, want in zip(moved, direct):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    (grad,) = torch.autograd.grad(sum((m * m.detach().cos()).sum() for m in moved), matrix)
    (expected,) = torch.autograd.grad(sum((w * w.detach().cos()).sum() for w in direct), matrix)
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_compose_and_inverse_act_consistently(arch):
    canonical = hf_lmc.canonicalize(build_model(TINY[arch]))
    first = random_symmetry(canonical.spec, seed=1)
    second = random_symmetry(canonical.spec, seed=2)
    state = canonical.state_dict()
    composed = second.compose(first).apply(canonical).state_dict()
    sequential = second.apply(first.apply(canonical)).state_dict()
    undone = first.inverse().apply(first.apply(canonical)).state_dict()
    for name in state:
        torch.testing.assert_close(composed[name], sequential[name], rtol=1e-10, atol=1e-10, msg=name)
        torch.testing.assert_close(undone[name], state[name], rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("arch", sorted(TINY))
def test_split_moves_the_assignments_first_and_its_ordered_maps_skip_no_gather_they_need(arch):
    """``T = in_order o assignments``: the in-order maps, ``ordered`` (they move tensors without a
    gather), applied after the assignments give every tensor ``T`` gives, and the split composes
    back to ``T`` exactly. A wrongly ordered flag would drop a permutation and fail here."""
    canonical = hf_lmc.canonicalize(build_model(TINY[arch]))
    transform = random_symmetry(canonical.spec, seed=3)
    in_order, assignments = transform.split()
    layer_maps = [e for space, e in in_order.maps.items() if space != "residual"]
    assert layer_maps and all(m.ordered for e in layer_maps for m in _monomials(e))
    assert not any(m.ordered for e in assignments.maps.values() for m in _monomials(e))
    want = transform.apply(canonical).state_dict()
    got = in_order.apply(assignments.apply(canonical).materialize()).state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    rejoined = in_order.compose(assignments)
    for space, element in transform.maps.items():
        for mine, theirs in zip(_monomials(rejoined.maps[space]), _monomials(element)):
            assert torch.equal(mine.perm, theirs.perm) and torch.equal(mine.blocks, theirs.blocks), space
        assert not any(m.ordered for m in _monomials(rejoined.maps[space])) or space == "residual"


def _monomials(element) -> list[BlockMonomial]:
    return [element.map] if hasattr(element, "map") else [element.qk, element.ov]


def test_layernorm_residual_maps_fix_the_ones_direction():
    spec = _spec(norm="layernorm", gated_mlp=False, rotary_dim=0)
    o = random_symmetry(spec, seed=4).maps["residual"].matrix
    u = torch.full((12,), 1 / math.sqrt(12), dtype=torch.float64)
    torch.testing.assert_close(o @ u, u)
    torch.testing.assert_close(o @ o.T, torch.eye(12, dtype=torch.float64))


@pytest.mark.parametrize("rotary_dim", [2, 4, 6])
def test_rope_qk_blocks_commute_with_every_rotary_rotation(rotary_dim):
    spec = _spec(head_dim=6, num_heads=2, num_kv_heads=2, hidden_size=12, rotary_dim=rotary_dim)
    qk = random_symmetry(spec, seed=5).maps["attn.0"].qk
    half = rotary_dim // 2
    for theta in torch.rand(4, dtype=torch.float64) * 10:
        rot = torch.eye(6, dtype=torch.float64)
        c, s = torch.cos(theta * torch.arange(1, half + 1)), torch.sin(theta * torch.arange(1, half + 1))
        idx = torch.arange(half)
        rot[idx, idx], rot[idx, idx + half], rot[idx + half, idx], rot[idx + half, idx + half] = c, -s, s, c
        for m in qk.blocks:
            torch.testing.assert_close(m.T @ rot, rot @ m.T)  # so q^T R k is unchanged under (M, M^-T)


def test_rotary_block_inverse_is_exact():
    g = torch.Generator().manual_seed(0)
    m, inv = rotary_block(
        torch.rand(2, dtype=torch.float64) + 0.5, torch.rand(2, dtype=torch.float64), 4, 6, random_gl(2, g)
    )
    torch.testing.assert_close(m @ inv, torch.eye(6, dtype=torch.float64))


def test_gqa_head_permutation_keeps_groups_together():
    spec = _spec()
    attention = random_symmetry(spec, seed=6).maps["attn.1"]
    kv_perm, group = attention.qk.perm, spec.group_size
    for h, target in enumerate(attention.query_perm.tolist()):
        assert target // group == kv_perm[h // group]


def test_permutation_preset_draws_only_permutations():
    t = random_symmetry(_spec(), seed=7, kinds="permutation")
    o = t.maps["residual"].matrix
    assert torch.equal(o.abs().sum(0), torch.ones(12, dtype=o.dtype)) and set(o.unique().tolist()) <= {0.0, 1.0}
    eye = torch.eye(4, dtype=torch.float64)
    assert all(torch.equal(b, eye) for b in t.maps["attn.0"].qk.blocks)
    assert torch.equal(t.maps["mlp.0"].map.blocks.flatten(), torch.ones(10, dtype=torch.float64))


def test_unknown_symmetry_names_are_rejected():
    with pytest.raises(ValueError, match="choose from"):
        random_symmetry(_spec(), kinds="everything")
    with pytest.raises(ValueError, match="choose from"):
        random_symmetry(_spec(), kinds={"residual", "rotations"})


def test_axes_table_names_layer_spaces():
    assert axes_of("layers.3.attn.k.weight") == (("attn.3", "k"), ("residual", "in"))
    assert axes_of("layers.0.mlp.down.weight") == (("residual", "out"), ("mlp.0", "down"))
    assert axes_of("head.bias") == (None,)
