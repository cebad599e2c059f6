"""Shared linear-algebra helpers at the bottom of the package: single-threaded decompositions,
the Householder frame of ``1/sqrt(d)``, side-by-side small solves, and linear assignment.

Every SVD / eigh / QR in hf_lmc goes through :func:`single_threaded`: on small CPU machines
multi-threaded LAPACK decompositions are many times slower than single-threaded ones
(docs/decisions.md#d-single-thread-lapack). :func:`assign` lives here rather than in :mod:`hf_lmc.matching` because the
symmetry groups harden relaxed permutations with it, and symmetry sits below matching.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch
from scipy.optimize import linear_sum_assignment
from torch import Tensor

T = TypeVar("T")


@contextlib.contextmanager
def single_threaded_context():
    """Limit torch to one intra-op thread inside the block, restoring the caller's count after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def single_threaded(fn):
    """Decorator: run ``fn`` with torch limited to one intra-op thread."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with single_threaded_context():
            return fn(*args, **kwargs)

    return wrapper


def householder_to_first(d: int, dtype=torch.float64, device=None) -> torch.Tensor | None:
    """Unit ``v`` such that ``H = I - 2 v v^T`` swaps ``u = 1/sqrt(d)`` and ``e_1`` (``None`` if d == 1).

    In that frame the maps of ``1-perp`` that fix ``u`` are exactly ``diag(1, X)``.
    """
    v = torch.full((d,), 1.0 / math.sqrt(d), dtype=dtype, device=device)
    v[0] -= 1.0
    norm = v.norm()
    return None if norm < 1e-12 else v / norm


class OnesFrame:
    """The Householder frame of the maps of ``1-perp`` that fix ``u = 1/sqrt(d)``: ``H = I - 2 v
    v^T`` (:func:`householder_to_first`) swaps ``u`` and ``e_1``, so such a map ``m`` is ``H
    diag(1, X) H``. ``reduce(m) = (H m H)[1:, 1:]`` and ``expand(X) = H diag(1, X) H``, ``H``
    applied as the reflection it is, in ``O(d^2)``: never a dense ``d x d`` product. ``v``:
    the reflection's vector when held elsewhere (a module's buffer, on its device); ``None``
    computes it, which for ``d == 1`` (the identity the only such map) is ``None`` too."""

    def __init__(self, d: int, dtype: torch.dtype, device=None, v: torch.Tensor | None = None):
        self.d = d
        self.v = householder_to_first(d, dtype, device) if v is None else v

    def _reflect(self, x: torch.Tensor) -> torch.Tensor:  # H x H
        x = x - 2 * torch.outer(self.v, self.v @ x)
        return x - 2 * torch.outer(x @ self.v, self.v)

    def reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x[1:, 1:] if self.v is None else self._reflect(x)[1:, 1:]

    def expand(self, inner: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.d, self.d, dtype=inner.dtype, device=inner.device)
        full[0, 0] = 1.0
        full[1:, 1:] = inner
        return full if self.v is None else self._reflect(full)


def solve_side_by_side(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """``[job() for job in jobs]``, up to ``torch.get_num_threads()`` jobs at a time.

    For independent small decompositions (weight matching's per-head solves: a few eigh / SVD of
    ``head_dim``² each). Threads inside one such call gain little, but torch releases the GIL in
    them, so separate calls run side by side, each on one thread as every decomposition here
    does: the results are bit for bit the sequential ones. With one thread allowed, the jobs
    run in turn on the caller's thread.
    """
    workers = min(len(jobs), torch.get_num_threads())
    if workers <= 1:
        return [job() for job in jobs]
    with single_threaded_context(), ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda job: job(), jobs))


def assign(similarity: Tensor) -> Tensor:
    """The permutation ``perm`` maximising ``sum_h similarity[perm[h], h]``.

    ``similarity[i, j]`` compares target block ``i`` with source block ``j``; the result
    sends source ``j`` to position ``perm[j]`` (the convention of :class:`BlockMonomial`).
    """
    cost = similarity.detach().to("cpu", torch.float64, copy=True).neg_()  # scipy solves on the CPU
    rows, cols = linear_sum_assignment(cost.numpy())  # a C-contiguous float64 array: not copied
    return perm_from_pairs(
        torch.as_tensor(rows, device="cpu").long(), torch.as_tensor(cols, device="cpu").long(), similarity.shape[1]
    )


def perm_from_pairs(rows: Tensor, cols: Tensor, n: int) -> Tensor:
    """The permutation (``perm[cols[i]] = rows[i]``, on the CPU) of a complete matching of ``n`` pairs."""
    perm = torch.empty(n, dtype=torch.long, device="cpu")
    perm[cols] = rows
    return perm
