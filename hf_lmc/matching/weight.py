"""Data-free weight matching over the full symmetry group (docs/design.md §4).

Coordinate descent on ``sum_t |A_t - T(B)_t|^2 / |A_t|^2`` over canonical tensors ``t``:

1. residual map by Procrustes on the cross-covariance of every tensor touching the stream
   (the first sweep uses only embeddings and head, whose other axes are already aligned; where
   they span fewer directions than the stream, every layer's circuits complete it);
2. per layer, heads assigned by their QK and OV circuits (invariant to per-head maps, never
   materialising a d x d circuit), then per-KV-head QK / OV maps by balanced GL matching
   (RoPE-restricted where RoPE applies);
3. per layer, MLP units by linear assignment (SwiGLU: on balanced up/down, then signed scales).

Each sweep streams both models group by group; only d x d statistics and the transform are
kept, so neither model needs to be in memory as a whole. The large products run on ``device``
(a GPU when there is one); the small solves, and the transform returned, stay on the CPU.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from functools import partial

import torch
from torch import Tensor

from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.canonical.spec import ArchSpec, spec_differences
from hf_lmc.config.options import DEFAULT_ROTARY_SOLVE, DEFAULT_SYMMETRIES, ROTARY_SOLVES
from hf_lmc.matching.contract import PairwiseMatcher
from hf_lmc.matching.solvers import (
    CompletedPolar,
    Moments,
    assign,
    assign_heads,
    assign_similarity,
    balanced_scales,
    match_gl_moments,
    match_rotary_joint_moments,
    match_rotary_moments,
    polar,
    polar_fixing_ones,
    similarity_product,
)
from hf_lmc.symmetry import AttentionMap, BlockMonomial, MlpMap, ResidualMap, Transform, axes_of, resolve_kinds
from hf_lmc.utils.devices import compute_device, full_float32_products
from hf_lmc.utils.linalg import solve_side_by_side
from hf_lmc.utils.progress import bar as progress_bar


def _residual_axis(name: str) -> int | None:
    for axis, entry in enumerate(axes_of(name)):
        if entry is not None and entry[0] == "residual":
            return axis
    return None


def _flat(t: Tensor, axis: int) -> Tensor:
    """``t`` as (d, rest) with the residual axis first (a view for matrices: no copy)."""
    if t.dim() == 2 and axis == 1:
        return t.T
    return t.movedim(axis, 0).reshape(t.shape[axis], -1)


def _with_bias(weight: Tensor, bias: Tensor) -> Tensor:
    return torch.cat([weight, bias[:, None]], dim=1)


def _apply(transform: Transform, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {n: transform.apply_tensor(n, t) for n, t in tensors.items()}


EXACT = 1e-12  # an objective this small means B is A up to rounding: nothing left to improve


class WeightMatcher(PairwiseMatcher):
    """Align model B to model A without data.

    Args:
        symmetries: ``"full"``, ``"permutation"`` or a set of kinds from
            :data:`hf_lmc.symmetry.KINDS` (e.g. ``{"residual_permutation", "heads", "mlp"}``).
        max_sweeps: upper bound on coordinate-descent sweeps.
        tol: stop when refitting the residual map after a sweep improves the objective by less
            than this (relative): the layer maps would not move either.
        dtype: dtype of the large products (float32 by default; the small solves always run
            in float64).
        similarity_dtype: dtype of the products behind the F x F MLP unit and the head
            similarities (bfloat16 by default: they only rank units and heads, and bfloat16
            products run several times faster on CPUs).
        progress: show a progress bar per sweep.
        device: where each layer's products run (``"cuda"``, ``"cpu"``, ...; default: the
            current CUDA device when there is one, else the CPU). Layers are moved there one
            at a time. The per-head solves run on the CPU, up to ``torch.get_num_threads()``
            side by side, and so does scipy's part of each assignment.
        solver_threads: how many layers' MLP unit assignments (scipy, on the CPU) run on
            threads of their own while the next layers' products go on; each holds its layer
            until it is done. Default: half of ``torch.get_num_threads()``, at least 1 and at
            most 4. ``0`` solves each in turn, in line. The result is the same either way.
        rotary_solve: how a RoPE head's per-pair scale-rotations are solved, one of
            :data:`hf_lmc.config.options.ROTARY_SOLVES`: ``"moments"`` (each model's pair balanced on
            its own, the angle by Procrustes) or ``"joint"`` (Tran et al.'s appendix G.1: the
            least-squares map of Q and K together). Both recover twins exactly.

    ``match(a, b)`` returns a :class:`Transform` ``T`` with ``T.apply(b) ~ a``, on the CPU;
    ``fit([a, b])`` returns ``[Transform(), T]`` (:class:`~hf_lmc.matching.contract.PairwiseMatcher`).
    """

    def __init__(
        self,
        symmetries=DEFAULT_SYMMETRIES,
        *,
        max_sweeps: int = 6,
        tol: float = 2e-2,
        dtype: torch.dtype = torch.float32,
        similarity_dtype: torch.dtype = torch.bfloat16,
        progress: bool = True,
        device: str | torch.device | None = None,
        solver_threads: int | None = None,
        rotary_solve: str = DEFAULT_ROTARY_SOLVE,
    ):
        if solver_threads is not None and solver_threads < 0:
            raise ValueError(f"solver_threads must be >= 0, got {solver_threads}")
        if rotary_solve not in ROTARY_SOLVES:
            raise ValueError(f"unknown rotary_solve {rotary_solve!r}; choose from {', '.join(ROTARY_SOLVES)}")
        self.rotary_solve = rotary_solve
        self.kinds = resolve_kinds(symmetries)
        self.device = compute_device(device)
        self.dtype = dtype
        self.similarity_dtype = similarity_dtype
        self.max_sweeps = max_sweeps
        self.tol = tol
        self.progress = progress
        self.solver_threads = solver_threads
        self.history: list[float] = []

    # -- public ------------------------------------------------------------------------------

    def match(self, a: CanonicalModel, b: CanonicalModel) -> Transform:
        """B's transform ``T`` with ``T.apply(b) ~ a`` (on the CPU)."""
        with full_float32_products():
            return self._fit(a, b)

    def _fit(self, a: CanonicalModel, b: CanonicalModel) -> Transform:
        spec = _check_compatible(a, b)
        self.history = []
        # Embeddings and head: their only symmetry is the residual map, so their statistics are
        # gathered once and seed the first residual estimate.
        fixed = _ResidualStats(spec.hidden_size, self.device)
        for group in ("embed", "head"):
            fixed.add(self._cast(a.group(group)), self._cast(b.group(group)))
        residual = self._first_residual(spec, a, b, fixed)
        layer_maps: dict = {}
        best, best_objective = Transform(), float("inf")
        for sweep in range(self.max_sweeps):
            stats = fixed.copy()
            rotate = Transform({"residual": residual} if residual is not None else {}).to(device=self.device)
            self._sweep(spec, a, b, rotate, stats, layer_maps, desc=f"weight matching, sweep {sweep + 1}")
            # One pass scores the layer maps under the current residual map and under its refit.
            current = stats.objective(residual)
            refit = self._solve_residual(spec, stats)
            predicted = stats.objective(refit)
            self.history += [current, predicted]
            for objective, r in ((current, residual), (predicted, refit)):
                if objective < best_objective:
                    best_objective = objective
                    best = Transform(layer_maps | ({"residual": r} if r is not None else {}))
            # A residual refit that barely helps will not move the layer maps either: stop.
            if not predicted < current * (1 - self.tol) or best_objective < EXACT:
                break
            residual = refit
        return best

    def _sweep(
        self,
        spec: ArchSpec,
        a: CanonicalModel,
        b: CanonicalModel,
        rotate: Transform,
        stats: _ResidualStats,
        layer_maps: dict,
        desc: str,
    ) -> None:
        """Match every layer under the residual map ``rotate``: the maps go into ``layer_maps``,
        the layers (B's with them applied) into ``stats``.

        Within a sweep no layer's maps depend on another's, so a layer's MLP assignment (scipy,
        on the CPU, seconds at thousands of units) is solved on a worker thread while the next
        layers' products run. Layers are added to ``stats`` in order, as their assignments
        finish, so the sums and the result are those of a sweep that solves each in turn.
        """
        threads = self.solver_threads
        if threads is None:
            threads = min(4, max(1, torch.get_num_threads() // 2))
        solver = ThreadPoolExecutor(threads, thread_name_prefix="hf_lmc-assign") if threads else _InLine()
        pending: deque = deque()  # (layer, its tensors, attention map, MLP map being solved), oldest first

        def add_oldest():
            i, ga, gb, attention, mlp = pending.popleft()
            maps = {f"attn.{i}": attention, f"mlp.{i}": mlp.result()}
            layer_maps.update(maps)
            stats.add(ga, gb, Transform(maps).to(self.dtype, self.device))

        try:
            for i in progress_bar(range(spec.num_layers), desc=desc, show=self.progress, leave=False):
                ga, gb = self._cast(a.group(i)), self._cast(b.group(i))
                pending.append((i, ga, gb, *self._match_layer(spec, i, ga, gb, rotate, solver)))
                del ga, gb
                if len(pending) > threads:  # a layer per worker in flight, no more
                    add_oldest()
            while pending:
                add_oldest()
        finally:
            solver.shutdown(wait=True, cancel_futures=True)

    def _cast(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(device=self.device, dtype=self.dtype) for k, v in tensors.items()}

    def _moved(self, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
        return {k: v.to(self.device) for k, v in tensors.items()}

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

    def _solve_residual(self, spec: ArchSpec, stats: _ResidualStats) -> ResidualMap | None:
        d, cross = spec.hidden_size, stats.cross
        if "residual" in self.kinds:  # the d x d SVD where the statistics are: a GPU's beats one CPU thread's
            matrix = (polar_fixing_ones(cross) if spec.centred else polar(cross)).cpu()
        elif "residual_permutation" in self.kinds:
            matrix = torch.eye(d, dtype=torch.float64, device="cpu")[assign(cross)].T
        else:
            return None
        return ResidualMap.from_matrix(matrix)

    def _first_residual(self, spec: ArchSpec, a: CanonicalModel, b: CanonicalModel, fixed: _ResidualStats):
        """The residual map the first sweep matches layers under.

        Embeddings and head fix it only on the directions they span. Where they span fewer
        than the stream (a vocabulary or patch smaller than the width), the rest is arbitrary,
        and a wrong start there can leave coordinate descent in a local optimum, even for a
        twin. The free directions are chosen from every layer's circuits, which no layer map
        moves (:func:`_circuits`); the directions the embeddings and head fix are kept. Only
        when some directions are free does this read the layers: one extra pass before the
        first sweep.
        """
        if "residual" not in self.kinds:
            return self._solve_residual(spec, fixed)
        # Where the statistics are, like the refits: a d x d SVD is slow on one CPU thread at LLM widths.
        completion = CompletedPolar(fixed.cross, fixing_ones=spec.centred)
        for i in range(spec.num_layers if completion.free else 0):
            circuits = zip(_circuits(spec, i, self._moved(a.group(i))), _circuits(spec, i, self._moved(b.group(i))))
            for circuit_a, circuit_b in circuits:
                completion.add(circuit_a, circuit_b)
        return ResidualMap.from_matrix(completion.solve().cpu())

    # -- layers ------------------------------------------------------------------------------

    def _match_layer(
        self, spec: ArchSpec, i: int, a: dict[str, Tensor], b: dict[str, Tensor], rotate: Transform, solver: Executor
    ) -> tuple[AttentionMap, Future[MlpMap]]:
        """Layer ``i``'s attention map and (being solved on ``solver``) MLP map, for B's layer
        seen through the residual map."""
        p = f"layers.{i}."
        attn = {n: rotate.apply_tensor(n, t) for n, t in b.items() if n.startswith(p + "attn.")}
        attention = self._match_attention(spec, p, a, attn)
        del attn  # B's rotated attention weights are not needed for the MLP
        mlp = {n: t for n, t in b.items() if n.startswith(p + "mlp.")}
        return attention, self._match_mlp(spec, p, a, mlp, rotate, solver)

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
        group = torch.arange(h, device=self.device) // g
        if "heads" in self.kinds:
            # Heads are ranked by circuit similarities from (heads, heads, dh, dh) cross blocks and
            # (heads, dh, dh) self blocks: one matmul each in similarity_dtype (they only rank
            # heads), summed in float32.
            low = [x.to(self.similarity_dtype) for x in (qa, ka, va, oa, qb, kb, vb, ob)]
            qq, kk, vv, oo = (_block_products(x, y).float() for x, y in zip(low[:4], low[4:]))
            self_a = [(x @ x.mT).float() for x in low[:4]]
            self_b = [(x @ x.mT).float() for x in low[4:]]
            del low
            # Circuit similarities <Q_i^T K_i, Q_j^T K_j> = <Q_i Q_j^T, K_i K_j^T>, and for OV.
            qk = (qq * kk[group][:, group]).sum((-1, -2)) / _circuit_norms(
                self_a[0], self_a[1][group], self_b[0], self_b[1][group]
            )
            ov = (oo * vv[group][:, group]).sum((-1, -2)) / _circuit_norms(
                self_a[3], self_a[2][group], self_b[3], self_b[2][group]
            )
            kv_perm, query_perm = assign_heads(qk + ov, kv)
        else:
            kv_perm, query_perm = torch.arange(kv, device="cpu"), torch.arange(h, device="cpu")

        # The per-KV-head maps must be exact for twins: their moments are taken in float64, one
        # KV head's slices at a time (a whole layer in float64 is 8 d^2 doubles at peak).
        def rows(x: Tensor, heads: Tensor) -> Tensor:  # the heads' (dh, m) data side by side
            return x[heads.to(x.device)].transpose(0, 1).reshape(dh, -1).double()

        def moments(*data: Tensor) -> Moments:  # (dh, dh) products where the data is, solved on the CPU
            return Moments.of(*data).to("cpu")

        # Moments on the device, head by head; then every head's solve at once, side by side.
        qk_jobs, ov_jobs = [], []
        rotary_solver = match_rotary_joint_moments if self.rotary_solve == "joint" else match_rotary_moments
        for jb in range(kv):
            ia = int(kv_perm[jb])
            b_queries = torch.arange(jb * g, (jb + 1) * g, device="cpu")
            a_queries = query_perm[b_queries]
            if "qk" in self.kinds:
                qk_moments = moments(rows(qa, a_queries), ka[ia].double(), rows(qb, b_queries), kb[jb].double())
                qk_jobs.append(
                    partial(rotary_solver, qk_moments, spec.rotary_dim)
                    if spec.rotary_dim
                    else partial(match_gl_moments, qk_moments)
                )
            if "ov" in self.kinds:
                ov_moments = moments(va[ia].double(), rows(oa, a_queries), vb[jb].double(), rows(ob, b_queries))
                ov_jobs.append(partial(match_gl_moments, ov_moments))
        solved = solve_side_by_side(qk_jobs + ov_jobs)
        qk_blocks, ov_blocks = solved[: len(qk_jobs)], solved[len(qk_jobs) :]
        eye = BlockMonomial.identity(kv, dh, device="cpu")
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

    def _match_mlp(
        self, spec: ArchSpec, p: str, a: dict[str, Tensor], b: dict[str, Tensor], rotate: Transform, solver: Executor
    ) -> Future[MlpMap]:
        """Units by linear assignment on ``<up_a, up_b> + <down_a, down_b> (+ <gate_a, gate_b>)``.

        SwiGLU units also have a sign: ``(up, down) -> (-up, -down)`` leaves
        ``SiLU(gate x) (up x) down`` alone, and independently trained models pick it at random
        per unit. So for SwiGLU the up/down part counts by its size,
        ``<gate_a, gate_b> + |<up_a, up_b> + <down_a, down_b>|``, and each matched unit takes
        that part's sign with its scale. Without it, a unit whose partner is flipped scores
        against it, and averaging the two cancels their up and down rows.

        B's residual map is applied here, in ``similarity_dtype``: the F x F similarity only
        ranks units, so bfloat16 products (several times faster on CPUs) do not change it.
        SwiGLU scales come from row norms, which the orthogonal residual map leaves alone.
        The similarity is computed here; its assignment is solved on ``solver``.
        """
        n, low = spec.intermediate_size, self.similarity_dtype

        def units(model, dtype, rotate=None):
            def weight(name):
                t = model[p + name].to(dtype)
                return rotate.apply_tensor(p + name, t) if rotate is not None else t

            up = _with_bias(weight("mlp.up.weight"), model[p + "mlp.up.bias"].to(dtype))
            down = weight("mlp.down.weight").T
            gate = (
                _with_bias(weight("mlp.gate.weight"), model[p + "mlp.gate.bias"].to(dtype)) if spec.gated_mlp else None
            )
            return up, down, gate

        scaled = spec.gated_mlp and "mlp_scale" in self.kinds
        scale_a = scale_b = torch.ones(n, dtype=torch.float64, device="cpu")
        if scaled:
            scale_a = balanced_scales(*units(a, self.dtype)[:2]).double().cpu()
            scale_b = balanced_scales(*units(b, self.dtype)[:2]).double().cpu()

        def mlp_map(perm: Tensor, sign: Tensor | None = None) -> MlpMap:
            scale = scale_b / scale_a[perm]
            return MlpMap(BlockMonomial.scaled_permutation(perm, scale if sign is None else sign * scale))

        if "mlp" not in self.kinds:
            return _InLine().submit(mlp_map, torch.arange(n, device="cpu"))

        def whole(model, rotate=None):  # one row per unit: up, down (and gate)
            return torch.cat([t for t in units(model, low, rotate) if t is not None], 1)

        if not scaled:  # no sign to choose: one product of the whole rows
            similarity = similarity_product(whole(a), whole(b, rotate))
            return solver.submit(lambda: mlp_map(assign_similarity(similarity)))

        def balanced(up, down, gate, scale):  # one row per unit: balanced up and down; the gate
            scale = scale.to(device=up.device, dtype=low)[:, None]
            return torch.cat([scale * up, down / scale], 1), gate

        (odd_a, gate_a), (odd_b, gate_b) = balanced(*units(a, low), scale_a), balanced(*units(b, low, rotate), scale_b)
        similarity = similarity_product(odd_a, odd_b)  # flips sign with either unit
        flipped = similarity < 0  # one byte a pair: where a matched unit takes the sign -1
        similarity.abs_().add_(similarity_product(gate_a, gate_b))

        def solve() -> MlpMap:
            perm = assign_similarity(similarity)
            chosen = flipped[perm.to(flipped.device), torch.arange(n, device=flipped.device)].cpu()
            return mlp_map(perm, 1.0 - 2.0 * chosen.double())

        return solver.submit(solve)


class _InLine(Executor):
    """An executor that runs each job at once, in the caller's thread (``solver_threads=0``)."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as err:  # noqa: BLE001 (any job error is handed to whoever asks for the result, as a pool does)
            future.set_exception(err)
        return future


class _ResidualStats:
    """Everything the residual step needs, and enough to score *any* residual map.

    With ``x_a``, ``x_b`` a tensor flattened to (d, rest) along its residual axis and B's other
    maps applied, ``|x_a - R x_b|^2 = |x_a|^2 + |x_b|^2 - 2 <x_a x_b^T, R>`` for orthogonal
    ``R``. So one pass over the models yields the Procrustes target (``cross``, each tensor
    weighted by ``1/(|x_a| |x_b|)``) and the objective of every ``R`` (``weighted``, each
    tensor weighted by ``1/|x_a|^2``, plus the constant terms).
    """

    def __init__(self, d: int, device: torch.device):
        self.cross = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.weighted = torch.zeros(d, d, dtype=torch.float64, device=device)
        self.constant = 0.0
        self.count = 0

    def copy(self) -> _ResidualStats:
        other = _ResidualStats(self.cross.shape[0], self.cross.device)
        other.cross, other.weighted = self.cross.clone(), self.weighted.clone()
        other.constant, other.count = self.constant, self.count
        return other

    def add(self, a: dict[str, Tensor], b: dict[str, Tensor], transform: Transform | None = None) -> None:
        """Add one group's tensors, B's with ``transform`` (every map but the residual one) applied.

        B's tensors are transformed one at a time, so a transformed group never sits in memory.
        """
        for name, ta in a.items():
            norm_a = _squared_norm(ta)
            if norm_a == 0:
                continue
            tb = transform.apply_tensor(name, b[name]) if transform is not None else b[name]
            axis = _residual_axis(name)
            if axis is None:
                self.constant += (_squared_norm(ta - tb) / norm_a).item()
            else:
                xa, xb = _flat(ta, axis), _flat(tb, axis)
                product = (xa @ xb.T).double()
                norm_b = _squared_norm(xb)
                self.cross += product / (norm_a * norm_b).sqrt().clamp_min(1e-300)
                self.weighted += product / norm_a
                self.constant += ((norm_a + norm_b) / norm_a).item()
            self.count += 1

    def objective(self, residual: ResidualMap | None) -> float:
        """Mean relative squared distance with residual map ``residual`` (identity if None)."""
        inner = (
            (self.weighted * residual.matrix.to(self.weighted)).sum() if residual is not None else self.weighted.trace()
        )
        return max(self.constant - 2 * inner.item(), 0.0) / max(self.count, 1)


def _circuits(spec: ArchSpec, i: int, group: dict[str, Tensor]) -> list[Tensor]:
    """Layer ``i``'s d x d circuits, which the residual map ``R`` moves to ``R C R^T`` and no
    other map moves: ``sum_h W_Q,h^T W_K,h`` and ``sum_h W_O,h W_V,h`` (per-head GL and
    RoPE-commuting maps cancel inside each head, head permutations in the sum),
    ``W_down W_up`` (unit permutations and SwiGLU scales cancel) and, for SwiGLU, the gate's
    Gram matrix ``W_gate^T W_gate``. Float64, biases left out.
    """
    p = f"layers.{i}."
    h, kv, dh = spec.num_heads, spec.num_kv_heads, spec.head_dim
    kv_of_query = torch.arange(h, device=group[p + "attn.q.weight"].device) // spec.group_size
    q = group[p + "attn.q.weight"].double().reshape(h, dh, -1)
    k = group[p + "attn.k.weight"].double().reshape(kv, dh, -1)[kv_of_query]
    v = group[p + "attn.v.weight"].double().reshape(kv, dh, -1)[kv_of_query]
    o = group[p + "attn.o.weight"].double().T.reshape(h, dh, -1)
    circuits = [torch.einsum("hjd,hje->de", q, k), torch.einsum("hjd,hje->de", o, v)]
    circuits.append(group[p + "mlp.down.weight"].double() @ group[p + "mlp.up.weight"].double())
    if p + "mlp.gate.weight" in group:
        gate = group[p + "mlp.gate.weight"].double()
        circuits.append(gate.T @ gate)
    return circuits


def _squared_norm(t: Tensor) -> Tensor:
    return torch.linalg.vector_norm(t).double().square()


def _block_products(x: Tensor, y: Tensor) -> Tensor:
    """``out[i, j] = x_i y_j^T`` for head blocks ``x``: (n, b, m), as one (n b) x (n b) matmul."""
    n, b, _ = x.shape
    return (x.reshape(n * b, -1) @ y.reshape(n * b, -1).T).reshape(n, b, n, b).transpose(1, 2)


def _circuit_norms(vec_a: Tensor, cov_a: Tensor, vec_b: Tensor, cov_b: Tensor) -> Tensor:
    """``|V_i^T C_i| |V'_j^T C'_j|`` for every head pair, from per-head moments ``V V^T``, ``C C^T``."""
    norm_a = (vec_a * cov_a).sum((-1, -2)).clamp_min(0).sqrt()
    norm_b = (vec_b * cov_b).sum((-1, -2)).clamp_min(0).sqrt()
    # A zero head (padded in by hf_lmc.canonical.widths) has zero similarity to every head: 0 / tiny, not 0 / 0.
    return (norm_a[:, None] * norm_b[None, :]).clamp_min(torch.finfo(norm_a.dtype).tiny)


def _stack(pairs):
    return torch.stack([m for m, _ in pairs]), torch.stack([inv for _, inv in pairs])


def _double(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    return {k: v.double() for k, v in tensors.items()}


def _check_compatible(a: CanonicalModel, b: CanonicalModel) -> ArchSpec:
    if a.spec != b.spec:
        diffs = "; ".join(spec_differences(a.spec, b.spec))
        raise ValueError(
            f"models differ in architecture ({diffs}); hf_lmc matches models of one shape "
            f"(models of two widths: hf_lmc.canonical.widths.to_common_shape(a, b) first)"
        )
    return a.spec
