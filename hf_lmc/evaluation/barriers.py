"""Loss along the linear path between two models, and the loss barrier (docs/design.md §1).

``barrier = max_alpha [ L((1-alpha) A + alpha B) - ((1-alpha) L(A) + alpha L(B)) ]`` over an
evenly spaced alpha grid (:data:`~hf_lmc.config.options.PATH_POINTS` points by default). ``average`` interpolates the stock HF
parameters as they are (the unaligned baseline); every other method of :mod:`hf_lmc.merging.alignment`
interpolates canonical forms after aligning the models.

For M models the path becomes the simplex they span, and the barrier its worst point:
``max_w [ L(sum_k w_k theta_k) - sum_k w_k L(theta_k) ]`` over a grid of the simplex (every
point with coordinates in steps of ``1/(points-1)``, plus the centre). With two models this is
exactly the barrier above on the same alpha grid.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from hf_lmc.canonical.form import canonicalize, combine, to_hf, weighted_sum
from hf_lmc.canonical.widths import check_mergeable, spec_of, to_common_shape
from hf_lmc.config.methods import METHODS, check_method
from hf_lmc.config.options import (
    DEFAULT_SYMMETRIES,
    EVAL_OPTIONS,
    FIT_OPTIONS,
    PATH_POINTS,
    SIMPLEX_POINTS,
    AccelerateOptions,
    EvalOptions,
    LearnOptions,
    revisions_per_model,
)
from hf_lmc.evaluation.batches import describe_data, fitting_batches, load_batches
from hf_lmc.evaluation.grids import alpha_grid, excess_over_vertices, loss_barrier, simplex_barrier, simplex_grid
from hf_lmc.evaluation.loss import evaluate
from hf_lmc.io.loading import LoadedModel, load_model
from hf_lmc.io.outputs import save_figure
from hf_lmc.merging.alignment import matcher_for
from hf_lmc.symmetry import Transform
from hf_lmc.utils.progress import bar as progress_bar

logger = logging.getLogger(__name__)


@dataclass
class BarrierResult:
    """Losses (and accuracies, for classifiers) along the path, per method."""

    alphas: list[float]
    losses: dict[str, list[float]] = field(default_factory=dict)
    accuracies: dict[str, list[float]] = field(default_factory=dict)
    #: Per trained method (learned, dual), its run's stopping rule: where and why it stopped, and
    #: the held-out estimate along the run (:class:`~hf_lmc.learned.training.Stopping`).
    stopping: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def barriers(self) -> dict[str, float]:
        return {method: loss_barrier(self.alphas, losses) for method, losses in self.losses.items()}

    def table(self) -> str:
        """A markdown table: barrier per method and its ratio to the plain average."""
        vanilla = self.barriers.get("average")
        rows = ["| method | loss at α=0.5 | barrier | ratio to average |", "|---|---|---|---|"]
        middle = min(range(len(self.alphas)), key=lambda i: abs(self.alphas[i] - 0.5))
        for method, value in self.barriers.items():
            ratio = f"{value / vanilla:.3f}" if vanilla and vanilla > 0 else "—"
            rows.append(f"| {method} | {self.losses[method][middle]:.4f} | {value:.4f} | {ratio} |")
        return "\n".join(rows)

    def to_json(self) -> str:
        fields = {"alphas": self.alphas, "losses": self.losses, "accuracies": self.accuracies}
        return json.dumps(fields | {"barriers": self.barriers}, indent=2)


@dataclass
class SimplexBarrierResult:
    """Losses (and accuracies, for classifiers) over a grid of the simplex, per method."""

    points: list[tuple[float, ...]]
    losses: dict[str, list[float]] = field(default_factory=dict)
    accuracies: dict[str, list[float]] = field(default_factory=dict)

    @property
    def barriers(self) -> dict[str, float]:
        return {method: simplex_barrier(self.points, losses) for method, losses in self.losses.items()}

    def worst(self, method: str) -> tuple[float, ...]:
        """The grid point where ``method``'s loss rises furthest above the vertices' plane."""
        excess = excess_over_vertices(self.points, self.losses[method])
        return self.points[max(range(len(excess)), key=excess.__getitem__)]

    def centre_loss(self, method: str) -> float:
        count = len(self.points[0])
        return self.losses[method][
            min(range(len(self.points)), key=lambda i: max(abs(x - 1 / count) for x in self.points[i]))
        ]

    def table(self) -> str:
        """A markdown table: loss at the centre, the worst grid point, the barrier and its ratio to averaging."""
        vanilla = self.barriers.get("average")
        rows = ["| method | loss at the centre | worst point w | barrier | ratio to average |", "|---|---|---|---|---|"]
        for method, value in self.barriers.items():
            ratio = f"{value / vanilla:.3f}" if vanilla and vanilla > 0 else "—"
            worst = "(" + ", ".join(f"{x:.2f}" for x in self.worst(method)) + ")"
            rows.append(f"| {method} | {self.centre_loss(method):.4f} | {worst} | {value:.4f} | {ratio} |")
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"barriers": self.barriers}, indent=2)


def _merges(
    method: str,
    loaded: Sequence[LoadedModel],
    points: Sequence[Sequence[float]],
    *,
    symmetries,
    fit_batches,
    learn: LearnOptions,
    accelerate: AccelerateOptions,
    transforms: Sequence[Transform] | None = None,
    stopped: dict | None = None,
) -> Iterator[PreTrainedModel]:
    """The stock model at each point ``w`` of ``points`` (one weight per model) for ``method``:
    ``average`` mixes the stored weights, every other method the aligned canonical forms
    (``transforms`` when given, else aligned here with uniform weights; a trained method's
    :class:`~hf_lmc.learned.training.Stopping` goes into ``stopped[method]``)."""
    for k, other in enumerate(loaded[1:], 2):  # a path under one config must compute what each model does
        check_mergeable(loaded[0].model.config, other.model.config, "model 1", f"model {k}")
    one_shape = all(spec_of(m.model.config) == spec_of(loaded[0].model.config) for m in loaded)
    if method == "average" and one_shape:
        states = [m.model.state_dict() for m in loaded]
        scratch = copy.deepcopy(loaded[0].model)
        for w in points:
            mixed = {
                k: weighted_sum([s[k] for s in states], w) if v.is_floating_point() else v for k, v in states[0].items()
            }
            scratch.load_state_dict(mixed)
            yield scratch
        return
    canonical = [canonicalize(m.model) for m in loaded]
    if not one_shape:  # models of two widths meet in one shape (exact; hf_lmc.canonical.widths)
        canonical = list(to_common_shape(*canonical))
        if method == "average":  # there, the embedded models interpolated with no alignment
            transforms = [Transform() for _ in canonical]
    if transforms is None:
        logger.info("aligning the models: %s matching", method)
        matcher = matcher_for(
            method,
            len(canonical),
            symmetries=symmetries,
            batches=fit_batches if METHODS[method].needs_data else None,
            learn=learn,
            accelerate=accelerate,
            progress=False,
        )
        transforms = matcher.fit(canonical, None)
        if stopped is not None and getattr(matcher, "stopping", None) is not None:
            stopped[method] = matcher.stopping  # a trained method's run: where it stopped, and its curve
    dtype = next(loaded[0].model.parameters()).dtype
    moved = [
        t.to(dtype).apply(c).materialize() if t.maps or k else c for k, (t, c) in enumerate(zip(transforms, canonical))
    ]
    for w in points:
        yield to_hf(combine(moved, w))


def barrier(
    model_a,
    model_b,
    data,
    *,
    methods=("average", "weight"),
    alphas: int | list[float] = PATH_POINTS,
    symmetries=DEFAULT_SYMMETRIES,
    eval_options: EvalOptions = EVAL_OPTIONS,
    fit_data=None,
    fit_options: EvalOptions = FIT_OPTIONS,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    revision_a: str | None = None,
    revision_b: str | None = None,
    progress: bool = True,
) -> BarrierResult:
    """Evaluate the linear path between two models for each method in ``methods``.

    Models are HF model instances, local folders or Hub ids; ``data`` (held-out) and
    ``fit_data`` (calibration / training data for activation, learned and dual matching) are
    anything :func:`hf_lmc.evaluation.batches.load_batches` accepts.
    """
    for method in methods:
        check_method(method, fit_data, data_parameter="fit_data")
    logger.info("loading the two models")
    a, b = load_model(model_a, revision_a), load_model(model_b, revision_b)
    if fit_data is not None:
        logger.info("reading the fitting data %s", describe_data(fit_data))
    fit_batches = (
        fitting_batches(fit_data, a.model.config, a.folder, fit_options, models=[a.model, b.model], progress=progress)
        if fit_data is not None
        else None
    )
    return barrier_of_loaded(
        a,
        b,
        data,
        methods=methods,
        alphas=alphas,
        symmetries=symmetries,
        eval_options=eval_options,
        progress=progress,
        fit_batches=fit_batches,
        learn=learn,
        accelerate=accelerate,
    )


def barrier_of_loaded(
    a: LoadedModel,
    b: LoadedModel,
    data,
    *,
    methods,
    alphas,
    symmetries,
    eval_options,
    progress,
    fit_batches=None,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    transforms: dict[str, tuple[Transform, Transform]] | None = None,
) -> BarrierResult:
    """:func:`barrier` for loaded models; ``transforms`` holds alignments already computed."""
    grid = alpha_grid(alphas) if isinstance(alphas, int) else list(alphas)
    batches = load_batches(data, a.model.config, a.folder, eval_options)
    result = BarrierResult(grid)
    bar = progress_bar(total=len(methods) * len(grid), desc="loss along the path", show=progress)
    for method in methods:
        logger.info(
            "%s path: loss at %d points on %d batches of %s", method, len(grid), len(batches), describe_data(data)
        )
        models = _merges(
            method,
            (a, b),
            [(1 - alpha, alpha) for alpha in grid],
            symmetries=symmetries,
            fit_batches=fit_batches,
            learn=learn,
            accelerate=accelerate,
            transforms=(transforms or {}).get(method),
            stopped=result.stopping,
        )
        _evaluate_into(result, method, models, batches, bar)
    bar.close()
    return result


def _evaluate_into(result, method: str, models, batches, bar) -> None:
    for model in models:
        scores = evaluate(model, batches)
        result.losses.setdefault(method, []).append(scores.loss)
        if scores.accuracy is not None:
            result.accuracies.setdefault(method, []).append(scores.accuracy)
        bar.update()


def barrier_over_simplex(
    models: Sequence,
    data,
    *,
    methods=("average", "weight"),
    points: int = SIMPLEX_POINTS,
    symmetries=DEFAULT_SYMMETRIES,
    eval_options: EvalOptions = EVAL_OPTIONS,
    fit_data=None,
    fit_options: EvalOptions = FIT_OPTIONS,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    revisions: Sequence[str | None] | None = None,
    progress: bool = True,
) -> SimplexBarrierResult:
    """Evaluate every method over a grid of the simplex of ``models`` (:func:`simplex_grid` with
    ``points`` per edge): the M-model :func:`barrier`. Forms of models and data as there."""
    for method in methods:
        check_method(method, fit_data, count=len(models), data_parameter="fit_data")
    logger.info("loading the %d models", len(models))
    loaded = [load_model(m, r) for m, r in zip(models, revisions_per_model(revisions, len(models)))]
    first = loaded[0]
    if fit_data is not None:
        logger.info("reading the fitting data %s", describe_data(fit_data))
    fit_batches = (
        fitting_batches(
            fit_data, first.model.config, first.folder, fit_options, models=[m.model for m in loaded], progress=progress
        )
        if fit_data is not None
        else None
    )
    return simplex_barrier_of_loaded(
        loaded,
        data,
        methods=methods,
        points=points,
        symmetries=symmetries,
        eval_options=eval_options,
        progress=progress,
        fit_batches=fit_batches,
        learn=learn,
        accelerate=accelerate,
    )


def simplex_barrier_of_loaded(
    loaded: Sequence[LoadedModel],
    data,
    *,
    methods,
    points: int | Sequence[Sequence[float]],
    symmetries,
    eval_options,
    progress,
    fit_batches=None,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    transforms: dict[str, Sequence[Transform]] | None = None,
) -> SimplexBarrierResult:
    """:func:`barrier_over_simplex` for loaded models; ``transforms`` holds alignments already computed."""
    grid = simplex_grid(len(loaded), points) if isinstance(points, int) else [tuple(w) for w in points]
    batches = load_batches(data, loaded[0].model.config, loaded[0].folder, eval_options)
    result = SimplexBarrierResult(grid)
    bar = progress_bar(total=len(methods) * len(grid), desc="loss over the simplex", show=progress)
    for method in methods:
        logger.info(
            "%s: loss at %d points of the simplex on %d batches of %s",
            method,
            len(grid),
            len(batches),
            describe_data(data),
        )
        models = _merges(
            method,
            loaded,
            grid,
            symmetries=symmetries,
            fit_batches=fit_batches,
            learn=learn,
            accelerate=accelerate,
            transforms=(transforms or {}).get(method),
        )
        _evaluate_into(result, method, models, batches, bar)
    bar.close()
    return result


def plot(
    result: BarrierResult, path: str | Path, title: str = "loss along the linear path", *, overwrite: bool = False
) -> Path:
    """Save a figure of loss against alpha, one line per method (:func:`hf_lmc.io.outputs.save_figure`:
    PNG, PDF or SVG by the suffix; an existing file only with ``overwrite``, and only one hf_lmc wrote)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5), dpi=120)
    for method, losses in result.losses.items():
        ax.plot(result.alphas, losses, marker="o", label=f"{method} (barrier {result.barriers[method]:.3f})")
    ax.set_xlabel("α  (0 = model A, 1 = model B)")
    ax.set_ylabel("held-out loss")
    ax.set_title(title, fontsize=9, wrap=True)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    try:
        return save_figure(fig, path, overwrite=overwrite)
    finally:
        plt.close(fig)


