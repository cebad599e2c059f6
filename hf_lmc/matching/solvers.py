"""Small pure solvers behind weight matching: Procrustes, assignment, balanced GL matching.

Shapes: ``(b, m)`` data matrices hold ``m`` samples of a ``b``-dimensional block; "vector"
data transforms as ``M x`` and "covector" data as ``M^{-T} x``. All math runs in float64.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from scipy.optimize import brentq, minimize_scalar
from scipy.sparse import csr_matrix
from scipy.sparse.csgraph import min_weight_full_bipartite_matching
from torch import Tensor

from hf_lmc.symmetry.groups import rotary_block
from hf_lmc.utils.linalg import OnesFrame, assign, perm_from_pairs, single_threaded, single_threaded_context

#: The least singular value a least-squares GL map keeps (and below which a
#: Procrustes target leaves a direction free), relative to its largest.
MIN_RELATIVE_SINGULAR_VALUE = 1e-6


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
    frame = OnesFrame(m.shape[0], m.dtype, m.device)
    return frame.expand(polar(frame.reduce(m)))


class CompletedPolar:
    """The orthogonal ``R`` maximising ``tr(R^T m)``, completed where ``m`` leaves it free.

    Where ``m = U S V^T`` has rank ``r < n``, ``tr(R^T m)`` fixes ``R`` only on its ``r``
    singular directions: every ``R = U_r V_r^T + U_f Q V_f^T`` with ``Q`` orthogonal scores the
    same. Two-sided pairs ``(A, B)`` with ``A ~ R B R^T`` (``add``; e.g. the circuits
    ``W_Q^T W_K`` that every map but ``R`` leaves alone) choose ``Q``: ``solve`` maximises
    ``sum tr(A^T R B R^T) / (|A| |B|)`` over it by alternating Procrustes, each step linear in
    ``Q`` with the other factor of ``R`` held at the last estimate; exact when B is A moved by
    an orthogonal ``R``. The directions ``m`` fixes are kept as they are, so where ``m`` has
    full rank the result is :func:`polar`'s. Each pair is kept only as its four projections
    on the ``k = n - r`` free directions (``4 k n`` numbers).

    ``fixing_ones=True`` restricts ``R`` to the maps of :func:`polar_fixing_ones`, solved in
    its Householder frame.
    """

    def __init__(self, m: Tensor, *, fixing_ones: bool = False, floor: float = MIN_RELATIVE_SINGULAR_VALUE):
        m = m.double()
        self._frame = OnesFrame(m.shape[0], m.dtype, m.device) if fixing_ones else None
        with single_threaded_context():  # as in polar: a full-rank m gives its result to the bit
            u, sigma, vh = torch.linalg.svd(self._reduce(m))
        rank = int((sigma > floor * sigma[0]).sum()) if sigma.numel() and sigma[0] > 0 else 0
        self._fixed = u[:, :rank] @ vh[:rank]
        self._u_free, self._v_free = u[:, rank:], vh[rank:].T
        self._pairs: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []

    @property
    def free(self) -> int:
        """How many directions ``m`` leaves free (``k``)."""
        return self._u_free.shape[1]

    def _reduce(self, x: Tensor) -> Tensor:
        return x if self._frame is None else self._frame.reduce(x)

    def add(self, a: Tensor, b: Tensor) -> None:
        """Add a pair with ``a ~ R b R^T`` (n x n, in the original coordinates)."""
        if not self.free:
            return
        a, b = self._reduce(a.double()), self._reduce(b.double())
        norm = (torch.linalg.matrix_norm(a) * torch.linalg.matrix_norm(b)).sqrt()
        if norm == 0:
            return
        a, b = a / norm, b / norm
        uf, vf = self._u_free, self._v_free
        self._pairs.append((uf.T @ a, uf.T @ a.T, b.T @ vf, b @ vf))

    def solve(self, *, iterations: int = 100, tol: float = 1e-12) -> Tensor:
        """``R`` (n x n): the fixed directions from ``m``, the free ones from the pairs."""
        q = torch.eye(self.free, dtype=self._fixed.dtype, device=self._fixed.device)
        for _ in range(iterations if self._pairs else 0):
            r = self._fixed + self._u_free @ q @ self._v_free.T
            target = sum(rows @ r @ cols + rows_t @ r @ cols_t for rows, rows_t, cols, cols_t in self._pairs)
            q, previous = polar(target), q
            if torch.linalg.matrix_norm(q - previous) <= tol * max(self.free, 1) ** 0.5:
                break
        r = self._fixed + self._u_free @ q @ self._v_free.T
        return r if self._frame is None else self._frame.expand(r)


#: Square assignments whose float64 cost matrix takes at most this many bytes (n <= 5792) are
#: solved densely by scipy, which is faster there than the certified sparse solve; larger ones
#: are solved sparsely, which never builds that matrix (docs/design.md §4 has the timings).
DENSE_ASSIGNMENT_BYTES = 256 << 20


def assign_product(
    left: Tensor, right: Tensor, rows: int = 1024, candidates: int = 32, dense_bytes: int = DENSE_ASSIGNMENT_BYTES
) -> Tensor:
    """:func:`assign` on ``left @ right.T``, exactly; above ``dense_bytes`` of float64 cost
    matrix, without building it.

    The product is kept in its own dtype (the float64 matrix ``linear_sum_assignment`` needs is
    4x a bfloat16 one: 537 MB at FFN 8192). A large assignment is solved on each row's
    ``candidates`` best columns, then certified optimal for the whole matrix by LP duality
    (:func:`_certified_sparse_assignment`), adding any column the certificate rejects. The
    product, the candidates and the certificate's screens run where ``left`` and ``right`` are;
    the matching itself (scipy) on the CPU.
    """
    return assign_similarity(similarity_product(left, right, rows), candidates, rows, dense_bytes)


def similarity_product(left: Tensor, right: Tensor, rows: int = 1024) -> Tensor:
    """``left @ right.T`` in ``rows``-row slices, in the operands' dtype, where they are."""
    n, m = left.shape[0], right.shape[0]
    product = torch.empty(n, m, dtype=torch.promote_types(left.dtype, right.dtype), device=left.device)
    for i in range(0, n, rows):
        torch.matmul(left[i : i + rows], right.T, out=product[i : i + rows])
    return product


