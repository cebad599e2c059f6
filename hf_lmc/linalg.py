"""Shared linear-algebra helpers. Dense decompositions run single-threaded.

Measured on this project's 2-core CPU machines (torch 2.13 CPU wheel): multi-threaded LAPACK
decompositions are pathologically slow — SVD of a 2048² float64 matrix 56 s with 2 threads vs
4.4 s with 1, eigh of 256² 0.17 s vs 0.009 s. Every SVD / eigh / QR in hf_lmc goes through
:func:`single_threaded`.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


@contextlib.contextmanager
def single_threaded_context():
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
