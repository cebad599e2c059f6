"""The checks of a merge that need no model, in a module that imports neither torch nor
transformers.

The command line runs them before it imports the pipeline (which loads torch and transformers,
seconds on a loaded machine), so that a request that cannot run as written (an output folder
that exists, an output that is an input, weights off the simplex, a data method without data)
is refused at once; :func:`hf_lmc.merging.pipeline.resolve` runs the same checks, so the Python API
refuses alike.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError

from hf_lmc.config.methods import METHODS, check_method
from hf_lmc.config.options import (
    MergeRequest,
    ParameterError,
    UsageError,
    check_device,
    revisions_per_model,
    simplex_weights,
)
from hf_lmc.io.outputs import check_apart, check_output_folder, check_output_path, check_replaceable


def merge_request(models: Sequence, output, **settings) -> MergeRequest:
    """The :class:`MergeRequest` of ``models`` and ``settings``; a refused setting is a
    :class:`UsageError` in one line naming each refused setting by its keyword."""
    if len(models) < 2:
        raise ParameterError(f"merge needs at least 2 models in {{}}, got {len(models)}", "models")
    try:
        return MergeRequest(models=models, output=output, **settings)
    except ValidationError as err:
        raise UsageError(
            "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in err.errors())
        ) from None


def check_request(request: MergeRequest) -> list[tuple[Path, str]]:
    """Every check of ``request`` that reads no model: the method against the number of models and
    the data, the weights, the revisions, the device's name, and every folder the merge writes
    (:func:`check_outputs`). Returns those folders, each with the parameter that names it."""
    count = len(request.models)
    check_method(request.method, request.data, count=count)
    if request.tokenizer_model >= count:
        raise ParameterError(
            f"{{}} names model {request.tokenizer_from}, but the merge has {count} models", "tokenizer_from"
        )
    if request.learn.trained == "permutations" and request.method != "learned":
        raise ParameterError(
            f"{{}} permutations is a form of learned matching (method learned), not of {request.method}", "trained"
        )
    if request.learn.trained == "permutations" and request.symmetries != "permutation":
        raise ParameterError(
            "{} permutations starts from permutation-only weight matching: pass --symmetries permutation", "trained"
        )
    simplex_weights(request.weights, count)
    revisions_per_model(request.revisions, count)
    try:
        check_device(request.device)
    except ValueError as err:
        raise ParameterError(f"{{}}: {err}", "device") from None
    return check_outputs(request, [*request.models, *named_paths(request.data, request.eval_data)])


def check_outputs(request: MergeRequest, read: Sequence[str | Path]) -> list[tuple[Path, str]]:
    """Check, before any work, every folder the merge writes (``output``, and the training state
    under ``accelerate.checkpoint_dir``) against every path it ``read``s and against each other,
    and that each is one the run may write or replace (docs/design.md §6). Returns them, each
    with the parameter that names it. A dead run's set-aside output is put back first
    (:func:`hf_lmc.io.outputs.clean_stale`): it is the user's folder, and judged as such."""
    output = check_output_folder(request.output, read, "output", overwrite=request.overwrite)
    written = [(output, "output")]
    if request.accelerate.checkpoint_dir is not None:
        state = Path(request.accelerate.checkpoint_dir)
        check_output_path(state, "checkpoint_dir")
        check_apart(state, read, "checkpoint_dir")
        check_apart(state, [output], "checkpoint_dir", role="the output", missing=True)
        check_replaceable(state, "checkpoint_dir", kinds=("training-state",))
        written.append((state, "checkpoint_dir"))
    return written


def named_paths(*data) -> list[str | Path]:
    """Those of ``data`` that name a local file or folder (others are loaded data or Hub names)."""
    return [d for d in data if isinstance(d, (str, Path)) and os.path.lexists(d)]


#: What an aligned set (``hf-lmc align``) takes no value for: it interpolates nothing, measures
#: nothing and is no single checkpoint to push; each with why, as the refusal says it.
_NOT_ALIGNED = {
    "weights": "align interpolates nothing (its transforms are those of the merge at equal weights); weight the "
    "written models in the tool that merges them",
    "eval_data": "align measures no barrier; measure one with hf-lmc barrier",
    "push_to_hub": "align writes a folder of several models, not one checkpoint; push the folders you merge",
}


def check_align_request(request: MergeRequest) -> list[tuple[Path, str]]:
    """The checks of an aligned set (``hf-lmc align``) that read no model: a method that finds
    symmetries (``average`` moves nothing), none of the settings only a merge has
    (:data:`_NOT_ALIGNED`), then every check of a merge (:func:`check_request`)."""
    if METHODS[request.method].pair_class is None:
        found = ", ".join(name for name, m in METHODS.items() if m.pair_class is not None)
        raise ParameterError(
            f"{{}} {request.method} finds no symmetries, so align would move nothing; choose one that does: {found}",
            "method",
        )
    for name, why in _NOT_ALIGNED.items():
        if getattr(request, name) is not None:
            raise ParameterError(f"{{}} is not taken here: {why}", name)
    return check_request(request)
