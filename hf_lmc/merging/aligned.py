"""Aligned models for other merging tools (``hf-lmc align``): every model of a merge written as a
stock checkpoint in the merge's coordinates, with nothing interpolated.

A merge moves each model by the symmetry its method found and interpolates the moved models
(:func:`hf_lmc.merging.pipeline.align`). Here the same stages run up to the interpolation
(:func:`~hf_lmc.merging.pipeline.resolve`, then :func:`~hf_lmc.merging.pipeline.align_members`)
and each moved model is written instead, in the form the merge interpolates: the first model too,
rewritten into the canonical form the others are written in, so that a linear merge of the
written folders at equal weights is ``hf-lmc merge``'s merge of the models, to float rounding.
Tools without alignment (mergekit's linear, SLERP, TIES) then merge models that share no base.

The output is one folder: ``OUTPUT/<name>/`` per model (:func:`member_folders`), each a stock
checkpoint with a card saying what moved it and the transforms beside its weights, and the
transforms once more at the top (``hf-lmc apply OUTPUT MODEL`` moves another checkpoint the
same way). It is written as every output is (docs/design.md §6): checked before any work,
staged whole in a hidden sibling and moved into place at the end, so a failure leaves nothing.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_lmc.canonical.form import block_rows, export_config, hf_state_dict_groups
from hf_lmc.config.methods import METHODS
from hf_lmc.config.options import MergeRequest
from hf_lmc.io.card import ModelSource, aligned_card, inherited_license, training_notes
from hf_lmc.io.export import write_checkpoint
from hf_lmc.io.hub import shown_reference
from hf_lmc.io.outputs import discard, move_into_place, staging_folder
from hf_lmc.merging.average import model_name
from hf_lmc.merging.pipeline import Inputs, Members, align_members, resolve, save_merge_transforms, written_dtype
from hf_lmc.merging.preflight import check_align_request, merge_request
from hf_lmc.symmetry.stored import TRANSFORMS_FILE, manifest_path, read_manifest
from hf_lmc.utils.devices import launched_processes, wait_for_others

logger = logging.getLogger(__name__)

#: A model's folder name as written: a plain name, no path, no hidden file.
_FOLDER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: The names the output's top level holds besides the models' folders.
_TAKEN = {TRANSFORMS_FILE.lower(), manifest_path(TRANSFORMS_FILE).name.lower()}


@dataclass(frozen=True)
class AlignResult:
    """What :func:`align_models` wrote: the output folder, one folder per model in the order given
    (the first is the reference), and the transforms beside them."""

    output: Path
    method: str
    folders: tuple[Path, ...]
    transforms: Path
    stopping: object | None = None  # learned and dual matching: what the stopping rule reached
    wrote: bool = True  # False on every launched process but the main one, which writes


def member_folders(models: Sequence[str | Path], labels: Sequence[str | None] | None = None) -> list[str]:
    """The folder each of ``models`` is written to inside the output: its label where it has one,
    else its name (a local folder's last part, a Hub id's part after the owner, without a
    ``@revision``). Where any two would be the same (ignoring case) or one is not a plain name
    (letters, digits, ``.``, ``_``, ``-``, starting with a letter or digit, at most 100 characters),
    every model's folder is ``model-1``, ``model-2``, ... in the order given instead."""
    labels = list(labels or [None] * len(models))
    names = [
        label or shown_reference(model).partition("@")[0].rstrip("/").rpartition("/")[2]
        for model, label in zip(models, labels)
    ]
    folded = [name.lower() for name in names]
    plain = all(_FOLDER_NAME.fullmatch(name) for name in names) and not _TAKEN & set(folded)
    if plain and len(set(folded)) == len(names):
        return names
    return [f"model-{k + 1}" for k in range(len(models))]


def align_models(models: Sequence[str | Path], output: str | Path, *, progress: bool = True, **settings) -> AlignResult:
    """Align M >= 2 checkpoints of one architecture as a merge of them aligns them, and write each,
    moved by its transform and interpolated with nothing, as a stock checkpoint in
    ``output/<name>/`` (:func:`member_folders`); the transforms go beside each and at the top.

    The first model is the reference, written in the canonical form the merge interpolates, so
    that the written models' plain average is :func:`hf_lmc.merge_models`' merge of ``models`` (at
    equal weights) to float rounding, and any merging tool can combine them.

    ``settings`` are the fields of :class:`hf_lmc.config.options.MergeRequest` a merge aligns and
    writes by: ``method`` (``"weight"``, the default, or any method that finds symmetries),
    ``symmetries``, ``device``, ``revisions``, ``labels`` (which also name the folders), ``data``
    and ``data_options`` (fitting data), ``learn`` and ``accelerate`` (learned and dual
    matching), and the output settings ``dtype``, ``shard_size``, ``overwrite``, ``tokenizer_from``
    and ``inherit_from_a``. A merge's own settings (``weights``, ``eval_data``, ``push_to_hub``)
    are refused (:func:`hf_lmc.merging.preflight.check_align_request`).
    """
    return run_aligned(merge_request(list(models), output, **settings), progress=progress)


