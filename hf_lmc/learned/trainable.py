"""A whole model's symmetry transform as trainable parameters (learned and dual matching).

:class:`TrainableTransform` mirrors a :class:`~hf_lmc.Transform` space by space: the residual
map becomes an :class:`OrthogonalParam`, every layer's KV-head QK maps one batched :class:`GLParam`
(or :class:`RotaryParam` under RoPE), their OV maps another, each layer's MLP units a
:class:`PermutationParam` (with learnable log-scales for SwiGLU), and the order of the KV
heads (each with its query heads) a :class:`PermutationParam` too (under GQA a query head's
part within its group stays as initialised). ``permutations="fixed"`` keeps the initial unit and
head assignments (weight matching's) and trains only the continuous maps around them.
``forward()`` returns the current :class:`~hf_lmc.Transform` (differentiable); ``harden()``
returns the exact group element export applies.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.config.options import LearnOptions, with_overrides
from hf_lmc.learned.params import GLParam, OrthogonalParam, PermutationParam, RotaryParam
from hf_lmc.learned.sharing import RowSharing
from hf_lmc.symmetry import AttentionMap, BlockMonomial, DenseAttentionMap, DenseMlpMap, MlpMap, ResidualMap, Transform


def _inverse_then(perm: Tensor, first: Tensor) -> Tensor:
    """Per row (layer), the permutation of ``perm^-1 o first``: ``argsort(perm)[first]``."""
    return torch.argsort(perm, dim=-1).gather(-1, first)


def _in_order(*perms: Tensor) -> bool:
    """Whether every row of every ``perms`` is the identity (checked once, on construction or
    load: maps built from in-order assignments skip their gathers every step)."""
    return all(bool((p == torch.arange(p.shape[-1], device=p.device)).all()) for p in perms)


class _TracksOrder(nn.Module):
    """Keeps ``ordered`` (the fixed assignments are the identity) true to the buffers, also after
    ``load_state_dict``."""

    def __init__(self):
        super().__init__()
        self.ordered = False
        self.register_load_state_dict_post_hook(lambda module, _: module._track_order())

    def _fixed_perms(self) -> tuple[Tensor, ...]:
        raise NotImplementedError

    def _track_order(self) -> None:
        perms = self._fixed_perms()
        self.ordered = bool(perms) and _in_order(*perms)


class _AttentionParams(_TracksOrder):
    """Every layer's attention maps: each kind (QK, OV) one module over all layers and KV heads,
    shape ``(layers, kv, dh, dh)``, so a step builds them in a few batched calls rather than a
    few per layer (each call is a kernel launch, and ``matrix_exp`` a host sync, on a GPU)."""

    def __init__(self, spec: ArchSpec, inits: list[AttentionMap | None], permutations: str, frame: str, dtype):
        super().__init__()
        kv, dh = spec.num_kv_heads, spec.head_dim
        eye = BlockMonomial.identity(kv, dh, dtype=dtype)
        qks = [init.qk if init is not None else eye for init in inits]
        ovs = [init.ov if init is not None else eye for init in inits]

        def stacked(monomials):
            return torch.stack([m.blocks.to(dtype) for m in monomials]), torch.stack(
                [m.inverse_blocks.to(dtype) for m in monomials]
            )

        self.register_buffer("kv_perm", torch.stack([qk.perm for qk in qks]))
        self.register_buffer(
            "query_perm",
            torch.stack([init.query_perm if init is not None else torch.arange(spec.num_heads) for init in inits]),
        )
        if spec.rotary_dim:
            self.qk = RotaryParam(dh, spec.rotary_dim, init=stacked(qks), frame=frame, dtype=dtype)
        else:
            self.qk = GLParam(dh, init=stacked(qks), frame=frame, dtype=dtype)
        self.ov = GLParam(dh, init=stacked(ovs), frame=frame, dtype=dtype)
        # The order of the KV groups trains (with their query heads); under GQA, which query head
        # of a group plays which part stays as initialised.
        g = spec.group_size
        query = torch.arange(spec.num_heads)
        self.register_buffer("within_group", (query // g) * g + self.query_perm % g)
        learns = kv > 1 and permutations != "fixed"
        self.heads = (
            nn.ModuleList(PermutationParam(kv, init=perm, method=permutations, dtype=dtype) for perm in self.kv_perm)
            if learns
            else None
        )
        self._track_order()

    def _fixed_perms(self) -> tuple[Tensor, ...]:
        return (self.kv_perm, self.query_perm) if self.heads is None else ()

    @staticmethod
    def _maps(kv_perm: Tensor, query_perm: Tensor, ordered: bool, qk, qk_inv, ov, ov_inv) -> list[AttentionMap]:
        # unbind, not indexing: its backward is one stack, where each index's is a zero-filled copy
        layers = zip(*(t.unbind(0) for t in (qk, qk_inv, ov, ov_inv)))
        return [
            AttentionMap(
                BlockMonomial(perm, qk, qk_inv, ordered), BlockMonomial(perm, ov, ov_inv, ordered), query, ordered
            )
            for (qk, qk_inv, ov, ov_inv), perm, query in zip(layers, kv_perm, query_perm)
        ]

    def relative(self, first: _AttentionParams, sharing: RowSharing | None = None) -> list[AttentionMap]:
        """Every layer's ``self^-1 o first`` (fixed assignments), composed for all layers at once:
        ``BlockMonomial.inverse`` and ``compose`` per layer, batched over the layer axis."""
        ordered = self.ordered and first.ordered
        index = first.kv_perm if ordered else _inverse_then(self.kv_perm, first.kv_perm)
        query = first.query_perm if ordered else _inverse_then(self.query_perm, first.query_perm)

        def composed(mine, theirs):  # (M^-1 o T)_h = M^-1_{idx[h]} T_h, inverse T^-1_h M_{idx[h]}
            m, m_inv = mine(sharing)
            t, t_inv = theirs(sharing)
            if not ordered:
                at = index[:, :, None, None].expand_as(m)
                m, m_inv = m.gather(1, at), m_inv.gather(1, at)
            return m_inv @ t, t_inv @ m

        return self._maps(index, query, ordered, *composed(self.qk, first.qk), *composed(self.ov, first.ov))

    def forward(self, sharing: RowSharing | None = None) -> list[AttentionMap | DenseAttentionMap]:
        if self.heads is None:
            return self._maps(self.kv_perm, self.query_perm, self.ordered, *self.qk(sharing), *self.ov(sharing))
        layers = zip(*(t.unbind(0) for t in (*self.qk(sharing), *self.ov(sharing))))
        fixed = torch.arange(self.kv_perm.shape[1], device=self.kv_perm.device)
        maps = []
        for (qk, qk_inv, ov, ov_inv), heads, within in zip(layers, self.heads, self.within_group):
            matrix, perm = heads.matrix_and_perm()
            maps.append(
                DenseAttentionMap(
                    AttentionMap(BlockMonomial(fixed, qk, qk_inv), BlockMonomial(fixed, ov, ov_inv), within),
                    matrix,
                    perm,
                )
            )
        return maps


class _MlpParams(_TracksOrder):
    """Every layer's MLP maps: the units' log-scales as one ``(layers, units)`` parameter."""

    def __init__(self, spec: ArchSpec, inits: list[MlpMap | None], permutations: str, frame: str, dtype):
        super().__init__()
        n = spec.intermediate_size
        perms = [init.map.perm if init is not None else torch.arange(n) for init in inits]
        scales = [
            init.map.blocks[:, 0, 0].to(dtype) if init is not None else torch.ones(n, dtype=dtype) for init in inits
        ]
        if permutations == "fixed":  # no n x n scores: a plain gather, as export applies it
            self.units = None
            self.register_buffer("perm", torch.stack(perms))
        else:
            self.units = nn.ModuleList(
                PermutationParam(n, init=perm, method=permutations, dtype=dtype) for perm in perms
            )
        scales = torch.stack(scales)
        # A unit's sign (a SwiGLU symmetry, weight matching's start may flip it) stays as started:
        # a scale trained through zero would leave the group.
        self.register_buffer("sign", torch.where(scales < 0, -1.0, 1.0).to(dtype), persistent=False)
        self.log_scale = nn.Parameter(scales.abs().log(), requires_grad=spec.gated_mlp)  # only SwiGLU units scale
        # Scales commute with one another: a factor on each side ("both") is a second, zero-started
        # log-scale added to the first, as the difference of A's and B's is in dual matching.
        both = frame == "both" and spec.gated_mlp
        self.left_log_scale = nn.Parameter(torch.zeros_like(self.log_scale)) if both else None
        self._track_order()

    def _fixed_perms(self) -> tuple[Tensor, ...]:
        return (self.perm,) if self.units is None else ()

    def _log_scale(self) -> Tensor:
        return self.log_scale if self.left_log_scale is None else self.log_scale + self.left_log_scale

    def _scale(self) -> Tensor:
        return self.sign * self._log_scale().exp()

    @staticmethod
    def _maps(perm: Tensor, scale: Tensor, ordered: bool) -> list[MlpMap]:
        return [
            MlpMap(BlockMonomial(perm, s[:, None, None], inv[:, None, None], ordered))
            for perm, s, inv in zip(perm, scale.unbind(0), (1.0 / scale).unbind(0))
        ]

    def relative(self, first: _MlpParams) -> list[MlpMap]:
        """Every layer's ``self^-1 o first`` (fixed assignments), for all layers at once: unit
        ``h`` goes where ``first`` sends it and back through ``self``, scaled by ``s_first[h] /
        s_self[idx[h]]``."""
        if self.ordered and first.ordered:
            return self._maps(first.perm, first._scale() / self._scale(), True)
        index = _inverse_then(self.perm, first.perm)
        return self._maps(index, first._scale() / self._scale().gather(1, index), False)

    def forward(self) -> list[MlpMap | DenseMlpMap]:
        scale = self._scale()
        if self.units is None:
            return self._maps(self.perm, scale, self.ordered)
        maps = []
        for units, s in zip(self.units, scale.unbind(0)):
            matrix, perm = units.matrix_and_perm()
            maps.append(DenseMlpMap(matrix, s, perm))
        return maps


class _ResidualPermutation(nn.Module):
    """The residual stream's dimensions under a trainable permutation (``trained="permutations"``):
    a :class:`PermutationParam` over them, started at the permutation ``init`` is the matrix of
    (permutation-only weight matching's; identity if None). Its matrix is orthogonal, so it
    takes the orthogonal map's place; a permutation fixes the ones vector, as LayerNorm models need."""

    def __init__(self, d: int, init: Tensor | None, method: str, dtype):
        super().__init__()
        perm = None
        if init is not None:
            perm = init.argmax(dim=0)  # y[perm[h]] = x[h]: column h's one sits in row perm[h]
            if not torch.equal(init, torch.eye(d, dtype=init.dtype, device=init.device)[:, perm]):
                raise ValueError("permutation-only learned matching starts from a residual permutation, not a rotation")
        self.dims = PermutationParam(d, init=perm, method=method, dtype=dtype)

    def forward(self, sharing: RowSharing | None = None) -> Tensor:
        return self.dims()  # the scores' assignment: nothing to share


class TrainableTransform(nn.Module):
    """Trainable parameters for every symmetry of ``spec``, starting at ``init`` (identity if None).

    Of ``options`` (:class:`~hf_lmc.config.options.LearnOptions`, with ``overrides`` of its fields set
    over them) it reads ``permutations``, ``orthogonal`` and ``frame``; ``dtype`` is that of the
    parameters."""

    def __init__(
        self,
        spec: ArchSpec,
        init: Transform | None = None,
        options: LearnOptions | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        **overrides,
    ):
        super().__init__()
        learn = with_overrides(LearnOptions, options, overrides)
        permutations, orthogonal, frame = learn.permutations, learn.orthogonal, learn.frame
        maps = init.maps if init is not None else {}
        residual = maps.get("residual")
        start = residual.matrix if residual is not None else None
        if learn.trained == "permutations":  # the residual's dimensions permuted, not rotated
            self.residual = _ResidualPermutation(spec.hidden_size, start, permutations, dtype)
        else:
            self.residual = OrthogonalParam(
                spec.hidden_size, init=start, method=orthogonal, fix_ones=spec.centred, frame=frame, dtype=dtype
            )
        layers = range(spec.num_layers)
        self.attention = _AttentionParams(spec, [maps.get(f"attn.{i}") for i in layers], permutations, frame, dtype)
        self.mlp = _MlpParams(spec, [maps.get(f"mlp.{i}") for i in layers], permutations, frame, dtype)
        if learn.trained == "permutations":  # every continuous map stays where weight matching started it
            continuous = [*self.attention.qk.parameters(), *self.attention.ov.parameters(), *self.mlp.parameters()]
            permutation_scores = {
                id(p) for m in self.modules() if isinstance(m, PermutationParam) for p in m.parameters()
            }
            for parameter in continuous:
                if id(parameter) not in permutation_scores:
                    parameter.requires_grad_(False)

    @property
    def fixed_assignments(self) -> bool:
        """Whether the unit and head assignments stay as initialised (``permutations="fixed"``)."""
        return self.attention.heads is None and self.mlp.units is None

    def forward(self, sharing: RowSharing | None = None) -> Transform:
        """The current transform (differentiable). ``sharing``
        (:class:`~hf_lmc.learned.sharing.RowSharing`, the interpolant's ``parameter_sharing``)
        splits the parameterisation's solves and exponentials across the processes of a
        launch: a collective then, called by every process in the same order."""
        return self._transform(self.residual(sharing), self.attention(sharing), self.mlp())

    def relative(self, first: TrainableTransform, sharing: RowSharing | None = None) -> Transform:
        """``self()^-1 o first()``, differentiable in both, with each kind of map composed for all
        layers in a few batched calls (``Transform.inverse().compose()`` takes a few per layer and
        map: dual matching builds this every step, and on a GPU each call is a kernel launch).
        Needs fixed assignments on both sides: relaxed permutations have no inverse. ``sharing``:
        as for :meth:`forward`."""
        if not (self.fixed_assignments and first.fixed_assignments):
            raise ValueError(
                "relative() needs fixed unit and head assignments (permutations='fixed') on both transforms"
            )
        # Fixed assignments: the residual is an OrthogonalParam (a permutation-only residual trains
        # its assignment, which the options allow only relaxed).
        residual = self.residual.inverse_then(first.residual, sharing)
        attention = self.attention.relative(first.attention, sharing)
        return self._transform(residual, attention, self.mlp.relative(first.mlp))

    @staticmethod
    def _transform(residual: Tensor, attention, mlp) -> Transform:
        maps = {"residual": ResidualMap.from_matrix(residual)}
        for i, (attn, units) in enumerate(zip(attention, mlp)):
            maps[f"attn.{i}"], maps[f"mlp.{i}"] = attn, units
        return Transform(maps)

    @torch.no_grad()
    def harden(self) -> Transform:
        """The exact group element the parameters currently select (soft permutations hardened)."""
        current = self()
        maps = {
            space: element.harden() if isinstance(element, (DenseAttentionMap, DenseMlpMap)) else element
            for space, element in current.maps.items()
        }
        if isinstance(self.residual, _ResidualPermutation):  # relaxed (sinkhorn): the soft matrix is no symmetry
            maps["residual"] = ResidualMap.from_matrix(self.residual.dims.hard_matrix().detach())
        return Transform(maps).to(torch.float64)
