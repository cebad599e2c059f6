"""Data-free weight matching over the full symmetry group (DESIGN §4).

Coordinate descent on ``sum_t |A_t - T(B)_t|^2 / |A_t|^2`` over canonical tensors ``t``:

1. residual map by Procrustes on the cross-covariance of every tensor touching the stream
   (the first sweep uses only embeddings and head, whose other axes are already aligned);
2. per layer, heads assigned by their QK and OV circuits (invariant to per-head maps, never
   materialising a d x d circuit), then per-KV-head QK / OV maps by balanced GL matching
   (RoPE-restricted where RoPE applies);
3. per layer, MLP units by linear assignment (SwiGLU: on balanced up/down, then scales).

Each sweep streams both models group by group; only d x d statistics and the transform are
kept, so neither model needs to be in memory as a whole.
"""

from __future__ import annotations

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..canonical import CanonicalModel
from ..spec import ArchSpec, Group, spec_differences
from ..symmetry import AttentionMap, BlockMonomial, MlpMap, ResidualMap, Transform, axes_of, resolve_kinds
from .solvers import assign, balanced_scales, match_gl, match_rotary, polar, polar_fixing_ones


def _residual_axis(name: str) -> int | None:
    for axis, entry in enumerate(axes_of(name)):
        if entry is not None and entry[0] == "residual":
            return axis
    return None


def _flat(t: Tensor, axis: int) -> Tensor:
    """``t`` as (d, rest) with the residual axis first."""
    return t.movedim(axis, 0).reshape(t.shape[axis], -1)


def _with_bias(weight: Tensor, bias: Tensor) -> Tensor:
    return torch.cat([weight, bias[:, None]], dim=1)


def _apply(transform: Transform, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: transform.apply_tensor(n, t) for n, t in tensors.items()}


EXACT = 1e-12  # an objective this small means B is A up to rounding: nothing left to improve


