"""Alignment methods: find the transform that brings model B into model A's basin."""

from .learned import DualMatcher, LearnedMatcher
from .weight import WeightMatcher

__all__ = ["DualMatcher", "LearnedMatcher", "WeightMatcher"]
