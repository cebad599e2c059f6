"""hf_lmc: merge independently trained transformers through linear mode connectivity.

Models are rewritten exactly into a canonical RMSNorm-absorbed form, aligned by
function-preserving symmetries, interpolated, and exported as ordinary HF checkpoints.

The public names resolve on first use (PEP 562), so ``import hf_lmc`` and the command line's
``--help`` load neither torch nor transformers; ``from hf_lmc import DualPath`` imports what
it needs then. ``DualMatcher``, ``LearnedMatcher``, ``SimplexMatcher`` and ``MergeSpec`` remain
aliases of the trainable paths and the merge request they name now.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: Public name -> the module that defines it.
_PUBLIC = {
    "UnsupportedModelError": "adapters",
    "BarrierResult": "barriers",
    "barrier": "barriers",
    "CanonicalModel": "canonical",
    "canonicalize": "canonical",
    "export_config": "canonical",
    "interpolate": "canonical",
    "to_hf": "canonical",
    "CheckpointError": "checkpoint",
    "InheritanceError": "inherit",
    "UnsafeFileError": "inherit",
    "ActivationMatcher": "matching",
    "DualPath": "matching",
    "DualMatcher": "matching",  # the earlier names of the paths and of the merge request: aliases
    "EndpointSharding": "matching",
    "LearnedPath": "matching",
    "LearnedMatcher": "matching",
    "SimplexPath": "matching",
    "SimplexMatcher": "matching",
    "TrainedMatcher": "matching",
    "UniverseMatcher": "matching",
    "WeightMatcher": "matching",
    "METHODS": "methods",
    "apply_transforms": "moving",
    "AccelerateOptions": "options",
    "EvalOptions": "options",
    "LearnOptions": "options",
    "MergeRequest": "options",
    "MergeSpec": "options",
    "OutputOptions": "options",
    "MergeResult": "pipeline",
    "merge": "pipeline",
    "merge_models": "pipeline",
    "Recipe": "recipe",
    "RecipeError": "recipe",
    "load_recipe": "recipe",
    "RecipeResult": "runner",
    "run_recipe": "runner",
    "ArchSpec": "spec",
    "inspect_models": "survey",
    "Transform": "symmetry",
    "random_symmetry": "symmetry",
}

__all__ = [  # the names of _PUBLIC and __version__, written out: the form linters and type checkers read
    "METHODS",
    "AccelerateOptions",
    "ActivationMatcher",
    "ArchSpec",
    "BarrierResult",
    "CanonicalModel",
    "CheckpointError",
    "DualMatcher",
    "DualPath",
    "EndpointSharding",
    "EvalOptions",
    "InheritanceError",
    "LearnOptions",
    "LearnedMatcher",
    "LearnedPath",
    "MergeRequest",
    "MergeResult",
    "MergeSpec",
    "OutputOptions",
    "Recipe",
    "RecipeError",
    "RecipeResult",
    "SimplexMatcher",
    "SimplexPath",
    "TrainedMatcher",
    "Transform",
    "UniverseMatcher",
    "UnsafeFileError",
    "UnsupportedModelError",
    "WeightMatcher",
    "__version__",
    "apply_transforms",
    "barrier",
    "canonicalize",
    "export_config",
    "inspect_models",
    "interpolate",
    "load_recipe",
    "merge",
    "merge_models",
    "random_symmetry",
    "run_recipe",
    "to_hf",
]


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'hf_lmc' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # resolved once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))


if TYPE_CHECKING:  # the names as static analysis and IDEs see them
    from .adapters import UnsupportedModelError
    from .barriers import BarrierResult, barrier
    from .canonical import CanonicalModel, canonicalize, export_config, interpolate, to_hf
    from .checkpoint import CheckpointError
    from .inherit import InheritanceError, UnsafeFileError
    from .matching import (
        ActivationMatcher,
        DualMatcher,
        DualPath,
        EndpointSharding,
        LearnedMatcher,
        LearnedPath,
        SimplexMatcher,
        SimplexPath,
        TrainedMatcher,
        UniverseMatcher,
        WeightMatcher,
    )
    from .methods import METHODS
    from .moving import apply_transforms
    from .options import AccelerateOptions, EvalOptions, LearnOptions, MergeRequest, MergeSpec, OutputOptions
    from .pipeline import MergeResult, merge, merge_models
    from .recipe import Recipe, RecipeError, load_recipe
    from .runner import RecipeResult, run_recipe
    from .spec import ArchSpec
    from .survey import inspect_models
    from .symmetry import Transform, random_symmetry
