"""Random elements of a model's symmetry group, and the structured blocks they are made of.

``random_symmetry(spec, seed)`` draws from the full group of docs/design.md §3 (or a named subset);
applying it must leave the model's function unchanged, which makes it a free property test
for every adapter and for the engine itself.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.symmetry.engine import Transform
from hf_lmc.symmetry.groups import AttentionMap, BlockMonomial, MlpMap, ResidualMap, rotary_block
from hf_lmc.utils.linalg import single_threaded

#: Symmetry classes, by name (``--symmetries`` picks a subset).
KINDS = ("residual", "residual_permutation", "heads", "qk", "ov", "mlp", "mlp_scale")
PRESETS = {
    "full": frozenset({"residual", "heads", "qk", "ov", "mlp", "mlp_scale"}),
    "permutation": frozenset({"residual_permutation", "heads", "mlp"}),
}


def resolve_kinds(kinds: str | frozenset[str] | set[str]) -> frozenset[str]:
    """A preset name (``"full"``, ``"permutation"``) or a set of names from :data:`KINDS`."""
    if isinstance(kinds, str):
        if kinds not in PRESETS:
            raise ValueError(f"unknown symmetry preset {kinds!r}; choose from {sorted(PRESETS)}")
        return PRESETS[kinds]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown symmetry kind(s) {sorted(unknown)}; choose from {KINDS}")
    return frozenset(kinds)


@single_threaded
def random_orthogonal(n: int, generator: torch.Generator) -> Tensor:
    """Haar-random orthogonal ``n x n`` matrix (float64)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(())).unsqueeze(0)


@functools.lru_cache(maxsize=8)
@single_threaded
def centred_basis(d: int, dtype=torch.float64) -> Tensor:
    """Orthonormal basis (d, d-1) of ``1-perp`` (cached: callers must not modify it)."""
    u = torch.full((d, 1), 1.0 / math.sqrt(d), dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.cat([u, torch.eye(d, dtype=torch.float64)[:, : d - 1]], dim=1))
    return q[:, 1:].to(dtype)


def orthogonal_fixing_ones(rotation: Tensor) -> Tensor:
    """Embed a (d-1)-dim rotation as a d x d orthogonal map of ``1-perp`` that fixes ``u``."""
    d = rotation.shape[0] + 1
    basis = centred_basis(d, rotation.dtype)
    u = torch.full((d, 1), 1.0 / math.sqrt(d), dtype=rotation.dtype)
    return basis @ rotation @ basis.T + u @ u.T


def random_gl(n: int, generator: torch.Generator, log_scale: float = 0.5) -> tuple[Tensor, Tensor]:
    """A well-conditioned random invertible matrix and its exact inverse: ``U diag(s) V``."""
    u, v = random_orthogonal(n, generator), random_orthogonal(n, generator)
    s = torch.exp((torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * log_scale)
    return u @ torch.diag(s) @ v, v.T @ torch.diag(1 / s) @ u.T


def _random_qk_block(spec: ArchSpec, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    dh, r = spec.head_dim, spec.rotary_dim
    if r == 0:
        return random_gl(dh, generator)
    scales = torch.exp((torch.rand(r // 2, generator=generator, dtype=torch.float64) * 2 - 1) * 0.5)
    angles = torch.rand(r // 2, generator=generator, dtype=torch.float64) * 2 * math.pi
    passthrough = random_gl(dh - r, generator) if dh > r else None
    return rotary_block(scales, angles, r, dh, passthrough)


def _stack(pairs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


def random_attention(spec: ArchSpec, generator: torch.Generator, kinds: frozenset[str]) -> AttentionMap:
    kv, g, dh = spec.num_kv_heads, spec.group_size, spec.head_dim
    kv_perm = torch.randperm(kv, generator=generator) if "heads" in kinds else torch.arange(kv)
    within = [torch.randperm(g, generator=generator) if "heads" in kinds else torch.arange(g) for _ in range(kv)]
    query_perm = torch.cat([kv_perm[j] * g + within[j] for j in range(kv)])
    eye = BlockMonomial.identity(kv, dh)
    qk = (
        BlockMonomial(kv_perm, *_stack([_random_qk_block(spec, generator) for _ in range(kv)]))
        if "qk" in kinds
        else None
    )
    ov = BlockMonomial(kv_perm, *_stack([random_gl(dh, generator) for _ in range(kv)])) if "ov" in kinds else None
    qk = qk or BlockMonomial(kv_perm, eye.blocks, eye.inverse_blocks)
    ov = ov or BlockMonomial(kv_perm, eye.blocks.clone(), eye.inverse_blocks.clone())
    return AttentionMap(qk, ov, query_perm)


def random_mlp(spec: ArchSpec, generator: torch.Generator, kinds: frozenset[str]) -> MlpMap:
    n = spec.intermediate_size
    perm = torch.randperm(n, generator=generator) if "mlp" in kinds else torch.arange(n)
    scale = torch.ones(n, dtype=torch.float64)
    if spec.gated_mlp and "mlp_scale" in kinds:
        scale = torch.exp((torch.rand(n, generator=generator, dtype=torch.float64) * 2 - 1) * 0.5)
        scale = (
            scale * (1 - 2 * torch.randint(0, 2, (n,), generator=generator)).double()
        )  # SwiGLU units' sign flips too
    return MlpMap(BlockMonomial.scaled_permutation(perm, scale))


def random_residual(spec: ArchSpec, generator: torch.Generator, kinds: frozenset[str]) -> ResidualMap:
    d = spec.hidden_size
    if "residual" in kinds:
        if spec.centred:  # the stream lives in 1-perp: rotate only there
            return ResidualMap.from_matrix(orthogonal_fixing_ones(random_orthogonal(d - 1, generator)))
        return ResidualMap.from_matrix(random_orthogonal(d, generator))
    perm = torch.randperm(d, generator=generator) if "residual_permutation" in kinds else torch.arange(d)
    return ResidualMap.from_matrix(torch.eye(d, dtype=torch.float64)[:, perm])


def random_symmetry(
    spec: ArchSpec, seed: int = 0, *, kinds: str | frozenset[str] = "full", dtype: torch.dtype = torch.float64
) -> Transform:
    """A random element of ``spec``'s symmetry group (seeded); applying it preserves the function."""
    kinds = resolve_kinds(kinds)
    generator = torch.Generator().manual_seed(seed)
    maps = {"residual": random_residual(spec, generator, kinds)}
    for i in range(spec.num_layers):
        maps[f"attn.{i}"] = random_attention(spec, generator, kinds)
        maps[f"mlp.{i}"] = random_mlp(spec, generator, kinds)
    return Transform(maps).to(dtype=dtype)
