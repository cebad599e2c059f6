"""Learned and dual matching: transforms trained on the loss of the interpolated model (DESIGN §4).

``LearnedMatcher`` trains B's transform only; ``DualMatcher`` trains both models' transforms
toward one shared linear path. Both start from weight matching (B's transform) and the identity
(A's), sample ``lambda ~ U(0.4, 0.6)`` per call, and evaluate the interpolant with the stock HF
class. ``merge(alpha)`` hardens the transforms and returns a stock model: an exact symmetry of
each endpoint at ``alpha = 0`` and ``alpha = 1``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ..canonical import canonicalize, interpolate, to_hf
from ..symmetry import Transform
from .interpolant import Interpolant
from .trainable import TrainableTransform
from .weight import WeightMatcher

INITS = ("weight", "identity")


class DualMatcher(nn.Module):
    """Both models learn their transforms toward one shared linear path.

    Args:
        model_a, model_b: stock HF models (or checkpoint folders) of one architecture and shape.
        init: ``"weight"`` (B's transform starts at weight matching's solution) or ``"identity"``.
        symmetries: the group weight matching searches for the initialisation.
        permutations: ``"ste"`` or ``"sinkhorn"`` (MLP units).
        orthogonal: ``"cayley"``, ``"exp"`` or ``"polar"`` (the residual map).
        lambda_range: interpolation weights are drawn uniformly from this range.
        dtype: dtype of the frozen endpoint weights and of the transform parameters.
    """

    learns_a = True

    def __init__(
        self,
        model_a,
        model_b,
        *,
        init: str = "weight",
        symmetries="full",
        permutations: str = "ste",
        orthogonal: str = "cayley",
        lambda_range: tuple[float, float] = (0.4, 0.6),
        dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        if init not in INITS:
            raise ValueError(f"unknown init {init!r}; choose from {INITS}")
        low, high = lambda_range
        if not 0.0 <= low <= high <= 1.0:
            raise ValueError(f"lambda_range must satisfy 0 <= low <= high <= 1, got {lambda_range}")
        self.lambda_range = (float(low), float(high))
        a = canonicalize(model_a, dtype=dtype).materialize()
        b = canonicalize(model_b, dtype=dtype).materialize()
        start = WeightMatcher(symmetries, progress=False).fit(a, b) if init == "weight" else None
        options = {"permutations": permutations, "orthogonal": orthogonal, "dtype": dtype}
        self.transform_b = TrainableTransform(a.spec, start, **options)
        self.transform_a = TrainableTransform(a.spec, None, **options) if self.learns_a else None
        self.interpolant = Interpolant(a, b)

    def sample_lambda(self) -> Tensor:
        low, high = self.lambda_range
        return torch.empty(()).uniform_(low, high)

    def forward(self, batch: dict[str, Tensor], alpha: float | Tensor | None = None) -> Tensor:
        """The interpolated model's loss on ``batch`` at ``alpha`` (sampled when ``None``)."""
        alpha = self.sample_lambda() if alpha is None else alpha
        inputs = dict(batch)
        if "labels" not in inputs and "input_ids" in inputs:
            inputs["labels"] = inputs["input_ids"]  # causal LM: next-token loss
        transform_a = self.transform_a() if self.transform_a is not None else None
        return self.interpolant(self.transform_b(), alpha, transform_a, **inputs).loss

    def transforms(self) -> tuple[Transform, Transform]:
        """The exact (hardened) transforms of A and B the parameters currently select."""
        transform_a = self.transform_a.harden() if self.transform_a is not None else Transform()
        return transform_a, self.transform_b.harden()

    @torch.no_grad()
    def merge(self, alpha: float = 0.5) -> PreTrainedModel:
        """A stock HF model computing ``(1 - alpha) T_A(A) + alpha T_B(B)`` with exact transforms."""
        transform_a, transform_b = self.transforms()
        a, b = self.interpolant.a, self.interpolant.b
        dtype = next(iter(a.group("head").values())).dtype
        return to_hf(interpolate(transform_a.to(dtype).apply(a), transform_b.to(dtype).apply(b), alpha))


class LearnedMatcher(DualMatcher):
    """Only B learns its transform (one-sided learned matching); A stays as it is."""

    learns_a = False
