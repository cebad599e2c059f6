"""Alignment methods: find the transforms that bring models into one basin (B into A's, or M models into a shared one)."""

from .activation import ActivationMatcher
from .learned import DualMatcher, LearnedMatcher, SimplexMatcher
from .universe import UniverseMatcher
from .weight import WeightMatcher

__all__ = ["ActivationMatcher", "DualMatcher", "LearnedMatcher", "SimplexMatcher", "UniverseMatcher", "WeightMatcher"]
