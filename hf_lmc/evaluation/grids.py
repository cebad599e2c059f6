"""Grids of interpolation weights and the loss excess over them: the pure math of the barrier
(docs/design.md §1), with no models involved.

For two models the path is ``(1 - alpha) A + alpha B`` over an evenly spaced alpha grid, and the
barrier is the largest excess of the loss over the straight line between the endpoints' losses.
For M models the path becomes the simplex they span, the grid every point with coordinates in
steps of ``1/(points-1)`` plus the centre, and the barrier the largest excess over the plane
through the vertices' losses. :mod:`hf_lmc.evaluation.barriers` evaluates models on these grids; the
learned matchers locate the worst point of their path on :func:`alpha_grid`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence

from hf_lmc.config.options import ParameterError


def excess_over_line(alphas: Sequence[float], losses: Sequence[float]) -> list[float]:
    """The loss at each alpha above the straight line between the endpoints' losses."""
    start, end = losses[0], losses[-1]
    return [loss - ((1 - a) * start + a * end) for a, loss in zip(alphas, losses)]


def loss_barrier(alphas: list[float], losses: list[float]) -> float:
    """``max_alpha`` of the loss above the straight line between the endpoints."""
    return max(excess_over_line(alphas, losses))


def alpha_grid(points: int) -> list[float]:
    """``points`` evenly spaced alphas from 0 to 1, both ends included (at least 2)."""
    if points < 2:
        raise ParameterError(f"{{}} needs at least 2 points, got {points}", "alphas")
    return [i / (points - 1) for i in range(points)]


def check_alpha_grid(alphas: Sequence[float]) -> list[float]:
    """``alphas`` as a list, once it is a grid the barrier can be measured on: at least 2 finite
    numbers, increasing from 0 to 1 (the barrier compares the path with its endpoints). A NaN is
    refused by name: it compares false with everything, so an order check alone lets it through."""
    grid = list(alphas)
    if not all(isinstance(a, (int, float)) and not isinstance(a, bool) for a in grid):
        raise ParameterError("{} must list numbers only, e.g. [0, 0.25, 0.5, 0.75, 1]", "alphas")
    if not all(math.isfinite(a) for a in grid):
        shown = next(a for a in grid if not math.isfinite(a))
        raise ParameterError(f"{{}} holds {shown}; list finite numbers from 0 to 1", "alphas")
    if len(grid) < 2 or grid[0] != 0 or grid[-1] != 1 or any(b <= a for a, b in itertools.pairwise(grid)):
        raise ParameterError(
            "{} must increase from 0 to 1 (the barrier compares the path with its endpoints)", "alphas"
        )
    return grid


def simplex_grid(count: int, points: int) -> list[tuple[float, ...]]:
    """Every point of the simplex of ``count`` models whose coordinates are multiples of
    ``1/(points-1)``, plus the centre if it is not one of them. Vertices (the models themselves)
    come first, in model order; with two models the points are ``(1 - alpha, alpha)`` of
    :func:`alpha_grid`."""
    if count < 2:
        raise ValueError(f"a simplex grid needs at least 2 models, got {count}")
    steps = len(alpha_grid(points)) - 1
    grid = [tuple(c / steps for c in reversed(combo)) for combo in _compositions(steps, count)]
    grid.sort(key=lambda w: (-max(w), [-x for x in w]))  # vertices first, then edges, ...
    centre = (1.0 / count,) * count
    if not any(all(abs(x - c) < 1e-12 for x, c in zip(w, centre)) for w in grid):
        grid.append(centre)
    return grid


def _compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every tuple of ``parts`` non-negative integers summing to ``total``."""
    for cuts in itertools.combinations(range(total + parts - 1), parts - 1):
        edges = (-1, *cuts, total + parts - 1)
        yield tuple(edges[i + 1] - edges[i] - 1 for i in range(parts))


def simplex_barrier(points: Sequence[Sequence[float]], losses: Sequence[float]) -> float:
    """``max_w`` of the loss above the plane through the vertices' losses (``points`` must hold
    every vertex); with two models, :func:`loss_barrier`."""
    return max(excess_over_vertices(points, losses))


def excess_over_vertices(points: Sequence[Sequence[float]], losses: Sequence[float]) -> list[float]:
    """Each grid point's loss above ``sum_k w_k L(theta_k)``, the plane through the vertices'
    losses (``points`` must hold every vertex)."""
    vertex = {}
    for w, loss in zip(points, losses):
        for k, x in enumerate(w):
            if x == 1.0:
                vertex[k] = loss
    if len(vertex) != len(points[0]):
        raise ValueError("the grid must contain every vertex (each model on its own)")
    return [loss - sum(x * vertex[k] for k, x in enumerate(w)) for w, loss in zip(points, losses)]