class WeightMatcher:
    """Align model B to model A without data.

    Args:
        symmetries: ``"full"``, ``"permutation"`` or a set of kinds from
            :data:`hf_lmc.symmetry.KINDS` (e.g. ``{"residual_permutation", "heads", "mlp"}``).
        max_sweeps: upper bound on coordinate-descent sweeps.
        tol: stop when a sweep improves the objective by less than this (relative).
        dtype: dtype of the large products (float32 by default; the small solves always run
            in float64).
        progress: show a progress bar per sweep.

    ``fit(a, b)`` returns a :class:`Transform` ``T`` with ``T.apply(b) ~ a``.
    """

    def __init__(
        self, symmetries="full", *, max_sweeps: int = 6, tol: float = 1e-2, dtype: torch.dtype = torch.float32, progress: bool = True
    ):
        self.kinds = resolve_kinds(symmetries)
        self.dtype = dtype
        self.max_sweeps = max_sweeps
        self.tol = tol
        self.progress = progress
        self.history: list[float] = []

    # -- public ------------------------------------------------------------------------------

    def fit(self, a: CanonicalModel, b: CanonicalModel) -> Transform:
        spec = _check_compatible(a, b)
        transform, best, best_objective = Transform(), Transform(), float("inf")
        self.history = []
        for sweep in range(self.max_sweeps + 1):
            # One pass scores the current transform and gathers the next residual map's statistics.
            residual, objective = self._residual_pass(a, b, transform, use_layers=sweep > 0)
            self.history.append(objective)
            improved = objective < best_objective * (1 - self.tol)
            if objective < best_objective:
                best, best_objective = transform, objective
            if (sweep > 0 and not improved) or sweep == self.max_sweeps or best_objective < EXACT:
                break  # converged: return the best transform seen
            maps = {"residual": residual} if residual is not None else {}
            for i in tqdm(range(spec.num_layers), desc=f"weight matching, sweep {sweep + 1}", disable=not self.progress, leave=False):
                b_layer = _apply(Transform(maps).to(self.dtype), self._cast(b.group(i)))
                maps |= self._match_layer(spec, i, self._cast(a.group(i)), b_layer)
            transform = Transform(maps)
        return best

    def _cast(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(self.dtype) for k, v in tensors.items()}

    def objective(self, a: CanonicalModel, b: CanonicalModel, transform: Transform) -> float:
        """Mean relative squared distance ``|A_t - T(B)_t|^2 / |A_t|^2`` over tensors."""
        total, count = 0.0, 0
        for group in a.spec.groups():
            ga, gb = _double(a.group(group)), _apply(transform.to(torch.float64), _double(b.group(group)))
            for name, ta in ga.items():
                norm = ta.square().sum()
                if norm > 0:
                    total += ((ta - gb[name]).square().sum() / norm).item()
                    count += 1
        return total / max(count, 1)

    # -- residual ----------------------------------------------------------------------------

    def _residual_pass(self, a: CanonicalModel, b: CanonicalModel, transform: Transform, use_layers: bool):
        """Score the current transform and gather the next residual map's statistics, in one pass.

        With ``N`` the non-residual maps and ``R`` the (orthogonal) residual map, every tensor's
        distance follows from the same cross-covariance Procrustes needs:
        ``|A - R N B|^2 = |A|^2 + |N B|^2 - 2 <A N(B)^T, R>`` along the residual axis. So B is
        never transformed in full just to be scored.
        """
        spec = a.spec
        d = spec.hidden_size
        cross = torch.zeros(d, d, dtype=torch.float64)
        others = Transform({k: v for k, v in transform.maps.items() if k != "residual"}).to(self.dtype)
        current = transform.maps.get("residual")
        rotation = current.matrix.double() if current is not None else torch.eye(d, dtype=torch.float64)
        total, count = 0.0, 0
        for group in spec.groups():
            ga, gb = self._cast(a.group(group)), _apply(others, self._cast(b.group(group)))
            for name, ta in ga.items():
                norm_a = _squared_norm(ta)
                if norm_a == 0:
                    continue
                axis = _residual_axis(name)
                if axis is None:
                    distance = _squared_norm(ta - gb[name])
                else:
                    xa, xb = _flat(ta, axis), _flat(gb[name], axis)
                    product = (xa @ xb.T).double()
                    norm_b = _squared_norm(xb)
                    distance = norm_a + norm_b - 2 * (product * rotation).sum()
                    if use_layers or not isinstance(group, int):
                        cross += product / (norm_a * norm_b).sqrt().clamp_min(1e-300)
                total += (distance / norm_a).clamp_min(0).item()
                count += 1
        objective = total / max(count, 1)
        if "residual" in self.kinds:
            matrix = polar_fixing_ones(cross) if spec.centred else polar(cross)
        elif "residual_permutation" in self.kinds:
            matrix = torch.eye(d, dtype=torch.float64)[assign(cross)].T
        else:
            return None, objective
        return ResidualMap.from_matrix(matrix), objective

    # -- layers ------------------------------------------------------------------------------

    def _match_layer(self, spec: ArchSpec, i: int, a: dict[str, Tensor], b: dict[str, Tensor]) -> dict:
        p = f"layers.{i}."
        return {f"attn.{i}": self._match_attention(spec, p, a, b), f"mlp.{i}": self._match_mlp(spec, p, a, b)}

    def _match_attention(self, spec: ArchSpec, p: str, a: dict[str, Tensor], b: dict[str, Tensor]) -> AttentionMap:
        h, kv, g, dh = spec.num_heads, spec.num_kv_heads, spec.group_size, spec.head_dim

        def heads(model):
            q = _with_bias(model[p + "attn.q.weight"], model[p + "attn.q.bias"]).reshape(h, dh, -1)
            k = _with_bias(model[p + "attn.k.weight"], model[p + "attn.k.bias"]).reshape(kv, dh, -1)
            v = _with_bias(model[p + "attn.v.weight"], model[p + "attn.v.bias"]).reshape(kv, dh, -1)
            o = model[p + "attn.o.weight"].T.reshape(h, dh, -1)  # (h, dh, d): covector rows
            return q, k, v, o

        qa, ka, va, oa = heads(a)
        qb, kb, vb, ob = heads(b)
        small = {"dtype": torch.float64}  # per-head solves are tiny: do them exactly
        group = torch.arange(h) // g
        if "heads" in self.kinds:
            # Circuit similarities <Q_i^T K_i, Q_j^T K_j> = <Q_i Q_j^T, K_i K_j^T>, and for OV.
            qq = torch.einsum("iad,jbd->ijab", qa, qb)
            kk = torch.einsum("iad,jbd->ijab", ka, kb)[group][:, group]
            oo = torch.einsum("iad,jbd->ijab", oa, ob)
            vv = torch.einsum("iad,jbd->ijab", va, vb)[group][:, group]
            qk, ov = (qq * kk).sum((-1, -2)), (oo * vv).sum((-1, -2))
            qk = qk / (_self_norm(qa, ka[group])[:, None] * _self_norm(qb, kb[group])[None, :]).clamp_min(1e-300)
            ov = ov / (_self_norm(oa, va[group])[:, None] * _self_norm(ob, vb[group])[None, :]).clamp_min(1e-300)
            sim = qk + ov
            within = {}
            kv_sim = torch.empty(kv, kv, dtype=sim.dtype)
            for ia in range(kv):
                for jb in range(kv):
                    block = sim[ia * g : (ia + 1) * g, jb * g : (jb + 1) * g]
                    perm = assign(block)
                    within[ia, jb] = perm
                    kv_sim[ia, jb] = block[perm, torch.arange(g)].sum()
            kv_perm = assign(kv_sim)
            query_perm = torch.cat([kv_perm[jb] * g + within[int(kv_perm[jb]), jb] for jb in range(kv)])
        else:
            kv_perm, query_perm = torch.arange(kv), torch.arange(h)

        qk_blocks, ov_blocks = [], []
        for jb in range(kv):
            ia = int(kv_perm[jb])
            b_queries = range(jb * g, (jb + 1) * g)
            a_queries = [int(query_perm[j]) for j in b_queries]
            qa_data, qb_data = torch.cat([qa[j] for j in a_queries], 1).to(**small), torch.cat([qb[j] for j in b_queries], 1).to(**small)
            oa_data, ob_data = torch.cat([oa[j] for j in a_queries], 1).to(**small), torch.cat([ob[j] for j in b_queries], 1).to(**small)
            ka_i, kb_j, va_i, vb_j = ka[ia].to(**small), kb[jb].to(**small), va[ia].to(**small), vb[jb].to(**small)
            if "qk" in self.kinds:
                if spec.rotary_dim:
                    qk_blocks.append(match_rotary(qa_data, ka_i, qb_data, kb_j, spec.rotary_dim))
                else:
                    qk_blocks.append(match_gl(qa_data, ka_i, qb_data, kb_j))
            if "ov" in self.kinds:
                ov_blocks.append(match_gl(va_i, oa_data, vb_j, ob_data))
        eye = BlockMonomial.identity(kv, dh)
        qk = BlockMonomial(kv_perm, *_stack(qk_blocks)) if qk_blocks else BlockMonomial(kv_perm, eye.blocks, eye.inverse_blocks)
        ov = BlockMonomial(kv_perm, *_stack(ov_blocks)) if ov_blocks else BlockMonomial(kv_perm, eye.blocks, eye.inverse_blocks)
        return AttentionMap(qk, ov, query_perm)

    def _match_mlp(self, spec: ArchSpec, p: str, a: dict[str, Tensor], b: dict[str, Tensor]) -> MlpMap:
        n = spec.intermediate_size

        def units(model):
            up = _with_bias(model[p + "mlp.up.weight"], model[p + "mlp.up.bias"])
            down = model[p + "mlp.down.weight"].T
            gate = _with_bias(model[p + "mlp.gate.weight"], model[p + "mlp.gate.bias"]) if spec.gated_mlp else None
            return up, down, gate

        up_a, down_a, gate_a = units(a)
        up_b, down_b, gate_b = units(b)
        scale_a = scale_b = torch.ones(n, dtype=up_a.dtype)
        if spec.gated_mlp and "mlp_scale" in self.kinds:
            scale_a, scale_b = balanced_scales(up_a, down_a), balanced_scales(up_b, down_b)
        sim = (scale_a[:, None] * up_a) @ (scale_b[:, None] * up_b).T
        sim += (down_a / scale_a[:, None]) @ (down_b / scale_b[:, None]).T
        if gate_a is not None:
            sim += gate_a @ gate_b.T
        perm = assign(sim) if "mlp" in self.kinds else torch.arange(n)
        return MlpMap(BlockMonomial.scaled_permutation(perm, scale_b.double() / scale_a[perm].double()))


def _squared_norm(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t).double().square()


def _self_norm(vec: Tensor, cov: Tensor) -> Tensor:
    """``|vec_i^T cov_i|_F`` per head, via ``<vec vec^T, cov cov^T>``."""
    return ((vec @ vec.mT) * (cov @ cov.mT)).sum((-1, -2)).clamp_min(0).sqrt()


def _stack(pairs):
    return torch.stack([m for m, _ in pairs]), torch.stack([inv for _, inv in pairs])


def _double(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.double() for k, v in tensors.items()}


def _check_compatible(a: CanonicalModel, b: CanonicalModel) -> ArchSpec:
    if a.spec != b.spec:
        diffs = "; ".join(spec_differences(a.spec, b.spec))
        raise ValueError(f"models differ in architecture ({diffs}); hf_lmc merges models of one architecture and shape")
    return a.spec
