"""Alignment methods: find the transform that brings model B into model A's basin."""

from .weight import WeightMatcher

__all__ = ["WeightMatcher"]
