"""Learned and dual matching: transforms trained on the loss of the interpolated model (docs/design.md §4).

The path modules are plain ``nn.Module`` s whose call is the loss at a sampled point of their
path (:class:`TrainedPath`), so they train in any loop; ``fit`` is the package's loop
(:func:`hf_lmc.learned.training.train`). Two models share :class:`PairPath`: ``LearnedMatcher``
trains B's transform only and ``DualMatcher`` both models' transforms, toward one shared linear
path. Both start from weight matching (B's transform) and the identity
(A's), and evaluate the interpolant with the stock HF class at one ``lambda`` per call: half the
draws from ``U(0.4, 0.6)``, half near the path's current worst point, which ``fit`` re-locates
on the latest batches as training moves it. ``merge(alpha)`` hardens the transforms and
returns a stock model: an exact symmetry of each endpoint at ``alpha = 0`` and ``alpha = 1``.

``SimplexMatcher`` is the same for M models: each carries a transform toward one shared point,
starting from universe matching, trained at weights ``w ~ Dirichlet(1)``, uniform over the simplex.
All three share the loss (:class:`TrainedPath`), the training loop and the interpolant.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from hf_lmc.canonical.form import CanonicalModel, canonicalize, combine, interpolate, to_hf
from hf_lmc.config.options import (
    DEFAULT_INIT,
    DEFAULT_SYMMETRIES,
    INITS,
    PATH_POINTS,
    LearnOptions,
    simplex_weights,
    with_overrides,
)
from hf_lmc.evaluation.grids import alpha_grid, excess_over_line
from hf_lmc.evaluation.head_loss import mixture_loss, next_token_loss
from hf_lmc.learned.endpoints import EndpointSharding, sharding_of
from hf_lmc.learned.interpolant import Interpolant
from hf_lmc.learned.targets import TargetCache, tensor_bytes
from hf_lmc.learned.trainable import TrainableTransform
from hf_lmc.learned.training import train
from hf_lmc.matching.universe import UniverseMatcher
from hf_lmc.matching.weight import WeightMatcher
from hf_lmc.symmetry import Transform
from hf_lmc.utils.devices import computed_on_main, launch_device

#: Where the worst point of the path is looked for: the barrier's grid (docs/design.md §1).
#: Draws near it are uniform within half a grid step of it.
WORST_GRID = tuple(alpha_grid(PATH_POINTS))


class TrainedPath(nn.Module):
    """A path (or simplex) of merges whose transforms train: ``self(batch)`` is the loss at a
    sampled point of it, and the transforms' parameters are what trains. Subclasses set the
    interpolant, the objective and ``label`` and implement ``forward`` and ``transforms``."""

    interpolant: Interpolant
    objective: str
    label: str  # the progress bar's name for this path; each concrete path sets it
    seeks_worst = False  # whether fit() re-locates the path's worst point (see PairPath)
    input_noise = 0.0  # std of the Gaussian noise on pixel_values in training mode (see PairPath)
    #: The endpoints' outputs kept between passes over the fitting data (set by the training
    #: loop where :attr:`reuses_targets`; ``None``: the endpoints run at every use).
    targets: TargetCache | None = None

    def _set_options(self, options: LearnOptions | None, overrides: dict) -> LearnOptions:
        """Set (and return) :attr:`learn`: ``options`` with ``overrides`` (LearnOptions fields),
        checked before any model is read; :func:`~hf_lmc.learned.training.train` reads the
        loop's settings from it when ``fit`` is given none."""
        self.learn = learn = with_overrides(LearnOptions, options, overrides)
        self.objective, self.input_noise = learn.objective, float(learn.input_noise)
        return learn

    def _check_images(self, model: CanonicalModel) -> None:
        """Refuse input noise for a model that takes no images."""
        if self.input_noise and not model.adapter.takes_images:
            raise ValueError(
                f"input_noise perturbs images, and {model.adapter.model_class.__name__} takes {model.adapter.input_name}: "
                "use input_noise=0"
            )

    @property
    def reuses_targets(self) -> bool:
        """Whether the endpoints' outputs on a batch can be kept and read again
        (:mod:`hf_lmc.learned.targets`): not where input noise redraws the inputs in training
        mode, nor where the endpoints' forwards are collectives (sharded or shared endpoints),
        which every process must run in step."""
        return not self.input_noise and not self.interpolant.distributed

    def _perturbed(self, batch: dict[str, Tensor]) -> dict[str, Tensor]:
        """``batch`` with fresh Gaussian noise of std ``input_noise`` on its ``pixel_values``, in
        training mode (as dropout is); unchanged otherwise."""
        if not (self.input_noise and self.training):
            return batch
        pixels = batch.get("pixel_values")
        if pixels is None:
            raise ValueError(f"input_noise perturbs pixel_values, and this batch has none (keys: {', '.join(batch)})")
        return {**batch, "pixel_values": pixels + self.input_noise * torch.randn_like(pixels)}

    def _point_loss(self, batch: dict[str, Tensor], transforms, weights, part: int = 0) -> Tensor:
        """The loss of the point ``sum_k w_k T_k(theta_k)`` on ``batch``, per ``self.objective``.

        ``"ensemble"``: the cross-entropy of the point's predictions to ``sum_k w_k p_k``, the
        endpoints' predicted distributions mixed at the same weights (computed without gradient).
        By convexity that mixture's loss is at most ``sum_k w_k L_k``, the barrier's reference,
        so a point that matches it has no barrier; and unlike one-hot labels it says, at every
        position, what the two models predict together. (On a classifier whose endpoints are
        near one-hot the two objectives coincide.)

        A causal LM's head is applied a slice of positions at a time under either objective
        (:mod:`~hf_lmc.evaluation.head_loss`), so no step holds its tokens x vocabulary logits.
        The endpoints' outputs on ``part`` of the step's batch are read from :attr:`targets`
        where it holds them (:mod:`hf_lmc.learned.targets`).
        """
        batch = self._perturbed(batch)
        if self.objective == "labels":
            return self._labels_loss(batch, transforms, weights)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        mask = inputs.get("attention_mask")
        if self.interpolant.has_vocabulary_head:
            endpoints = self._endpoint_outputs(inputs, len(weights), part, features=True)
            hidden, head = self.interpolant.features_at(transforms, weights, **inputs)
            return mixture_loss(hidden, head, endpoints, weights, mask)
        logits = self._endpoint_outputs(inputs, len(weights), part, features=False)
        target = sum(w * z.softmax(-1) for z, w in zip(logits, weights))
        log_probs = _wide(self.interpolant.at(transforms, weights, **inputs).logits).log_softmax(-1)
        per_position = -(target * log_probs).sum(-1)
        if mask is None or per_position.dim() != mask.dim():
            return per_position.mean()
        mask = mask.to(per_position.dtype)
        return (per_position * mask).sum() / mask.sum()

    @torch.no_grad()
    def _endpoint_outputs(self, inputs: dict[str, Tensor], count: int, part: int, features: bool) -> list:
        """Every endpoint's output on ``inputs``, part ``part`` of the step's batch: its
        ``(hidden, head)`` (``features``) or its logits in at least float32; kept in
        :attr:`targets` where the path reuses them (the head is the endpoint's own tensor, not
        counted against the budget)."""

        def compute() -> list:
            if features:
                return [self.interpolant.endpoint_features(k, **inputs) for k in range(count)]
            return [_wide(self.interpolant.endpoint(k, **inputs).logits) for k in range(count)]

        key = None if self.targets is None else self.targets.step_key(part)  # set only where reuses_targets
        if key is None:
            return compute()
        size = (lambda outs: tensor_bytes(*(h for h, _ in outs))) if features else (lambda outs: tensor_bytes(*outs))
        return self.targets.get(key, compute, size)

    def _labels_loss(
        self, batch: dict[str, Tensor], transforms=None, weights=None, endpoint: int | None = None
    ) -> Tensor:
        """The labels' cross-entropy at the point ``(transforms, weights)``, or of ``endpoint``
        alone, as the stock class computes it; a causal LM's a slice of positions at a time
        (:func:`~hf_lmc.evaluation.head_loss.next_token_loss`)."""
        inputs = _labelled(batch)
        if not self.interpolant.has_vocabulary_head:
            output = (
                self.interpolant.endpoint(endpoint, **inputs)
                if endpoint is not None
                else self.interpolant.at(transforms, weights, **inputs)
            )
            return output.loss
        labels = inputs.pop("labels")
        if endpoint is not None:
            hidden, head = self.interpolant.endpoint_features(endpoint, **inputs)
        else:
            hidden, head = self.interpolant.features_at(transforms, weights, **inputs)
        return next_token_loss(hidden, head, labels)

    #: The package's training loop as a method: ``path.fit(batches, steps=...)`` is
    #: :func:`hf_lmc.learned.training.train` ``(path, batches, steps=...)``, with the same
    #: arguments, and returns the loss of every step. With no settings it trains with the
    #: path's :attr:`learn`, held-out batches and stopping rule included, as ``hf-lmc merge``
    #: does; the defaults were chosen with batches of :data:`hf_lmc.config.options.FIT_OPTIONS`' size,
    #: what ``hf-lmc merge --data`` gives.
    fit = train


