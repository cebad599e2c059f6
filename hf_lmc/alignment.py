"""The alignment methods behind ``merge`` and ``barrier``, as one table of names.

Every method yields a pair of exact transforms ``(T_A, T_B)``; the merge is
``(1 - alpha) T_A(A) + alpha T_B(B)``. Data-free weight matching and activation matching move
B only (``T_A`` is the identity); learned matching trains ``T_B`` from weight matching's
solution, and dual matching trains both. ``average`` is the vanilla baseline and moves nothing.

For M > 2 models (:func:`align_many`) every method yields one transform per model and the merge
is ``sum_k w_k T_k(theta_k)``: ``weight`` is universe matching (:class:`~hf_lmc.UniverseMatcher`),
``learned`` and ``dual`` refine it on data at weights ``w ~ Dirichlet(concentration * 1)``
(:class:`~hf_lmc.SimplexMatcher`; ``learned`` keeps the first model's transform fixed, ``dual``
trains all). Activation matching stays a two-model method.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .canonical import CanonicalModel
from .devices import launch_device
from .symmetry import Transform

METHODS = ("average", "weight", "activation", "learned", "dual")
#: Methods that need data: calibration batches (activation) or training batches (learned, dual).
DATA_METHODS = ("activation", "learned", "dual")
#: Methods whose transforms are trained (soft permutations are hardened before export).
TRAINED_METHODS = ("learned", "dual")
#: Methods that merge more than two models.
MULTI_METHODS = ("average", "weight", "learned", "dual")


@dataclass(frozen=True)
class LearnOptions:
    """Settings of learned and dual matching (see :class:`hf_lmc.DualMatcher`).

    ``mixed_precision`` (``"no"``, ``"fp16"``, ``"bf16"``) and ``gradient_accumulation_steps`` go
    to the training loop's ``accelerate.Accelerator``; one process can hold only one mixed
    precision setting, so a run that changes it needs a fresh process.
    """

    steps: int = 200
    lr: float = 3e-3
    residual_lr: float | None = None  # the residual maps' learning rate (None: lr)
    schedule: str = "constant"  # a transformers scheduler name: "constant", "cosine", "linear", ...
    warmup: int = 0  # linear warmup steps
    permutations: str = "fixed"  # weight matching's assignment; "ste" / "sinkhorn" train it
    orthogonal: str = "cayley"
    frame: str = "own"  # where each map's trained factor sits: "own" (M_0 f(A)), "target" (f(A) M_0) or "both" (f(L) M_0 f(A))
    lambda_range: tuple[float, float] = (0.4, 0.6)
    worst_fraction: float = 0.5  # share of draws near the path's current worst point (two models)
    focus: str = "worst"  # those draws: near the worst grid point, or "excess": near each in proportion to its excess
    objective: str = "labels"  # or "ensemble": toward the endpoints' mixed predictions
    input_noise: float = 0.0  # image models: std of Gaussian noise on pixel_values while training
    mixed_precision: str = "no"
    gradient_accumulation_steps: int = 1
    #: More than two models: the weights of each step are drawn from Dirichlet(concentration * 1).
    concentration: float = 0.1
    #: Seed of the training draws (interpolation weights, input noise); None: torch's RNG as it stands.
    seed: int | None = None

    def __post_init__(self):
        # Here, not only where the maps are built: a conflict fails before models load or match.
        # Only a non-default frame can conflict, and the defaults built at import time must not
        # import the parameterisations (they import back into this package).
        if self.frame != "own":
            from .symmetry.params import check_orthogonal

            check_orthogonal(self.orthogonal, self.frame)


def check_method(method: str, data, flag: str = "--data", count: int = 2) -> None:
    """Fail early, with what to do, for an unknown method, a two-model method given ``count`` > 2
    models, or a data method without data."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    if count > 2 and method not in MULTI_METHODS:
        raise ValueError(f"method {method!r} aligns two models; for {count} use one of {', '.join(MULTI_METHODS)}")
    if method in DATA_METHODS and data is None:
        raise ValueError(
            f"method {method!r} learns from data: pass {flag} (a text file or folder, a datasets id, or .pt tensors for ViT)"
        )


def align(
    method: str,
    a: CanonicalModel,
    b: CanonicalModel,
    *,
    symmetries="full",
    batches=None,
    learn: LearnOptions = LearnOptions(),
    progress: bool = True,
    device=None,
) -> tuple[Transform, Transform]:
    """``(T_A, T_B)`` for ``method``; ``batches`` feed activation, learned and dual matching.
    ``device`` is where weight matching's products run (default: a GPU when there is one; for the
    learned methods' weight-matching start, this process's device under ``accelerate launch``)."""
    from .matching import ActivationMatcher, DualMatcher, LearnedMatcher, WeightMatcher

    check_method(method, batches)
    if method == "average":
        raise ValueError("average interpolates the stored parameters and has no canonical transforms")
    if method == "weight":
        return Transform(), WeightMatcher(symmetries, progress=progress, device=device).fit(a, b)
    if method == "activation":
        return Transform(), ActivationMatcher(batches, symmetries, progress=progress).fit(a, b)
    matcher_class = DualMatcher if method == "dual" else LearnedMatcher
    with seeded(learn.seed):
        matcher = matcher_class(
            a, b, symmetries=symmetries, permutations=learn.permutations, orthogonal=learn.orthogonal, frame=learn.frame,
            lambda_range=learn.lambda_range,
            worst_fraction=learn.worst_fraction, focus=learn.focus, objective=learn.objective, input_noise=learn.input_noise,
            init_device=device,
        )
        _fit(matcher, batches, learn, progress)
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


def _fit(matcher, batches, learn: LearnOptions, progress: bool) -> None:
    matcher.fit(
        batches, steps=learn.steps, lr=learn.lr, residual_lr=learn.residual_lr, schedule=learn.schedule, warmup_steps=learn.warmup,
        mixed_precision=learn.mixed_precision, gradient_accumulation_steps=learn.gradient_accumulation_steps, progress=progress,
    )


def align_many(
    method: str,
    models: Sequence[CanonicalModel],
    weights: Sequence[float] | None = None,
    *,
    symmetries="full",
    batches=None,
    learn: LearnOptions = LearnOptions(),
    progress: bool = True,
    device=None,
) -> list[Transform]:
    """One transform per model for ``method``; the merge is ``sum_k weights[k] T_k(models[k])``.

    Two models go through :func:`align` (so a two-model merge is the same however it is asked
    for); more go through universe matching and its learned refinement.
    """
    from .matching import SimplexMatcher, UniverseMatcher

    if len(models) == 2:
        return list(align(method, *models, symmetries=symmetries, batches=batches, learn=learn, progress=progress, device=device))
    check_method(method, batches, count=len(models))
    if method == "average":
        raise ValueError("average interpolates the stored parameters and has no canonical transforms")
    if method != "weight":  # a learned refinement follows: unless asked, start where the launch put this process
        device = launch_device(device)
    start = UniverseMatcher(symmetries, progress=progress, device=device).fit(models, weights)
    if method == "weight":
        return start
    with seeded(learn.seed):
        matcher = SimplexMatcher(
            models, init=start, learns_first=method == "dual", symmetries=symmetries, permutations=learn.permutations,
            orthogonal=learn.orthogonal, frame=learn.frame, concentration=learn.concentration, objective=learn.objective,
            input_noise=learn.input_noise,
        )
        _fit(matcher, batches, learn, progress)
    return matcher.transforms()
