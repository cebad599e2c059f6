"""Activation matching: the weight matcher's structure, with costs from activations (docs/design.md §4).

Both models run the same calibration batches; per token, one pass records

* the residual stream entering every layer (HF ``hidden_states``, centred for LayerNorm
  models: the canonical stream) -> residual map by Procrustes on ``sum h_a h_b^T``;
* per layer, queries and keys (canonical readers applied to the normalised stream) and every
  head's value mix ``z`` (the input of the attention output projection, hooked) -> heads
  assigned by what they write, ``W_O z`` (invariant to OV maps), then per-KV-head QK maps from
  query/key moments and OV maps from ``z`` and ``W_O`` moments (RoPE-restricted under RoPE);
* per layer, the MLP units (the input of the down projection, hooked) -> units by linear
  assignment on their correlations; SwiGLU scales from their RMS ratios.

Only second moments are kept (``d x d`` per layer for the stream and heads, ``F x F`` float32
per layer for MLP units), so the calibration set can be any size. Models run as stock HF
models exported from canonical form (:func:`hf_lmc.to_hf`), so any canonical model, including
a transformed one, can be matched.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import partial

import torch
from torch import Tensor

from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.form import CanonicalModel, to_hf
from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.config.options import DEFAULT_SYMMETRIES
from hf_lmc.evaluation.batches import Batch, EvalOptions, load_batches
from hf_lmc.matching.contract import PairwiseMatcher
from hf_lmc.matching.solvers import (
    Moments,
    assign,
    assign_heads,
    match_gl_moments,
    match_rotary_moments,
    polar,
    polar_fixing_ones,
)
from hf_lmc.matching.weight import _check_compatible, _stack
from hf_lmc.symmetry import AttentionMap, BlockMonomial, MlpMap, ResidualMap, Transform, resolve_kinds
from hf_lmc.utils.linalg import solve_side_by_side
from hf_lmc.utils.progress import bar as progress_bar


class ActivationMatcher(PairwiseMatcher):
    """Align model B to model A from their activations on calibration data.

    Args:
        data: calibration batches: an iterable of batch dicts (e.g. a ``DataLoader``), one
            batch dict, a tensor of ``input_ids`` (``pixel_values`` for ViT), or other data
            :func:`hf_lmc.evaluation.batches.load_batches` reads without a tokenizer (``.pt`` image
            tensors). Text is tokenised by :func:`hf_lmc.merge` and the CLI with A's tokenizer.
        symmetries: ``"full"``, ``"permutation"`` or a set of kinds (as for weight matching).
        max_batches: use at most this many batches.
        dtype: dtype the models run in (moments always accumulate in float64).
        progress: show a progress bar over the batches.

    ``match(a, b)`` returns a :class:`Transform` ``T`` with ``T.apply(b) ~ a``; ``fit([a, b])``
    returns ``[Transform(), T]`` (:class:`~hf_lmc.matching.contract.PairwiseMatcher`).
    """

    def __init__(
        self,
        data,
        symmetries=DEFAULT_SYMMETRIES,
        *,
        max_batches: int | None = None,
        dtype: torch.dtype = torch.float32,
        progress: bool = True,
    ):
        self.data = data
        self.kinds = resolve_kinds(symmetries)
        self.max_batches = max_batches
        self.dtype = dtype
        self.progress = progress

    def match(self, a: CanonicalModel, b: CanonicalModel) -> Transform:
        """B's transform ``T`` with ``T.apply(b) ~ a``, from the models' activations on the calibration data."""
        spec = _check_compatible(a, b)
        stats = self._collect(spec, a, b)
        residual = self._solve_residual(spec, stats.stream)
        rotation = residual.matrix if residual is not None else torch.eye(spec.hidden_size, dtype=torch.float64)
        maps: dict = {"residual": residual} if residual is not None else {}
        rotate = Transform({"residual": ResidualMap.from_matrix(rotation)})
        for i, layer in enumerate(stats.layers):
            ga, gb = (
                _double(a.group(i)),
                {n: rotate.apply_tensor(n, t) for n, t in _double(b.group(i)).items()},
            )  # B in A's basis
            p = f"layers.{i}."
            maps[f"attn.{i}"] = self._match_attention(spec, layer, ga[p + "attn.o.weight"], gb[p + "attn.o.weight"])
            maps[f"mlp.{i}"] = self._match_mlp(
                spec, layer, _unit_descriptors(spec, p, ga), _unit_descriptors(spec, p, gb)
            )
        return Transform(maps)

    # -- collection --------------------------------------------------------------------------

    def _batches(self, a: CanonicalModel) -> Iterator[Batch]:
        data = self.data
        if isinstance(data, Tensor):
            data = [{"pixel_values" if data.is_floating_point() else "input_ids": data}]
        elif isinstance(data, dict):
            data = [data]
        elif not (isinstance(data, Iterable) and not isinstance(data, (str, bytes)) and _yields_dicts(data)):
            data = load_batches(data, a.config, None, EvalOptions(max_batches=self.max_batches))
        for n, batch in enumerate(data):
            if self.max_batches is not None and n >= self.max_batches:
                return
            yield batch

    @torch.no_grad()
    def _collect(self, spec: ArchSpec, a: CanonicalModel, b: CanonicalModel) -> _Statistics:
        models = [to_hf(m.to(self.dtype)) for m in (a, b)]
        weights = [_Readers(spec, m) for m in (a, b)]
        stats = _Statistics(spec)
        for batch in progress_bar(self._batches(a), desc="activation matching", show=self.progress, unit="batch"):
            records = [_record(spec, model, batch) for model in models]
            keep = batch.get("attention_mask")
            keep = keep.reshape(-1).bool() if keep is not None else None
            stats.add(spec, records, weights, keep)
        if stats.tokens == 0:
            raise ValueError("activation matching got no calibration tokens; pass non-empty data")
        return stats

    # -- solves ------------------------------------------------------------------------------

    def _solve_residual(self, spec: ArchSpec, stream: list[_Cross]) -> ResidualMap | None:
        cross = sum(s.ab / (s.aa.trace() * s.bb.trace()).sqrt().clamp_min(1e-300) for s in stream)
        if "residual" in self.kinds:
            return ResidualMap.from_matrix(polar_fixing_ones(cross) if spec.centred else polar(cross))
        if "residual_permutation" in self.kinds:
            return ResidualMap.from_matrix(torch.eye(spec.hidden_size, dtype=torch.float64)[assign(cross)].T)
        return None

    def _match_attention(self, spec: ArchSpec, layer: _Layer, o_a: Tensor, o_b: Tensor) -> AttentionMap:
        h, kv, g, dh = spec.num_heads, spec.num_kv_heads, spec.group_size, spec.head_dim
        # Per head pair, the (dh x dh) blocks of W_O,a^T W_O,b: what head i of A and head j of B write.
        writes = _blocks(o_a.T @ o_b, h, dh)
        writes_a = _diagonal_blocks(o_a.T @ o_a, h, dh)
        writes_b = _diagonal_blocks(o_b.T @ o_b, h, dh)
        z = layer.z
        if "heads" in self.kinds:
            # <W_O,i z_a,i, W_O,j z_b,j> summed over tokens, normalised: heads compared by their output.
            sim = (writes * _blocks(z.ab, h, dh)).sum((-1, -2))
            norm_a = (writes_a * _diagonal_blocks(z.aa, h, dh)).sum((-1, -2)).clamp_min(0).sqrt()
            norm_b = (writes_b * _diagonal_blocks(z.bb, h, dh)).sum((-1, -2)).clamp_min(0).sqrt()
            kv_perm, query_perm = assign_heads(sim / (norm_a[:, None] * norm_b[None, :]).clamp_min(1e-300), kv)
        else:
            kv_perm, query_perm = torch.arange(kv), torch.arange(h)
        q, k = layer.q, layer.k
        qk_jobs, ov_jobs = [], []  # every head's solve, then all at once, side by side
        for jb in range(kv):
            ia = int(kv_perm[jb])
            pairs = [(int(query_perm[j]), j) for j in range(jb * g, (jb + 1) * g)]  # (A head, B head)
            if "qk" in self.kinds:
                moments = Moments(
                    *_grouped(q, pairs, dh),
                    _block(k.aa, ia, ia, dh),
                    _block(k.bb, jb, jb, dh),
                    _block(k.ab, ia, jb, dh),
                )
                qk_jobs.append(
                    partial(match_rotary_moments, moments, spec.rotary_dim)
                    if spec.rotary_dim
                    else partial(match_gl_moments, moments)
                )
            if "ov" in self.kinds:
                vec_aa, vec_bb, vec_ab = _grouped(z, pairs, dh)
                moments = Moments(
                    vec_aa,
                    vec_bb,
                    vec_ab,
                    sum(writes_a[i] for i, _ in pairs),
                    sum(writes_b[j] for _, j in pairs),
                    sum(writes[i, j] for i, j in pairs),
                )
                ov_jobs.append(partial(match_gl_moments, moments))
        solved = solve_side_by_side(qk_jobs + ov_jobs)
        qk_blocks, ov_blocks = solved[: len(qk_jobs)], solved[len(qk_jobs) :]
        eye = BlockMonomial.identity(kv, dh)
        qk = (
            BlockMonomial(kv_perm, *_stack(qk_blocks))
            if qk_blocks
            else BlockMonomial(kv_perm, eye.blocks, eye.inverse_blocks)
        )
        ov = (
            BlockMonomial(kv_perm, *_stack(ov_blocks))
            if ov_blocks
            else BlockMonomial(kv_perm, eye.blocks, eye.inverse_blocks)
        )
        return AttentionMap(qk, ov, query_perm)

    def _match_mlp(self, spec: ArchSpec, layer: _Layer, weights_a: Tensor, weights_b: Tensor) -> MlpMap:
        """Units by correlation; units the data cannot tell apart (e.g. ReLU units dead on every
        calibration token) are told apart by their weights, a tie-break far below any correlation."""
        units, n = layer.units, layer.units.tokens
        mean_a, mean_b = units.sum_a / n, units.sum_b / n
        rms_a, rms_b = (units.sq_a / n).sqrt(), (units.sq_b / n).sqrt()
        scaled = spec.gated_mlp and "mlp_scale" in self.kinds
        sign = torch.ones(spec.intermediate_size, dtype=torch.float64)
        if "mlp" in self.kinds:
            std_a = (rms_a.square() - mean_a.square()).clamp_min(0).sqrt().clamp_min(1e-12)
            std_b = (rms_b.square() - mean_b.square()).clamp_min(0).sqrt().clamp_min(1e-12)
            correlation = units.covariance() / (std_a[:, None] * std_b[None, :])
            # A SwiGLU unit's sign is a symmetry (weight matching's _match_mlp): a flipped
            # partner correlates at -1, as closely as an unflipped one at +1.
            perm = assign((correlation.abs() if scaled else correlation) + _TIE_BREAK * (weights_a @ weights_b.T))
            if scaled:
                sign = torch.where(correlation[perm, torch.arange(spec.intermediate_size)] < 0, -1.0, 1.0).double()
        else:
            perm = torch.arange(spec.intermediate_size)
        scale = torch.ones(spec.intermediate_size, dtype=torch.float64)
        if scaled:
            ok = (rms_a[perm] > 0) & (rms_b > 0)
            scale = sign * torch.where(ok, rms_a[perm] / rms_b.where(ok, torch.ones_like(rms_b)), scale)
        return MlpMap(BlockMonomial.scaled_permutation(perm, scale))


_TIE_BREAK = 1e-3  # weight of the unit-weight cosine similarity next to activation correlations


def _double(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {name: t.double() for name, t in tensors.items()}


def _unit_descriptors(spec: ArchSpec, p: str, group: dict[str, Tensor]) -> Tensor:
    """One unit-norm row per MLP unit: its up (and gate) row with bias and its down column.

    Scale-free (SwiGLU units may be rescaled), so only directions compare.
    """

    def part(name: str) -> Tensor:
        return _unit_rows(torch.cat([group[p + name + ".weight"], group[p + name + ".bias"][:, None]], 1))

    parts = [part("mlp.up"), _unit_rows(group[p + "mlp.down.weight"].T)]
    if spec.gated_mlp:
        parts.append(part("mlp.gate"))
    return torch.cat(parts, 1) / len(parts) ** 0.5


def _unit_rows(x: Tensor) -> Tensor:
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-300)


# -- recording ---------------------------------------------------------------------------------


class _Readers:
    """Canonical query and key weights of every layer, in float64 (applied to the stream)."""

    def __init__(self, spec: ArchSpec, model: CanonicalModel):
        self.q, self.k = [], []
        for i in range(spec.num_layers):
            group = model.group(i)
            p = f"layers.{i}.attn."
            self.q.append((group[p + "q.weight"].double(), group[p + "q.bias"].double()))
            self.k.append((group[p + "k.weight"].double(), group[p + "k.bias"].double()))


def _record(spec: ArchSpec, model, batch: Batch) -> dict:
    """One batch through one model: the stream entering each layer and the hooked inputs."""
    inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "pixel_values")}
    hooked: dict[str, list[Tensor]] = {"heads": [], "mlp": []}
    handles = []
    adapter = adapter_for(model.config)
    for kind, template in (("heads", adapter.heads_input), ("mlp", adapter.mlp_input)):
        for i in range(spec.num_layers):
            module = model.get_submodule(template.format(i=i))
            handles.append(module.register_forward_hook(lambda _m, args, _out, kind=kind: hooked[kind].append(args[0])))
    try:  # the base model: its hidden states are the whole model's, without the tokens x vocabulary logits
        out = model.base_model(**inputs, output_hidden_states=True)
    finally:
        for handle in handles:
            handle.remove()
    # Every layer's input, and the last layer's output (after the exported final norm, which for a
    # canonical export has unit gain and so keeps each token's direction in the stream).
    return {"stream": out.hidden_states, "heads": hooked["heads"], "mlp": hooked["mlp"]}


def _tokens(t: Tensor, keep: Tensor | None) -> Tensor:
    """``(..., width)`` activations as float64 ``(tokens, width)``, padding dropped."""
    t = t.reshape(-1, t.shape[-1]).double()
    return t[keep] if keep is not None else t


class _Cross:
    """``sum x_a^T x_b``, ``sum x_a^T x_a``, ``sum x_b^T x_b`` over tokens (float64)."""

    def __init__(self, width: int):
        self.ab, self.aa, self.bb = (torch.zeros(width, width, dtype=torch.float64) for _ in range(3))

    def add(self, xa: Tensor, xb: Tensor) -> None:
        self.ab += xa.T @ xb
        self.aa += xa.T @ xa
        self.bb += xb.T @ xb


class _Units:
    """MLP unit statistics: the cross moment (float32, ``F x F``) and per-unit sums (float64).

    The cross moment accumulates activations minus a per-unit shift (the first batch's mean):
    the covariance ``E[ab] - E[a] E[b]`` of units with a large mean would otherwise cancel
    away float32's digits, and with them the weight tie-break between units the data cannot
    tell apart.
    """

    def __init__(self, width: int):
        self.ab = torch.zeros(width, width, dtype=torch.float32)
        self.sum_a, self.sum_b, self.sq_a, self.sq_b = (torch.zeros(width, dtype=torch.float64) for _ in range(4))
        self.shift_a = self.shift_b = None
        self.tokens = 0

    def add(self, xa: Tensor, xb: Tensor) -> None:
        if xa.shape[0] == 0:
            return
        if self.shift_a is None:
            self.shift_a, self.shift_b = xa.mean(0), xb.mean(0)
        self.ab += (xa - self.shift_a).float().T @ (xb - self.shift_b).float()
        self.sum_a += xa.sum(0)
        self.sum_b += xb.sum(0)
        self.sq_a += xa.square().sum(0)
        self.sq_b += xb.square().sum(0)
        self.tokens += xa.shape[0]

    def covariance(self) -> Tensor:
        """Per unit pair, ``E[a b] - E[a] E[b]`` over all tokens (float64)."""
        n = self.tokens
        mean_a, mean_b = self.sum_a / n - self.shift_a, self.sum_b / n - self.shift_b
        return self.ab.double() / n - mean_a[:, None] * mean_b[None, :]


class _Layer:
    def __init__(self, spec: ArchSpec):
        self.q = _Cross(spec.num_heads * spec.head_dim)
        self.k = _Cross(spec.num_kv_heads * spec.head_dim)
        self.z = _Cross(spec.num_heads * spec.head_dim)
        self.units = _Units(spec.intermediate_size)


class _Statistics:
    def __init__(self, spec: ArchSpec):
        self.stream = [_Cross(spec.hidden_size) for _ in range(spec.num_layers + 1)]
        self.layers = [_Layer(spec) for _ in range(spec.num_layers)]
        self.tokens = 0

    def add(self, spec: ArchSpec, records: list[dict], readers: list[_Readers], keep: Tensor | None) -> None:
        ra, rb = records
        streams = [self._stream(spec, ra["stream"][i], rb["stream"][i], keep) for i in range(spec.num_layers + 1)]
        for cross, (ha, hb) in zip(self.stream, streams):
            cross.add(ha, hb)
        for i in range(spec.num_layers):
            ha, hb = streams[i]
            na, nb = _normalise(ha, spec.norm_eps), _normalise(hb, spec.norm_eps)
            layer = self.layers[i]
            (qa_w, qa_b), (qb_w, qb_b) = readers[0].q[i], readers[1].q[i]
            (ka_w, ka_b), (kb_w, kb_b) = readers[0].k[i], readers[1].k[i]
            layer.q.add(na @ qa_w.T + qa_b, nb @ qb_w.T + qb_b)
            layer.k.add(na @ ka_w.T + ka_b, nb @ kb_w.T + kb_b)
            layer.z.add(_tokens(ra["heads"][i], keep), _tokens(rb["heads"][i], keep))
            layer.units.add(_tokens(ra["mlp"][i], keep), _tokens(rb["mlp"][i], keep))
        self.tokens += streams[0][0].shape[0]

    @staticmethod
    def _stream(spec: ArchSpec, ha: Tensor, hb: Tensor, keep: Tensor | None) -> tuple[Tensor, Tensor]:
        ha, hb = _tokens(ha, keep), _tokens(hb, keep)
        if spec.centred:  # the canonical stream of a LayerNorm model is the centred one
            ha, hb = ha - ha.mean(1, keepdim=True), hb - hb.mean(1, keepdim=True)
        return ha, hb


def _normalise(h: Tensor, eps: float) -> Tensor:
    """The canonical norm: unit RMS (the stream is already centred for LayerNorm models)."""
    return h * torch.rsqrt(h.square().mean(1, keepdim=True) + eps)


def _yields_dicts(data) -> bool:
    if isinstance(data, (list, tuple)):
        return not data or isinstance(data[0], dict)
    return hasattr(data, "__iter__") and not hasattr(data, "column_names")  # a DataLoader or generator


# -- block helpers -----------------------------------------------------------------------------


def _blocks(m: Tensor, n: int, b: int) -> Tensor:
    """``(n b, n b)`` as ``(n, n, b, b)`` blocks."""
    return m.reshape(n, b, n, b).transpose(1, 2)


def _diagonal_blocks(m: Tensor, n: int, b: int) -> Tensor:
    idx = torch.arange(n)
    return _blocks(m, n, b)[idx, idx]


def _block(m: Tensor, i: int, j: int, b: int) -> Tensor:
    return m[i * b : (i + 1) * b, j * b : (j + 1) * b]


def _grouped(cross: _Cross, pairs: list[tuple[int, int]], b: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(aa, bb, ab)`` moments of a KV group's query heads taken side by side as samples."""
    aa = sum(_block(cross.aa, i, i, b) for i, _ in pairs)
    bb = sum(_block(cross.bb, j, j, b) for _, j in pairs)
    ab = sum(_block(cross.ab, i, j, b) for i, j in pairs)
    return aa, bb, ab
