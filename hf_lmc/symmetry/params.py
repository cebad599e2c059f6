"""Former home of the trainable parameterisations, kept only for the callers not yet moved.

The parameterisations are in :mod:`hf_lmc.matching.params` (the learned matchers are their only
users, and symmetry sits below matching); :func:`check_orthogonal` and ``FRAMES`` are declared
in :mod:`hf_lmc.options`. Delete this module once nothing imports it.
"""

from ..options import FRAMES, check_orthogonal

__all__ = ["FRAMES", "check_orthogonal"]
