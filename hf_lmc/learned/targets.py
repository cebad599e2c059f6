"""The endpoints' outputs a learned run computes again and again, kept once computed.

Learned and dual matching run the endpoints themselves, without gradient, at every step: under
the ``ensemble`` objective each step's target is the endpoints' predictions on its batch, and
every barrier estimate reads the endpoints' losses on the held-out batches. The endpoints never
change while the transforms train (a symmetry does not change a model's function, and the
targets are read off the endpoints as given), so on a fitting set of fixed batches, passed over
several times (the defaults' 1000 steps pass about four times over 8192 sequences in batches of
32), every pass after the first recomputes what the first computed. :class:`TargetCache` keeps
it, up to a budget of bytes: the same tensors, so the merge is the same, bit for bit, sooner.

Nothing is kept where recomputing could give something else (input noise redraws the inputs)
or where the endpoints' forwards are collectives every process must join in step (endpoints
sharded or built shared across processes): :meth:`hf_lmc.learned.paths.TrainedPath.reuses_targets`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from torch import Tensor

T = TypeVar("T")


class TargetCache:
    """Values keyed by the batch they were computed on, up to ``budget`` bytes.

    The training loop sets :attr:`batch` to the index of the step's batch in the fitting data
    (``None``: a batch with no stable place, nothing kept); a path reads through :meth:`get`.
    Values past the budget are computed and not kept: the first batches of a pass are kept, the
    rest recomputed each pass. :attr:`hits` and :attr:`misses` count the reads.
    """

    def __init__(self, budget: int):
        self.budget = int(budget)
        self.used = 0
        self.batch: int | None = None
        self.hits = 0
        self.misses = 0
        self._kept: dict[Hashable, object] = {}

    def get(self, key: Hashable, compute: Callable[[], T], size: Callable[[T], int]) -> T:
        """``compute()``'s value for ``key``: kept from an earlier call, or computed now (and
        kept while ``size(value)`` bytes fit the budget)."""
        if key in self._kept:
            self.hits += 1
            return self._kept[key]  # type: ignore[return-value]
        self.misses += 1
        value = compute()
        nbytes = size(value)
        if self.used + nbytes <= self.budget:
            self._kept[key] = value
            self.used += nbytes
        return value

    def step_key(self, part: Hashable) -> Hashable | None:
        """The key of ``part`` of this step's batch (``None``: the batch has no stable place)."""
        return None if self.batch is None else ("step", self.batch, part)


def tensor_bytes(*tensors: Tensor) -> int:
    """Bytes the tensors' elements take."""
    return sum(t.numel() * t.element_size() for t in tensors)
