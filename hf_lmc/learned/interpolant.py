"""The interpolant ``(1 - alpha) T_A(A) + alpha T_B(B)`` evaluated by the stock HF model, differentiably.

With M endpoints it is the point ``sum_k w_k T_k(theta_k)`` of the simplex they span: the same
code, with the two-model path as the case ``w = (1 - alpha, alpha)``.

Learned matching trains the parameters of ``T`` through the loss of the interpolated model on
real batches (docs/design.md §4). Nothing here re-implements a forward pass: canonical tensors are
exported with the same code as :func:`hf_lmc.to_hf` (the adapter's ``hf_group``), and the stock
model class runs them through :func:`torch.func.functional_call`.

Memory (docs/design.md §5): the model class is a weightless skeleton (its parameter slots are empty,
so device moves and state dicts see only the transforms), and each transformer layer's interpolated weights are built *inside* that layer's call. With
``checkpoint_layers`` the call runs under :func:`torch.utils.checkpoint.checkpoint`, so a
layer's transformed weights are freed after its forward and rebuilt in backward: only one
layer's worth is alive at a time, next to the frozen endpoints and the activations. A fraction
checkpoints that share of the layers, spread evenly: the others keep their weights until
backward and skip the second build (less recomputation where small batches leave a GPU
waiting on the host). ``"auto"`` (the default) keeps whole as many layers as fit in
:data:`KEEP_WHOLE_BYTES` at each call's batch and checkpoints the rest: a small model runs no
recomputation, a large one runs as ``True`` does (docs/decisions.md#d-checkpoint-auto). The
gradients are the same either way. The endpoints
live in :class:`~hf_lmc.learned.endpoints.EndpointStore` objects: they follow the module's
device and dtype moves, and with ``shard`` each process keeps only its FSDP2 shard of them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.func import functional_call
from torch.utils.checkpoint import checkpoint

from hf_lmc.canonical.form import (
    CanonicalModel,
    export_config,
    hf_state_dict_groups,
    interpolate,
    skeleton,
    weighted_sum,
)
from hf_lmc.canonical.spec import Group
from hf_lmc.evaluation.head_loss import VocabShard, vocabulary_head_key
from hf_lmc.learned.endpoints import EndpointSharding, EndpointStore, shard_mesh, sharding_of
from hf_lmc.learned.sharing import RowSharing, sharing_mesh
from hf_lmc.learned.tensor_parallel import LayerPlan, gathered_features, plan_layer, summed_features
from hf_lmc.symmetry import Transform, axes_of

#: The canonical lookup tables (first axis the vocabulary, moved by no map): a call reads only
#: its tokens' rows, so a moving point's table holds only those, moved, and the call's
#: ``input_ids`` are renumbered into it (:meth:`Interpolant._evaluate`).
TOKEN_TABLES = frozenset({"embed.tokens"})

#: The canonical head's tensors whose first axis is the vocabulary (moved by no map): a
#: vocabulary-parallel loss reads only this process's rows of them, so a shared build of the
#: head keeps its rows instead of gathering them (:class:`~hf_lmc.evaluation.head_loss.VocabShard`).
HEAD_ROWS = frozenset({"head.weight", "head.bias"})


@dataclass
class _Point:
    """Where in the simplex the current call evaluates: shared by the interpolant and its layers.

    ``transforms[i]`` moves the i-th endpoint the point mixes (``None``: it stays as it is) and
    ``weights`` sum to 1; ``members`` names those endpoints (``None``: all of them, in order), so
    a point of one endpoint reads (and, sharded, gathers) that endpoint's tensors alone;
    ``parallel``: its layers run tensor-parallel on the launch's batch (:meth:`Interpolant._tensor_parallel`).
    """

    transforms: tuple[Transform | None, ...] = ()
    weights: tuple[float | Tensor, ...] = ()
    members: tuple[int, ...] | None = None
    parallel: bool = False


@dataclass
class BuildClock:
    """Wall seconds an interpolant spends building weights and blocked in gathers, summed while
    ``running`` (``hf-lmc merge -v`` reports them per step; ``benchmarks/strong_scaling.py``
    measures with them).

    ``build``: computing interpolated weights (the maps' arithmetic and the endpoints' mix), in
    forward and in recomputation; their backward runs inside autograd and is not counted.
    ``gathers``: waiting for the endpoints' layers (FSDP2's all-gathers) and for the merged rows'
    all-gather of a sharded build. On CUDA each timed region synchronises the device first and
    last, so a running clock costs a little overlap; it is off unless asked for.
    """

    running: bool = False
    build: float = 0.0
    gathers: float = 0.0

    def reset(self) -> None:
        self.build = self.gathers = 0.0

    @contextlib.contextmanager
    def timing(self, part: str, device: torch.device | None = None):
        """Add the wall time of the ``with`` body to ``part`` (``"build"`` or ``"gathers"``)."""
        if not self.running:
            yield
            return
        synchronize = device is not None and device.type == "cuda"
        if synchronize:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        try:
            yield
        finally:
            if synchronize:
                torch.cuda.synchronize(device)
            setattr(self, part, getattr(self, part) + time.perf_counter() - start)


#: ``checkpoint_layers="auto"``: the memory a call may keep alive until backward in the layers
#: it does not checkpoint, as :func:`auto_checkpointed` estimates it (docs/decisions.md#d-checkpoint-auto).
KEEP_WHOLE_BYTES = 1 << 30
#: What a layer not checkpointed keeps until backward, in its own weights' size (the two
#: transformed endpoints, their mix and the products between) and in hidden states of the
#: call's batch (its activations; GPT-2's tanh GELU keeps the most): upper estimates, from the
#: peak memory of the suite's GPT-2 with and without checkpointing.
WEIGHT_COPIES, HIDDEN_STATES = 4, 64


def checkpointed_layers(num_layers: int, checkpoint_layers: bool | float) -> frozenset[int]:
    """The layers that rebuild their weights under gradient checkpointing.

    ``True``: all of them; ``False``: none; a fraction ``f`` in [0, 1]: ``round(f * num_layers)``
    of them, spread evenly (layer ``k * num_layers // count`` for ``k < count``).
    """
    if not isinstance(checkpoint_layers, (int, float)) or not 0 <= checkpoint_layers <= 1:  # bools are 0 and 1
        raise ValueError(
            f"checkpoint_layers takes True, False, 'auto' or a fraction of the layers in [0, 1], got {checkpoint_layers!r}"
        )
    count = round(float(checkpoint_layers) * num_layers)
    return frozenset(k * num_layers // count for k in range(count))


def auto_checkpointed(num_layers: int, layer_bytes: int, hidden_bytes: int) -> frozenset[int]:
    """``checkpoint_layers="auto"``'s layers for a call: all but as many as fit in
    :data:`KEEP_WHOLE_BYTES`, each costing ``WEIGHT_COPIES`` times its weights' ``layer_bytes``
    and ``HIDDEN_STATES`` times the call's ``hidden_bytes``, spread evenly."""
    whole = min(num_layers, KEEP_WHOLE_BYTES // (WEIGHT_COPIES * layer_bytes + HIDDEN_STATES * hidden_bytes))
    return frozenset(range(num_layers)) - checkpointed_layers(num_layers, whole / num_layers)


class _RebuiltLayer(nn.Module):
    """A stock layer module whose weights are interpolated on the fly from the canonical endpoints."""

    def __init__(self, layer: nn.Module, build, current, running, checkpointed):
        super().__init__()
        self.layer = layer
        self._build = build  # (point) -> {layer-relative HF name: tensor}
        self._current = current  # () -> the point of the call in progress
        self._running = running  # (point) -> a context the layer's call runs in
        self._checkpointed = checkpointed  # (the layer's hidden-state input or None) -> whether to checkpoint

    def _run(self, point: _Point, *args, **kwargs):
        with self._running(point):
            return functional_call(self.layer, self._build(point), args, kwargs, tie_weights=False, strict=False)

    def forward(self, *args, **kwargs):
        point = self._current()  # captured now: backward's recomputation must see the same point
        if torch.is_grad_enabled() and self._checkpointed(args[0] if args else kwargs.get("hidden_states")):
            return checkpoint(self._run, point, *args, use_reentrant=False, **kwargs)
        return self._run(point, *args, **kwargs)


def _features_of_weight(module: nn.Module, args) -> None:
    """A ``Conv1D``'s pre-hook: its output has as many features as the weight it runs with has
    columns (a tensor-parallel call's: this process's share)."""
    module.nf = module.weight.shape[-1]


class Interpolant(nn.Module):
    """Evaluate ``(1 - alpha) T_A(a) + alpha T_B(b)`` (or ``sum_k w_k T_k(m_k)``) with the stock
    model class of the first endpoint.

    Args:
        a, b, *more: canonical endpoints of one architecture and shape (kept as they are: frozen).
        checkpoint_layers: rebuild each layer's weights inside gradient checkpointing (see the
            module docstring); off, every layer's weights stay alive until backward; a fraction
            in [0, 1] checkpoints that share of the layers (:func:`checkpointed_layers`);
            ``"auto"``, those that do not fit in :data:`KEEP_WHOLE_BYTES` at each call's batch
            (:func:`auto_checkpointed`), and every layer when ``shard`` makes calls collectives.
        shard: under ``torch.distributed`` with N > 1 processes, shard every endpoint layer
            across them with FSDP2 and gather a layer's tensors when it is built
            (:mod:`hf_lmc.learned.endpoints`); every call is then a collective. An
            :class:`~hf_lmc.learned.endpoints.EndpointSharding` sets CPU offload, the gather
            dtype and prefetching.

    ``interpolant(T_B, alpha, T_A, **batch)`` runs the two-model path;
    ``interpolant.at(transforms, weights, **batch)`` any point of the simplex;
    ``interpolant.endpoint(k, **batch)`` endpoint ``k`` alone; ``features_at`` and
    ``endpoint_features`` the same points' last hidden states and head, for a loss that applies
    the head itself (:mod:`hf_lmc.evaluation.head_loss`).
    """

    def __init__(
        self,
        a: CanonicalModel,
        b: CanonicalModel,
        *more: CanonicalModel,
        checkpoint_layers: bool | float | str = "auto",
        shard: bool | EndpointSharding = False,
    ):
        super().__init__()
        if any(m.spec != a.spec for m in (b, *more)):
            raise ValueError("the canonical models differ in architecture or shape")
        sharding = sharding_of(shard)
        # A distributed call's layers run collectives, which every process must run alike:
        # "auto" there checkpoints every layer rather than decide on each process's own batch.
        auto = checkpoint_layers == "auto" and sharding is None
        if not auto:
            fixed = checkpointed_layers(a.spec.num_layers, True if checkpoint_layers == "auto" else checkpoint_layers)
        # Tied embeddings cannot survive a learned transform of B: the interpolant is untied.
        config = copy.deepcopy(a.config)
        if hasattr(config, "tie_word_embeddings"):
            config.tie_word_embeddings = False
        mesh = shard_mesh(sharding)
        #: Whether evaluating a point (an endpoint alone included) is a collective of the
        #: launch's processes: endpoints sharded across them, or groups built shared.
        self.distributed = sharding is not None
        store_mesh = mesh if sharding is not None and sharding.layers else None
        self.endpoints = [
            EndpointStore(m, store_mesh, sharding) for m in (CanonicalModel(a.spec, config, a.load_group), b, *more)
        ]
        self.models = tuple(store.canonical() for store in self.endpoints)
        self._sharing = sharing_mesh(mesh) if sharding is not None and sharding.build else None
        # The groups built shared: those whose largest tensor has at least ``share_from`` elements
        # (below, a collective's latency costs more than the arithmetic it saves).
        self._shared_groups = (
            frozenset(g for g in a.spec.groups() if self.endpoints[0].largest(g) >= sharding.share_from)
            if self._sharing is not None
            else frozenset()
        )
        self._vocab_choice = sharding.vocab_parallel if sharding is not None else False
        self._parallel_choice = sharding.tensor_parallel if sharding is not None else False
        # The shared layers, and their matrices' rows and elements: what _tensor_parallel weighs.
        self._shared_layers = [i for i in range(a.spec.num_layers) if i in self._shared_groups]
        matrices = [s for i in self._shared_layers for s in self.endpoints[0].shapes(i).values() if len(s) >= 2]
        self._layer_rows, self._layer_elements = sum(s[0] for s in matrices), sum(s.numel() for s in matrices)
        self._plans: dict[int, LayerPlan | None] = {}  # each layer's, traced at its first use
        self._constants: dict[tuple, dict[str, Tensor]] = {}  # a planned layer's constants, per dtype and device
        self._parallel = False  # a tensor-parallel layer is running: its linears gather their features
        self.clock = BuildClock()
        self.a, self.b = self.models[:2]
        self.config = export_config(self.a)
        self.template = skeleton(self.a.adapter.model_class, self.config).eval()
        self._head_key = vocabulary_head_key(self.template) if not a.adapter.takes_images else None
        for module in self.template.modules():  # no weights of its own: every call supplies them
            for name in module._parameters:
                module._parameters[name] = None
        # A token embedding's padding row takes no gradient (LLaMA's): in a renumbered table the
        # row is held back by _lookup instead, the module's own padding index set aside.
        self._embedding = self.template.get_input_embeddings() if not a.adapter.takes_images else None
        self._padding = getattr(self._embedding, "padding_idx", None)
        self._point = _Point()
        checkpointed = self._auto_checkpointed() if auto else lambda i, hidden: i in fixed
        for i in range(a.spec.num_layers):
            path = self._layer_path(i)
            parent, name = path.rpartition(".")[::2]
            owner = self.template.get_submodule(parent)
            layer = owner.get_submodule(name)
            rebuilt = _RebuiltLayer(
                layer,
                self._layer_builder(i, path + "."),
                lambda: self._point,
                self._running,
                functools.partial(checkpointed, i),
            )
            owner.register_module(name, rebuilt)

    def _auto_checkpointed(self):
        """``checkpoint_layers="auto"``'s rule, ``(layer, hidden-state input) -> checkpointed``,
        decided per batch shape and dtype: the largest layer's elements (read off the endpoint
        store's shapes, nothing loaded) and the batch's hidden states, both in the hidden
        states' dtype, the one the call computes in (none given: checkpointed)."""
        store, num_layers = self.endpoints[0], self.a.spec.num_layers
        layer_elements = max(sum(shape.numel() for shape in store.shapes(i).values()) for i in range(num_layers))

        @functools.cache
        def layers(hidden_elements: int, element_size: int) -> frozenset[int]:
            return auto_checkpointed(num_layers, layer_elements * element_size, hidden_elements * element_size)

        def checkpointed(i: int, hidden: Tensor | None) -> bool:
            if not isinstance(hidden, Tensor):
                return True
            return i in layers(hidden.numel(), hidden.element_size())

        return checkpointed

    def _apply(self, fn, recurse: bool = True):
        """Device and dtype moves (``.to``, ``.double()``, ``accelerator.prepare``) move the endpoints too."""
        super()._apply(fn, recurse)
        for store in self.endpoints:
            store.apply(fn)
        return self

    def train(self, mode: bool = True) -> Interpolant:
        """The stock model always runs in eval mode (no dropout): the loss must be a function of
        the transforms alone, as it is for the merged model."""
        super().train(mode)
        self.template.eval()
        return self

    def _layer_path(self, i: int) -> str:
        """The module path of layer ``i`` (e.g. ``model.layers.3``), read off its exported keys."""
        keys = list(self.a.adapter.hf_group(self.a.group(i), self.config, self.a.spec, i))
        marker = f".{i}."
        return keys[0][: keys[0].index(marker) + len(marker) - 1]

    def _layer_builder(self, i: int, prefix: str):
        def build(point: _Point) -> dict[str, Tensor]:
            return {k.removeprefix(prefix): v for k, v in self._group(i, point).items()}

        return build

    def _group(
        self, group: Group, point: _Point, tokens: Tensor | None = None, vocab_rows: bool = False
    ) -> dict[str, Tensor]:
        """HF tensors of one group of the interpolant at ``point`` (``tokens``: the distinct
        ``input_ids`` of the batch, sorted, the only rows of the token table a moving point
        builds, in that order; ``vocab_rows``: the head at this process's vocabulary rows only,
        where :meth:`_vocab_parallel` holds)."""
        members = point.members if point.members is not None else range(len(self.models))
        if not self.clock.running:
            return self._built(group, point, members, tokens, vocab_rows)
        gathers = self.clock.gathers
        with self.clock.timing("build", self._device):
            built = self._built(group, point, members, tokens, vocab_rows)
        self.clock.build -= self.clock.gathers - gathers  # the gathers inside it are counted as gathers
        return built

    @property
    def parameter_sharing(self) -> RowSharing | None:
        """The row sharing the transforms' parameterisation may split its solves and
        exponentials over (:meth:`~hf_lmc.learned.trainable.TrainableTransform.forward`):
        this interpolant's, where it builds some group shared (a model large enough that the
        collectives pay), else ``None``."""
        return self._sharing if self._shared_groups else None

    def _load(self, k: int, group: Group) -> dict[str, Tensor]:
        """Endpoint ``k``'s tensors of ``group`` (a gather when its layers are sharded)."""
        if not self.clock.running or not self.endpoints[k].sharded(group):
            return self.models[k].group(group)
        with self.clock.timing("gathers", self._device):
            return self.models[k].group(group)

    @property
    def _device(self) -> torch.device:
        """Where the step computes: the device of the endpoints' whole groups."""
        whole = next(iter(self.endpoints[0].tensors.values()))
        return next(iter(whole.values())).device

    def _built(
        self, group: Group, point: _Point, members, tokens: Tensor | None = None, vocab_rows: bool = False
    ) -> dict[str, Tensor]:
        moves = any(t is not None for t in point.transforms)
        used = tokens if moves and group == "embed" else None
        if point.parallel and isinstance(group, int) and self._plan(group) is not None:  # a moving point
            return self._parallel_build(group, point, members)
        if group in self._shared_groups and moves:
            merged = self._shared_build(group, point, members, used, HEAD_ROWS if vocab_rows else frozenset())
        else:
            merged = self._merged(group, point, members, used)
            if vocab_rows:  # an endpoint's own head, at this process's vocabulary rows (views)
                merged = {n: t[self._sharing.rows(t.shape[0])] if n in HEAD_ROWS else t for n, t in merged.items()}
        return self.a.adapter.hf_group(merged, self.config, self.a.spec, group)

    def _sources(self, group: Group, point: _Point, members) -> list[tuple[dict[str, Tensor], Transform | None]]:
        """Each endpoint the point mixes: its tensors of ``group`` and what moves them."""
        return [(self._load(k, group), transform) for k, transform in zip(members, point.transforms)]

    @staticmethod
    def _mixed(name: str, sources, weights, rows: slice | Tensor | None = None, columns: slice | None = None) -> Tensor:
        """``sum_k w_k T_k(t_k)`` for one tensor: whole (``rows`` None), a share of its rows (a
        slice: :meth:`~hf_lmc.Transform.apply_rows`), or the rows of a lookup table a batch reads
        (an index, for a tensor whose first axis no map moves: those rows moved as they are);
        ``columns``: a share of a matrix's columns (:meth:`~hf_lmc.Transform.apply_columns`)."""
        # A table's rows are taken first (no map moves its first axis), then moved as a whole tensor.
        index, share = (rows, None) if isinstance(rows, Tensor) else (None, rows)
        moved = []
        for tensors, transform in sources:
            t = tensors[name] if index is None else tensors[name][index]
            if columns is not None:
                moved.append(t[:, columns] if transform is None else transform.apply_columns(name, t, columns))
            elif share is None:
                moved.append(t if transform is None else transform.apply_tensor(name, t))
            else:
                moved.append(t[share] if transform is None else transform.apply_rows(name, t, share))
        if columns is not None and len(moved) > 1 and any(transform is None for _, transform in sources):
            # A share of columns comes from apply_columns transposed (columns-major), from an
            # endpoint that stays as a slice of its rows: a sum of the two layouts strides across
            # one of them, several times slower than one blocked transpose to rows beforehand.
            moved = [m if transform is None else m.contiguous() for m, (_, transform) in zip(moved, sources)]
        if len(moved) == 1 and isinstance(weights[0], float) and weights[0] == 1.0:
            return moved[0]  # one endpoint: its moved tensor, not a copy (x * 1.0 is x)
        return weighted_sum(moved, weights)

    def _lookup(self, name: str, sources, weights, used: Tensor | None) -> Tensor | None:
        """The rows ``used`` of the token table ``name`` at the point, in that order (the table
        the renumbered ``input_ids`` read), or ``None`` where it is built whole."""
        if used is None or name not in TOKEN_TABLES or axes_of(name)[0] is not None:
            return None
        rows = self._mixed(name, sources, weights, used)
        if self._padding is None:
            return rows
        return torch.where((used == self._padding)[:, None], rows.detach(), rows)  # the padding row: no gradient

    def _merged(self, group: Group, point: _Point, members, used: Tensor | None = None) -> dict[str, Tensor]:
        """The canonical tensors of ``group`` at ``point``, built whole by this process (a token
        table only at the rows ``used``)."""
        sources = self._sources(group, point, members)
        if (
            len(sources) == 1
            and sources[0][1] is None
            and isinstance(point.weights[0], float)
            and point.weights[0] == 1.0
        ):
            return sources[0][0]  # one endpoint as it is: its own tensors, not a copy (x * 1.0 is x)
        merged = {}
        for name in sources[0][0]:
            table = self._lookup(name, sources, point.weights, used)
            merged[name] = table if table is not None else self._mixed(name, sources, point.weights)
        return merged

    def _shared_build(
        self, group: Group, point: _Point, members, used: Tensor | None = None, kept: frozenset[str] = frozenset()
    ) -> dict[str, Tensor]:
        """The canonical tensors of ``group`` at ``point``, this process building its rows of
        each matrix and all-gathers assembling them (:mod:`hf_lmc.learned.sharing`). Vectors
        (biases, gains) are built whole by every process: moving one costs ``O(d^2)`` at most,
        less than the collective that would share it; a token table, at the rows its own batch
        reads (``used``); the tensors named in ``kept``, at this process's rows alone (a
        vocabulary-parallel head: never gathered)."""
        sources = self._sources(group, point, members)
        shapes = {name: whole.shape for name, whole in sources[0][0].items()}
        local = {}
        for name, shape in shapes.items():
            if name in kept:
                local[name] = self._mixed(name, sources, point.weights, self._sharing.rows(shape[0]))
                continue
            table = self._lookup(name, sources, point.weights, used)
            if table is not None or len(shape) < 2:
                local[name] = table if table is not None else self._mixed(name, sources, point.weights)

        def parts():  # each matrix's rows, computed as the previous one's gather travels
            for name, shape in shapes.items():
                if name not in local:
                    yield name, self._mixed(name, sources, point.weights, self._sharing.rows(shape[0])), shape

        matrices = self._sharing.gather(parts(), waiting=lambda: self.clock.timing("gathers", self._device))
        return {name: local[name] if name in local else matrices[name] for name in shapes}

    def _parallel_build(self, group: int, point: _Point, members) -> dict[str, Tensor]:
        """Layer ``group``'s HF tensors for a tensor-parallel call: each linear's at this
        process's output features, built from its rows of the canonical matrices (and the whole
        vectors its biases read); the rest, constants of the export (:mod:`hf_lmc.learned.tensor_parallel`)."""
        plan = self._plans[group]
        sources = self._sources(group, point, members)
        local = {}
        for name in plan.matrices:
            rows = self._mixed(name, sources, point.weights, self._sharing.rows(sources[0][0][name].shape[0]))
            local[name] = rows.flatten(1)
        for name in plan.columns:  # a paired "in" linear's: its columns as rows
            share = self._sharing.rows(sources[0][0][name].shape[1])
            local[name] = self._mixed(name, sources, point.weights, columns=share).T
        vectors = {name: self._mixed(name, sources, point.weights) for name in plan.vectors}
        like = next(iter(sources[0][0].values()))
        key = (group, like.dtype, like.device)
        if key not in self._constants:
            zeros = {name: torch.zeros_like(t) for name, t in sources[0][0].items()}
            exported = self.a.adapter.hf_group(zeros, self.config, self.a.spec, group)
            self._constants[key] = {name: exported[name] for name in plan.constants}
        return plan.assemble(local, vectors, self._constants[key])

    def _plan(self, i: int) -> LayerPlan | None:
        """Layer ``i``'s tensor-parallel plan, traced from the adapter's export at its first use
        (its linears then gather their features while :attr:`_parallel` is set), or ``None``
        where the layer is not built shared or its export is not row for row."""
        if i not in self._plans:
            plan = None
            if i in self._shared_groups:
                path = self._layer_path(i)
                layer = self.template.get_submodule(path).layer
                plan = plan_layer(
                    lambda t: self.a.adapter.hf_group(t, self.config, self.a.spec, i),
                    self.endpoints[0].shapes(i),
                    layer,
                    path + ".",
                    self._sharing.rank,
                    self._sharing.count,
                    pairable=self.a.adapter.heads_by_width and self.a.spec.num_kv_heads % self._sharing.count == 0,
                )
                for module, linear in (plan.linears if plan is not None else {}).items():
                    linear_module = layer.get_submodule(module)
                    if not plan.paired:
                        gather = lambda output, layout=linear.layout: gathered_features(output, layout, self._sharing)
                        linear_module.register_forward_hook(self._collecting(gather))
                    elif linear.split == "in":
                        linear_module.register_forward_hook(
                            self._collecting(lambda output: summed_features(output, self._sharing))
                        )
                    if hasattr(linear_module, "nf"):  # Conv1D shapes its output by nf: its weight's columns now
                        linear_module.register_forward_pre_hook(_features_of_weight)
                if plan is not None and plan.paired:  # the attention then runs on this process's heads
                    self.a.adapter.share_heads(layer)
            self._plans[i] = plan
        return self._plans[i]

    def _collecting(self, collect):
        """The forward hook of a planned linear: in a tensor-parallel call, its output at this
        process's features becomes the whole output, ``collect(output)`` (an all-gather of every
        process's features, or a paired "in" linear's all-reduce of the partial outputs)."""

        def hook(module, args, output):
            if not self._parallel:
                return None
            if not self.clock.running:
                return collect(output)
            with self.clock.timing("gathers", self._device):
                return collect(output)

        return hook

    @contextlib.contextmanager
    def _running(self, point: _Point):
        """The context a layer's call runs in: its planned linears gather their features in a
        tensor-parallel call (also when checkpointing recomputes it in backward)."""
        previous, self._parallel = self._parallel, point.parallel
        try:
            yield
        finally:
            self._parallel = previous

    def state(
        self, transform: Transform, alpha: float | Tensor, transform_a: Transform | None = None
    ) -> dict[str, Tensor]:
        """The whole HF state dict of the interpolant (differentiable in the transforms and ``alpha``).

        ``transform_a`` moves A as well (dual matching); by default A stays as it is.
        """
        a = transform_a.apply(self.a) if transform_a is not None else self.a
        merged = interpolate(a, transform.apply(self.b), alpha)
        return {k: v for group in hf_state_dict_groups(merged, self.config) for k, v in group.items()}

    def forward(self, transform: Transform, alpha: float | Tensor, transform_a: Transform | None = None, **batch):
        """The two-model path at ``alpha``: ``(1 - alpha) T_A(a) + alpha T(b)``."""
        return self.at((transform_a, transform), (1 - alpha, alpha), **batch)

    def at(self, transforms, weights, **batch):
        """The stock model's output at ``sum_k weights[k] transforms[k](m_k)`` (``None``: m_k as it is)."""
        return self._evaluate(self._point_at(transforms, weights), batch)

    def endpoint(self, k: int, **batch):
        """Endpoint ``k``'s own output, unmoved: built from its tensors alone (no zero-weight
        copies of the others), so it is exactly the stock model it was made from."""
        return self._evaluate(self._endpoint_point(k), batch)

    @property
    def has_vocabulary_head(self) -> bool:
        """Whether the model ends in a bias-free vocabulary head (the causal LMs), which
        :meth:`features_at` and :meth:`endpoint_features` return instead of applying."""
        return self._head_key is not None

    def features_at(self, transforms, weights, **batch) -> tuple[Tensor, Tensor | VocabShard]:
        """``(hidden, head)`` of the point :meth:`at` evaluates: its last hidden states (after
        the final norm, ``B x S x d``) and its output embedding (``V x d``), whose product is
        :meth:`at`'s logits. The path's losses take that product a slice of positions at a time
        (:mod:`hf_lmc.evaluation.head_loss`) rather than hold the ``B S x V`` logits.

        Where the head is built shared (:meth:`_vocab_parallel`) it comes as this process's
        rows of it, a :class:`~hf_lmc.evaluation.head_loss.VocabShard`: the head is never gathered, and
        the losses of :mod:`hf_lmc.evaluation.head_loss` run vocabulary-parallel on it (every process
        calls this together, as the shared build's gathers need anyway)."""
        return self._evaluate(self._point_at(transforms, weights), batch, features=True)

    def endpoint_features(self, k: int, **batch) -> tuple[Tensor, Tensor | VocabShard]:
        """``(hidden, head)`` of endpoint ``k`` alone, as :meth:`features_at` returns them (the
        head as this process's rows where :meth:`features_at`'s is)."""
        return self._evaluate(self._endpoint_point(k), batch, features=True)

    def _point_at(self, transforms, weights) -> _Point:
        if len(transforms) != len(self.models) or len(weights) != len(self.models):
            raise ValueError(
                f"the interpolant has {len(self.models)} endpoints: pass one transform and one weight for each"
            )
        return _Point(tuple(transforms), tuple(weights))

    def _endpoint_point(self, k: int) -> _Point:
        if not 0 <= k < len(self.models):
            raise ValueError(f"the interpolant has {len(self.models)} endpoints; there is no endpoint {k}")
        return _Point((None,), (1.0,), (k,))

    def _evaluate(self, point: _Point, batch: dict, features: bool = False):
        if hasattr(self.config, "use_cache"):
            batch.setdefault("use_cache", False)  # a KV cache would be filled twice by checkpoint recomputation
        for transform in point.transforms:
            if transform is not None:
                transform.prepare()  # before the checkpointed layers
        moves = any(t is not None for t in point.transforms)
        agreed = functools.cache(lambda: self._agree_shapes(batch))  # at most one all-reduce a call
        vocab_rows = features and self._vocab_parallel(agreed)
        own = None  # in a tensor-parallel call: this process's rows of the launch's batch
        if features and moves and self._tensor_parallel(batch, agreed):
            size = batch["input_ids"].shape[0]
            own = slice(self._sharing.rank * size, (self._sharing.rank + 1) * size)
            batch = {
                k: self._launch_batch(v) if isinstance(v, Tensor) and v.dim() and v.shape[0] == size else v
                for k, v in batch.items()
            }
            point = dataclasses.replace(point, parallel=True)
        self._point = point
        try:
            # Embeddings, final norm and head here; every layer builds its own weights when called.
            # A moving point's token table holds only the batch's tokens, which are renumbered
            # into it: the lookups are the whole table's, and no vocabulary-sized table is built.
            tokens = None
            if "input_ids" in batch and "inputs_embeds" not in batch and moves:
                tokens, renumbered = batch["input_ids"].unique(return_inverse=True)
                batch = batch | {"input_ids": renumbered}
                if self._padding is not None:
                    self._embedding.padding_idx = None  # restored below; its backward has read it by then
            state = self._group("embed", point, tokens) | self._group("head", point, vocab_rows=vocab_rows)
            if not features:
                return functional_call(self.template, state, args=(), kwargs=batch, tie_weights=False, strict=False)
            if self._head_key is None:
                raise ValueError(f"{type(self.template).__name__} ends in no vocabulary head: evaluate it whole")
            prefix = self.template.base_model_prefix + "."
            body = {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
            hidden = functional_call(
                self.template.base_model, body, args=(), kwargs=batch, tie_weights=False, strict=False
            )
            head = state[self._head_key]
            last = hidden.last_hidden_state if own is None else hidden.last_hidden_state[own]
            if vocab_rows:
                size, sharing = self.template.get_output_embeddings().out_features, self._sharing
                head = VocabShard(head, sharing.rows(size).start, size, sharing.group, sharing.rank, sharing.count)
            return last, head
        finally:
            self._point = _Point()
            if self._embedding is not None:
                self._embedding.padding_idx = self._padding

    def _agree_shapes(self, batch: dict) -> tuple[int, bool]:
        """What the launch's processes agree on about this batch, in one all-reduce that
        every process makes together: the largest process's positions (``B x S``) and
        whether every process's batch tensors have this one's shapes. :meth:`_vocab_parallel`
        and :meth:`_tensor_parallel` read it, so each process takes the same paths."""
        inputs = batch.get("input_ids", batch.get("inputs_embeds"))
        positions = inputs.shape[:2].numel() if inputs is not None else 0
        shapes = [v.shape for _, v in sorted(batch.items()) if isinstance(v, Tensor)]
        signature = torch.tensor([d for shape in shapes for d in (len(shape), *shape)], dtype=torch.long)
        device = self._device if dist.get_backend(self._sharing.group) != "gloo" else torch.device("cpu")
        bounds = torch.cat([torch.tensor([positions]), signature, -signature]).to(device)
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self._sharing.group)
        maxima, minima = bounds[1 : 1 + len(signature)], -bounds[1 + len(signature) :]
        return int(bounds[0]), torch.equal(maxima, minima)

    def _vocab_parallel(self, agreed: Callable[[], tuple[int, bool]]) -> bool:
        """Whether the head comes as this process's vocabulary rows and the loss runs
        vocabulary-parallel, at every point of this batch's loss, the endpoints' included:
        for a causal LM whose head group is built shared (large enough to share), where that
        moves fewer bytes than gathering the head. A gathered head costs an all-gather and a
        reduce-scatter of ``(N - 1) / N x V d``; the vocabulary-parallel loss gathers each
        process's last hidden states, the point's and (the ensemble target) every endpoint's,
        and reduce-scatters their gradient, ``(2 + M) x (N - 1) x T d`` for ``T`` positions a
        process: it pays while ``(2 + M) N T < 2 V`` (docs/design.md §5). ``T`` is the largest
        process's (``agreed``: :meth:`_agree_shapes`, called only where the rule is read)."""
        if self._head_key is None or "head" not in self._shared_groups or self._vocab_choice is False:
            return False
        if self._vocab_choice:
            return True
        longest, _ = agreed()
        size = self.template.get_output_embeddings().out_features
        return (2 + len(self.models)) * self._sharing.count * longest < 2 * size

    def _tensor_parallel(self, batch: dict, agreed: Callable[[], tuple[int, bool]]) -> bool:
        """Whether a moving point's layers run tensor-parallel on this batch
        (:mod:`hf_lmc.learned.tensor_parallel`): its linears at each process's output
        features, on the launch's batch, their outputs gathered instead of their weights. For a
        causal LM's features (:meth:`features_at`) built shared, every process's batch of one
        shape (``agreed``: :meth:`_agree_shapes`), where that moves fewer bytes (unless forced)
        and some layer is planned. The bytes: the launch's ``T`` tokens times the shared layers'
        matrix rows (the linears' output features) against their elements (their weights),
        each crossing three times a step either way; read off the shapes, so a layer is traced
        (:meth:`_plan`, a few exports of it on the CPU) only where it would run
        tensor-parallel. Every process calls this together with the same batch keys."""
        ids = batch.get("input_ids")
        if self._parallel_choice is False or not self._shared_layers or ids is None or "inputs_embeds" in batch:
            return False
        if not agreed()[1]:
            return False  # the processes' batches differ in shape: the weights are gathered
        if (
            self._parallel_choice is None
            and self._sharing.count * ids.numel() * self._layer_rows >= self._layer_elements
        ):
            return False
        plans = [self._plan(i) for i in self._shared_layers]  # every layer's now: no short cut past one
        return any(plan is not None for plan in plans)

    def _launch_batch(self, part: Tensor) -> Tensor:
        """Every process's ``part`` of one batch tensor, in process order (an all-gather)."""
        carried = part.to(torch.uint8) if part.dtype == torch.bool else part
        whole = carried.new_empty((self._sharing.count * part.shape[0], *part.shape[1:]))
        dist.all_gather_single(whole, carried.contiguous(), group=self._sharing.group)
        return whole.to(torch.bool) if part.dtype == torch.bool else whole
