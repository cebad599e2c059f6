"""Alignment methods: find the transform that brings model B into model A's basin."""

from .activation import ActivationMatcher
from .learned import DualMatcher, LearnedMatcher
from .weight import WeightMatcher

__all__ = ["ActivationMatcher", "DualMatcher", "LearnedMatcher", "WeightMatcher"]
