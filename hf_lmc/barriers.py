"""Loss along the linear path between two models, and the loss barrier (DESIGN §1).

``barrier = max_alpha [ L((1-alpha) A + alpha B) - ((1-alpha) L(A) + alpha L(B)) ]`` over an
evenly spaced alpha grid (11 points by default). ``average`` interpolates the stock HF
parameters as they are (the vanilla baseline); every other method of :mod:`hf_lmc.alignment`
interpolates canonical forms after aligning the models.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from .canonical import canonicalize, interpolate, to_hf
from .evaluation import EvalOptions, evaluate, load_batches
from .loading import LoadedModel, load_model
from .alignment import DATA_METHODS, LearnOptions, align, check_method
from .symmetry import Transform
from .widths import spec_of, to_common_shape


@dataclass
class BarrierResult:
    """Losses (and accuracies, for classifiers) along the path, per method."""

    alphas: list[float]
    losses: dict[str, list[float]] = field(default_factory=dict)
    accuracies: dict[str, list[float]] = field(default_factory=dict)

    @property
    def barriers(self) -> dict[str, float]:
        return {method: loss_barrier(self.alphas, losses) for method, losses in self.losses.items()}

    def table(self) -> str:
        """A markdown table: barrier per method and its ratio to vanilla averaging."""
        vanilla = self.barriers.get("average")
        rows = ["| method | loss at α=0.5 | barrier | ratio to average |", "|---|---|---|---|"]
        middle = min(range(len(self.alphas)), key=lambda i: abs(self.alphas[i] - 0.5))
        for method, value in self.barriers.items():
            ratio = f"{value / vanilla:.3f}" if vanilla and vanilla > 0 else "—"
            rows.append(f"| {method} | {self.losses[method][middle]:.4f} | {value:.4f} | {ratio} |")
        return "\n".join(rows)

    def to_json(self) -> str:
        return json.dumps(asdict(self) | {"barriers": self.barriers}, indent=2)


def loss_barrier(alphas: list[float], losses: list[float]) -> float:
    """``max_alpha`` of the loss above the straight line between the endpoints."""
    start, end = losses[0], losses[-1]
    return max(loss - ((1 - a) * start + a * end) for a, loss in zip(alphas, losses))


def alpha_grid(points: int) -> list[float]:
    if points < 2:
        raise ValueError(f"--alphas needs at least 2 points, got {points}")
    return [i / (points - 1) for i in range(points)]


def _lerp_state(model: PreTrainedModel, a: dict, b: dict, alpha: float) -> PreTrainedModel:
    model.load_state_dict({k: torch.lerp(v, b[k], alpha) if v.is_floating_point() else v for k, v in a.items()})
    return model


def barrier(
    model_a,
    model_b,
    data,
    *,
    methods=("average", "weight"),
    alphas: int | list[float] = 11,
    symmetries="full",
    eval_options: EvalOptions = EvalOptions(),
    fit_data=None,
    fit_options: EvalOptions = EvalOptions(split="train"),
    learn: LearnOptions = LearnOptions(),
    revision_a: str | None = None,
    revision_b: str | None = None,
    progress: bool = True,
) -> BarrierResult:
    """Evaluate the linear path between two models for each method in ``methods``.

    Models are HF model instances, local folders or Hub ids; ``data`` (held-out) and
    ``fit_data`` (calibration / training data for activation, learned and dual matching) are
    anything :func:`hf_lmc.evaluation.load_batches` accepts.
    """
    for method in methods:
        check_method(method, fit_data, flag="--fit-data")
    a, b = load_model(model_a, revision_a), load_model(model_b, revision_b)
    fit_batches = load_batches(fit_data, a.model.config, a.folder, fit_options) if fit_data is not None else None
    return barrier_of_loaded(
        a, b, data, methods=methods, alphas=alphas, symmetries=symmetries, eval_options=eval_options, progress=progress,
        fit_batches=fit_batches, learn=learn,
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
    transforms: dict[str, tuple[Transform, Transform]] | None = None,
) -> BarrierResult:
    """:func:`barrier` for loaded models; ``transforms`` holds alignments already computed."""
    grid = alpha_grid(alphas) if isinstance(alphas, int) else list(alphas)
    batches = load_batches(data, a.model.config, a.folder, eval_options)
    result = BarrierResult(grid)
    bar = tqdm(total=len(methods) * len(grid), desc="loss along the path", disable=not progress)
    one_shape = spec_of(a.model.config) == spec_of(b.model.config)
    for method in methods:
        if method == "average" and one_shape:
            state_a, state_b = a.model.state_dict(), b.model.state_dict()
            scratch = copy.deepcopy(a.model)
            models = (_lerp_state(scratch, state_a, state_b, alpha) for alpha in grid)
        else:
            # Models of two widths meet in one shape (exact; hf_lmc.widths); there, "average"
            # interpolates the embedded models with no alignment.
            ca, cb = to_common_shape(canonicalize(a.model), canonicalize(b.model))
            if transforms and method in transforms:
                transform_a, transform_b = transforms[method]
            elif method == "average":
                transform_a, transform_b = Transform(), Transform()
            else:
                transform_a, transform_b = align(
                    method, ca, cb, symmetries=symmetries, batches=fit_batches if method in DATA_METHODS else None,
                    learn=learn, progress=False,
                )
            dtype = next(a.model.parameters()).dtype
            moved_a = transform_a.to(dtype).apply(ca).materialize() if transform_a.maps else ca
            moved_b = transform_b.to(dtype).apply(cb).materialize()
            models = (to_hf(interpolate(moved_a, moved_b, alpha)) for alpha in grid)
        for model in models:
            scores = evaluate(model, batches)
            result.losses.setdefault(method, []).append(scores.loss)
            if scores.accuracy is not None:
                result.accuracies.setdefault(method, []).append(scores.accuracy)
            bar.update()
    bar.close()
    return result


def plot(result: BarrierResult, path: str | Path, title: str = "loss along the linear path") -> Path:
    """Save a PNG of loss against alpha, one line per method."""
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
    fig.savefig(path)
    plt.close(fig)
    return path