def _wide(logits: Tensor) -> Tensor:
    """Logits in at least float32 (softmax of half-precision logits under autocast loses digits)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _split_fixed(start: Transform | None, permutations: str) -> tuple[Transform | None, Transform | None]:
    """With fixed assignments, ``start = in_order o assignments``: the path applies the
    assignments to its stored copy of the model once, and the trained maps then move tensors
    without a gather (per tensor, per step: on a GPU a kernel launch each, with its backward)."""
    if start is None or permutations != "fixed":
        return start, None
    in_order, assignments = start.split()
    return in_order, assignments if assignments.maps else None


def _with_assignments(hardened: Transform, assignments: Transform | None, like: nn.Module) -> Transform:
    """The transform of the model as given: its trained (in-order) maps after its assignments."""
    if assignments is None:
        return hardened
    return hardened.compose(assignments.to(dtype=torch.float64, device=next(like.parameters()).device))


def _held(shard_endpoints) -> Callable[[CanonicalModel], CanonicalModel]:
    """How a path keeps its models while it sets up: in memory, read once for the start and the
    endpoints; or, when the endpoints are sharded, as they are (a checkpoint folder stays on
    disk), read group by group by the start's sweeps and as the shards are cut, so that no
    process holds a whole model, let alone two."""
    sharding = sharding_of(shard_endpoints)
    return (lambda model: model) if sharding is not None and sharding.layers else CanonicalModel.materialize


def _labelled(batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """``batch`` with labels: a causal LM's are its ``input_ids``."""
    inputs = dict(batch)
    if "labels" not in inputs and "input_ids" in inputs:
        inputs["labels"] = inputs["input_ids"]  # causal LM: next-token loss
    return inputs


