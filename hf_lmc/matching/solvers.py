"""Small pure solvers behind weight matching: Procrustes, assignment, balanced GL matching.

Shapes: ``(b, m)`` data matrices hold ``m`` samples of a ``b``-dimensional block; "vector"
data transforms as ``M x`` and "covector" data as ``M^{-T} x``. All math runs in float64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

from ..linalg import householder_to_first, single_threaded
from ..symmetry.sample import rotary_block


@single_threaded
def polar(m: Tensor) -> Tensor:
    """The orthogonal ``R`` maximising ``tr(R^T m)``: ``U V^T`` from ``m = U S V^T``."""
    u, _, vh = torch.linalg.svd(m)
    return u @ vh


def polar_fixing_ones(m: Tensor) -> Tensor:
    """Like :func:`polar`, restricted to maps of ``1-perp`` that fix ``u = 1/sqrt(d)``.

    The Householder reflection ``H`` swapping ``u`` and ``e_1`` turns such maps into
    ``diag(1, X)``: ``X`` is the polar factor of ``(H m H)[1:, 1:]``. ``H`` acts in O(d^2), so
    this costs one (d-1) x (d-1) polar decomposition and no dense basis products.
    """
    v = householder_to_first(m.shape[0], m.dtype, m.device)
    if v is None:  # d == 1: the only such map is the identity
        return torch.ones_like(m)

    def reflect(x: Tensor) -> Tensor:  # H x H with H = I - 2 v v^T
        x = x - 2 * torch.outer(v, v @ x)
        return x - 2 * torch.outer(x @ v, v)

    inner = torch.zeros_like(m)
    inner[0, 0] = 1.0
    inner[1:, 1:] = polar(reflect(m)[1:, 1:])
    return reflect(inner)


_LARGE = 1 << 20  # cost matrices at least this big reuse one buffer (small ones are cheap to allocate)


@functools.lru_cache(maxsize=1)
def _cost_buffer(shape: tuple[int, int]) -> Tensor:
    """One reused float64 cost matrix for the large (MLP) assignments, which are all one size:
    allocating and page-faulting a fresh 0.5 GB array per layer costs as much as the assignment."""
    return torch.empty(shape, dtype=torch.float64)


def release_assignment_buffer() -> None:
    """Free the reused cost matrix (after a matching run)."""
    _cost_buffer.cache_clear()


def assign(similarity: Tensor) -> Tensor:
    """The permutation ``perm`` maximising ``sum_h similarity[perm[h], h]``.

    ``similarity[i, j]`` compares target block ``i`` with source block ``j``; the result
    sends source ``j`` to position ``perm[j]`` (the convention of :class:`BlockMonomial`).
    """
    cost = _cost_matrix(tuple(similarity.shape))
    cost.copy_(similarity.detach())
    return _solve(cost)


def assign_product(left: Tensor, right: Tensor, rows: int = 1024) -> Tensor:
    """:func:`assign` on ``left @ right.T``, computed a block of rows at a time straight into the
    float64 cost matrix, so the product is never held in its own dtype as well."""
    cost = _cost_matrix((left.shape[0], right.shape[0]))
    for i in range(0, left.shape[0], rows):
        cost[i : i + rows].copy_(left[i : i + rows] @ right.T)
    return _solve(cost)


def _cost_matrix(shape: tuple[int, int]) -> Tensor:
    n = shape[0] * shape[1]
    return _cost_buffer(shape) if n >= _LARGE else torch.empty(shape, dtype=torch.float64)


def _solve(similarity: Tensor) -> Tensor:
    """Linear assignment maximising a float64 ``similarity`` matrix, negated in place."""
    rows, cols = linear_sum_assignment(similarity.neg_().numpy())  # a C-contiguous float64 array: not copied
    perm = torch.empty(similarity.shape[1], dtype=torch.long)
    perm[torch.as_tensor(cols)] = torch.as_tensor(rows)
    return perm


def assign_heads(similarity: Tensor, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Head permutations ``(kv_perm, query_perm)`` maximising a query-head ``similarity``.

    Under GQA a query head must stay with the KV head it shares: every (A KV head, B KV head)
    pair gets the best assignment of their query heads, then KV heads are assigned on those
    totals. ``similarity[i, j]`` compares A's query head ``i`` with B's ``j``.
    """
    g = similarity.shape[0] // num_kv_heads
    within = {}
    kv_sim = torch.empty(num_kv_heads, num_kv_heads, dtype=similarity.dtype)
    for ia in range(num_kv_heads):
        for jb in range(num_kv_heads):
            block = similarity[ia * g : (ia + 1) * g, jb * g : (jb + 1) * g]
            perm = assign(block)
            within[ia, jb] = perm
            kv_sim[ia, jb] = block[perm, torch.arange(g)].sum()
    kv_perm = assign(kv_sim)
    query_perm = torch.cat([kv_perm[jb] * g + within[int(kv_perm[jb]), jb] for jb in range(num_kv_heads)])
    return kv_perm, query_perm


