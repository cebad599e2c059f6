"""Tensor-parallel layers for a shared build: the tokens' activations travel instead of the merged weights.

A shared build (:mod:`hf_lmc.learned.sharing`) has each of N processes compute its rows of
every interpolated weight and all-gathers assemble them, so that each process runs the whole
layer on its own tokens: every layer's weights cross between the processes three times a step
(forward, recomputation, and the gradient's reduce-scatter). Where the launch's tokens are fewer
than a layer's input features, which is where the build (``d^3`` per matrix) and not the tokens
(``T d^2``) dominates a step, it moves fewer bytes to bring the tokens to the rows instead:

1. the processes' batches are all-gathered once, and every process runs the model's layers on
   the launch's whole batch;
2. each linear of a layer runs with this process's built rows of its weight alone, its share
   of the output features, and an all-gather along the features assembles the whole output:
   ``T x d_out`` numbers for the launch's ``T`` tokens instead of ``d_out x d_in``;
3. backward, the adjoint reduce-scatter sums every process's gradient of its features.

Norms, attention and activations run on the whole batch in every process (replicated: each
process's backward carries its own loss's share of their gradient, which the next
reduce-scatter sums).

Where the attention reads its number of heads off its projections' widths (the adapter's
``heads_by_width``) and the key-value heads split evenly, the linears pair instead (Megatron's
column-then-row pairs): the query, key, value, up and gate projections run at the process's
output features as above, but their outputs stay there, so the attention runs on the
process's heads and the activation on its units; the output projections (attention and MLP)
run at the matching input features, built by columns
(:meth:`~hf_lmc.Transform.apply_columns`), and an all-reduce sums their partial outputs
(the bias added by one process). Backward, the all-reduce of the processes' shares of the
output's gradient hands every process the whole of it for its features. That moves two
``T x d`` sums a layer instead of every linear's output, and replicates neither attention nor
activation. After the last layer each process keeps its own tokens' hidden states, so
the head, the loss and DDP see what they see without this. Every built tensor's gradient is
then that of the processes' summed losses, as in a shared build that gathers the weights:
the same transforms, to rounding.

Which of a layer's HF tensors are which canonical rows is read off the adapter's own export
(:func:`plan_layer`), not written per family: canonical tensors whose rows carry their own
index are exported, and every linear's weight must come out with each output feature one
canonical row, unchanged (checked again on random tensors); its bias one canonical entry; every
other tensor a constant (the identity norms of the canonical form). A layer whose export does
anything else runs with its weights gathered. The collectives are c10d's ``all_gather_single``
and ``reduce_scatter_single`` in a small autograd function, as for the rows' gathers: an
output's features come out of the processes in the canonical rows' order, which the export may
interleave (GPT-NeoX's fused query-key-value), so one index puts them in the module's order.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers.pytorch_utils import Conv1D

from hf_lmc.learned.sharing import RowSharing, owner_of, share_of
from hf_lmc.symmetry import axes_of

#: Rows carry ``code * _BASE + row + 1`` in the traced export: float64 holds it exactly.
_BASE = 1 << 24


class _Permuted(torch.autograd.Function):
    """Rows put in another order; backward, the gradient put back (a gather both ways, where
    ``index_select``'s backward would zero-fill and scatter)."""

    @staticmethod
    def forward(ctx, rows: Tensor, order: Tensor, inverse: Tensor) -> Tensor:
        ctx.inverse = inverse
        return rows.index_select(0, order)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad.index_select(0, ctx.inverse), None, None


@dataclass(frozen=True)
class _Rows:
    """A process's rows of one linear's weight: its rows of the canonical matrices ``names``,
    concatenated in that order, put in the module's feature order by ``order`` (``None``:
    they are in it), ``inverse`` putting them back."""

    names: tuple[str, ...]
    order: Tensor | None = None
    inverse: Tensor | None = None

    def take(self, local: Mapping[str, Tensor]) -> Tensor:
        parts = [local[name] for name in self.names]
        rows = parts[0] if len(parts) == 1 else torch.cat(parts)
        if self.order is None:
            return rows
        return _Permuted.apply(rows, self.order.to(rows.device), self.inverse.to(rows.device))


@dataclass(frozen=True)
class FeatureLayout:
    """How one linear's output features are split over the processes and put back together.

    ``sizes[q]``: process ``q``'s number of features; ``order``: for each of the module's output
    features, its position in the processes' gathered outputs (each padded to ``max(sizes)``),
    or ``None`` where they already come in order.
    """

    sizes: tuple[int, ...]
    order: Tensor | None

    @property
    def width(self) -> int:
        return max(self.sizes)


@dataclass(frozen=True)
class _Linear:
    """One linear module of a layer, run on this process's output features."""

    weight: str  # its weight's HF name
    out_axis: int  # the weight's axis of output features: 0 for nn.Linear, 1 for Conv1D
    rows: _Rows  # this process's rows of the weight, from its rows of the canonical matrices
    bias: str | None  # its bias's HF name
    bias_names: tuple[str, ...]  # the whole canonical vectors its bias reads (none: a constant bias)
    bias_index: Tensor | None  # this process's entries of the bias in those vectors, concatenated
    own: Tensor  # this process's output features (indices into the module's)
    layout: FeatureLayout
    #: "out": the linear runs at this process's output features (its outputs gathered, or left
    #: at those features where a paired linear reads them); "in": at its input features, the
    #: output a partial sum that an all-reduce completes (``rows`` then holds its columns)
    split: str = "out"
    bias_here: bool = True  # an "in" linear's bias is added by one process, before the sum
    inputs: Tensor | None = None  # an "in" linear's input features here (indices into the module's)


@dataclass(frozen=True)
class LayerPlan:
    """A layer's tensor-parallel build for one process: which canonical rows it builds
    (``matrices``: this process's share of each; ``vectors``: whole), how they become its
    linears' HF tensors, and which HF tensors are constants."""

    matrices: tuple[str, ...]
    vectors: tuple[str, ...]
    linears: dict[str, _Linear]  # by module path, relative to the layer
    constants: tuple[str, ...]
    #: the matrices built by this process's columns (the paired "in" linears' weights), their
    #: columns as rows (``columns x rows``); ``matrices`` holds the rest, built by rows
    columns: tuple[str, ...] = ()

    @property
    def paired(self) -> bool:
        """Whether the layer's linears pair: each "out" linear's features stay on their process
        for the "in" linear that reads them (the layer runs on each process's heads and units)."""
        return bool(self.columns)

    def assemble(self, local: Mapping[str, Tensor], vectors: Mapping[str, Tensor], constants: Mapping[str, Tensor]):
        """The layer's HF tensors: each linear's at this process's features, the constants whole."""
        out = {name: constants[name] for name in self.constants}
        for linear in self.linears.values():
            taken = linear.rows.take(local)
            by_output = taken if linear.split == "out" else taken.T  # output features x input features
            out[linear.weight] = by_output if linear.out_axis == 0 else by_output.T
            if linear.bias is not None and linear.bias_names:
                whole = torch.cat([vectors[name] for name in linear.bias_names])
                out[linear.bias] = whole[linear.bias_index.to(whole.device)]
            elif linear.bias is not None:
                out[linear.bias] = constants[linear.bias][linear.own.to(constants[linear.bias].device)]
            if linear.bias is not None and not linear.bias_here:
                out[linear.bias] = torch.zeros_like(out[linear.bias])
        return out


def _out_axis(module: nn.Module | None) -> int | None:
    if isinstance(module, nn.Linear):
        return 0
    if isinstance(module, Conv1D):
        return 1
    return None


def _rows(
    sources: list[tuple[str, int]], own: list[int], sizes: Mapping[str, int], rank: int, count: int
) -> _Rows | None:
    """This process's rows of a linear whose feature ``j`` is row ``sources[j]`` of a canonical
    matrix (of ``sizes[name]`` rows; ``own``: its features): the concatenation of its whole
    shares of the matrices the linear reads, reordered, or ``None`` where its features are not
    exactly those rows once each. (An "in" linear's features are its input features, the
    matrices' columns as rows.)"""
    names = tuple(dict.fromkeys(name for name, _ in sources))
    offsets, total = {}, 0
    for name in names:
        share = share_of(sizes[name], rank, count)
        offsets[name] = total - share.start
        total += share.stop - share.start
    order = [offsets[sources[j][0]] + sources[j][1] for j in own]
    if sorted(order) != list(range(total)):
        return None
    if order == list(range(total)):
        return _Rows(names)
    order = torch.tensor(order, dtype=torch.long)
    return _Rows(names, order, torch.argsort(order))


def _decode(codes: Tensor, names: list[str]) -> list[tuple[str, int]] | None:
    """The ``(canonical name, row)`` each traced code names, or ``None`` if any is no code."""
    if not bool((codes == codes.round()).all()) or not bool((codes >= 1).all()):
        return None
    codes = codes.long() - 1
    index, rows = (codes // _BASE).tolist(), (codes % _BASE).tolist()
    if max(index) >= len(names):
        return None
    return [(names[k], r) for k, r in zip(index, rows)]


@dataclass(frozen=True)
class _Trace:
    """What :func:`plan_layer` read off a layer's export: the canonical tensors' names and
    shapes, whether vectors were traced, the coded export and the random inputs with their two
    exports, and the HF tensors found: each linear's weight (``path: (HF name, output axis,
    canonical row of each output feature)``), its bias's name, and the constants."""

    names: list[str]
    shapes: Mapping[str, torch.Size]
    vectors: bool
    codes: dict[str, Tensor]
    inputs: dict[str, Tensor]
    first: dict[str, Tensor]
    second: dict[str, Tensor]
    weights: dict[str, tuple[str, int, list[tuple[str, int]]]]
    biases: dict[str, str]
    constants: list[str]


def plan_layer(
    export: Callable[[dict[str, Tensor]], dict[str, Tensor]],
    shapes: Mapping[str, torch.Size],
    layer: nn.Module,
    prefix: str,
    rank: int,
    count: int,
    pairable: bool = False,
) -> LayerPlan | None:
    """The tensor-parallel plan of one layer for process ``rank`` of ``count``, read off
    ``export`` (the adapter's canonical-to-HF export of the layer, HF names starting with
    ``prefix``, the path of ``layer``), or ``None`` where the export is not row for row.

    The canonical tensors are exported three times, in float64 on the CPU: with each row of a
    matrix holding its own code (and each entry of a vector minus its code), and twice random.
    An HF weight of an ``nn.Linear`` or ``Conv1D`` must read one canonical matrix row per output
    feature (its codes constant along the row) and equal that row on the random tensors; its bias
    one vector entry per feature, or a constant; every other HF tensor the same on both random
    exports. Every canonical matrix must feed some linear. A family whose export refuses
    non-zero vectors (LLaMA's checks of absent biases) is traced with zero vectors.

    ``pairable``: the caller's word that the layer's attention runs on any share of whole heads
    this split gives. The linears then pair where each either opens a layer's own space (reads
    matrices whose rows are heads or units: "out") or closes it (one matrix whose rows are the
    residual, in order, and whose columns are heads or units: "in", traced a fourth time with
    the columns carrying the codes); otherwise, or with no "in" linear, the plan gathers.
    """
    names = list(shapes)
    matrices = [n for n in names if len(shapes[n]) >= 2]
    if not matrices or any(shapes[n][0] >= _BASE for n in names):
        return None

    def probe(kind: str, vectors: bool, seed: int = 0) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
        generator = torch.Generator().manual_seed(seed)
        tensors = {}
        for k, name in enumerate(names):
            shape = shapes[name]
            if len(shape) < 2 and not vectors:
                tensors[name] = torch.zeros(shape, dtype=torch.float64)
            elif kind == "codes":
                code = torch.arange(shape[0], dtype=torch.float64) + (k * _BASE + 1)
                code = code if len(shape) >= 2 else -code
                tensors[name] = code.reshape(-1, *[1] * (len(shape) - 1)).expand(shape).clone()
            elif kind == "columns":  # a matrix's columns carry the codes; vectors zero
                code = torch.arange(shape[1], dtype=torch.float64) + (k * _BASE + 1) if len(shape) == 2 else None
                tensors[name] = (
                    code.expand(shape).clone() if code is not None else torch.zeros(shape, dtype=torch.float64)
                )
            else:
                tensors[name] = torch.randn(shape, dtype=torch.float64, generator=generator)
        try:
            return tensors, export(tensors)
        except ValueError:
            return tensors, None

    vectors = True
    codes = probe("codes", vectors)[1]
    if codes is None:
        vectors = False
        codes = probe("codes", vectors)[1]
    inputs, first = probe("random", vectors, seed=0)
    second = probe("random", vectors, seed=1)[1]
    if codes is None or first is None or second is None:
        return None
    columns = probe("columns", vectors)[1] if pairable else None
    pairable = pairable and columns is not None

    def module_of(hf: str) -> tuple[str, str, nn.Module | None]:
        path, _, param = hf.removeprefix(prefix).rpartition(".")
        try:
            return path, param, layer.get_submodule(path)
        except AttributeError:
            return path, param, None

    weights, biases, constants = {}, {}, []
    for hf, traced in codes.items():
        path, param, module = module_of(hf)
        axis = _out_axis(module)
        if param == "weight" and axis is not None and traced.dim() == 2:
            by_feature = traced.movedim(axis, 0)
            if not bool((by_feature == by_feature[:, :1]).all()):
                return None  # a feature that mixes canonical rows
            sources = _decode(by_feature[:, 0], names)
            if sources is None or any(len(shapes[n]) < 2 for n, _ in sources):
                return None
            expected = torch.stack([inputs[n].reshape(shapes[n][0], -1)[r] for n, r in sources])
            if not torch.equal(first[hf].movedim(axis, 0), expected):
                return None  # rows scaled, or reordered within
            weights[path] = (hf, axis, sources)
        elif param == "bias" and axis is not None:
            biases[path] = hf
        elif torch.equal(first[hf], second[hf]):
            constants.append(hf)
        else:
            return None
    if {n for _, _, sources in weights.values() for n, _ in sources} != set(matrices) or set(biases) - set(weights):
        return None  # a matrix no linear reads, or a bias of a module that is no linear run here
    trace = _Trace(names, shapes, vectors, codes, inputs, first, second, weights, biases, constants)

    def inner(name: str, axis: int) -> bool:  # the axis is a layer's own space (heads, units), not the residual
        entry = axes_of(name)[axis]
        return entry is not None and entry[0] != "residual"

    splits, inputs_of = {}, {}  # each linear's split in a paired plan, and an "in" linear's input features
    for path, (hf, axis, sources) in weights.items() if pairable else ():
        read = {n for n, _ in sources}
        if all(inner(n, 0) for n in read):
            splits[path] = "out"
            continue
        (name,) = read if len(read) == 1 else (None,)
        if name is None or inner(name, 0) or not inner(name, 1) or sources != [(name, r) for r in range(len(sources))]:
            break  # a linear that neither opens nor closes a layer's own space: no pairs
        by_input = columns[hf].movedim(1 - axis, 0)
        if not bool((by_input == by_input[:, :1]).all()):
            break
        read_in = _decode(by_input[:, 0], names)
        if read_in is None or {n for n, _ in read_in} != {name}:
            break
        if not torch.equal(first[hf].movedim(1 - axis, 0), inputs[name][:, [c for _, c in read_in]].T):
            break
        splits[path], inputs_of[path] = "in", read_in
    else:
        if "in" in splits.values():
            plan = _build_plan(trace, splits, inputs_of, rank, count)
            if plan is not None:
                return plan
    return _build_plan(trace, {}, {}, rank, count)


def _build_plan(trace: _Trace, splits: dict[str, str], inputs_of, rank: int, count: int) -> LayerPlan | None:
    """The plan from :func:`plan_layer`'s traces: every linear at this process's output
    features (``splits`` empty: their outputs gathered), or paired, each linear at the split
    ``splits`` names ("in": at the input features ``inputs_of`` reads), or ``None``."""
    shapes, names, codes, inputs, first = trace.shapes, trace.names, trace.codes, trace.inputs, trace.first
    row_counts = {n: shape[0] for n, shape in shapes.items()}
    column_counts = {n: shape[1] for n, shape in shapes.items() if len(shape) >= 2}
    linears, used_vectors, constants = {}, set(), list(trace.constants)
    for path, (hf, axis, sources) in trace.weights.items():
        split = splits.get(path, "out")
        if split == "in":  # every output feature here, this process's input features
            by_input = inputs_of[path]
            own_in = [j for j, (n, c) in enumerate(by_input) if owner_of(c, column_counts[n], count) == rank]
            rows = _rows(by_input, own_in, column_counts, rank, count)
            owners = [rank] * len(sources)
        else:
            owners = [owner_of(r, row_counts[n], count) for n, r in sources]
        own = [j for j, q in enumerate(owners) if q == rank]
        if split == "out":
            rows = _rows(sources, own, row_counts, rank, count)
        if rows is None:
            return None
        sizes = tuple(owners.count(q) for q in range(count))
        seen, order = [0] * count, []
        for q in owners:
            order.append(q * max(sizes) + seen[q])
            seen[q] += 1
        bias, bias_names, bias_index = trace.biases.get(path), (), None
        if bias is not None:
            bias_sources = _decode(-codes[bias], names) if trace.vectors else None
            if bias_sources is not None and len(bias_sources) == len(sources):
                if not torch.equal(first[bias], torch.stack([inputs[n][r] for n, r in bias_sources])):
                    return None
                bias_names = tuple(dict.fromkeys(n for n, _ in bias_sources))
                starts = dict(zip(bias_names, [0, *itertools.accumulate(shapes[n][0] for n in bias_names)]))
                bias_index = torch.tensor(
                    [starts[bias_sources[j][0]] + bias_sources[j][1] for j in own], dtype=torch.long
                )
                used_vectors.update(bias_names)
            elif torch.equal(first[bias], trace.second[bias]):
                constants.append(bias)  # sliced to this process's features when assembled
            else:
                return None
        linears[path] = _Linear(
            weight=hf,
            out_axis=axis,
            rows=rows,
            bias=bias,
            bias_names=bias_names,
            bias_index=bias_index,
            own=torch.tensor(own, dtype=torch.long),
            layout=FeatureLayout(sizes, None if order == list(range(count * max(sizes))) else torch.tensor(order)),
            split=split,
            bias_here=split == "out" or rank == 0,
            inputs=torch.tensor(own_in, dtype=torch.long) if split == "in" else None,
        )
    by_columns = {n for path, read in inputs_of.items() for n, _ in read}
    matrices = [n for n in shapes if len(shapes[n]) >= 2]
    return LayerPlan(
        matrices=tuple(n for n in matrices if n not in by_columns),
        vectors=tuple(sorted(used_vectors)),
        linears=linears,
        constants=tuple(constants),
        columns=tuple(n for n in matrices if n in by_columns),
    )


class _GatheredFeatures(torch.autograd.Function):
    """A linear's whole output from every process's features of it; backward, the summing
    reduce-scatter that hands each process the launch's gradient of its features."""

    @staticmethod
    def forward(ctx, local: Tensor, layout: FeatureLayout, sharing: RowSharing, own: int) -> Tensor:
        ctx.layout, ctx.sharing, ctx.own, ctx.lead = layout, sharing, own, local.shape[:-1]
        tokens, width, count = ctx.lead.numel(), layout.width, sharing.count
        flat = local.reshape(tokens, local.shape[-1])
        if flat.shape[1] < width:
            flat = torch.cat([flat, flat.new_zeros((tokens, width - flat.shape[1]))], 1)
        every = flat.new_empty((count * tokens, width))
        dist.all_gather_single(every, flat.contiguous(), group=sharing.group)
        whole = every.view(count, tokens, width).permute(1, 0, 2).reshape(tokens, count * width)
        if layout.order is not None:
            whole = whole.index_select(1, layout.order.to(whole.device))
        return whole.reshape(*ctx.lead, whole.shape[1])

    @staticmethod
    def backward(ctx, grad: Tensor):
        layout, sharing = ctx.layout, ctx.sharing
        tokens, width, count = ctx.lead.numel(), layout.width, sharing.count
        flat = grad.reshape(tokens, grad.shape[-1])
        if layout.order is not None:
            wide = flat.new_zeros((tokens, count * width))
            wide.index_copy_(1, layout.order.to(flat.device), flat)
            flat = wide
        send = flat.reshape(tokens, count, width).permute(1, 0, 2).reshape(count * tokens, width)
        mine = flat.new_empty((tokens, width))
        dist.reduce_scatter_single(mine, send, op=dist.ReduceOp.SUM, group=sharing.group)
        return mine[:, : ctx.own].reshape(*ctx.lead, ctx.own), None, None, None


def gathered_features(local: Tensor, layout: FeatureLayout, sharing: RowSharing) -> Tensor:
    """The whole output of a linear from this process's features of it (``local``, ``... x
    layout.sizes[rank]``), in the module's feature order; differentiable."""
    return _GatheredFeatures.apply(local, layout, sharing, layout.sizes[sharing.rank])


class _Summed(torch.autograd.Function):
    """The sum over the processes of a paired "in" linear's partial outputs (an all-reduce);
    backward, the all-reduce of the processes' gradients: each holds its own loss's share of
    the replicated output's gradient, and the partial output of its features takes the sum."""

    @staticmethod
    def forward(ctx, partial: Tensor, sharing: RowSharing) -> Tensor:
        ctx.sharing = sharing
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=sharing.group)
        return total

    @staticmethod
    def backward(ctx, grad: Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.sharing.group)
        return total, None


def summed_features(partial: Tensor, sharing: RowSharing) -> Tensor:
    """The whole output of a paired "in" linear from this process's partial output (its input
    features' share of the product, the bias added by one process); differentiable."""
    return _Summed.apply(partial, sharing)