def run_aligned(request: MergeRequest, *, progress: bool = True) -> AlignResult:
    """Carry out one aligned export: resolve → align the members → write them, as :func:`hf_lmc.merging.pipeline.run`
    carries out a merge (under a launcher, learned and dual matching train on every process and
    the main one writes)."""
    check_align_request(request)
    processes = launched_processes()
    main = processes is None or processes.is_main_process
    inputs = resolve(request, progress=progress and main, push_check=False)
    wait_for_others(processes)  # every process has checked the output before any writes it
    members, folders = None, ()
    try:
        if main or METHODS[request.method].trained:  # learned and dual matching train on every process (DDP)
            logger.info(
                "aligning %d models: %s, symmetries %s",
                len(inputs.folders),
                request.method,
                ", ".join(sorted(inputs.kinds)),
            )
            members = align_members(request, inputs, progress=progress and main)
        if main:
            folders = write_aligned(request, inputs, members, progress=progress)
    finally:  # a failure on the main process still releases the others (the launcher then reports it)
        wait_for_others(processes)
    output = Path(request.output)
    return AlignResult(
        output,
        request.method,
        tuple(folders),
        output / TRANSFORMS_FILE,
        members.stopping if members is not None else None,
        main,
    )


def write_aligned(request: MergeRequest, inputs: Inputs, members: Members, *, progress: bool = True) -> list[Path]:
    """Write every member of ``members`` to its folder of ``request.output``, with its card and the
    transforms, and the transforms at the top: all staged in a hidden sibling of the output and
    moved into place once every folder is whole and no input changed meanwhile. Returns the
    folders, in the order of the models."""
    output, count = Path(request.output), len(request.models)
    names = member_folders(request.models, request.labels)
    labels = request.labels or [None] * count
    sources = [
        ModelSource.of(m, r, f, label)
        for m, r, f, label in zip(request.models, inputs.revisions, inputs.folders, labels)
    ]
    out_dtype = written_dtype(request.method, inputs.out_dtype, inputs.configs[0], inputs.width_notes)
    configs = [export_config(moved, dtype=out_dtype) for moved in members.moved]
    tied = all(getattr(config, "tie_word_embeddings", False) for config in configs)
    for config in configs:  # one form for the set: a merge of them unties where any one is untied
        if not tied and getattr(config, "tie_word_embeddings", False):
            config.tie_word_embeddings = False
    untied = bool(getattr(inputs.configs[0], "tie_word_embeddings", False)) and not tied
    notes = training_notes(request.method, request.learn) + inputs.width_notes + list(inputs.inherited_notes)
    staging = staging_folder(output)
    try:
        saved = save_merge_transforms(staging / TRANSFORMS_FILE, request, inputs, members, sources)
        beside = {TRANSFORMS_FILE: saved, manifest_path(saved).name: manifest_path(saved)}
        digest = read_manifest(saved).tensors.sha256
        for k, (moved, config, name, source) in enumerate(zip(members.moved, configs, names, sources)):
            card = aligned_card(
                source=source,
                member=k,
                members=list(zip(sources, names)),
                method=request.method,
                symmetries=sorted(inputs.kinds),
                model_type=inputs.configs[0].model_type,
                transforms_file=TRANSFORMS_FILE,
                untied=untied,
                license=inherited_license([inputs.folders[k]]),
                notes=notes,
                made_with=request.made_with,
            )
            logger.info("writing %s (%s) to %s", model_name(k, count), source.label, name)
            write_checkpoint(
                hf_state_dict_groups(moved, config, block_rows=block_rows(moved.spec)),
                config,
                staging / name,
                shard_size=request.shard_size,
                dtype=out_dtype,
                source_folder=inputs.folders[0],
                tokenizer_folder=inputs.folders[request.tokenizer_model],
                card=card,
                extra_files=beside,
                progress=progress,
                total_groups=len(moved.spec.groups()),
                kind="moved",
                moved_by={
                    "transforms": str(output.absolute()),
                    "sha256": digest,
                    "member": k,
                    "label": source.label,
                },
            )
        for checkpoint in members.sources:  # an input replaced mid-run fails it, and leaves no output
            checkpoint.verify_unchanged()
        move_into_place(staging, output, kind="aligned", overwrite=request.overwrite)
    except BaseException:
        discard(staging)
        raise
    return [output / name for name in names]