def plot_simplex(
    result: SimplexBarrierResult,
    path: str | Path,
    names: Sequence[str] = ("A", "B", "C"),
    title: str = "",
    *,
    overwrite: bool = False,
) -> Path:
    """Save a figure of three models' simplex: one triangle per method, each grid point coloured by
    its loss above ``sum_k w_k L(theta_k)`` (the quantity whose maximum is the barrier); written as
    :func:`plot` writes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if len(result.points[0]) != 3:
        raise ValueError(f"plot_simplex draws three models, got {len(result.points[0])}")
    corners = [(0.0, 0.0), (1.0, 0.0), (0.5, 3**0.5 / 2)]
    xs = [sum(w[k] * corners[k][0] for k in range(3)) for w in result.points]
    ys = [sum(w[k] * corners[k][1] for k in range(3)) for w in result.points]
    excess = {method: excess_over_vertices(result.points, losses) for method, losses in result.losses.items()}
    top = max(max(e) for e in excess.values())
    bottom = min(0.0, min(min(e) for e in excess.values()))
    fig, axes = plt.subplots(1, len(excess), figsize=(3.2 * len(excess), 3.2), dpi=120, squeeze=False)
    for ax, (method, values) in zip(axes[0], excess.items()):
        ax.fill(*zip(*corners), facecolor="none", edgecolor="0.6")
        dots = ax.scatter(xs, ys, c=values, s=90, cmap="magma_r", vmin=bottom, vmax=top, edgecolors="0.3")
        for (x, y), name in zip(corners, names):
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(0, 6 if y else -14), ha="center", fontsize=8)
        ax.set_title(f"{method}\nbarrier {result.barriers[method]:.3f}", fontsize=9, pad=16)
        ax.set_aspect("equal")
        ax.axis("off")
    fig.colorbar(dots, ax=axes[0].tolist(), shrink=0.8, label="loss above the vertices' plane")
    if title:
        fig.suptitle(title, fontsize=9)
    path = Path(path)
    try:
        return save_figure(fig, path, overwrite=overwrite, bbox_inches="tight")
    finally:
        plt.close(fig)
