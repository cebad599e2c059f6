"""Alignment: the transforms that bring models into one basin, by any registered method.

Every method (:mod:`hf_lmc.config.methods`) yields one exact transform per model; the merge is
``sum_k w_k T_k(theta_k)``, for two models ``(1 - alpha) T_A(A) + alpha T_B(B)``. The registry
entry names the matcher class that fits the method for two models and for more, and every
matcher answers the one contract ``fit(models, weights) -> list[Transform]``: the search
methods directly, the trained methods through :class:`~hf_lmc.learned.TrainedMatcher`, which
trains the named path. ``average`` is the unaligned baseline and has no transforms.
"""

from __future__ import annotations

from collections.abc import Sequence

from hf_lmc import learned, matching
from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.config.methods import check_method
from hf_lmc.config.options import DEFAULT_SYMMETRIES, AccelerateOptions, LearnOptions
from hf_lmc.symmetry import Transform


def align_many(
    method: str, models: Sequence[CanonicalModel], weights: Sequence[float] | None = None, **options
) -> list[Transform]:
    """One transform per model for ``method``; the merge is ``sum_k weights[k] T_k(models[k])``.

    ``options`` are :func:`matcher_for`'s: ``batches`` feed the data methods; ``learn`` and
    ``accelerate`` the trained ones. ``device`` is where weight matching's products run (default:
    a GPU when there is one); for the trained methods' weight-matching start, unless given, this
    process's device under ``accelerate launch``.
    """
    return matcher_for(method, len(models), **options).fit(models, weights)


def matcher_for(
    method: str,
    count: int,
    *,
    symmetries=DEFAULT_SYMMETRIES,
    batches=None,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    progress: bool = True,
    device=None,
):
    """The matcher of ``method`` for ``count`` models, set up with the same settings a merge
    passes: the registry's matcher class, or for a trained method a
    :class:`~hf_lmc.learned.TrainedMatcher` of the registry's path. Its ``fit(models, weights)``
    gives the transforms (and a trained method's keeps what its stopping rule reached in
    ``stopping``)."""
    entry = check_method(method, batches, count=count)
    name = entry.pair_class if count == 2 else entry.many_class
    if name is None:
        raise ValueError(f"{method} interpolates the stored parameters and has no canonical transforms")
    named = getattr(learned if entry.trained else matching, name)
    if entry.trained:
        matcher = learned.TrainedMatcher(
            named,
            batches,
            learn=learn,
            accelerate=accelerate,
            symmetries=symmetries,
            progress=progress,
            device=device,
        )
    elif entry.needs_data:
        matcher = named(batches, symmetries, progress=progress)
    else:
        matcher = named(symmetries, progress=progress, device=device)
    return matcher


def align(method: str, a: CanonicalModel, b: CanonicalModel, **options) -> tuple[Transform, Transform]:
    """``(T_A, T_B)`` for ``method``: :func:`align_many` of two models (same options)."""
    t_a, t_b = align_many(method, [a, b], **options)
    return t_a, t_b
