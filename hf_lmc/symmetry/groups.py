"""Group elements that act on the axes of canonical tensors.

Every symmetry ``hf_lmc`` uses is a *block-monomial* map: a permutation of ``n`` blocks
composed with one invertible ``b x b`` matrix per block,

    y[perm[h]] = blocks[h] @ x[h]          (h = 0 .. n-1)

The residual rotation is the case ``n = 1, b = d``; an MLP permutation with per-neuron
scales is ``b = 1``; attention heads are ``n = heads, b = head_dim``. Tensors carry an axis
of such a space in one of three roles:

* ``vector``   (something *written* into the space):  ``x <- T x``
* ``covector`` (something that *reads* the space):    ``xi <- T^{-T} xi``
* ``permute``  (only the permutation part acts; SwiGLU's gate, which cannot be scaled)

All functions are pure and differentiable in ``blocks``: learned matching backpropagates
through exactly the code that export runs under ``no_grad``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from hf_lmc.utils.linalg import assign

if TYPE_CHECKING:
    from hf_lmc.canonical.spec import ArchSpec

#: How far from its group an element may be and still count as in it (saved transforms are
#: checked on load: :func:`hf_lmc.symmetry.load_transforms`), on each check's scale-free
#: measure: ``max |B B^-1 - I|`` for a block and its stored inverse, ``max |O^T O - I|`` for the
#: residual map, ``max |s - 1|`` for a unit scale that must be 1, and so on. Not relative to the
#: stored dtype's eps: learned matching computes its elements in float32 and hardens them to
#: float64, so a float64 file may carry float32 rounding, and a float32 product over ``n`` terms
#: rounds by at most about ``n * eps(float32)``; this is that bound at ``n = 8192`` (LLaMA-2-70B's
#: residual width), ``2**-10 = 9.8e-4`` (docs/decisions.md#d-symmetry-tolerance). An edited map, a
#: split GQA group or a scaled GELU unit is off by far more; half precision (whose rounding is this
#: size or larger) is refused by its dtype.
SYMMETRY_TOLERANCE = 8192 * torch.finfo(torch.float32).eps

#: The dtypes a group element's matrices may be stored in: rounding to half precision breaks
#: the symmetry (a map and its stored inverse no longer cancel).
ELEMENT_DTYPES = (torch.float32, torch.float64)


def _apply_blocks(
    t: Tensor,
    axis: int,
    n: int,
    mats: Tensor | None,
    source: Tensor | None,
    transpose: bool,
    rows: slice | None = None,
    dense: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Act on ``t`` along ``axis`` (size ``n*b``) with per-block ``mats``, then permute the blocks:
    block ``h`` of the result is block ``source[h]`` (``source = argsort(perm)``; ``None``: the
    blocks stay in order, no gather). ``rows`` (``axis`` 0 only): those rows of the result alone,
    at their share of the cost (:func:`_block_rows`). ``dense`` (``n = 1``): :func:`_dense_factors`
    of ``mats``, made once by the caller for the many tensors one map moves."""
    if rows is not None:
        return _block_rows(t, n, mats, source, transpose, rows, dense)
    if n == 1:  # one dense block (the residual map): a plain matmul, no permutation to apply
        if mats is None:
            return t
        left, right = dense if dense is not None else _dense_factors(mats, transpose)
        if t.dim() == 2 and axis == 0:  # rows: multiply from the left, the result stays contiguous
            return left.to(dtype=t.dtype, device=t.device) @ t
        return (t.movedim(axis, -1) @ right.to(dtype=t.dtype, device=t.device)).movedim(-1, axis)
    if mats is not None and mats.shape[-1] == 1:  # scalar blocks (MLP units): scale, then gather
        scale = mats.reshape(-1).to(dtype=t.dtype, device=t.device)
        shape = [1] * t.dim()
        shape[axis] = -1
        t = t * scale.reshape(shape)  # a 1 x 1 block is its own transpose
        mats = None
    if mats is None:  # a pure block permutation: one gather along the axis, no moved copies
        if source is None:
            return t
        b = t.shape[axis] // n
        source = source.to(t.device)  # y[perm[h]] = x[h]  <=>  y = x[argsort(perm)]
        index = source if b == 1 else (source[:, None] * b + torch.arange(b, device=t.device)).reshape(-1)
        return t.index_select(axis, index)
    mats = mats.to(dtype=t.dtype, device=t.device)
    if (
        axis == 0 and t.is_contiguous()
    ):  # rows (weights' output axis, biases): a batched matmul on a view, its result in place
        y = torch.bmm(mats.mT if transpose else mats, t.reshape(n, t.shape[0] // n, -1))
        if source is not None:
            y = y.index_select(0, source.to(y.device))
        return y.reshape(t.shape)
    x = t.movedim(axis, -1)
    lead = x.shape[:-1]
    x = x.reshape(*lead, n, -1)
    # vector: y_h = M_h x_h ; covector passes M^{-1} with transpose=True: y_h = M_h^{-T} x_h
    x = torch.einsum("...hb,hcb->...hc", x, mats) if not transpose else torch.einsum("...hb,hbc->...hc", x, mats)
    if source is not None:
        x = x.index_select(-2, source.to(x.device))
    return x.reshape(*lead, -1).movedim(-1, axis)


def _dense_factors(mats: Tensor, transpose: bool) -> tuple[Tensor, Tensor]:
    """One dense block's matrix ``M`` as it acts (``mats[0]``, or its transpose where
    ``transpose``) and ``M^T``, both contiguous: the left factor of a product over axis 0 and the
    right factor over any other. Contiguous because a product's rounding may depend on its
    operands' layout (BLAS kernels differ by CPU), and a loaded map must act bit for bit as the
    saved one. Views of ``mats`` where already contiguous (their gradient a view too: ``mats[0]``'s
    is a zero-filled copy), else copies."""
    m = mats.squeeze(0)
    acting = m.T if transpose else m
    return acting.contiguous(), acting.T.contiguous()


def _block_rows(
    t: Tensor,
    n: int,
    mats: Tensor | None,
    source: Tensor | None,
    transpose: bool,
    rows: slice,
    dense: tuple[Tensor, Tensor] | None = None,
) -> Tensor:
    """Rows ``rows`` of :func:`_apply_blocks` along axis 0, reading only the input rows they
    depend on: a slice of the dense matrix times ``t``, or the few blocks ``source`` sends
    there. A sharded build (:mod:`hf_lmc.learned.sharing`) computes each process's rows so."""
    start, stop, _ = rows.indices(t.shape[0])
    flat = t.reshape(t.shape[0], -1)
    if n == 1:
        if mats is None:
            return t[start:stop]
        left = (dense if dense is not None else _dense_factors(mats, transpose))[0]
        return (left[start:stop].to(dtype=t.dtype, device=t.device) @ flat).reshape(-1, *t.shape[1:])
    b = t.shape[0] // n
    first, last = start // b, -(-stop // b)  # the output blocks the rows touch
    blocks = flat.reshape(n, b, -1)
    if source is None:
        index, x = slice(first, last), blocks[first:last]
    else:
        index = source[first:last].to(t.device)
        x = blocks.index_select(0, index)
    if mats is not None and mats.shape[-1] == 1:  # scalar blocks: scale each unit
        x = x * mats.reshape(-1)[index].to(dtype=t.dtype, device=t.device)[:, None, None]
    elif mats is not None:
        m = mats[index].to(dtype=t.dtype, device=t.device)
        x = torch.bmm(m.mT if transpose else m, x)
    offset = first * b
    return x.reshape(-1, *t.shape[1:])[start - offset : stop - offset]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _floating_defect(name: str, t: Tensor) -> str | None:
    """Why ``t`` cannot hold a group element's matrices or scales (not float32 or float64, or not
    finite), or ``None``."""
    if t.dtype not in ELEMENT_DTYPES:
        if t.is_floating_point():
            return f"{name} is {_dtype_name(t.dtype)}: rounding to it breaks the symmetry (float32 or float64 only)"
        return f"{name} is {_dtype_name(t.dtype)}, not float32 or float64"
    if not bool(torch.isfinite(t).all()):
        return f"{name} holds NaN or infinite values"
    return None


def _permutation_defect(name: str, perm: Tensor) -> str | None:
    """Why ``perm`` is not a permutation of ``0 .. n-1`` (an integer tensor holding each index
    once), or ``None``."""
    if perm.is_floating_point() or perm.is_complex() or perm.dtype == torch.bool:
        return f"{name} is {_dtype_name(perm.dtype)}, not an integer type"
    n = perm.numel()
    flat = perm.reshape(-1).long()
    outside = flat[(flat < 0) | (flat >= n)]
    if outside.numel():
        return f"{name} holds {int(outside[0])}, outside 0..{n - 1}: not a permutation"
    counts = torch.bincount(flat, minlength=n)
    if bool((counts != 1).any()):
        index = int(torch.nonzero(counts != 1)[0])
        return f"{name} is not a permutation ({index} appears {int(counts[index])} times)"
    return None


def _is_identity(perm: Tensor) -> bool:
    return torch.equal(perm.long(), torch.arange(perm.numel(), device=perm.device))


def _deviation(a: Tensor, b: Tensor) -> float:
    """``max |a - b|``, in float64."""
    return float((a.double() - b.double().to(a.device)).abs().max()) if a.numel() else 0.0


def _beyond(what: str, measure: str, error: float, tolerance: float) -> str | None:
    """``what``, with the measured ``error`` and the ``tolerance``, where the error exceeds it."""
    return f"{what} ({measure} = {error:.2g}, tolerance {tolerance:.1e})" if error > tolerance else None


def _unit_scale_defect(name: str, scale: Tensor, spec: ArchSpec, tolerance: float) -> str | None:
    """Why per-unit scales ``scale`` leave an MLP's group: a gated (SwiGLU) MLP's units take any
    non-zero scale, the sign included; a non-gated MLP's (GELU, not positively homogeneous)
    none, so every scale must be 1."""
    s = scale.double().reshape(-1)
    if spec.gated_mlp:
        return None if bool((s != 0).all()) else f"{name} scales a unit by 0 (not invertible)"
    return _beyond(
        f"{name} scales the units of a non-gated MLP, whose activation (GELU) is not positively "
        "homogeneous: they may only be permuted",
        "max |s - 1|",
        _deviation(s, torch.ones_like(s)),
        tolerance,
    )


def _permutation_matrix_defect(name: str, matrix: Tensor, perm: Tensor, given: bool, tolerance: float) -> str | None:
    """Why ``matrix`` is not the matrix of ``perm``: ``P[perm[h], h] = 1`` and 0 elsewhere (``y =
    P x`` sends ``x[h]`` to ``y[perm[h]]``, as :meth:`BlockMonomial.dense` writes it), measured
    without building ``P`` (an MLP's is ``F x F``). ``given``: ``perm`` is stored beside it
    (straight-through), else it is the assignment nearest ``matrix``."""
    at = (perm.long().to(matrix.device), torch.arange(perm.numel(), device=matrix.device))
    ones = matrix[at].double()
    rest = matrix.abs().index_put_(at, torch.zeros((), dtype=matrix.dtype, device=matrix.device))
    error = max(_deviation(ones, torch.ones_like(ones)), float(rest.max()))
    what = f"{name} is not the matrix of perm" if given else f"{name} is not a permutation matrix"
    return _beyond(what, "max |P - P_perm|", error, tolerance)


def _rotary_defect(name: str, blocks: Tensor, rotary_dim: int, tolerance: float) -> str | None:
    """Why QK ``blocks`` (..., dh, dh) do not commute with RoPE: each is compared with the map of
    :func:`rotary_block` read off its own entries (a frequency pair's
    ``a = M[i, i]``, ``b = M[i + r/2, i]``, its pass-through block as it is), relative to its
    largest entry."""

    m = blocks.double()
    dh, half = m.shape[-1], rotary_dim // 2
    pairs = torch.arange(half, device=m.device)
    a, b = m[..., pairs, pairs], m[..., pairs + half, pairs]
    rest = slice(rotary_dim, dh)
    passthrough = (m[..., rest, rest], m[..., rest, rest]) if dh > rotary_dim else None
    nearest, _ = rotary_block(torch.hypot(a, b), torch.atan2(b, a), rotary_dim, dh, passthrough)
    error = float(((m - nearest).abs() / m.abs().amax(dim=(-2, -1), keepdim=True)).max())
    return _beyond(
        f"{name} do not commute with RoPE (each frequency pair's block must be a scale-rotation "
        "[[a, -b], [b, a]], with no cross terms)",
        "max |M - M_rope| / max |M|",
        error,
        tolerance,
    )


def rotary_block(
    scales: Tensor, angles: Tensor, rotary_dim: int, head_dim: int, passthrough: tuple[Tensor, Tensor] | None
):
    """A QK map that commutes with every RoPE rotation, and its inverse.

    Per frequency pair ``(i, i + r/2)`` (HF ``rotate_half`` pairing) a scaled rotation
    ``s [[cos, -sin], [sin, cos]]``; the ``head_dim - r`` pass-through dims get their own
    invertible block (``passthrough = (M, M^{-1})``); no cross terms. Leading dimensions of
    ``scales`` and ``angles`` (``(..., r/2)``) and of the pass-through blocks give a batch of maps.
    """
    half = rotary_dim // 2
    m = torch.zeros(*scales.shape[:-1], head_dim, head_dim, dtype=scales.dtype, device=scales.device)
    inv = torch.zeros_like(m)
    idx = torch.arange(half, device=scales.device)
    pair = idx + half
    a, b = scales * torch.cos(angles), scales * torch.sin(angles)
    ia, ib = torch.cos(angles) / scales, -torch.sin(angles) / scales
    for mat, (p, q) in ((m, (a, b)), (inv, (ia, ib))):
        mat[..., idx, idx], mat[..., idx, pair] = p, -q
        mat[..., pair, idx], mat[..., pair, pair] = q, p
    if passthrough is not None:
        m[..., rotary_dim:, rotary_dim:], inv[..., rotary_dim:, rotary_dim:] = passthrough
    return m, inv


@dataclass(frozen=True)
class BlockMonomial:
    """``y[perm[h]] = blocks[h] @ x[h]``: a block permutation times per-block invertible maps.

    ``blocks``: (n, b, b); ``inverse_blocks``: (n, b, b), the exact inverses (kept, not
    recomputed, so orthogonal maps invert by transposition with no rounding). ``ordered``
    declares ``perm`` the identity, so moving a tensor skips the gather (and its backward): a
    learned transform whose assignments stay fixed has them applied to the stored model once
    (:meth:`split`) and trains in-order maps.
    """

    perm: Tensor
    blocks: Tensor
    inverse_blocks: Tensor
    ordered: bool = False

    @functools.cached_property
    def source(self) -> Tensor | None:
        """``argsort(perm)``, the gather index (``y = x[source]``; ``None`` when ordered): computed
        once per element, not once per tensor it moves (each is a kernel launch, and a training
        step moves every tensor). :meth:`Transform.prepare` computes it ahead of checkpointed layers."""
        return None if self.ordered else torch.argsort(self.perm)

    @functools.cached_property
    def _dense(self) -> tuple[Tensor, Tensor] | None:
        """One dense block's :func:`_dense_factors` as a vector moves (``blocks``): made once per
        element, not once per tensor it moves (the residual map moves every weight, and each
        transposed factor is a ``d x d`` copy). ``None`` for more blocks than one."""
        return _dense_factors(self.blocks, False) if self.num_blocks == 1 else None

    @functools.cached_property
    def _dense_inverse(self) -> tuple[Tensor, Tensor] | None:
        """The same as a covector moves (``inverse_blocks``, transposed)."""
        return _dense_factors(self.inverse_blocks, True) if self.num_blocks == 1 else None

    def prepare(self) -> None:
        self.source  # noqa: B018 - computes the cached properties
        self._dense  # noqa: B018
        self._dense_inverse  # noqa: B018

    @property
    def num_blocks(self) -> int:
        return self.perm.numel()

    @property
    def block_size(self) -> int:
        return self.blocks.shape[-1]

    @staticmethod
    def identity(n: int, b: int, dtype=torch.float64, device=None) -> BlockMonomial:
        eye = torch.eye(b, dtype=dtype, device=device).expand(n, b, b).clone()
        return BlockMonomial(torch.arange(n, device=device), eye, eye.clone())

    @staticmethod
    def orthogonal(matrix: Tensor) -> BlockMonomial:
        """A single dense orthogonal block (the residual stream's map)."""
        return BlockMonomial(torch.zeros(1, dtype=torch.long, device=matrix.device), matrix[None], matrix.mT[None])

    @staticmethod
    def permutation(perm: Tensor, dtype=torch.float64) -> BlockMonomial:
        """A pure permutation of scalar coordinates."""
        ones = torch.ones(perm.numel(), 1, 1, dtype=dtype, device=perm.device)
        return BlockMonomial(perm, ones, ones.clone())

    @staticmethod
    def scaled_permutation(perm: Tensor, scale: Tensor) -> BlockMonomial:
        """``y[perm[h]] = scale[h] x[h]`` (SwiGLU neurons: permutation x non-zero scaling, sign included)."""
        return BlockMonomial(perm, scale[:, None, None], (1.0 / scale)[:, None, None])

    def dense(self) -> Tensor:
        """The (n*b, n*b) matrix of the map; for tests and small spaces only."""
        n, b = self.num_blocks, self.block_size
        eye = torch.eye(n * b, dtype=self.blocks.dtype, device=self.blocks.device)
        return _apply_blocks(eye, 0, n, self.blocks, self.source, transpose=False)

    def compose(self, first: BlockMonomial) -> BlockMonomial:
        """``self o first``: apply ``first``, then ``self``."""
        perm = self.perm[first.perm]
        blocks = self.blocks[first.perm] @ first.blocks
        inverse = first.inverse_blocks @ self.inverse_blocks[first.perm]
        return BlockMonomial(perm, blocks, inverse, self.ordered and first.ordered)

    def inverse(self) -> BlockMonomial:
        inv = torch.argsort(self.perm)
        return BlockMonomial(inv, self.inverse_blocks[inv], self.blocks[inv], self.ordered)

    def split(self) -> tuple[BlockMonomial, BlockMonomial]:
        """``(in_order, assignment)`` with ``self = in_order o assignment``: the pure permutation,
        then the blocks where it put them (block ``perm[h]`` of ``in_order`` is ``blocks[h]``)."""
        eye = torch.eye(self.block_size, dtype=self.blocks.dtype, device=self.blocks.device).expand_as(self.blocks)
        source = torch.argsort(self.perm)
        order = torch.arange(self.num_blocks, device=self.perm.device)
        return BlockMonomial(order, self.blocks[source], self.inverse_blocks[source], ordered=True), BlockMonomial(
            self.perm, eye, eye
        )

    def expand(self, group: Tensor, perm: Tensor, ordered: bool = False) -> BlockMonomial:
        """Repeat block ``group[h]`` at block ``h`` under a finer permutation ``perm``.

        Used for GQA: one QK/OV map per KV head, shared by every query head of its group.
        """
        return BlockMonomial(perm, self.blocks[group], self.inverse_blocks[group], ordered)

    def vector(self, t: Tensor, axis: int, rows: slice | None = None) -> Tensor:
        return _apply_blocks(t, axis, self.num_blocks, self.blocks, self.source, False, rows, self._dense)

    def covector(self, t: Tensor, axis: int, rows: slice | None = None) -> Tensor:
        return _apply_blocks(
            t, axis, self.num_blocks, self.inverse_blocks, self.source, True, rows, self._dense_inverse
        )

    def permute(self, t: Tensor, axis: int, rows: slice | None = None) -> Tensor:
        return _apply_blocks(t, axis, self.num_blocks, None, self.source, False, rows)

    def to(self, dtype=None, device=None) -> BlockMonomial:
        return BlockMonomial(
            self.perm.to(device=device),
            self.blocks.to(dtype=dtype, device=device),
            self.inverse_blocks.to(dtype=dtype, device=device),
            self.ordered,
        )

    def defect(self, tolerance: float = SYMMETRY_TOLERANCE, name: str = "") -> str | None:
        """Why this is not a block-monomial map, or ``None``: ``perm`` must be a permutation (the
        identity where ``ordered``), ``blocks`` and ``inverse_blocks`` float32 or float64 and
        finite, and each inverse block its block's inverse (``max |B B^-1 - I|`` within
        ``tolerance``). ``name`` prefixes the parts' names in the reason (``"qk."``)."""
        return self._parts_defect(name) or self._inverse_defect(tolerance, name)

    def _parts_defect(self, name: str) -> str | None:
        defect = _permutation_defect(f"{name}perm", self.perm)
        if defect is None and self.ordered and not _is_identity(self.perm):
            defect = f"{name}perm is not the identity, though the element is stored as ordered"
        return (
            defect
            or _floating_defect(f"{name}blocks", self.blocks)
            or _floating_defect(f"{name}inverse_blocks", self.inverse_blocks)
        )

    def _inverse_defect(self, tolerance: float, name: str) -> str | None:
        product = self.blocks.double() @ self.inverse_blocks.double()
        eye = torch.eye(self.block_size, dtype=torch.float64, device=product.device)
        return _beyond(
            f"{name}inverse_blocks are not the blocks' inverses",
            "max |B B^-1 - I|",
            _deviation(product, eye),
            tolerance,
        )


@dataclass(frozen=True)
class ResidualMap:
    """Residual-stream map: one dense orthogonal (or permutation) matrix on R^d.

    Writers transform as vectors, readers as covectors (``O^{-T} = O``). For LayerNorm models
    the map must fix ``u = 1/sqrt(d)`` so that the stream stays in ``1-perp``.
    """

    map: BlockMonomial

    ROLES = ("out", "in")

    @staticmethod
    def from_matrix(matrix: Tensor) -> ResidualMap:
        return ResidualMap(BlockMonomial.orthogonal(matrix))

    @property
    def matrix(self) -> Tensor:
        """The d x d matrix ``O`` (a residual map is always a single dense block)."""
        return self.map.blocks[0]

    def act(self, t: Tensor, axis: int, role: str, rows: slice | None = None) -> Tensor:
        return self.map.vector(t, axis, rows) if role == "out" else self.map.covector(t, axis, rows)

    def compose(self, first: ResidualMap) -> ResidualMap:
        return ResidualMap(self.map.compose(first.map))

    def inverse(self) -> ResidualMap:
        return ResidualMap(self.map.inverse())

    def split(self) -> tuple[ResidualMap, None]:
        """One dense block: no assignment to split off."""
        return self, None

    def prepare(self) -> None:
        self.map.prepare()

    def to(self, dtype=None, device=None) -> ResidualMap:
        return ResidualMap(self.map.to(dtype, device))

    def defect(self, spec: ArchSpec, tolerance: float = SYMMETRY_TOLERANCE) -> str | None:
        """Why this is not a residual map of ``spec``'s models, or ``None``: one orthogonal block
        (every norm of the canonical form is a unit RMSNorm, and ``n(O x) = O n(x)`` needs ``|O x|
        = |x|``) with its inverse (:meth:`BlockMonomial.defect`'s parts), which for a LayerNorm
        model (``spec.centred``) keeps the centred stream in ``1-perp``: ``O u = +-u`` for ``u =
        1/sqrt(d)``. Measures and ``tolerance`` as :data:`SYMMETRY_TOLERANCE` says."""
        defect = self.map._parts_defect("map.")
        if defect is not None:
            return defect
        o = self.matrix.double()
        eye = torch.eye(o.shape[0], dtype=torch.float64, device=o.device)
        defect = _beyond("the residual map is not orthogonal", "max |O^T O - I|", _deviation(o.mT @ o, eye), tolerance)
        if defect is None and not torch.equal(self.map.inverse_blocks[0], self.map.blocks[0].mT):
            defect = self.map._inverse_defect(tolerance, "map.")  # stored apart (a transposed one: checked above)
        if defect is None and spec.centred:
            u = torch.full((o.shape[0],), o.shape[0] ** -0.5, dtype=torch.float64, device=o.device)
            image = o @ u
            sign = 1.0 if float(image @ u) >= 0 else -1.0
            defect = _beyond(
                "the residual map does not keep a LayerNorm model's centred stream in 1-perp (it must send u = "
                "1/sqrt(d) to +-u)",
                "|O u -+ u|",
                float((image - sign * u).norm()),
                tolerance,
            )
        return defect


@dataclass(frozen=True)
class MlpMap:
    """MLP hidden units: permutation, times per-neuron scaling of ``up`` for SwiGLU (any non-zero
    factor: ``(up, down) -> (-up, -down)`` is a symmetry too).

    ``up`` rows are vectors, ``down`` columns covectors, ``gate`` rows only permute
    (SiLU is not positively homogeneous).
    """

    map: BlockMonomial

    ROLES = ("up", "gate", "down")

    def act(self, t: Tensor, axis: int, role: str, rows: slice | None = None) -> Tensor:
        if role == "up":
            return self.map.vector(t, axis, rows)
        if role == "gate":
            return self.map.permute(t, axis, rows)
        return self.map.covector(t, axis, rows)

    def compose(self, first: MlpMap) -> MlpMap:
        return MlpMap(self.map.compose(first.map))

    def inverse(self) -> MlpMap:
        return MlpMap(self.map.inverse())

    def split(self) -> tuple[MlpMap, MlpMap]:
        """``(scales in order, unit permutation)``: see :meth:`BlockMonomial.split`."""
        in_order, assignment = self.map.split()
        return MlpMap(in_order), MlpMap(assignment)

    def prepare(self) -> None:
        self.map.prepare()

    def to(self, dtype=None, device=None) -> MlpMap:
        return MlpMap(self.map.to(dtype, device))

    def defect(self, spec: ArchSpec, tolerance: float = SYMMETRY_TOLERANCE) -> str | None:
        """Why this is not an MLP map of ``spec``'s models, or ``None``: a unit permutation with
        per-unit scales (:meth:`BlockMonomial.defect`), scales that only a gated (SwiGLU) MLP may
        set to other than 1."""
        return self.map.defect(tolerance, "map.") or _unit_scale_defect("map.blocks", self.map.blocks, spec, tolerance)


@dataclass(frozen=True)
class AttentionMap:
    """One attention layer: head permutation (GQA-aware) with per-KV-head QK and OV maps.

    ``qk`` and ``ov`` act on KV heads and share their permutation; ``query_perm`` permutes
    query heads and must send every query head of KV group ``g`` into group ``perm[g]``.
    Query rows are QK vectors, key rows QK covectors (so ``q.k`` is unchanged), value rows
    OV vectors and output-projection columns OV covectors.
    """

    qk: BlockMonomial
    ov: BlockMonomial
    query_perm: Tensor
    ordered: bool = False  # query_perm (and so qk's and ov's perm) is the identity: no gathers

    ROLES = ("q", "k", "v", "o")

    @property
    def group_size(self) -> int:
        return self.query_perm.numel() // self.qk.num_blocks

    def _query_level(self, kv_map: BlockMonomial) -> BlockMonomial:
        if self.group_size == 1:  # one query head per KV head: the same blocks (no gather, nor its backward)
            return BlockMonomial(self.query_perm, kv_map.blocks, kv_map.inverse_blocks, self.ordered)
        group = torch.arange(self.query_perm.numel(), device=self.query_perm.device) // self.group_size
        return kv_map.expand(group, self.query_perm, self.ordered)

    @functools.cached_property
    def _query_qk(self) -> BlockMonomial:  # queries' weights and biases share it: built once
        return self._query_level(self.qk)

    @functools.cached_property
    def _query_ov(self) -> BlockMonomial:
        return self._query_level(self.ov)

    def prepare(self) -> None:
        for monomial in (self.qk, self.ov, self._query_qk, self._query_ov):
            monomial.prepare()

    def act(self, t: Tensor, axis: int, role: str, rows: slice | None = None) -> Tensor:
        if role == "q":
            return self._query_qk.vector(t, axis, rows)
        if role == "k":
            return self.qk.covector(t, axis, rows)
        if role == "v":
            return self.ov.vector(t, axis, rows)
        return self._query_ov.covector(t, axis, rows)

    def compose(self, first: AttentionMap) -> AttentionMap:
        ordered = self.ordered and first.ordered
        return AttentionMap(
            self.qk.compose(first.qk), self.ov.compose(first.ov), self.query_perm[first.query_perm], ordered
        )

    def inverse(self) -> AttentionMap:
        return AttentionMap(self.qk.inverse(), self.ov.inverse(), torch.argsort(self.query_perm), self.ordered)

    def split(self) -> tuple[AttentionMap, AttentionMap]:
        """``(per-head maps in order, head order)``: see :meth:`BlockMonomial.split`. Query heads
        go where ``query_perm`` sends them, each with its KV head (GQA keeps groups whole)."""
        (qk, qk_order), (ov, ov_order) = self.qk.split(), self.ov.split()
        heads = torch.arange(self.query_perm.numel(), device=self.query_perm.device)
        return AttentionMap(qk, ov, heads, ordered=True), AttentionMap(qk_order, ov_order, self.query_perm)

    def to(self, dtype=None, device=None) -> AttentionMap:
        return AttentionMap(
            self.qk.to(dtype, device), self.ov.to(dtype, device), self.query_perm.to(device=device), self.ordered
        )

    def defect(self, spec: ArchSpec, tolerance: float = SYMMETRY_TOLERANCE, name: str = "") -> str | None:
        """Why this is not an attention map of ``spec``'s models, or ``None``: per-KV-head QK and
        OV maps (:meth:`BlockMonomial.defect`) that share their KV permutation; ``query_perm`` a
        permutation (the identity where ``ordered``) that sends every query head of KV group ``g``
        into group ``perm[g]`` (GQA: a query head stays with its KV head); under RoPE
        (``spec.rotary_dim``), QK maps that commute with every rotary angle. Any invertible OV
        map, and QK map without RoPE, is in the group. ``name`` prefixes the parts' names."""
        defect = (
            _permutation_defect(f"{name}query_perm", self.query_perm)
            or self.qk.defect(tolerance, f"{name}qk.")
            or self.ov.defect(tolerance, f"{name}ov.")
        )
        if defect is not None:
            return defect
        if not torch.equal(self.qk.perm.long(), self.ov.perm.long()):
            return f"{name}qk.perm and {name}ov.perm differ (a KV head's QK and OV maps move with it)"
        if self.ordered and not _is_identity(self.query_perm):
            return f"{name}query_perm is not the identity, though the element is stored as ordered"
        g = self.group_size
        kv_head = torch.arange(self.query_perm.numel(), device=self.query_perm.device) // g
        group, kv_group = self.query_perm.long() // g, self.qk.perm.long()[kv_head]
        split = torch.nonzero(group != kv_group)
        if split.numel():
            q = int(split[0])
            return (
                f"{name}query_perm splits query heads from their KV heads: query head {q} goes to group "
                f"{int(group[q])}, its KV head {q // g} to {int(kv_group[q])}"
            )
        return (
            _rotary_defect(f"{name}qk.blocks", self.qk.blocks, spec.rotary_dim, tolerance) if spec.rotary_dim else None
        )


@dataclass(frozen=True)
class DenseMlpMap:
    """MLP units mixed by a dense ``n x n`` matrix ``P`` (``y = P x``), with per-unit scales.

    The trainable form of :class:`MlpMap` for learned matching: ``P`` comes from
    :class:`~hf_lmc.learned.params.PermutationParam` (a hard permutation matrix in the forward
    pass under the straight-through estimator, a doubly stochastic one under Sinkhorn). ``up``
    rows get ``P (s x)``, ``gate`` rows ``P x`` and ``down`` columns ``P (x / s)``, which is the
    exact symmetry whenever ``P`` is a permutation matrix. :meth:`harden` gives the
    :class:`MlpMap` that export applies.
    """

    matrix: Tensor
    scale: Tensor
    perm: Tensor | None = None  # set when ``matrix`` *is* this permutation's matrix (straight-through)

    ROLES = ("up", "gate", "down")

    def act(self, t: Tensor, axis: int, role: str, rows: slice | None = None) -> Tensor:
        x = t.movedim(axis, 0)
        shape = x.shape
        x = x.reshape(shape[0], -1)
        scale = self.scale.to(dtype=x.dtype, device=x.device)[:, None]
        if role == "up":
            x = x * scale
        elif role == "down":
            x = x / scale
        if rows is not None:  # axis 0: those rows of P x alone
            return _mixed_rows(x, self.matrix, self.perm, 1, rows).reshape(-1, *shape[1:])
        matrix = self.matrix.to(dtype=x.dtype, device=x.device)
        y = _HardPermute.apply(x, matrix, self.perm.to(x.device)) if self.perm is not None else matrix @ x
        return y.reshape(shape).movedim(0, axis)

    def harden(self) -> MlpMap:
        """The permutation ``P`` is (or is closest to: linear assignment), with the same scales."""
        perm = self.perm if self.perm is not None else assign(self.matrix.detach()).to(self.matrix.device)
        return MlpMap(BlockMonomial.scaled_permutation(perm, self.scale.detach().double()))

    def compose(self, first) -> MlpMap:
        raise TypeError("a DenseMlpMap is a training-time relaxation; harden() it before composing")

    def split(self):
        raise TypeError("a DenseMlpMap is a training-time relaxation; harden() it before splitting")

    def inverse(self) -> MlpMap:
        raise TypeError("a DenseMlpMap is a training-time relaxation; harden() it before inverting")

    def prepare(self) -> None:
        pass  # nothing cached

    def to(self, dtype=None, device=None) -> DenseMlpMap:
        perm = self.perm.to(device=device) if self.perm is not None else None
        return DenseMlpMap(self.matrix.to(dtype=dtype, device=device), self.scale.to(dtype=dtype, device=device), perm)

    def defect(self, spec: ArchSpec, tolerance: float = SYMMETRY_TOLERANCE) -> str | None:
        """Why this relaxation does not act as an element of the MLP's group, or ``None``:
        ``matrix`` must be a permutation matrix (that of ``perm`` where it is given:
        straight-through), ``scale`` finite unit scales of :meth:`MlpMap.defect`'s kind."""
        defect = _floating_defect("matrix", self.matrix) or _floating_defect("scale", self.scale)
        if defect is None and self.perm is not None:
            defect = _permutation_defect("perm", self.perm)
        return (
            defect
            or _permutation_matrix_defect(
                "matrix", self.matrix, self.harden().map.perm, self.perm is not None, tolerance
            )
            or _unit_scale_defect("scale", self.scale, spec, tolerance)
        )


@dataclass(frozen=True)
class DenseAttentionMap:
    """KV groups reordered by a ``kv x kv`` matrix ``P`` after their per-head maps.

    The trainable form of :class:`AttentionMap` for learned matching: ``heads`` holds the
    per-KV-head QK / OV maps (identity KV permutation) and a query permutation that stays inside
    each group (under GQA, which query head of a group plays which part; fixed), ``matrix`` the
    order of the KV groups as in :class:`DenseMlpMap` (``perm`` set when it is exactly that
    permutation's matrix: straight-through). A group's query heads are contiguous, so ``P``
    moves them with their KV head. :meth:`harden` gives the exact element.
    """

    heads: AttentionMap
    matrix: Tensor
    perm: Tensor | None = None

    ROLES = AttentionMap.ROLES

    def act(self, t: Tensor, axis: int, role: str, rows: slice | None = None) -> Tensor:
        x = self.heads.act(t, axis, role).movedim(axis, 0)
        shape = x.shape
        if rows is not None:  # axis 0: the per-head maps on every row (a head_dim / d share), the mix on ``rows``
            flat = x.reshape(shape[0], -1)
            return _mixed_rows(flat, self.matrix, self.perm, shape[0] // self.matrix.shape[0], rows).reshape(
                -1, *shape[1:]
            )
        x = x.reshape(self.matrix.shape[0], -1)  # one row of (head_dim x rest) per head
        matrix = self.matrix.to(dtype=x.dtype, device=x.device)
        y = _HardPermute.apply(x, matrix, self.perm.to(x.device)) if self.perm is not None else matrix @ x
        return y.reshape(shape).movedim(0, axis)

    def harden(self) -> AttentionMap:
        """The head permutation ``P`` is (or is closest to), composed with the per-head maps."""
        perm = self.perm if self.perm is not None else assign(self.matrix.detach()).to(self.matrix.device)
        qk, ov, within = self.heads.qk, self.heads.ov, self.heads.query_perm
        g = self.heads.group_size
        query = torch.arange(within.numel(), device=within.device)
        return AttentionMap(
            BlockMonomial(perm, qk.blocks.detach(), qk.inverse_blocks.detach()),
            BlockMonomial(perm, ov.blocks.detach(), ov.inverse_blocks.detach()),
            perm.to(within.device)[query // g] * g
            + within % g,  # B's query head q: its group's new place, its part kept
        )

    def compose(self, first):
        raise TypeError("a DenseAttentionMap is a training-time relaxation; harden() it before composing")

    def split(self):
        raise TypeError("a DenseAttentionMap is a training-time relaxation; harden() it before splitting")

    def inverse(self):
        raise TypeError("a DenseAttentionMap is a training-time relaxation; harden() it before inverting")

    def prepare(self) -> None:
        self.heads.prepare()

    def to(self, dtype=None, device=None) -> DenseAttentionMap:
        perm = self.perm.to(device=device) if self.perm is not None else None
        return DenseAttentionMap(self.heads.to(dtype, device), self.matrix.to(dtype=dtype, device=device), perm)

    def defect(self, spec: ArchSpec, tolerance: float = SYMMETRY_TOLERANCE) -> str | None:
        """Why this relaxation does not act as an element of the attention group, or ``None``:
        ``heads`` an attention map (:meth:`AttentionMap.defect`) with the identity KV permutation
        (so its query permutation stays inside each group), ``matrix`` a permutation matrix (that
        of ``perm`` where it is given: straight-through)."""
        defect = _floating_defect("matrix", self.matrix)
        if defect is None and self.perm is not None:
            defect = _permutation_defect("perm", self.perm)
        defect = defect or self.heads.defect(spec, tolerance, "heads.")
        if defect is None and not _is_identity(self.heads.qk.perm):
            defect = "heads.qk.perm is not the identity (a dense attention map orders its KV heads by its matrix alone)"
        return defect or _permutation_matrix_defect(
            "matrix", self.matrix, self.harden().qk.perm, self.perm is not None, tolerance
        )


def _mixed_rows(x: Tensor, matrix: Tensor, perm: Tensor | None, b: int, rows: slice) -> Tensor:
    """Rows ``rows`` of ``(P kron I_b) x`` for ``x`` of ``n b`` rows: the output blocks the rows
    touch, each a row of ``P`` (or, with ``perm``, the one block it picks, straight-through)."""
    start, stop, _ = rows.indices(x.shape[0])
    first, last = start // b, -(-stop // b)
    blocks = x.reshape(matrix.shape[0], -1)
    matrix = matrix.to(dtype=x.dtype, device=x.device)
    if perm is not None:
        y = _HardPermute.apply(blocks, matrix, perm.to(x.device), slice(first, last))
    else:
        y = matrix[first:last] @ blocks
    offset = first * b
    return y.reshape(-1, x.shape[1])[start - offset : stop - offset]


class _HardPermute(torch.autograd.Function):
    """``y = P x`` where ``P`` (the matrix argument) equals the permutation ``perm``'s matrix.

    Forward is a gather, not an ``n x n`` matmul; backward gives ``x`` its exact gradient
    ``P^T dy`` (a gather) and ``P`` the dense ``dy x^T`` a straight-through estimator needs.
    ``rows``: those rows of ``P x`` alone (the rows of ``P`` outside them get no gradient).
    """

    @staticmethod
    def forward(ctx, x: Tensor, matrix: Tensor, perm: Tensor, rows: slice | None = None) -> Tensor:
        ctx.save_for_backward(x, perm)
        ctx.rows = rows
        source = torch.argsort(perm)  # y[perm[h]] = x[h]
        return x[source] if rows is None else x[source[rows]]

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, perm = ctx.saved_tensors
        rows, dx, dmatrix = ctx.rows, None, None
        if rows is None:
            dx = dy[perm] if ctx.needs_input_grad[0] else None
            dmatrix = dy @ x.T if ctx.needs_input_grad[1] else None
            return dx, dmatrix, None, None
        if ctx.needs_input_grad[0]:
            dx = torch.zeros_like(x).index_add_(0, torch.argsort(perm)[rows], dy)
        if ctx.needs_input_grad[1]:
            dmatrix = x.new_zeros(perm.numel(), perm.numel())
            dmatrix[rows] = dy @ x.T
        return dx, dmatrix, None, None


#: Any group element a transform holds for one space.
Element = ResidualMap | AttentionMap | MlpMap | DenseAttentionMap | DenseMlpMap