class PairPath(TrainedPath):
    """The linear path ``(1 - a) T_A(A) + a T_B(B)`` between two models, trained at sampled
    ``a``: B's transform always, A's where the class sets ``learns_a``
    (:class:`DualMatcher`; :class:`LearnedMatcher` keeps A as it is). Instantiate one of those two.

    With A's transform trained, a step evaluates the path as ``(1 - a) A + a T_A^-1 T_B(B)``
    (the same path moved by the symmetry ``T_A^-1``: the same loss and gradients), so it moves
    one model's tensors and costs what a one-sided step does; ``merge`` exports the path itself.

    Args:
        model_a, model_b: stock HF models (or checkpoint folders) of one architecture and shape.
        options: the settings of learned and dual matching (:class:`~hf_lmc.config.options.LearnOptions`,
            whose defaults are the command line's), kept as :attr:`learn`: the path reads those
            below when it is built, and ``fit`` trains with the rest (steps, learning rates,
            schedule, stopping rule, seed) unless it is given others.
        **overrides: :class:`~hf_lmc.config.options.LearnOptions` fields set over ``options``
            (``DualMatcher(a, b, orthogonal="exp")``), checked as the options are.
        init: ``"weight"`` (B's transform starts at weight matching's solution), ``"identity"``,
            or B's starting :class:`Transform` itself (e.g. :class:`ActivationMatcher`'s, whose
            unit and head assignments come from what the units compute; with
            ``permutations="fixed"`` the start's assignments are the ones kept).
        symmetries: the group weight matching searches for the initialisation.

    Of the options, the path reads:

        permutations: ``"fixed"`` keeps the starting unit and head assignments and trains only
            the continuous maps (the default; docs/decisions.md#d-fixed-permutations); ``"ste"`` or
            ``"sinkhorn"`` train the assignments too (n x n scores per layer).
        orthogonal: ``"cayley"``, ``"exp"`` or ``"polar"`` (the residual map).
        frame: where each continuous map's trained factor sits (:mod:`hf_lmc.learned.params`):
            ``"own"``, ``M_0 f(A)``, Adam stepping in the coordinates of the model the map moves;
            ``"target"``, ``f(A) M_0``, stepping in those it moves them into (A's, for B's map);
            or ``"both"``, ``f(L) M_0 f(A)``. The same group every way; only the optimiser's
            geometry differs. Dual matching in the own frame trains the relative map
            ``T_A^-1 T_B = f(A_A)^-1 M_0 f(A_B)``, a factor on each side of B's start, so
            one-sided matching with ``"both"`` takes dual matching's steps (``L = -A_A``; the
            same losses, tests) at one-sided cost. A starts at the identity, where the frames
            coincide, so dual matching with ``"target"`` puts both factors on one side.
        lambda_range: interpolation weights are drawn uniformly from this range (all of them
            with ``worst_fraction=0``).
        worst_fraction: the share of draws taken instead within 0.05 of the path's current worst
            point, the alpha of the evaluation grid (:data:`~hf_lmc.config.options.PATH_POINTS`) where the loss stands highest above the line
            between the endpoints. ``fit`` re-locates it every ``locate_every`` steps; in a
            loop of your own, call :meth:`locate_worst`. Training only on the middle of the path
            pushes its worst point outward, where the barrier is then measured; these draws
            follow it there (docs/decisions.md#d-worst-point-draws).
        focus: where those draws go. ``"worst"``: near the one grid point of highest excess.
            ``"excess"``: near each interior grid point with probability proportional to its
            excess over the line (none where the path is at or below it), so a path with two
            humps of about one height, whose argmax flips between them from one location to
            the next, trains on both.
        objective: ``"ensemble"`` (cross-entropy to the endpoints' predictions mixed at the
            same ``lambda``; costs a forward of each endpoint per step) or ``"labels"`` (the
            batch's cross-entropy). The default was chosen on the benchmark suite.
        input_noise: image models: the std of Gaussian noise added to ``pixel_values`` afresh at
            every training-mode call (in the model's input units). Endpoints that have memorised
            their training images have no loss on them to speak of, so the transforms learn to fit
            those images rather than the path on new ones; noise of about the size at which the
            endpoints' loss on training images reaches their held-out loss restores that
            (docs/decisions.md#d-input-noise).

    The settings that are not options:

        dtype: dtype of the frozen endpoint weights and of the transform parameters.
        checkpoint_layers: ``True`` rebuilds each layer's interpolated weights inside gradient
            checkpointing, so only one layer's transformed weights are alive at a time. A
            fraction in [0, 1] checkpoints that share of the layers, spread evenly: faster
            where small batches leave a GPU waiting on the host, at the memory of the other
            layers' weights (``benchmarks/learned_step.py``). ``"auto"`` (the default) keeps as
            many layers whole as fit in 1 GiB at each batch and checkpoints the rest
            (docs/decisions.md#d-checkpoint-auto). The merge is the same under every setting.
        shard_endpoints: under ``torch.distributed`` (``accelerate launch``, ``torchrun``; create
            the ``Accelerator`` first) shard the frozen endpoints' layers across the processes
            with FSDP2 and gather each layer when it is built (:mod:`hf_lmc.learned.endpoints`).
            An :class:`~hf_lmc.learned.endpoints.EndpointSharding` adds CPU offload of the
            shards and a gather dtype. Every forward, and ``merge``, is then a collective: call
            them on every process.
        init_device: where the weight-matching start runs (``init="weight"``). Default: this
            process's device under ``accelerate launch`` / ``torchrun`` (the CPU under
            ``--cpu``, GPU ``LOCAL_RANK`` with several processes), else a GPU when torch sees
            one (:func:`hf_lmc.utils.devices.launch_device`). The path itself goes where
            ``accelerator.prepare`` or ``.to`` puts it.

    Under ``torch.distributed`` with several processes, construction is a collective: the main
    process computes the start and sends it to the others (one start for all), so build the
    path on every process.
    """

    #: Whether A's transform trains too (B's always does); each concrete path sets it.
    learns_a: bool

    def __init__(
        self,
        model_a,
        model_b,
        options: LearnOptions | None = None,
        *,
        init: str | Transform = DEFAULT_INIT,
        symmetries=DEFAULT_SYMMETRIES,
        dtype: torch.dtype = torch.float32,
        checkpoint_layers: bool | float | str = "auto",
        shard_endpoints: bool | EndpointSharding = False,
        init_device: str | torch.device | None = None,
        **overrides,
    ):
        super().__init__()
        learn = self._set_options(options, overrides)
        init_device = launch_device(init_device)
        self.worst_fraction, self.focus, self.draws = float(learn.worst_fraction), learn.focus, learn.draws
        if not isinstance(init, Transform) and init not in INITS:
            raise ValueError(f"unknown init {init!r}; choose from {INITS} or pass B's starting Transform")
        low, high = learn.lambda_range
        self.lambda_range = (float(low), float(high))
        focus, permutations = learn.focus, learn.permutations
        # Saved with the path's state (accelerate checkpoints), so a resumed run draws alike.
        self.register_buffer("worst_alpha", torch.tensor((low + high) / 2, dtype=torch.float64))
        # The excess over the line at every grid point when last located (zero until then); saved
        # only where the draws read it, so "worst" checkpoints keep their earlier layout.
        self.register_buffer(
            "grid_excess", torch.zeros(len(WORST_GRID), dtype=torch.float64), persistent=focus == "excess"
        )
        self._focus_read = None  # (buffer versions, worst alpha, excess weights): see _focus_state
        self.dtype = dtype
        held = _held(shard_endpoints)
        a, b = held(canonicalize(model_a, dtype=dtype)), held(canonicalize(model_b, dtype=dtype))
        self._check_images(a)
        if isinstance(init, Transform):
            start = init
        elif init == "weight":
            start = computed_on_main(lambda: WeightMatcher(symmetries, progress=False, device=init_device).match(a, b))
        else:
            start = None
        start, self._assignments = _split_fixed(start, permutations)
        if self._assignments is not None:
            b = held(self._assignments.to(dtype).apply(b))  # B stored in its assigned order
        self.transform_b = TrainableTransform(a.spec, start, learn, dtype=dtype)
        self.transform_a = TrainableTransform(a.spec, None, learn, dtype=dtype) if self.learns_a else None
        self.interpolant = Interpolant(a, b, checkpoint_layers=checkpoint_layers, shard=shard_endpoints)

    @property
    def seeks_worst(self) -> bool:
        return self.worst_fraction > 0

    def sample_lambda(self) -> Tensor:
        """A draw from ``lambda_range``, or (a ``worst_fraction`` of the time) near the grid point
        that ``focus`` picks."""
        low, high = self.lambda_range
        if self.seeks_worst and torch.rand(()) < self.worst_fraction:
            centre, half = self._focus_point(), (WORST_GRID[1] - WORST_GRID[0]) / 2
            low, high = max(centre - half, 0.0), min(centre + half, 1.0)
        return torch.empty(()).uniform_(low, high)

    def _focus_point(self) -> float:
        """The worst point, or (``focus="excess"``) an interior grid point drawn in proportion to
        its located excess over the line; the worst point while no point stands above it."""
        worst, weights = self._focus_state()
        if self.focus == "excess" and weights.sum() > 0:
            return WORST_GRID[1 + int(torch.multinomial(weights, 1))]
        return worst

    def _focus_state(self) -> tuple[float, Tensor]:
        """:attr:`worst_alpha` and the interior excess weights, on the host. They are read from the
        buffers only when those change (relocated, loaded, moved): on a GPU each read waits for
        every queued kernel, which once per step would keep the host from running ahead."""
        key = tuple((t.device, t.data_ptr(), t._version) for t in (self.worst_alpha, self.grid_excess))
        if self._focus_read is None or self._focus_read[0] != key:
            self._focus_read = (key, float(self.worst_alpha), self.grid_excess[1:-1].clamp_min(0).cpu())
        return self._focus_read[1:]

    @torch.no_grad()
    def locate_worst(self, batches: Iterable[dict[str, Tensor]], held_out: bool = False) -> float:
        """Set (and return) :attr:`worst_alpha`: the interior alpha of the evaluation grid where the
        path's loss on ``batches`` (labels, whatever the training objective) stands highest above
        the line between the endpoints' losses (each point's excess goes to :attr:`grid_excess`,
        which ``focus="excess"`` draws from). Under ``torch.distributed`` the losses are
        averaged over the processes first, so every process draws near the same point; call it
        on every process. ``held_out``: ``batches`` are the run's held-out batches, the same at
        every call, whose endpoint losses :attr:`targets` keeps."""
        transforms = self._path()
        losses = torch.zeros(len(WORST_GRID), dtype=torch.float64)
        count = 0
        kept = held_out and self.targets is not None  # fit sets targets only where reuses_targets
        for index, batch in enumerate(batches):
            inputs = self._perturbed(batch)

            def ends_of(inputs=inputs) -> list[Tensor]:
                return [self._labels_loss(inputs, endpoint=k) for k in (0, 1)]

            ends = self.targets.get(("held-out", index), ends_of, lambda e: tensor_bytes(*e)) if kept else ends_of()
            inner = [self._labels_loss(inputs, transforms, (1 - alpha, alpha)) for alpha in WORST_GRID[1:-1]]
            losses += torch.stack([ends[0], *inner, ends[1]]).double().cpu()
            count += 1
        if count == 0:
            raise ValueError("locate_worst needs at least one batch")
        losses /= count
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1
        ):
            device = self.worst_alpha.device if torch.distributed.get_backend() != "gloo" else torch.device("cpu")
            losses = losses.to(device)
            torch.distributed.all_reduce(losses)
            losses = losses.cpu() / torch.distributed.get_world_size()
        excess = excess_over_line(WORST_GRID, losses.tolist())
        self.grid_excess.copy_(torch.tensor(excess, dtype=torch.float64))
        self.worst_alpha.fill_(WORST_GRID[max(range(1, len(WORST_GRID) - 1), key=excess.__getitem__)])
        return float(self.worst_alpha)

    def forward(self, batch: dict[str, Tensor], alpha: float | Tensor | None = None) -> Tensor:
        """The interpolated model's loss on ``batch`` at ``alpha``; when ``None``, sampled, and with
        ``draws`` above 1 one weight per share of the batch's rows, the shares' losses averaged in
        proportion to their rows."""
        if alpha is not None or self.draws == 1:
            alpha = self.sample_lambda() if alpha is None else alpha
            return self._point_loss(batch, self._path(), (1 - alpha, alpha))
        transforms = self._path()  # built once, read by every draw
        rows = len(next(iter(batch.values())))
        shares = {key: value.tensor_split(min(self.draws, rows)) for key, value in batch.items()}
        total = 0.0
        for index, values in enumerate(zip(*shares.values())):
            alpha, part = self.sample_lambda(), dict(zip(shares, values))
            total = total + self._point_loss(part, transforms, (1 - alpha, alpha), index) * (len(values[0]) / rows)
        return total

    def _path(self) -> tuple[Transform | None, Transform]:
        """What the loss moves A and B by (``None``: A stays).

        Dual matching's path ``(1 - a) T_A(A) + a T_B(B)`` is ``T_A`` applied to ``(1 - a) A +
        a T_A^-1 T_B(B)``, and a symmetry does not change the function: the loss is the same
        function of both transforms on either path, so it has the same gradients, and the second
        moves one model's tensors per step instead of both (dual then costs what one-sided
        matching does); ``T_A^-1 T_B`` is composed for all layers in a few batched calls. Relaxed
        permutations (``ste``, ``sinkhorn``) are not group elements while training, have no
        inverse, and leave the model's function changed: both move.
        """
        sharing = self.interpolant.parameter_sharing  # every process calls this path, in step
        if self.transform_a is None:
            return None, self.transform_b(sharing)
        if not (self.transform_a.fixed_assignments and self.transform_b.fixed_assignments):
            return self.transform_a(sharing), self.transform_b(sharing)
        return None, self.transform_a.relative(self.transform_b, sharing)

    def _hardened(self) -> tuple[Transform, Transform]:
        """The exact transforms of the stored endpoints (B's stored in its fixed assigned order)."""
        transform_a = self.transform_a.harden() if self.transform_a is not None else Transform()
        return transform_a, self.transform_b.harden()

    def transforms(self) -> tuple[Transform, Transform]:
        """The exact (hardened) transforms of A and B the parameters currently select."""
        transform_a, transform_b = self._hardened()
        return transform_a, _with_assignments(transform_b, self._assignments, self.transform_b)

    @torch.no_grad()
    def aligned(self) -> tuple[CanonicalModel, CanonicalModel]:
        """``T_A(A)`` and ``T_B(B)`` with the exact transforms (lazy canonical views): the ends
        of the path :meth:`merge` exports, e.g. to evaluate it along a grid."""
        transform_a, transform_b = self._hardened()
        a, b = self.interpolant.a, self.interpolant.b
        return transform_a.to(self.dtype).apply(a), transform_b.to(self.dtype).apply(b)

    @torch.no_grad()
    def merge(self, alpha: float = 0.5) -> PreTrainedModel:
        """A stock HF model computing ``(1 - alpha) T_A(A) + alpha T_B(B)`` with exact transforms."""
        return to_hf(interpolate(*self.aligned(), alpha))

    @classmethod
    def over_simplex(cls, models: Sequence, options: LearnOptions | None = None, **settings) -> SimplexMatcher:
        """This matching for three or more models: a :class:`SimplexMatcher` whose first model's
        transform trains exactly when A's does here (``learns_first=cls.learns_a``)."""
        return SimplexMatcher(models, options, learns_first=cls.learns_a, **settings)


