"""Small pure solvers behind weight matching: Procrustes, assignment, balanced GL matching.

Shapes: ``(b, m)`` data matrices hold ``m`` samples of a ``b``-dimensional block; "vector"
data transforms as ``M x`` and "covector" data as ``M^{-T} x``. All math runs in float64.
"""

from __future__ import annotations

import math

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from ..linalg import single_threaded
from ..symmetry.sample import centred_basis, rotary_block


@single_threaded
def polar(m: Tensor) -> Tensor:
    """The orthogonal ``R`` maximising ``tr(R^T m)``: ``U V^T`` from ``m = U S V^T``."""
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


@single_threaded
def polar_fixing_ones(m: Tensor) -> Tensor:
    """Like :func:`polar`, restricted to maps of ``1-perp`` that fix ``u = 1/sqrt(d)``."""
    d = m.shape[0]
    basis = centred_basis(d, m.dtype)
    u = torch.full((d, 1), 1.0 / math.sqrt(d), dtype=m.dtype)
    return basis @ polar(basis.T @ m @ basis) @ basis.T + u @ u.T


def assign(similarity: Tensor) -> Tensor:
    """The permutation ``perm`` maximising ``sum_h similarity[perm[h], h]``.

    ``similarity[i, j]`` compares target block ``i`` with source block ``j``; the result
    sends source ``j`` to position ``perm[j]`` (the convention of :class:`BlockMonomial`).
    """
    rows, cols = linear_sum_assignment(similarity.detach().cpu().double().numpy(), maximize=True)
    perm = torch.empty(similarity.shape[1], dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm


@single_threaded
def _balancing(vec: Tensor, cov: Tensor, ridge: float = 1e-12) -> tuple[Tensor, Tensor]:
    """``T`` with ``T P T^T = T^{-T} R T^{-1} = diag`` for ``P = vec vec^T``, ``R = cov cov^T``.

    The balanced realisation is unique up to an orthogonal map commuting with the diagonal,
    so two models related by any GL map have balanced forms related by an orthogonal one.
    """
    b = vec.shape[0]
    eye = torch.eye(b, dtype=vec.dtype)
    p, r = vec @ vec.T, cov @ cov.T
    p = p + ridge * (p.trace() / b + 1e-30) * eye
    r = r + ridge * (r.trace() / b + 1e-30) * eye
    chol = torch.linalg.cholesky(p)
    chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    evals, evecs = torch.linalg.eigh(chol.T @ r @ chol)
    root = evals.clamp_min(1e-300).sqrt().sqrt()  # Sigma^{1/2}, Sigma^2 = evals
    t = root[:, None] * evecs.T @ chol_inv
    t_inv = chol @ evecs / root[None, :]
    return t, t_inv


def match_gl(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor) -> tuple[Tensor, Tensor]:
    """An invertible ``M`` (and ``M^{-1}``) with ``M vec_b ~ vec_a`` and ``M^{-T} cov_b ~ cov_a``.

    Both sides are brought to their balanced form, then aligned by an orthogonal Procrustes
    step; exact whenever B is a GL transform of A.
    """
    ta, ta_inv = _balancing(vec_a, cov_a)
    tb, tb_inv = _balancing(vec_b, cov_b)
    cross = (ta @ vec_a) @ (tb @ vec_b).T + (ta_inv.T @ cov_a) @ (tb_inv.T @ cov_b).T
    r = polar(cross)
    return ta_inv @ r @ tb, tb_inv @ r.T @ ta


def match_rotary(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """Like :func:`match_gl`, restricted to maps that commute with RoPE.

    Per frequency pair ``(i, i + r/2)`` a scale-rotation ``s R(theta)``: the scale balances
    ``|s q| = |k / s|`` on each side, the angle is the 2-D Procrustes solution. The
    ``head_dim - r`` pass-through dimensions get a free GL block from :func:`match_gl`.
    """
    head_dim, half = vec_a.shape[0], rotary_dim // 2
    scales, angles = torch.empty(half, dtype=vec_a.dtype), torch.empty(half, dtype=vec_a.dtype)
    for i in range(half):
        pair = [i, i + half]
        s_a = _pair_scale(vec_a[pair], cov_a[pair])
        s_b = _pair_scale(vec_b[pair], cov_b[pair])
        c = (s_a * vec_a[pair]) @ (s_b * vec_b[pair]).T + (cov_a[pair] / s_a) @ (cov_b[pair] / s_b).T
        angles[i] = torch.atan2(c[1, 0] - c[0, 1], c[0, 0] + c[1, 1])
        scales[i] = s_b / s_a
    passthrough = None
    if head_dim > rotary_dim:
        rest = slice(rotary_dim, head_dim)
        passthrough = match_gl(vec_a[rest], cov_a[rest], vec_b[rest], cov_b[rest])
    return rotary_block(scales, angles, rotary_dim, head_dim, passthrough)


def _pair_scale(vec: Tensor, cov: Tensor) -> Tensor:
    """``s`` with ``|s vec| = |cov / s|`` (1 when either side is zero)."""
    nv, nc = vec.norm(), cov.norm()
    if nv == 0 or nc == 0:
        return torch.ones((), dtype=vec.dtype)
    return (nc / nv).sqrt()


def balanced_scales(vec: Tensor, cov: Tensor) -> Tensor:
    """Per row ``s`` with ``|s vec_i| = |cov_i / s|`` (SwiGLU neurons: up row vs down column)."""
    nv, nc = vec.norm(dim=1), cov.norm(dim=1)
    ok = (nv > 0) & (nc > 0)
    return torch.where(ok, (nc / nv.where(ok, torch.ones_like(nv))).sqrt(), torch.ones_like(nv))
