"""Trainable parameterisations of the symmetry groups (for learned and dual matching, docs/design.md §4).

Each module holds free parameters and produces a group element that stays *in* its group for
every parameter value, so gradient steps never leave the set of function-preserving maps:

* :class:`OrthogonalParam` — ``O = O_0 f(A)`` with ``A`` skew-symmetric and ``f`` the Cayley
  map ``(I - A/2)^{-1} (I + A/2)`` or the matrix exponential (the two agree to second order in
  ``A``, so one Adam step turns the map equally far under either), or ``O = polar(M)``
  (projection of a free matrix). ``frame="target"`` puts the trained factor on the other side,
  ``O = f(A) O_0``: the same set of maps, but Adam's per-coordinate steps are taken in the
  coordinates the map moves the model *into* (A's, for B's transform) rather than its own. With
  ``fix_ones`` (LayerNorm models) the map is built in the Householder frame that sends
  ``u = 1/sqrt(d)`` to ``e_1``, so it fixes ``u`` exactly. ``frame="both"`` trains a factor on
  each side, ``O = f(L) O_0 f(A)``: the relative map dual matching trains, ``T_A^{-1} T_B``, has
  exactly this form, so one-sided matching in this frame follows dual matching's optimiser path.
* :class:`GLParam` — ``M = M_0 exp(A)`` (or ``exp(A) M_0`` with ``frame="target"``, ``exp(L) M_0
  exp(A)`` with ``"both"``) with ``A`` free; the inverse ``exp(-A) M_0^{-1}`` comes with it, no
  matrix inversion of the product.
* :class:`PermutationParam` — scores ``S``; the hard permutation is the linear assignment of
  ``S``. ``"ste"``: forward the hard permutation matrix, backward through the Sinkhorn
  relaxation (straight-through). ``"sinkhorn"``: forward the soft doubly stochastic matrix,
  which :meth:`PermutationParam.harden` turns into the assignment before export.

Every module starts exactly at its initial element and stays in its connected component (the
sign of the determinant never changes), which is why learned matching starts from weight
matching's solution (docs/design.md §4). Only the learned matchers use them (:mod:`hf_lmc.learned.trainable`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from hf_lmc.config.options import FRAMES, PERMUTATIONS, LearnOptions, check_orthogonal
from hf_lmc.learned.sharing import RowSharing
from hf_lmc.symmetry.groups import rotary_block
from hf_lmc.utils.linalg import OnesFrame, assign

#: The parameterisation and frame of a map built with none given: learned matching's defaults.
_DEFAULTS = LearnOptions()

#: The trained (relaxed) permutation parameterisations: every entry of ``PERMUTATIONS`` but ``"fixed"``.
PERMUTATION_METHODS = tuple(p for p in PERMUTATIONS if p != "fixed")


def _check_frame(frame: str) -> str:
    """``frame`` itself, or a ``ValueError`` naming the frames of :data:`hf_lmc.config.options.FRAMES`."""
    if frame not in FRAMES:
        raise ValueError(f"unknown frame {frame!r}; choose from {FRAMES}")
    return frame


def _skew(a: Tensor) -> Tensor:
    return a - a.mT


class _Polar(torch.autograd.Function):
    """``Q = U V^T`` from ``M = U S V^T``, with the gradient of the polar factor itself.

    Autograd through ``svd`` is undefined at repeated singular values (e.g. at the identity, the
    natural start), but ``Q`` is smooth wherever ``M`` is invertible: with ``M = Q P``,
    ``dQ = Q Omega`` where ``P Omega + Omega P = Q^T dM - dM^T Q``. Solved in ``P``'s eigenbasis,
    the adjoint is ``grad_M = Q (B - B^T)`` with ``B = V ((V^T Q^T G V) / (s_i + s_j)) V^T``.
    """

    @staticmethod
    def forward(ctx, m: Tensor) -> Tensor:
        u, s, vh = torch.linalg.svd(m)
        q = u @ vh
        ctx.save_for_backward(q, s, vh)
        return q

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        q, s, vh = ctx.saved_tensors
        a = vh @ (q.mT @ grad) @ vh.mT
        b = vh.mT @ (a / (s[:, None] + s[None, :]).clamp_min(torch.finfo(s.dtype).tiny)) @ vh
        return q @ (b - b.mT)


class OrthogonalParam(nn.Module):
    """A trainable orthogonal ``d x d`` map, starting at ``init`` (identity if omitted).

    ``forward(sharing)`` and :meth:`inverse_then` take a
    :class:`~hf_lmc.learned.sharing.RowSharing`: each process then solves for its share of
    the Cayley map's columns (each column its own right-hand side) and an all-gather assembles
    them, so the one ``d x d`` solve of a step is split across the processes, not repeated.
    """

    def __init__(
        self,
        d: int,
        *,
        init: Tensor | None = None,
        method: str = _DEFAULTS.orthogonal,
        fix_ones: bool = False,
        frame: str = _DEFAULTS.frame,
        dtype=torch.float32,
    ):
        super().__init__()
        check_orthogonal(method, frame)
        self.method, self.fix_ones, self.step_frame = method, fix_ones, _check_frame(frame)
        init = torch.eye(d, dtype=dtype) if init is None else init.to(dtype)
        if fix_ones:
            ones = OnesFrame(d, dtype, init.device)
            init = ones.reduce(init)  # the map on 1-perp, in the frame where u is e_1
            # The reflection's vector (zero for d == 1, where H is the identity): a buffer, so it
            # follows the module's moves; not saved, as it is a function of d.
            v = torch.zeros(d, dtype=dtype) if ones.v is None else ones.v
            self.register_buffer("reflection", v, persistent=False)
            # Paths saved before the reflection kept H itself as the buffer "frame": ignored on load.
            self.register_load_state_dict_pre_hook(lambda module, state, prefix, *_: state.pop(prefix + "frame", None))
        n = init.shape[0]
        if method == "polar":
            self.weight = nn.Parameter(init.clone())
        else:
            self.register_buffer("base", init.clone())
            self.weight = nn.Parameter(torch.zeros(n, n, dtype=dtype))
            self.left = nn.Parameter(torch.zeros(n, n, dtype=dtype)) if frame == "both" else None

    def _factor(self, weight: Tensor) -> Tensor:
        return torch.linalg.matrix_exp(_skew(weight))

    def _columns(self, cols: slice) -> Tensor:
        """Columns ``cols`` of the map on the trained space, Cayley's: ``f(A) = (I - A/2)^{-1}
        (I + A/2)``, so a column of ``M_0 f(A)``, ``f(A) M_0`` or ``f(L) M_0 f(A)`` is one solve
        with its own right-hand side.

        Cayley at half the angle: ``I + A + A^2/2 + O(A^3)``, as ``exp(A)``. The plain ``(I -
        A)^{-1} (I + A)`` is ``I + 2A + ...``: per Adam step it turns the whole stream twice as
        far as ``exp``, and trained to a higher barrier than at half the rate
        (docs/decisions.md#d-cayley-residual).
        """
        a = _skew(self.weight) / 2
        eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        if self.step_frame == "target":
            return torch.linalg.solve(eye - a, (eye + a) @ self.base[:, cols])
        inner = self.base @ torch.linalg.solve(eye - a, (eye + a)[:, cols])
        if self.step_frame == "own":
            return inner
        left = _skew(self.left) / 2
        return torch.linalg.solve(eye - left, (eye + left) @ inner)

    def _inner(self, sharing: RowSharing | None = None) -> Tensor:
        """The map on the trained space (``1-perp`` in the reflected frame under ``fix_ones``)."""
        if self.method == "polar":
            return _Polar.apply(self.weight)
        if self.method == "cayley":
            if sharing is None:
                return self._columns(slice(None))
            n = self.weight.shape[0]
            return sharing.gather_rows(self._columns(sharing.rows(n)).mT, n).mT
        factor = self._factor(self.weight)
        if self.step_frame == "own":
            return self.base @ factor
        if self.step_frame == "target":
            return factor @ self.base
        return self._factor(self.left) @ self.base @ factor

    def _outer(self, inner: Tensor) -> Tensor:
        """The ``d x d`` map from the map on the trained space: under ``fix_ones`` ``H diag(1,
        inner) H``, the reflection applied on each side as ``x - 2 v (v^T x)``."""
        if not self.fix_ones:
            return inner
        return OnesFrame(inner.shape[0] + 1, inner.dtype, inner.device, v=self.reflection).expand(inner)

    def forward(self, sharing: RowSharing | None = None) -> Tensor:
        """The orthogonal map; ``sharing`` shares the Cayley solve (a collective: every process calls it)."""
        return self._outer(self._inner(sharing))

    def inverse_then(self, first: OrthogonalParam, sharing: RowSharing | None = None) -> Tensor:
        """``self()^T @ first()``, dual matching's relative residual map, composed on the trained
        space: ``H diag(1, X)^T H H diag(1, Y) H = H diag(1, X^T Y) H``, one ``n^3`` product
        where composing the two ``d x d`` maps takes five. With ``sharing`` each process forms
        its columns of ``X^T Y`` from its columns of ``Y``."""
        if self.fix_ones != first.fix_ones:
            raise ValueError("inverse_then needs two maps of one kind (fix_ones on both or neither)")
        mine = self._inner(sharing)
        if sharing is None or first.method != "cayley":
            return self._outer(mine.mT @ first._inner(sharing))
        n = mine.shape[0]
        share = mine.mT @ first._columns(sharing.rows(n))
        return self._outer(sharing.gather_rows(share.mT, n).mT)


def _matrix_exp(generators: Tensor, sharing: RowSharing | None) -> Tensor:
    """``matrix_exp`` of a batch ``(..., b, b)``; with ``sharing``, each process's share of the
    flattened batch, all-gathered. Each matrix's exponential is computed alone either way."""
    if sharing is None:
        return torch.linalg.matrix_exp(generators)
    flat = generators.flatten(0, -3)
    share = torch.linalg.matrix_exp(flat[sharing.rows(flat.shape[0])])
    return sharing.gather_rows(share, flat.shape[0]).view(generators.shape)


class GLParam(nn.Module):
    """Trainable invertible ``b x b`` maps ``M_0 exp(A)`` and their exact inverses.

    ``init = (M_0, M_0^{-1})`` may carry leading batch dimensions (a layer's KV heads): the
    maps are then trained and returned as one batch, with a single ``matrix_exp`` call per
    forward: on a GPU each call synchronises with the host, so one call per head would stall
    every step (docs/decisions.md#d-batched-head-maps).
    """

    def __init__(
        self, b: int, *, init: tuple[Tensor, Tensor] | None = None, frame: str = _DEFAULTS.frame, dtype=torch.float32
    ):
        super().__init__()
        self.step_frame = _check_frame(frame)
        eye = torch.eye(b, dtype=dtype)
        base, base_inv = (eye, eye) if init is None else (init[0].to(dtype), init[1].to(dtype))
        if base.shape[-2:] != (b, b) or base_inv.shape != base.shape:
            raise ValueError(
                f"GLParam({b}) needs (..., {b}, {b}) maps and inverses of one shape, got {tuple(base.shape)} and {tuple(base_inv.shape)}"
            )
        self.register_buffer("base", base.clone())
        self.register_buffer("base_inv", base_inv.clone())
        self.weight = nn.Parameter(torch.zeros_like(self.base))
        self.left = nn.Parameter(torch.zeros_like(self.base)) if frame == "both" else None

    def forward(self, sharing: RowSharing | None = None) -> tuple[Tensor, Tensor]:
        """``(M, M^-1)``. With ``sharing`` each process takes the exponentials of its share of
        the batch's matrices and an all-gather assembles them (a collective: every process calls it)."""
        generators = [self.weight] if self.left is None else [self.weight, self.left]
        step, step_inv, *left = _matrix_exp(torch.stack([x for g in generators for x in (g, -g)]), sharing).unbind(0)
        if self.step_frame == "own":
            return self.base @ step, step_inv @ self.base_inv
        if self.step_frame == "target":
            return step @ self.base, self.base_inv @ step_inv
        left, left_inv = left
        return left @ self.base @ step, step_inv @ self.base_inv @ left_inv


def sinkhorn(scores: Tensor, temperature: float = 0.1, iterations: int = 20) -> Tensor:
    """A doubly stochastic matrix from ``scores`` by log-domain Sinkhorn normalisation."""
    log = scores / temperature
    for _ in range(iterations):
        log = log - log.logsumexp(dim=1, keepdim=True)
        log = log - log.logsumexp(dim=0, keepdim=True)
    return log.exp()


class PermutationParam(nn.Module):
    """A trainable permutation of ``n`` items as an ``n x n`` matrix ``P`` (``y = P x``).

    ``init`` is a permutation in :class:`~hf_lmc.symmetry.BlockMonomial`'s convention
    (``y[perm[h]] = x[h]``); the scores start at ``scale`` on its entries and 0 elsewhere.
    """

    def __init__(
        self,
        n: int,
        *,
        init: Tensor | None = None,
        method: str = "ste",
        temperature: float = 0.1,
        scale: float = 1.0,
        dtype=torch.float32,
    ):
        super().__init__()
        if method not in PERMUTATION_METHODS:
            raise ValueError(f"unknown permutation parameterisation {method!r}; choose from {PERMUTATION_METHODS}")
        self.method, self.temperature = method, temperature
        perm = torch.arange(n) if init is None else init
        scores = torch.zeros(n, n, dtype=dtype)
        scores[perm, torch.arange(n)] = scale
        self.scores = nn.Parameter(scores)

    def harden(self) -> Tensor:
        """The permutation (``perm[h]`` = where item ``h`` goes) the scores currently select
        (solved on the CPU, returned on the scores' device)."""
        return assign(self.scores.detach()).to(self.scores.device)

    def hard_matrix(self, perm: Tensor | None = None) -> Tensor:
        perm = self.harden() if perm is None else perm
        p = torch.zeros_like(self.scores)
        p[perm.to(p.device), torch.arange(p.shape[1], device=p.device)] = 1.0
        return p

    def forward(self) -> Tensor:
        return self.matrix_and_perm()[0]

    def matrix_and_perm(self) -> tuple[Tensor, Tensor | None]:
        """``P`` and, under the straight-through estimator, the permutation ``P`` equals.

        ``ste``: the forward value is the hard permutation (linear assignment on the scores) and
        the gradient passes straight to the scores (Ainsworth et al.'s estimator, in matrix
        form). ``sinkhorn``: the doubly stochastic matrix, its 20 normalisations recomputed in
        backward rather than stored (each is an ``n x n`` tensor: gigabytes at LLM widths).
        """
        if self.method == "sinkhorn":
            if torch.is_grad_enabled() and self.scores.requires_grad:
                return checkpoint(sinkhorn, self.scores, self.temperature, use_reentrant=False), None
            return sinkhorn(self.scores, self.temperature), None
        perm = self.harden()
        return self.hard_matrix(perm) + (self.scores - self.scores.detach()), perm


class RotaryParam(nn.Module):
    """A trainable QK map that commutes with RoPE: per frequency pair a scale-rotation
    ``exp(log_s) R(theta)``, plus a :class:`GLParam` block on the ``head_dim - rotary_dim``
    pass-through dims. Starts at ``init = (M, M^{-1})`` (which must have that form; leading
    batch dimensions, e.g. a layer's KV heads, train as one batch as in :class:`GLParam`).

    The scale-rotations commute, so the frame does not change them, except that ``"both"``
    adds a second, zero-started copy of ``log_s`` and ``theta`` (summed): as in dual matching,
    where the relative map's angle is the difference of two trained ones.
    """

    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        *,
        init: tuple[Tensor, Tensor] | None = None,
        frame: str = _DEFAULTS.frame,
        dtype=torch.float32,
    ):
        super().__init__()
        half = rotary_dim // 2
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        if init is None:
            init = (torch.eye(head_dim, dtype=dtype), torch.eye(head_dim, dtype=dtype))
        m, m_inv = (x.to(dtype) for x in init)
        idx = torch.arange(half)
        cos_part, sin_part = m[..., idx, idx], m[..., idx + half, idx]
        self.log_scales = nn.Parameter(torch.log(torch.hypot(cos_part, sin_part)))
        self.angles = nn.Parameter(torch.atan2(sin_part, cos_part))
        both = frame == "both"
        self.left_log_scales = nn.Parameter(torch.zeros_like(self.log_scales)) if both else None
        self.left_angles = nn.Parameter(torch.zeros_like(self.angles)) if both else None
        rest = slice(rotary_dim, head_dim)
        self.passthrough = (
            GLParam(head_dim - rotary_dim, init=(m[..., rest, rest], m_inv[..., rest, rest]), frame=frame, dtype=dtype)
            if head_dim > rotary_dim
            else None
        )

    def forward(self, sharing: RowSharing | None = None) -> tuple[Tensor, Tensor]:
        """``(M, M^-1)``; ``sharing`` shares the pass-through block's exponentials (:class:`GLParam`)."""
        passthrough = self.passthrough(sharing) if self.passthrough is not None else None
        log_scales, angles = self.log_scales, self.angles
        if self.left_angles is not None:
            log_scales, angles = log_scales + self.left_log_scales, angles + self.left_angles
        return rotary_block(log_scales.exp(), angles, self.rotary_dim, self.head_dim, passthrough)
