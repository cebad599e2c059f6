"""Universe matching: M models aligned to one shared reference by weight matching (docs/design.md §4).

Two models have a natural reference (A) and one transform to find (B's). With M models any
choice of reference favours one model, so every model moves, toward an *evolving* reference:

1. seed: the first model stays; model k is aligned to the weighted average of models
   0..k-1 as aligned so far;
2. rounds: each model in turn is aligned afresh to the weighted average of all the *others*
   as currently aligned (leaving itself out, so it cannot pull the reference toward itself),
   until a round lowers the weighted objective by less than ``tol``.

Each alignment is a :class:`~hf_lmc.WeightMatcher` fit against a lazy reference, so the
reference is never stored: every group the matcher reads is rebuilt from the other models
(one group of each alive at a time), and only the M transforms are kept.

Exact for twins: if every model is a symmetry of the first, the seed aligns each of them to
the first exactly, the average of the aligned models *is* the first model, and any merge
``sum_k w_k T_k(theta_k)`` computes its function.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_lmc.canonical.form import CanonicalModel, combine
from hf_lmc.config.options import DEFAULT_SYMMETRIES, simplex_weights
from hf_lmc.matching.weight import WeightMatcher, _check_compatible
from hf_lmc.symmetry import Transform
from hf_lmc.utils.devices import compute_device
from hf_lmc.utils.progress import bar as progress_bar

#: A seed objective below this means every model is a symmetry of the first up to float32
#: rounding (independent models sit near 1): no round could improve on it.
EXACT = 1e-6


class UniverseMatcher:
    """Align M models to one shared reference without data.

    Args:
        symmetries: the group every pairwise fit searches (as for :class:`WeightMatcher`).
        max_rounds: upper bound on leave-one-out rounds after the seed.
        tol: stop when a round lowers the weighted objective by less than this (relative).
        progress: show a progress bar over the fits.
        **options: passed on to each :class:`WeightMatcher` (``max_sweeps``, ``dtype``,
            ``device``, ...); the references are built on that ``device`` too.

    ``fit(models, weights)`` returns one :class:`Transform` per model; the merge is
    ``sum_k weights[k] T_k(models[k])``. ``history`` holds the weighted objective (mean relative
    squared distance of each aligned model to its reference) after the seed and each round.
    """

    def __init__(
        self, symmetries=DEFAULT_SYMMETRIES, *, max_rounds: int = 3, tol: float = 1e-2, progress: bool = True, **options
    ):
        self.symmetries = symmetries
        self.max_rounds = max_rounds
        self.tol = tol
        self.progress = progress
        self.options = options
        self.history: list[float] = []

    def fit(self, models: Sequence[CanonicalModel], weights: Sequence[float] | None = None) -> list[Transform]:
        """One transform per model toward the shared reference (``weights``: uniform by default)."""
        if len(models) < 2:
            raise ValueError(f"universe matching needs at least 2 models, got {len(models)}")
        for other in models[1:]:
            _check_compatible(models[0], other)
        weights = simplex_weights(weights, len(models))
        count = len(models)
        # The matcher's float32 working copies: the reference is rebuilt from them on every read.
        device = compute_device(self.options.get("device"))
        models = [m.to(torch.float32, device) for m in models]
        transforms: list[Transform] = [Transform()] * count
        bar = progress_bar(total=count - 1 + self.max_rounds * count, desc="universe matching", show=self.progress)

        def align(k: int, others: list[int]) -> float:
            reference = combine(
                [transforms[j].to(torch.float32, device).apply(models[j]) for j in others],
                _renormalised(weights, others),
            )
            matcher = WeightMatcher(self.symmetries, progress=False, **self.options)
            transforms[k] = matcher.match(reference, models[k])
            bar.update()
            return min(matcher.history) if matcher.history else 0.0

        objective = [0.0] * count
        for k in range(1, count):
            objective[k] = align(k, list(range(k)))
        self.history = [_mean(objective, weights)]  # the first model's term is 0 here: not comparable to rounds
        best, best_objective = list(transforms), float("inf")
        for round_ in range(self.max_rounds):
            if self.history[0] < EXACT:  # twins: the seed already put every model on the first
                break
            for k in range(count):
                objective[k] = align(k, [j for j in range(count) if j != k])
            self.history.append(_mean(objective, weights))
            if self.history[-1] < best_objective:
                best, best_objective = list(transforms), self.history[-1]
            if round_ and not self.history[-1] < self.history[-2] * (1 - self.tol):
                break
        bar.close()
        return best


def _renormalised(weights: Sequence[float], subset: list[int]) -> list[float]:
    """The weights of ``subset``, rescaled to sum to 1 (uniform if they are all zero)."""
    total = sum(weights[j] for j in subset)
    if total <= 0:
        return [1.0 / len(subset)] * len(subset)
    return [weights[j] / total for j in subset]


def _mean(values: list[float], weights: Sequence[float]) -> float:
    return sum(v * w for v, w in zip(values, weights))
