"""Trained alignment: the learned, dual and simplex paths (``nn.Module`` s trained by :func:`train`),
their parameterisations, the training loop with its resume state, and the distributed build of the
interpolated weights. :class:`TrainedMatcher` runs a path under the matchers' shared contract
(:class:`~hf_lmc.matching.contract.Matcher`).
"""

from hf_lmc.learned.endpoints import EndpointSharding
from hf_lmc.learned.paths import (
    DualMatcher,
    LearnedMatcher,
    PairPath,
    SimplexMatcher,
    TrainedPath,
)
from hf_lmc.learned.training import TrainedMatcher, train

__all__ = [
    "DualMatcher",
    "EndpointSharding",
    "LearnedMatcher",
    "PairPath",
    "SimplexMatcher",
    "TrainedMatcher",
    "TrainedPath",
    "train",
]
