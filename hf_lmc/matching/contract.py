"""The call every method's matcher answers for a merge, and its two-model form.

A matcher's ``fit(models, weights=None)`` returns one :class:`~hf_lmc.Transform` per model, and
the merge is ``sum_k weights[k] T_k(models[k])``: weight, activation, universe, learned and dual
matching all answer that one call, so a caller picks a method without knowing its kind.
Pairwise methods (:class:`~hf_lmc.WeightMatcher`, :class:`~hf_lmc.ActivationMatcher`) align B
to A and leave A as it is; their own call is ``match(a, b)``, B's transform.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.symmetry import Transform


@runtime_checkable
class Matcher(Protocol):
    """The call a merge makes on a method's matcher: one transform per model, for merging at ``weights``.

    A matcher is what finds a method's transforms. A search matcher answers this call itself; a
    trained one (:class:`~hf_lmc.learned.DualMatcher` and its kin) is a trainable path, an
    ``nn.Module`` whose own ``fit(batches)`` trains it in a user's loop, and
    :class:`~hf_lmc.learned.TrainedMatcher` runs it under this call. Runtime-checkable, so a test
    can hold every class the method registry builds to it.
    """

    def fit(self, models: Sequence[CanonicalModel], weights: Sequence[float] | None = None) -> list[Transform]:
        """One transform per model; the merge is ``sum_k weights[k] T_k(models[k])``."""
        ...


class PairwiseMatcher:
    """Base of the matchers that align one model, B, to another, A.

    Subclasses implement :meth:`match`; :meth:`fit` is the shared contract for two models:
    A's transform is the identity and B's is ``match(a, b)``, whatever the merge weights.
    """

    def match(self, a: CanonicalModel, b: CanonicalModel) -> Transform:
        """B's transform ``T``, with ``T.apply(b)`` as close to ``a`` as the method finds."""
        raise NotImplementedError

    def fit(self, models: Sequence[CanonicalModel], weights: Sequence[float] | None = None) -> list[Transform]:
        """``[Transform(), self.match(a, b)]`` for ``models = [a, b]``; a ``ValueError`` for any other count."""
        if len(models) != 2:
            raise ValueError(
                f"{type(self).__name__} aligns two models, got {len(models)}; for three or more use UniverseMatcher "
                "(weight matching of 3+ models)"
            )
        return [Transform(), self.match(*models)]