class DualMatcher(PairPath):
    """Both models learn their transforms toward one shared linear path (arguments: :class:`PairPath`)."""

    learns_a = True
    label = "dual matching"


class LearnedMatcher(PairPath):
    """Only B learns its transform (one-sided learned matching); A stays as it is (arguments: :class:`PairPath`)."""

    learns_a = False
    label = "learned matching"


class SimplexMatcher(TrainedPath):
    """M models learn their transforms toward one shared point: the M-model dual matching.

    Every point ``sum_k w_k T_k(theta_k)`` of the simplex the aligned models span should have
    low loss, so each call trains at weights ``w ~ Dirichlet(concentration * 1)``: the default
    1 draws uniformly over the simplex. (Draws near the vertices, as a concentration of 0.1
    gives, train the transforms where they barely change the loss, and on the benchmark
    suite's triples left the merge above its universe-matching start: docs/decisions.md#d-simplex-concentration.)

    Args:
        models: stock HF models (or checkpoint folders) of one architecture and shape.
        init: ``"weight"`` (start from universe matching, :class:`UniverseMatcher`),
            ``"identity"``, or one :class:`Transform` per model.
        learns_first: ``False`` keeps the first model's starting transform fixed (one model
            anchors the others, as A does in :class:`LearnedMatcher`); ``True``: all learn.
        options, overrides: as for :class:`PairPath`; of them the simplex reads ``concentration``
            (of the Dirichlet the weights are drawn from) where a pair reads ``lambda_range``,
            ``worst_fraction`` and ``focus`` (``"ensemble"`` mixes the M endpoints at the
            sampled weights).
        symmetries, dtype, checkpoint_layers, shard_endpoints, init_device: as for :class:`PairPath`.
    """

    label = "simplex matching"

    def __init__(
        self,
        models: Sequence,
        options: LearnOptions | None = None,
        *,
        init: str | Sequence[Transform] = DEFAULT_INIT,
        learns_first: bool = True,
        symmetries=DEFAULT_SYMMETRIES,
        dtype: torch.dtype = torch.float32,
        checkpoint_layers: bool | float | str = "auto",
        shard_endpoints: bool | EndpointSharding = False,
        init_device: str | torch.device | None = None,
        **overrides,
    ):
        super().__init__()
        learn = self._set_options(options, overrides)
        init_device = launch_device(init_device)
        if len(models) < 2:
            raise ValueError(f"SimplexMatcher needs at least 2 models, got {len(models)}")
        if isinstance(init, str) and init not in INITS:
            raise ValueError(f"unknown init {init!r}; choose from {INITS} or pass one Transform per model")
        self.concentration = float(learn.concentration)
        self.dtype = dtype
        held = _held(shard_endpoints)
        canonical = [held(canonicalize(m, dtype=dtype)) for m in models]
        self._check_images(canonical[0])
        if init == "weight":
            start = list(
                computed_on_main(lambda: UniverseMatcher(symmetries, progress=False, device=init_device).fit(canonical))
            )
        elif init == "identity":
            start = [Transform()] * len(canonical)
        elif len(init) != len(canonical):
            raise ValueError(f"init has {len(init)} transforms for {len(canonical)} models; pass one per model")
        else:
            start = list(init)
        # A model that does not learn is moved once, here, and costs nothing per step.
        self.fixed_first = None if learns_first else start[0]
        if self.fixed_first is not None:
            canonical[0] = held(self.fixed_first.to(dtype).apply(canonical[0]))
        first = 0 if learns_first else 1
        self._assignments = []  # per learned model, as ``self.learned``
        for k in range(first, len(canonical)):
            start[k], assignments = _split_fixed(start[k], learn.permutations)
            self._assignments.append(assignments)
            if assignments is not None:  # stored in its assigned order
                canonical[k] = held(assignments.to(dtype).apply(canonical[k]))
        self.learned = nn.ModuleList(
            TrainableTransform(canonical[0].spec, t, learn, dtype=dtype) for t in start[first:]
        )
        self.interpolant = Interpolant(*canonical, checkpoint_layers=checkpoint_layers, shard=shard_endpoints)

    @property
    def count(self) -> int:
        return len(self.interpolant.models)

    def sample_weights(self) -> Tensor:
        concentration = torch.full((self.count,), self.concentration)
        return torch.distributions.Dirichlet(concentration).sample()

    def forward(self, batch: dict[str, Tensor], weights: Sequence[float] | Tensor | None = None) -> Tensor:
        """The loss of ``sum_k w_k T_k(theta_k)`` on ``batch`` (``w`` sampled when ``None``)."""
        weights = self.sample_weights() if weights is None else weights
        sharing = self.interpolant.parameter_sharing
        current = [t(sharing) for t in self.learned]
        transforms = current if self.fixed_first is None else [None, *current]
        return self._point_loss(batch, transforms, weights)

    def transforms(self) -> list[Transform]:
        """One exact (hardened) transform per model, in the order the models were given."""
        hardened = [_with_assignments(t.harden(), a, t) for t, a in zip(self.learned, self._assignments)]
        return hardened if self.fixed_first is None else [self.fixed_first, *hardened]

    @torch.no_grad()
    def merge(self, weights: Sequence[float] | None = None) -> PreTrainedModel:
        """A stock HF model computing ``sum_k w_k T_k(theta_k)`` with exact transforms (uniform by default)."""
        weights = simplex_weights(weights, self.count)
        hardened = [t.harden().to(self.dtype) for t in self.learned]
        models = (
            self.interpolant.models
        )  # in their fixed assigned orders; the first already moved when it does not learn
        moved = [models[0] if self.fixed_first is not None else hardened.pop(0).apply(models[0])]
        moved += [t.apply(m) for t, m in zip(hardened, models[1:])]
        return to_hf(combine(moved, weights))