@dataclass(frozen=True)
class Moments:
    """Second moments of a (vector, covector) pair of data on both sides: all GL matching needs.

    For ``(b, m)`` data ``vec_a, cov_a, vec_b, cov_b``: ``vec_aa = vec_a vec_a^T``,
    ``vec_ab = vec_a vec_b^T`` and so on, each ``(b, b)``. Working from moments keeps the
    per-head solves independent of ``m`` (the model width) and lets callers build them from
    products they already have.
    """

    vec_aa: Tensor
    vec_bb: Tensor
    vec_ab: Tensor
    cov_aa: Tensor
    cov_bb: Tensor
    cov_ab: Tensor

    @staticmethod
    def of(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor) -> "Moments":
        return Moments(
            vec_a @ vec_a.T, vec_b @ vec_b.T, vec_a @ vec_b.T, cov_a @ cov_a.T, cov_b @ cov_b.T, cov_a @ cov_b.T
        )

    def sub(self, index) -> "Moments":
        """The moments of rows ``index`` of every data matrix."""
        return Moments(
            *(
                m[index][:, index]
                for m in (self.vec_aa, self.vec_bb, self.vec_ab, self.cov_aa, self.cov_bb, self.cov_ab)
            )
        )


@single_threaded
def _balancing(p: Tensor, r: Tensor, ridge: float = 1e-12) -> tuple[Tensor, Tensor]:
    """``T`` with ``T P T^T = T^{-T} R T^{-1} = diag`` for moments ``P = vec vec^T``, ``R = cov cov^T``.

    The balanced realisation is unique up to an orthogonal map commuting with the diagonal,
    so two models related by any GL map have balanced forms related by an orthogonal one.
    """
    b = p.shape[0]
    eye = torch.eye(b, dtype=p.dtype)
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
    return match_gl_moments(Moments.of(vec_a, cov_a, vec_b, cov_b))


def match_gl_moments(moments: Moments) -> tuple[Tensor, Tensor]:
    """:func:`match_gl` from the data's second moments."""
    ta, ta_inv = _balancing(moments.vec_aa, moments.cov_aa)
    tb, tb_inv = _balancing(moments.vec_bb, moments.cov_bb)
    cross = ta @ moments.vec_ab @ tb.T + ta_inv.T @ moments.cov_ab @ tb_inv
    r = polar(cross)
    return ta_inv @ r @ tb, tb_inv @ r.T @ ta


def match_rotary(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """Like :func:`match_gl`, restricted to maps that commute with RoPE.

    Per frequency pair ``(i, i + r/2)`` a scale-rotation ``s R(theta)``: the scale balances
    ``|s q| = |k / s|`` on each side, the angle is the 2-D Procrustes solution. The
    ``head_dim - r`` pass-through dimensions get a free GL block from :func:`match_gl`.
    """
    return match_rotary_moments(Moments.of(vec_a, cov_a, vec_b, cov_b), rotary_dim)


def match_rotary_moments(moments: Moments, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """:func:`match_rotary` from the data's second moments."""
    head_dim, half = moments.vec_aa.shape[0], rotary_dim // 2
    dtype = moments.vec_aa.dtype
    scales, angles = torch.empty(half, dtype=dtype), torch.empty(half, dtype=dtype)
    for i in range(half):
        pair = moments.sub([i, i + half])
        s_a = _pair_scale(pair.vec_aa.trace(), pair.cov_aa.trace())
        s_b = _pair_scale(pair.vec_bb.trace(), pair.cov_bb.trace())
        c = (s_a * s_b) * pair.vec_ab + pair.cov_ab / (s_a * s_b)
        angles[i] = torch.atan2(c[1, 0] - c[0, 1], c[0, 0] + c[1, 1])
        scales[i] = s_b / s_a
    passthrough = None
    if head_dim > rotary_dim:
        passthrough = match_gl_moments(moments.sub(slice(rotary_dim, head_dim)))
    return rotary_block(scales, angles, rotary_dim, head_dim, passthrough)


def _pair_scale(vec_sq: Tensor, cov_sq: Tensor) -> Tensor:
    """``s`` with ``|s vec| = |cov / s|`` from the squared norms (1 when either side is zero)."""
    if vec_sq <= 0 or cov_sq <= 0:
        return torch.ones((), dtype=vec_sq.dtype)
    return (cov_sq / vec_sq).sqrt().sqrt()


def balanced_scales(vec: Tensor, cov: Tensor) -> Tensor:
    """Per row ``s`` with ``|s vec_i| = |cov_i / s|`` (SwiGLU neurons: up row vs down column)."""
    nv, nc = vec.norm(dim=1), cov.norm(dim=1)
    ok = (nv > 0) & (nc > 0)
    return torch.where(ok, (nc / nv.where(ok, torch.ones_like(nv))).sqrt(), torch.ones_like(nv))
