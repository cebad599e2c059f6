"""hf_lmc: merge independently trained transformers through linear mode connectivity.

Models are rewritten exactly into a canonical RMSNorm-absorbed form, aligned by
function-preserving symmetries, interpolated, and exported as ordinary HF checkpoints.
"""

from .adapters import UnsupportedModelError
from .barriers import BarrierResult, barrier
from .canonical import CanonicalModel, canonicalize, export_config, interpolate, to_hf
from .checkpoint import CheckpointError
from .matching import ActivationMatcher, DualMatcher, LearnedMatcher, SimplexMatcher, UniverseMatcher, WeightMatcher
from .pipeline import MergeResult, merge, merge_models
from .recipe import Recipe, RecipeError, load_recipe
from .runner import RecipeResult, run_recipe
from .spec import ArchSpec
from .symmetry import Transform, random_symmetry

__version__ = "0.1.0"

__all__ = [
    "ActivationMatcher",
    "BarrierResult",
    "MergeResult",
    "barrier",
    "merge",
    "Recipe",
    "RecipeError",
    "RecipeResult",
    "load_recipe",
    "run_recipe",
    "merge_models",
    "ArchSpec",
    "CanonicalModel",
    "CheckpointError",
    "DualMatcher",
    "LearnedMatcher",
    "SimplexMatcher",
    "Transform",
    "UniverseMatcher",
    "UnsupportedModelError",
    "WeightMatcher",
    "__version__",
    "canonicalize",
    "export_config",
    "interpolate",
    "random_symmetry",
    "to_hf",
]
