"""A whole model's symmetry transform as trainable parameters (learned and dual matching).

:class:`TrainableTransform` mirrors a :class:`~hf_lmc.Transform` space by space: the residual
map becomes an :class:`OrthogonalParam`, a layer's KV-head QK maps one batched :class:`GLParam`
(or :class:`RotaryParam` under RoPE), its OV maps another, each layer's MLP units a
:class:`PermutationParam` (with learnable log-scales for SwiGLU), and the order of the KV
heads (each with its query heads) a :class:`PermutationParam` too (under GQA a query head's
part within its group stays as initialised). ``permutations="fixed"`` keeps the initial unit and
head assignments (weight matching's) and trains only the continuous maps around them.
``forward()`` returns the current :class:`~hf_lmc.Transform` (differentiable); ``harden()``
returns the exact group element export applies.
"""

from __future__ import annotations

import torch
from torch import nn

from ..spec import ArchSpec
from ..symmetry import AttentionMap, BlockMonomial, DenseAttentionMap, DenseMlpMap, MlpMap, ResidualMap, Transform
from ..symmetry.params import PERMUTATION_METHODS, GLParam, OrthogonalParam, PermutationParam, RotaryParam

#: How the unit and head assignments train: ``"fixed"`` (not at all; the default), or a parameterisation.
PERMUTATIONS = ("fixed", *PERMUTATION_METHODS)


class _AttentionParams(nn.Module):
    def __init__(self, spec: ArchSpec, init: AttentionMap | None, permutations: str, frame: str, dtype):
        super().__init__()
        kv, dh = spec.num_kv_heads, spec.head_dim
        eye = BlockMonomial.identity(kv, dh, dtype=dtype)
        qk = init.qk if init is not None else eye
        ov = init.ov if init is not None else eye
        self.register_buffer("kv_perm", qk.perm.clone())
        self.register_buffer("query_perm", init.query_perm.clone() if init is not None else torch.arange(spec.num_heads))
        # One module per kind holds every KV head's map (a batch): one matrix_exp per layer, not per head.
        if spec.rotary_dim:
            self.qk = RotaryParam(dh, spec.rotary_dim, init=(qk.blocks, qk.inverse_blocks), frame=frame, dtype=dtype)
        else:
            self.qk = GLParam(dh, init=(qk.blocks, qk.inverse_blocks), frame=frame, dtype=dtype)
        self.ov = GLParam(dh, init=(ov.blocks, ov.inverse_blocks), frame=frame, dtype=dtype)
        # The order of the KV groups trains (with their query heads); under GQA, which query head
        # of a group plays which part stays as initialised.
        g = spec.group_size
        query = torch.arange(spec.num_heads)
        self.register_buffer("within_group", (query // g) * g + self.query_perm % g)
        learns = kv > 1 and permutations != "fixed"
        self.heads = PermutationParam(kv, init=self.kv_perm, method=permutations, dtype=dtype) if learns else None

    def forward(self) -> AttentionMap | DenseAttentionMap:
        def monomial(param, perm):
            return BlockMonomial(perm, *param())

        if self.heads is None:
            return AttentionMap(monomial(self.qk, self.kv_perm), monomial(self.ov, self.kv_perm), self.query_perm)
        fixed = torch.arange(self.kv_perm.numel(), device=self.kv_perm.device)
        matrix, perm = self.heads.matrix_and_perm()
        return DenseAttentionMap(AttentionMap(monomial(self.qk, fixed), monomial(self.ov, fixed), self.within_group), matrix, perm)


class _MlpParams(nn.Module):
    def __init__(self, spec: ArchSpec, init: MlpMap | None, permutations: str, frame: str, dtype):
        super().__init__()
        n = spec.intermediate_size
        perm = init.map.perm if init is not None else torch.arange(n)
        scale = init.map.blocks[:, 0, 0].to(dtype) if init is not None else torch.ones(n, dtype=dtype)
        if permutations == "fixed":  # no n x n scores: a plain gather, as export applies it
            self.units = None
            self.register_buffer("perm", perm.clone())
        else:
            self.units = PermutationParam(n, init=perm, method=permutations, dtype=dtype)
        self.log_scale = nn.Parameter(scale.log(), requires_grad=spec.gated_mlp)  # only SwiGLU units scale
        # Scales commute with one another: a factor on each side ("both") is a second, zero-started
        # log-scale added to the first, as the difference of A's and B's is in dual matching.
        both = frame == "both" and spec.gated_mlp
        self.left_log_scale = nn.Parameter(torch.zeros_like(self.log_scale)) if both else None

    def forward(self) -> MlpMap | DenseMlpMap:
        log_scale = self.log_scale if self.left_log_scale is None else self.log_scale + self.left_log_scale
        if self.units is None:
            return MlpMap(BlockMonomial.scaled_permutation(self.perm, log_scale.exp()))
        matrix, perm = self.units.matrix_and_perm()
        return DenseMlpMap(matrix, log_scale.exp(), perm)


class TrainableTransform(nn.Module):
    """Trainable parameters for every symmetry of ``spec``, starting at ``init`` (identity if None)."""

    def __init__(
        self,
        spec: ArchSpec,
        init: Transform | None = None,
        *,
        permutations: str = "fixed",
        orthogonal: str = "cayley",
        frame: str = "own",
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if permutations not in PERMUTATIONS:
            raise ValueError(f"unknown permutation parameterisation {permutations!r}; choose from {PERMUTATIONS}")
        maps = init.maps if init is not None else {}
        residual = maps.get("residual")
        self.residual = OrthogonalParam(
            spec.hidden_size, init=residual.matrix if residual is not None else None, method=orthogonal, fix_ones=spec.centred, frame=frame, dtype=dtype
        )
        self.attention = nn.ModuleList(_AttentionParams(spec, maps.get(f"attn.{i}"), permutations, frame, dtype) for i in range(spec.num_layers))
        self.mlp = nn.ModuleList(_MlpParams(spec, maps.get(f"mlp.{i}"), permutations, frame, dtype) for i in range(spec.num_layers))

    def forward(self) -> Transform:
        maps = {"residual": ResidualMap.from_matrix(self.residual())}
        for i, (attn, mlp) in enumerate(zip(self.attention, self.mlp)):
            maps[f"attn.{i}"], maps[f"mlp.{i}"] = attn(), mlp()
        return Transform(maps)

    @torch.no_grad()
    def harden(self) -> Transform:
        """The exact group element the parameters currently select (soft permutations hardened)."""
        current = self()
        maps = {space: element.harden() if isinstance(element, (DenseAttentionMap, DenseMlpMap)) else element for space, element in current.maps.items()}
        return Transform(maps).to(torch.float64)
