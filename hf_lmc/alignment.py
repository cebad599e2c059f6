"""Alignment: the transforms that bring models into one basin, by any registered method.

Every method (:mod:`hf_lmc.methods`) yields one exact transform per model; the merge is
``sum_k w_k T_k(theta_k)``, for two models ``(1 - alpha) T_A(A) + alpha T_B(B)``. The registry
entry names the matcher that fits the method for two models and for more; every matcher has the
one contract ``fit(models, weights) -> list[Transform]``. ``average`` is the vanilla baseline
and has no transforms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from . import matching
from .canonical import CanonicalModel
from .devices import launch_device
from .methods import check_method
from .options import AccelerateOptions, LearnOptions
from .symmetry import Transform


def align_many(
    method: str,
    models: Sequence[CanonicalModel],
    weights: Sequence[float] | None = None,
    *,
    symmetries="full",
    batches=None,
    learn: LearnOptions = LearnOptions(),
    accelerate: AccelerateOptions = AccelerateOptions(),
    progress: bool = True,
    device=None,
) -> list[Transform]:
    """One transform per model for ``method``; the merge is ``sum_k weights[k] T_k(models[k])``.

    ``batches`` feed the data methods; ``learn`` and ``accelerate`` the trained ones. ``device``
    is where weight matching's products run (default: a GPU when there is one); for the trained
    methods' weight-matching start, unless given, this process's device under ``accelerate launch``.
    """
    entry = check_method(method, batches, count=len(models))
    name = entry.pair_matcher if len(models) == 2 else entry.many_matcher
    if name is None:
        raise ValueError(f"{method} interpolates the stored parameters and has no canonical transforms")
    if entry.trained:
        return _trained(entry.name, models, weights, symmetries, batches, learn, accelerate, progress, device)
    if entry.needs_data:
        matcher = getattr(matching, name)(batches, symmetries, progress=progress)
    else:
        matcher = getattr(matching, name)(symmetries, progress=progress, device=device)
    return matcher.fit(models, weights)


def align(method: str, a: CanonicalModel, b: CanonicalModel, **options) -> tuple[Transform, Transform]:
    """``(T_A, T_B)`` for ``method``: :func:`align_many` of two models (same options)."""
    t_a, t_b = align_many(method, [a, b], **options)
    return t_a, t_b


def _trained(method, models, weights, symmetries, batches, learn, accelerate, progress, device) -> list[Transform]:
    options = dict(symmetries=symmetries, permutations=learn.permutations, orthogonal=learn.orthogonal, frame=learn.frame,
                   objective=learn.objective, input_noise=learn.input_noise)
    if len(models) == 2:
        matcher_class = matching.DualMatcher if method == "dual" else matching.LearnedMatcher
        with seeded(learn.seed):
            matcher = matcher_class(
                *models, lambda_range=learn.lambda_range, worst_fraction=learn.worst_fraction, focus=learn.focus,
                init_device=device, **options,
            )
            _fit(matcher, batches, learn, accelerate, progress)
        return list(matcher.transforms())
    start = matching.UniverseMatcher(symmetries, progress=progress, device=launch_device(device)).fit(models, weights)
    with seeded(learn.seed):
        matcher = matching.SimplexMatcher(
            models, init=start, learns_first=method == "dual", concentration=learn.concentration, **options
        )
        _fit(matcher, batches, learn, accelerate, progress)
    return matcher.transforms()


@contextlib.contextmanager
def seeded(seed: int | None):
    """Run with torch's RNG seeded to ``seed`` and restore the caller's state afterwards
    (``None``: the RNG as it stands). Every process of a launch seeds alike, so all draw the
    same interpolation weights, as the learned matchers require."""
    if seed is None:
        yield
        return
    # GPUs' states are saved only where CUDA already runs: reading them would start it (a context
    # per device) in a process launched to stay on the CPU.
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _fit(matcher, batches, learn: LearnOptions, accelerate: AccelerateOptions, progress: bool) -> None:
    matcher.fit(
        batches, steps=learn.steps, lr=learn.lr, residual_lr=learn.residual_lr, schedule=learn.schedule, warmup_steps=learn.warmup,
        mixed_precision=accelerate.mixed_precision, gradient_accumulation_steps=accelerate.gradient_accumulation_steps,
        progress=progress,
    )
