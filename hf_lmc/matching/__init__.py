"""Alignment methods: find the transforms that bring models into one basin (B into A's, or M models into a shared one).

Every method answers ``fit(models, weights=None) -> list[Transform]``, one transform per model
(:class:`~hf_lmc.matching.contract.Matcher`). Pairwise methods also answer ``match(a, b)``, B's
transform; the learned paths are ``nn.Module`` s trained by :func:`train`, and
:class:`TrainedMatcher` runs them under the shared contract.
"""

from .activation import ActivationMatcher
from .contract import Matcher, PairwiseMatcher
from .endpoints import EndpointSharding
from .learned import (
    DualMatcher,
    DualPath,
    LearnedMatcher,
    LearnedPath,
    PairPath,
    SimplexMatcher,
    SimplexPath,
    TrainedPath,
)
from .training import TrainedMatcher, train
from .universe import UniverseMatcher
from .weight import WeightMatcher

__all__ = [
    "ActivationMatcher",
    "DualMatcher",
    "DualPath",
    "EndpointSharding",
    "LearnedMatcher",
    "LearnedPath",
    "Matcher",
    "PairPath",
    "PairwiseMatcher",
    "SimplexMatcher",
    "SimplexPath",
    "TrainedMatcher",
    "TrainedPath",
    "UniverseMatcher",
    "WeightMatcher",
    "train",
]
