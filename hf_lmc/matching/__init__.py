"""Alignment by search: weight, activation and universe matching (the data-free and data-driven
solves), with the assignment solvers they share.

Every method answers ``fit(models, weights=None) -> list[Transform]``, one transform per model
(:class:`~hf_lmc.matching.contract.Matcher`); pairwise methods also answer ``match(a, b)``, B's
transform. The trained methods are in :mod:`hf_lmc.learned`.
"""

from hf_lmc.matching.activation import ActivationMatcher
from hf_lmc.matching.contract import Matcher, PairwiseMatcher
from hf_lmc.matching.universe import UniverseMatcher
from hf_lmc.matching.weight import WeightMatcher

__all__ = ["ActivationMatcher", "Matcher", "PairwiseMatcher", "UniverseMatcher", "WeightMatcher"]
