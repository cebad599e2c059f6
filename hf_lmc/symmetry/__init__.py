"""Function-preserving symmetries of canonical models: group elements, the axes table, sampling.

The layer below matching: nothing here imports :mod:`hf_lmc.matching`. Their trainable
parameterisations, which only the learned matchers use, are in :mod:`hf_lmc.learned.params`.
"""

from hf_lmc.symmetry.engine import GLOBAL_AXES, LAYER_AXES, Transform, axes_of, load_transforms
from hf_lmc.symmetry.groups import AttentionMap, BlockMonomial, DenseAttentionMap, DenseMlpMap, MlpMap, ResidualMap
from hf_lmc.symmetry.sample import KINDS, PRESETS, random_symmetry, resolve_kinds

__all__ = [
    "GLOBAL_AXES",
    "KINDS",
    "LAYER_AXES",
    "PRESETS",
    "AttentionMap",
    "BlockMonomial",
    "DenseAttentionMap",
    "DenseMlpMap",
    "MlpMap",
    "ResidualMap",
    "Transform",
    "axes_of",
    "load_transforms",
    "random_symmetry",
    "resolve_kinds",
]