def assign_similarity(
    similarity: Tensor, candidates: int = 32, rows: int = 1024, dense_bytes: int = DENSE_ASSIGNMENT_BYTES
) -> Tensor:
    """:func:`assign` on ``similarity``: dense up to ``dense_bytes`` of float64 cost matrix,
    else sparse and certified (:func:`assign_product` says how). Only this part runs scipy,
    which releases the GIL: weight matching runs it on worker threads, beside later layers'
    products."""
    n, m = similarity.shape
    if n != m or n * m * 8 <= dense_bytes:
        return assign(similarity)
    return _certified_sparse_assignment(similarity, candidates, rows)


def _certified_sparse_assignment(similarity: Tensor, candidates: int, rows: int) -> Tensor:
    """Maximum-similarity permutation of a square matrix, solved on a sparse set of edges.

    Minimising ``cost = top - similarity + 1`` (positive: sparse solvers read zeros as missing
    edges; a constant shift does not change which permutation is best):

    1. solve on each row's ``candidates`` best columns (``min_weight_full_bipartite_matching``);
    2. duals: column potentials ``v`` are shortest paths under ``v_j <= v_pi(i) + cost_ij -
       cost_i,pi(i)`` over the sparse edges (Bellman-Ford, vectorised), and
       ``u_i = cost_i,pi(i) - v_pi(i)``, so matched edges are tight;
    3. if every reduced cost ``cost_ij - u_i - v_j`` of the *dense* matrix is non-negative, the
       duals are feasible and the matching is optimal (complementary slackness). Otherwise the
       violating edges join the sparse set and it goes again.
    """
    n = similarity.shape[0]
    top, largest = float(similarity.max()), float(similarity.abs().max())
    k = min(candidates, n)
    edge_rows, edge_cols = [], []
    for i in range(0, n, rows):
        block = similarity[i : i + rows]
        edge_cols.append(block.topk(k, dim=1).indices.reshape(-1).cpu())
        edge_rows.append(torch.arange(i, i + block.shape[0], device="cpu").repeat_interleave(k))
    edge_rows, edge_cols = torch.cat(edge_rows), torch.cat(edge_cols)  # on the CPU, for scipy
    for _ in range(n):  # each round adds at least one edge; in practice one or two rounds
        cost = top - _entries(similarity, edge_rows, edge_cols).double() + 1
        graph = csr_matrix((cost.numpy(), (edge_rows.numpy(), edge_cols.numpy())), shape=(n, n))
        try:
            matched_rows, matched_cols = min_weight_full_bipartite_matching(graph)
        except ValueError:  # no full matching among the candidates: widen them
            return _certified_sparse_assignment(similarity, 4 * k, rows) if 4 * k < n else assign(similarity)
        matched_rows, matched_cols = (
            torch.as_tensor(matched_rows, device="cpu").long(),
            torch.as_tensor(matched_cols, device="cpu").long(),
        )
        col_of = torch.empty(n, dtype=torch.long, device="cpu")
        col_of[matched_rows] = matched_cols
        u, v = _assignment_duals(edge_rows, edge_cols, cost, col_of, top)
        if u is None:  # no convergence (round-off cycles): let the dense solver decide
            return assign(similarity)
        new_rows, new_cols = _violations(similarity, u, v, top, largest, rows)
        if new_rows.numel() == 0:
            return perm_from_pairs(matched_rows, matched_cols, n)
        edge_rows, edge_cols = torch.cat([edge_rows, new_rows]), torch.cat([edge_cols, new_cols])
    return assign(similarity)


