"""hf_lmc: merge independently trained transformers through linear mode connectivity.

Models are rewritten exactly into a canonical RMSNorm-absorbed form, aligned by
function-preserving symmetries, interpolated, and exported as ordinary HF checkpoints.

The public names resolve on first use (PEP 562), so ``import hf_lmc`` and the command line's
``--help`` load neither torch nor transformers; ``from hf_lmc import DualMatcher`` imports what
it needs then.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from hf_lmc.version import __version__

#: Public name -> the module that defines it.
_PUBLIC = {
    "UnsupportedModelError": "canonical.adapters",
    "BarrierResult": "evaluation.barriers",
    "barrier": "evaluation.barriers",
    "CanonicalModel": "canonical.form",
    "canonicalize": "canonical.form",
    "export_config": "canonical.form",
    "interpolate": "canonical.form",
    "to_hf": "canonical.form",
    "CheckpointError": "io.checkpoint",
    "InheritanceError": "io.inherit",
    "UnsafeFileError": "io.inherit",
    "ActivationMatcher": "matching",
    "DualMatcher": "learned",
    "EndpointSharding": "learned",
    "LearnedMatcher": "learned",
    "SimplexMatcher": "learned",
    "TrainedMatcher": "learned",
    "UniverseMatcher": "matching",
    "WeightMatcher": "matching",
    "METHODS": "config.methods",
    "apply_transforms": "commands.apply",
    "AccelerateOptions": "config.options",
    "EvalOptions": "config.options",
    "LearnOptions": "config.options",
    "MergeRequest": "config.options",
    "OutputOptions": "config.options",
    "AlignResult": "merging.aligned",
    "align_models": "merging.aligned",
    "MergeResult": "merging.pipeline",
    "merge": "merging.pipeline",
    "merge_models": "merging.pipeline",
    "Recipe": "config.recipe",
    "RecipeError": "config.recipe",
    "load_recipe": "config.recipe",
    "RecipeResult": "merging.sweep",
    "run_recipe": "merging.sweep",
    "ArchSpec": "canonical.spec",
    "inspect_models": "commands.inspect",
    "Transform": "symmetry",
    "random_symmetry": "symmetry",
}

__all__ = [  # the names of _PUBLIC and __version__, written out: the form linters and type checkers read
    "METHODS",
    "AccelerateOptions",
    "ActivationMatcher",
    "AlignResult",
    "ArchSpec",
    "BarrierResult",
    "CanonicalModel",
    "CheckpointError",
    "DualMatcher",
    "EndpointSharding",
    "EvalOptions",
    "InheritanceError",
    "LearnOptions",
    "LearnedMatcher",
    "MergeRequest",
    "MergeResult",
    "OutputOptions",
    "Recipe",
    "RecipeError",
    "RecipeResult",
    "SimplexMatcher",
    "TrainedMatcher",
    "Transform",
    "UniverseMatcher",
    "UnsafeFileError",
    "UnsupportedModelError",
    "WeightMatcher",
    "__version__",
    "align_models",
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
    from hf_lmc.canonical.adapters import UnsupportedModelError
    from hf_lmc.canonical.form import CanonicalModel, canonicalize, export_config, interpolate, to_hf
    from hf_lmc.canonical.spec import ArchSpec
    from hf_lmc.commands.apply import apply_transforms
    from hf_lmc.commands.inspect import inspect_models
    from hf_lmc.config.methods import METHODS
    from hf_lmc.config.options import (
        AccelerateOptions,
        EvalOptions,
        LearnOptions,
        MergeRequest,
        OutputOptions,
    )
    from hf_lmc.config.recipe import Recipe, RecipeError, load_recipe
    from hf_lmc.evaluation.barriers import BarrierResult, barrier
    from hf_lmc.io.inherit import InheritanceError, UnsafeFileError
    from hf_lmc.io.weights import CheckpointError
    from hf_lmc.learned import (
        DualMatcher,
        EndpointSharding,
        LearnedMatcher,
        SimplexMatcher,
        TrainedMatcher,
    )
    from hf_lmc.matching import ActivationMatcher, UniverseMatcher, WeightMatcher
    from hf_lmc.merging.aligned import AlignResult, align_models
    from hf_lmc.merging.pipeline import MergeResult, merge, merge_models
    from hf_lmc.merging.sweep import RecipeResult, run_recipe
    from hf_lmc.symmetry import Transform, random_symmetry