def _entries(similarity: Tensor, rows: Tensor, cols: Tensor) -> Tensor:
    """``similarity[rows, cols]`` on the CPU, gathered where ``similarity`` is."""
    return similarity[rows.to(similarity.device), cols.to(similarity.device)].cpu()


def _violations(
    similarity: Tensor, u: Tensor, v: Tensor, top: float, largest: float, rows: int
) -> tuple[Tensor, Tensor]:
    """Entries whose reduced cost ``top + 1 - similarity_ij - u_i - v_j`` is negative (below
    ``-1e-9`` of the scale): screened in float32 with a bound on its rounding error, then
    decided in float64, so nothing is missed and the dense float64 matrix never exists.
    ``largest`` is ``max |similarity|``, which bounds the screen's error with the potentials'.
    Screened where ``similarity`` is; the entries found come back on the CPU."""
    tol = 1e-9 * (abs(top) + 1)
    row_term, col_term = top + 1 - u, v
    scale = float(row_term.abs().max()) + largest + float(col_term.abs().max())
    screen = 8 * torch.finfo(torch.float32).eps * scale  # float32 error of a - s - b is below this
    row_term, col_term = row_term.to(similarity.device), col_term.to(similarity.device)
    row32, col32 = row_term.float(), col_term.float()
    found_rows, found_cols = [], []
    step = max(1, rows // 4)  # float32 blocks of 8 MB at n = 8192
    for i in range(0, similarity.shape[0], step):
        block = similarity[i : i + step]
        r, c = torch.nonzero((row32[i : i + step, None] - block.float()) - col32[None, :] < screen, as_tuple=True)
        r = r + i
        exact = row_term[r] - similarity[r, c].double() - col_term[c]
        keep = exact < -tol
        found_rows.append(r[keep].cpu())
        found_cols.append(c[keep].cpu())
    return torch.cat(found_rows), torch.cat(found_cols)


def _assignment_duals(
    edge_rows: Tensor, edge_cols: Tensor, cost: Tensor, col_of: Tensor, top: float
) -> tuple[Tensor | None, Tensor | None]:
    """Dual potentials ``(u, v)`` of an optimal sparse assignment, or ``(None, None)``."""
    n = col_of.shape[0]
    matched_cost = torch.empty(n, dtype=torch.float64, device="cpu")
    is_matched = edge_cols == col_of[edge_rows]
    matched_cost[edge_rows[is_matched]] = cost[is_matched]
    weight = cost - matched_cost[edge_rows]  # v_j <= v_pi(i) + weight
    source = col_of[edge_rows]
    v = torch.zeros(n, dtype=torch.float64, device="cpu")  # a virtual source with a zero edge to every column
    slack = 1e-12 * (abs(top) + 1)
    for _ in range(n + 1):  # Bellman-Ford, all edges at once
        relaxed = v.scatter_reduce(0, edge_cols, v[source] + weight, reduce="amin")
        if not bool((relaxed < v - slack).any()):
            return matched_cost - v[col_of], v
        v = relaxed
    return None, None  # a negative cycle: round-off, or the matching was not optimal


def assign_heads(similarity: Tensor, num_kv_heads: int) -> tuple[Tensor, Tensor]:
    """Head permutations ``(kv_perm, query_perm)`` maximising a query-head ``similarity``.

    Under GQA a query head must stay with the KV head it shares: every (A KV head, B KV head)
    pair gets the best assignment of their query heads, then KV heads are assigned on those
    totals. ``similarity[i, j]`` compares A's query head ``i`` with B's ``j``. Solved on the CPU.
    """
    similarity = similarity.cpu()
    g = similarity.shape[0] // num_kv_heads
    within = {}
    kv_sim = torch.empty(num_kv_heads, num_kv_heads, dtype=similarity.dtype, device="cpu")
    for ia in range(num_kv_heads):
        for jb in range(num_kv_heads):
            block = similarity[ia * g : (ia + 1) * g, jb * g : (jb + 1) * g]
            perm = assign(block)
            within[ia, jb] = perm
            kv_sim[ia, jb] = block[perm, torch.arange(g, device="cpu")].sum()
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
    def of(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor) -> Moments:
        return Moments(
            vec_a @ vec_a.T, vec_b @ vec_b.T, vec_a @ vec_b.T, cov_a @ cov_a.T, cov_b @ cov_b.T, cov_a @ cov_b.T
        )

    def to(self, device: str | torch.device) -> Moments:
        return Moments(
            *(m.to(device) for m in (self.vec_aa, self.vec_bb, self.vec_ab, self.cov_aa, self.cov_bb, self.cov_ab))
        )

    def sub(self, index) -> Moments:
        """The moments of rows ``index`` of every data matrix."""
        return Moments(
            *(
                m[index][:, index]
                for m in (self.vec_aa, self.vec_bb, self.vec_ab, self.cov_aa, self.cov_bb, self.cov_ab)
            )
        )


@single_threaded
def _balancing(p: Tensor, r: Tensor, ridge: float = 1e-12) -> tuple[Tensor, Tensor, Tensor]:
    """``T`` with ``T P T^T = T^{-T} R T^{-1} = diag`` for moments ``P = vec vec^T``, ``R = cov cov^T``.

    The balanced realisation is unique up to an orthogonal map commuting with the diagonal,
    so two models related by any GL map have balanced forms related by an orthogonal one.
    Also returns the squared balanced values (the diagonal squared): it exists only where
    they are all positive, i.e. where ``vec^T cov`` has full rank ``b``.
    """
    b = p.shape[0]
    eye = torch.eye(b, dtype=p.dtype, device=p.device)
    p = p + ridge * (p.trace() / b + 1e-30) * eye
    r = r + ridge * (r.trace() / b + 1e-30) * eye
    chol = torch.linalg.cholesky(p)
    chol_inv = torch.linalg.solve_triangular(chol, eye, upper=False)
    evals, evecs = torch.linalg.eigh(chol.T @ r @ chol)
    root = evals.clamp_min(1e-300).sqrt().sqrt()  # Sigma^{1/2}, Sigma^2 = evals
    t = root[:, None] * evecs.T @ chol_inv
    t_inv = chol @ evecs / root[None, :]
    return t, t_inv, evals


def _rank_deficient(evals: Tensor, tol: float = 1e-10) -> bool:
    return bool(evals[0] <= tol * evals[-1])


@single_threaded
def _match_gl_least_squares(moments: Moments) -> tuple[Tensor, Tensor]:
    """GL matching where a balanced form does not exist (``vec^T cov`` of rank below ``b``).

    That happens when a head is wider than the data it sees (``head_dim > hidden_size`` in
    tiny configs, a dead head): the equations ``M vec_b = vec_a``, ``M^T cov_a = cov_b`` then
    leave ``M`` free on a subspace. ``M`` minimises their squared residual plus a vanishing
    pull ``lam |M - s I|^2`` that fixes the free part at a scale ``s`` matching the data. The
    normal equations are the Sylvester equation ``cov_aa M + M vec_bb + lam M = c``, solved in
    the two eigenbases. Exact whenever B is a GL transform of A.
    """
    b, dtype = moments.vec_aa.shape[0], moments.vec_aa.dtype
    tr = [float(m.trace()) for m in (moments.vec_aa, moments.vec_bb, moments.cov_aa, moments.cov_bb)]
    scale = ((tr[0] * tr[3]) / (tr[1] * tr[2])) ** 0.25 if min(tr) > 0 else 1.0
    lam = 1e-10 * (tr[1] + tr[2]) / b + 1e-300
    ea, ua = torch.linalg.eigh(moments.cov_aa)
    eb, ub = torch.linalg.eigh(moments.vec_bb)
    c = moments.vec_ab + moments.cov_ab + lam * scale * torch.eye(b, dtype=dtype, device=moments.vec_ab.device)
    m = ua @ ((ua.T @ c @ ub) / (ea.clamp_min(0)[:, None] + eb.clamp_min(0)[None, :] + lam)) @ ub.T
    return _conditioned(m)


def _conditioned(m: Tensor, floor: float = MIN_RELATIVE_SINGULAR_VALUE) -> tuple[Tensor, Tensor]:
    """``m`` with its singular values raised to at least ``floor`` times the largest, and its inverse.

    The least-squares solution is nearly singular where one model's data fills a direction the
    other's leaves empty (seen at condition number 5e10 on an embedded narrower model): any
    invertible map is an exact symmetry in exact arithmetic, but applying ``M`` and ``M^-1``
    then loses ``log10(cond)`` digits. Raising the smallest singular values changes the map
    only where the data barely constrains it, and keeps every merge exact to ``cond <= 1e6``.
    """
    u, sigma, vh = torch.linalg.svd(m)
    sigma = sigma.clamp_min(floor * sigma[0])
    return (u * sigma) @ vh, (vh.T / sigma) @ u.T


def match_gl(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor) -> tuple[Tensor, Tensor]:
    """An invertible ``M`` (and ``M^{-1}``) with ``M vec_b ~ vec_a`` and ``M^{-T} cov_b ~ cov_a``.

    Both sides are brought to their balanced form, then aligned by an orthogonal Procrustes
    step; exact whenever B is a GL transform of A. Where no balanced form exists (``vec^T cov``
    rank-deficient) a least-squares solve takes over, equally exact.
    """
    return match_gl_moments(Moments.of(vec_a, cov_a, vec_b, cov_b))


def match_gl_moments(moments: Moments) -> tuple[Tensor, Tensor]:
    """:func:`match_gl` from the data's second moments."""
    ta, ta_inv, sigma_a = _balancing(moments.vec_aa, moments.cov_aa)
    tb, tb_inv, sigma_b = _balancing(moments.vec_bb, moments.cov_bb)
    if _rank_deficient(sigma_a) or _rank_deficient(sigma_b):
        return _match_gl_least_squares(moments)
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
    """:func:`match_rotary` from the data's second moments.

    Every frequency pair at once: each pair's 2 x 2 blocks are four entries of the moments, so
    a head's scales and angles are a few elementwise ops (a loop over pairs was ~30 small ops
    per pair, and held the GIL that side-by-side solves share).
    """
    head_dim, half = moments.vec_aa.shape[0], rotary_dim // 2
    first = torch.arange(half, device=moments.vec_aa.device)
    second = first + half

    def trace(m: Tensor) -> Tensor:  # each pair's 2 x 2 block trace
        return m[first, first] + m[second, second]

    s_a = _pair_scales(trace(moments.vec_aa), trace(moments.cov_aa))
    s_b = _pair_scales(trace(moments.vec_bb), trace(moments.cov_bb))
    both = s_a * s_b

    def cross(rows: Tensor, cols: Tensor) -> Tensor:  # entry (rows, cols) of each pair's 2 x 2 cross block
        return both * moments.vec_ab[rows, cols] + moments.cov_ab[rows, cols] / both

    angles = torch.atan2(cross(second, first) - cross(first, second), cross(first, first) + cross(second, second))
    passthrough = None
    if head_dim > rotary_dim:
        passthrough = match_gl_moments(moments.sub(slice(rotary_dim, head_dim)))
    return rotary_block(s_b / s_a, angles, rotary_dim, head_dim, passthrough)


def match_rotary_joint_moments(moments: Moments, rotary_dim: int) -> tuple[Tensor, Tensor]:
    """Like :func:`match_rotary_moments`, each frequency pair's scale-rotation solved jointly on
    Q and K (Tran et al., appendix G.1).

    Per pair ``j``, ``U = r R(theta)`` minimises ``|Q_A - U Q_B|^2 + |K_A - U^{-T} K_B|^2``
    (``vec`` rows are Q, ``cov`` rows are K; ``U^{-T} = R(theta) / r``). With ``x = r^2`` the
    angle has a closed form and the scale is the minimiser of one scalar function
    (:func:`rotary_pair_scale`, Brent's method). The moments solve instead balances each model's
    pair on its own and takes the angle by Procrustes: both are exact on twins, only this one is
    the least-squares optimum. Pairs where either B side is zero, or nothing aligns, keep the
    moments solve's map. The pass-through dims get :func:`match_gl_moments`'s block, as there.
    """
    start, start_inv = match_rotary_moments(moments, rotary_dim)
    half = rotary_dim // 2
    first = torch.arange(half, device=moments.vec_aa.device)
    second = first + half
    eta_q, eta_k, gamma_q, gamma_k = (x.cpu().numpy() for x in rotary_pair_constants(moments, rotary_dim))
    scales, angles = (
        start[first, first].hypot(start[second, first]),
        torch.atan2(start[second, first], start[first, first]),
    )
    scales, angles = scales.cpu().numpy().copy(), angles.cpu().numpy().copy()
    for j in range(half):
        r = rotary_pair_scale(float(eta_q[j]), float(eta_k[j]), complex(gamma_q[j]), complex(gamma_k[j]))
        if r is not None:
            scales[j], angles[j] = r, -np.angle(r * gamma_q[j] + gamma_k[j] / r)
    passthrough = None
    if moments.vec_aa.shape[0] > rotary_dim:
        passthrough = (start[rotary_dim:, rotary_dim:], start_inv[rotary_dim:, rotary_dim:])
    as_tensor = partial(torch.as_tensor, dtype=start.dtype, device=start.device)
    return rotary_block(as_tensor(scales), as_tensor(angles), rotary_dim, start.shape[0], passthrough)


def rotary_pair_constants(moments: Moments, rotary_dim: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Appendix G.1's constants of every frequency pair: ``(eta_Q, eta_K, gamma_Q, gamma_K)``.

    ``eta`` is the squared norm of B's pair block; ``gamma = a + i b`` is the projection of
    A's-by-B's cross block ``P = A B^T`` on the scale-rotations ``[[a, -b], [b, a]]``:
    ``a = (P_11 + P_22) / 2``, ``b = (P_12 - P_21) / 2``, so that
    ``tr(P^T r R(theta)) = 2 r Re(gamma e^{i theta})``.
    """
    half = rotary_dim // 2
    first = torch.arange(half, device=moments.vec_aa.device)
    second = first + half

    def eta(m: Tensor) -> Tensor:
        return m[first, first] + m[second, second]

    def gamma(p: Tensor) -> Tensor:
        return torch.complex(p[first, first] + p[second, second], p[first, second] - p[second, first]) / 2

    return eta(moments.vec_bb), eta(moments.cov_bb), gamma(moments.vec_ab), gamma(moments.cov_ab)


def rotary_pair_objective(x, eta_q: float, eta_k: float, gamma_q: complex, gamma_k: complex):
    """Appendix G.1's ``g(x) = x eta_Q + eta_K / x - 4 sqrt(|gamma_Q|^2 x + |gamma_K|^2 / x +
    2 Re(gamma_Q conj(gamma_K)))``: ``|Q_A - U Q_B|^2 + |K_A - U^{-T} K_B|^2`` at ``|U|^2 = x``
    and the best angle, less the constant ``|Q_A|^2 + |K_A|^2`` (``x`` a float or an array)."""
    cross = 2 * (gamma_q * np.conj(gamma_k)).real
    inside = abs(gamma_q) ** 2 * x + abs(gamma_k) ** 2 / x + cross
    return x * eta_q + eta_k / x - 4 * np.sqrt(np.maximum(inside, 0.0))


def rotary_pair_scale(eta_q: float, eta_k: float, gamma_q: complex, gamma_k: complex) -> float | None:
    """The scale ``r* = sqrt(x*)`` of appendix G.1: ``x*`` minimises :func:`rotary_pair_objective`
    over ``x > 0``, by Brent's method (``scipy.optimize.minimize_scalar``) in ``t = log x``.

    ``g`` need not be unimodal, so Brent starts from the best point of a grid that spans the
    Q-only, K-only and balanced optima (widened until its best point is inside), and the
    stationary point it lands near is then polished by ``brentq`` on ``g'``, so that a twin's
    scale is exact to rounding rather than to Brent's ``sqrt(eps)``. ``None`` where the problem
    says nothing (a zero side of B, or no overlap at all): the caller keeps its other start.
    """
    if not (eta_q > 0 and eta_k > 0 and abs(gamma_q) + abs(gamma_k) > 0):
        return None
    args = (eta_q, eta_k, gamma_q, gamma_k)

    def objective(t):
        return rotary_pair_objective(np.exp(t), *args)

    def slope(t):  # d g(e^t) / dt = x g'(x)
        x = np.exp(t)
        root = np.sqrt(
            max(abs(gamma_q) ** 2 * x + abs(gamma_k) ** 2 / x + 2 * (gamma_q * np.conj(gamma_k)).real, 1e-300)
        )
        return x * eta_q - eta_k / x - 2 * (abs(gamma_q) ** 2 * x - abs(gamma_k) ** 2 / x) / root

    # Q alone is best at r = 2|gamma_Q| / eta_Q, K alone at r = eta_K / (2|gamma_K|), the norms at x = sqrt(eta_K / eta_Q).
    marks = [0.5 * np.log(eta_k / eta_q)]
    marks += [2 * np.log(2 * abs(gamma_q) / eta_q)] if abs(gamma_q) > 0 else []
    marks += [2 * np.log(eta_k / (2 * abs(gamma_k)))] if abs(gamma_k) > 0 else []
    low, high = min(marks) - 2.0, max(marks) + 2.0
    for _ in range(64):
        grid = np.linspace(low, high, 65)
        values = objective(grid)
        best = int(np.argmin(values))
        if 0 < best < len(grid) - 1:
            break
        width = high - low
        low, high = (low - width, high) if best == 0 else (low, high + width)
    else:
        return float(np.exp(grid[best] / 2))
    bracket = (grid[best - 1], grid[best], grid[best + 1])
    t = minimize_scalar(objective, bracket=bracket, method="brent").x
    step = grid[1] - grid[0]
    lo, hi = t - step, t + step
    if slope(lo) < 0 < slope(hi):
        t = brentq(slope, lo, hi, xtol=1e-15, rtol=4 * np.finfo(float).eps)
    return float(np.exp(t / 2))


def _pair_scales(vec_sq: Tensor, cov_sq: Tensor) -> Tensor:
    """Per pair ``s`` with ``|s vec| = |cov / s|`` from the squared norms (1 where either side is zero)."""
    ok = (vec_sq > 0) & (cov_sq > 0)
    one = torch.ones_like(vec_sq)
    return torch.where(ok, (cov_sq.where(ok, one) / vec_sq.where(ok, one)).sqrt().sqrt(), one)


def balanced_scales(vec: Tensor, cov: Tensor) -> Tensor:
    """Per row ``s`` with ``|s vec_i| = |cov_i / s|`` (SwiGLU neurons: up row vs down column)."""
    nv, nc = vec.norm(dim=1), cov.norm(dim=1)
    ok = (nv > 0) & (nc > 0)
    return torch.where(ok, (nc / nv.where(ok, torch.ones_like(nv))).sqrt(), torch.ones_like(nv))
