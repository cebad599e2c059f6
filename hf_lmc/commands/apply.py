"""Saved transforms applied to a model, or to a PEFT LoRA adapter (``hf-lmc apply``).

A merge saves the function-preserving maps that carried each model into its basin
(:mod:`hf_lmc.symmetry.stored`). Applying one to a checkpoint of the same architecture spec writes
a stock checkpoint of that model moved into the basin: the same function (it is a symmetry), in
the merge's coordinates; on the model the transform was fitted on, that is the model the merge
averaged. Applying it to a LoRA adapter trained on that model writes the adapter of the moved
model (:mod:`hf_lmc.commands.apply_lora`), which also serves the merge itself.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError

from hf_lmc.canonical.adapters import adapter_for, read_config
from hf_lmc.canonical.exactness import float64_rmsnorm, relative_error, sample_inputs
from hf_lmc.canonical.form import block_rows, canonicalize, export_config, hf_state_dict_groups
from hf_lmc.commands.apply_lora import is_lora_adapter, read_adapter_config, write_moved_adapter
from hf_lmc.commands.common import (
    APPLY,
    say,
)
from hf_lmc.config.options import (
    ParameterError,
    escape_controls,
)
from hf_lmc.io.card import ModelSource, inherited_license, moved_card
from hf_lmc.io.export import dtype_named, stored_dtype, write_checkpoint
from hf_lmc.io.fingerprint import fingerprint
from hf_lmc.io.hub import names_local_path, resolve_checkpoint, resolve_transforms, shown_reference
from hf_lmc.io.outputs import check_apart, check_output_folder, read_marker
from hf_lmc.symmetry.engine import Transform
from hf_lmc.symmetry.stored import TRANSFORMS_FILE, TransformsManifest, manifest_path, read_manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_transforms` wrote: the folder, whether it holds a model or an adapter,
    and which of the merge's models the transform was (its place and label)."""

    output: Path
    kind: str  # "model" or "adapter"
    member: int
    label: str


#: How far a moved model's logits on the probe batch may stray from its source's (relative to
#: their largest magnitude), by the dtype the moved weights are written in: the rounding of one
#: write, far below what a transform that is no symmetry changes (tenths to whole units).
PROBE_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


class ApplyError(ValueError):
    """A model or adapter that ``hf-lmc apply`` must not move by the transforms given: already
    moved, the merge itself, a model the merge does not know, or one that the move changed."""


def locate_transforms(reference: str | Path, revision: str | None = None) -> tuple[Path, str]:
    """The tensors file of the transforms ``reference`` names, and how to name their merge: a
    ``transforms.safetensors`` file, a folder holding one (a merge's output), or the Hub repo of
    a merge (only its two transforms files are downloaded). A local merge is named by its path,
    made absolute (it must resolve wherever the name is read again), a Hub merge by its id."""
    path = Path(reference)
    if path.is_file():
        return path, str(path.parent.absolute())
    if path.is_dir():
        if not (path / TRANSFORMS_FILE).is_file():
            raise FileNotFoundError(
                f"{path} holds no {TRANSFORMS_FILE}; pass the folder of an aligned merge or the transforms file itself"
            )
        return path / TRANSFORMS_FILE, str(path.absolute())
    if names_local_path(reference):
        raise FileNotFoundError(f"no such transforms file or merge folder: {reference}")
    try:
        return resolve_transforms(str(reference), revision) / TRANSFORMS_FILE, str(reference)
    except HFValidationError as err:
        raise FileNotFoundError(f"{reference} is neither a transforms file, a merge folder nor a Hub repo id") from err


def _candidates(manifest: TransformsManifest) -> str:
    return ", ".join(f"{chr(65 + k)}: {escape_controls(m.name, 40)}" for k, m in enumerate(manifest.models))


def member_index(manifest: TransformsManifest, member: str | int | None, folder: str | Path, shown: str) -> int:
    """Which of the merge's models the checkpoint in ``folder`` (``shown``, as messages name it)
    is. ``member`` names one: a letter (``A``, ``b``: case does not matter), a number from 1 or
    a model's label, refused where these name different models or where the checkpoint's content
    is another of the merge's models. Without ``member``, the model whose content fingerprint
    (:mod:`hf_lmc.io.fingerprint`) the manifest records for the checkpoint's; an unknown or
    ambiguous checkpoint is refused with the candidates listed."""
    recorded = [m.source.get("fingerprint") for m in manifest.models]
    content = fingerprint(folder) if any(recorded) else None
    same = [k for k, f in enumerate(recorded) if f is not None and f == content]
    if member is not None:
        index = _named_member(manifest, str(member).strip())
        if same and index not in same:
            raise ParameterError(
                f"{shown} is model {chr(65 + same[0])} of the merge by its content, not {chr(65 + index)} as {{}} says "
                f"({_candidates(manifest)}); name {chr(65 + same[0])} or leave the flag out",
                "member",
            )
        return index
    if len(same) == 1:
        return same[0]
    if not any(recorded):
        why = "its transforms record no content fingerprints (saved by an older hf-lmc)"
    elif same:
        why = "its content matches several of the merge's models"
    else:
        why = "its content matches none of the merge's models (moving another checkpoint of the same shape needs --member)"
    raise ParameterError(
        f"say which of the merge's models {shown} is with {{}}: {why}; candidates {_candidates(manifest)}", "member"
    )


def _named_member(manifest: TransformsManifest, text: str) -> int:
    """The model ``text`` names, by letter, number or label; refused where two readings differ."""
    count, labels = len(manifest.models), [m.name for m in manifest.models]
    readings = set()
    if len(text) == 1 and text.isalpha() and ord(text.upper()) - 65 < count:
        readings.add(ord(text.upper()) - 65)
    if text.isdigit() and 1 <= int(text) <= count:
        readings.add(int(text) - 1)
    if labels.count(text) == 1:
        readings.add(labels.index(text))
    if len(readings) == 1:
        return readings.pop()
    shown = escape_controls(text, 40)
    if readings:
        which = " and ".join(chr(65 + k) for k in sorted(readings))
        raise ParameterError(
            f"{{}} {shown!r} names models {which} (as a letter or number, and as a label); name one by its letter",
            "member",
        )
    raise ParameterError(
        f"{{}} {shown!r} names none of the merge's {count} models ({_candidates(manifest)}; or a number from 1)",
        "member",
    )


def refuse_moved(folder: Path, shown: str, transforms: Path) -> None:
    """Refuse to move what needs no moving: a model or adapter ``hf-lmc apply`` already moved (its
    marker records the transform), or the merge itself (it holds these transforms)."""
    record = read_marker(folder) or {}
    moved_by = record.get("moved_by")
    if isinstance(moved_by, dict):
        by = escape_controls(str(moved_by.get("label", "?")), 40)
        merge = escape_controls(str(moved_by.get("transforms", "?")), 120)
        raise ApplyError(
            f"{shown} was already moved by the transform of {by} of {merge}: it lives in that merge's coordinates; "
            "apply the transforms to the model it was moved from"
        )
    if (folder / TRANSFORMS_FILE).is_file() and (folder / TRANSFORMS_FILE).samefile(transforms):
        raise ApplyError(
            f"{shown} is the merge these transforms were saved with: it lives in the merge's coordinates already"
        )
    if record.get("kind") == "merge":
        raise ApplyError(
            f"{shown} is a merge hf-lmc wrote, not one of the models it merged: it lives in its own merge's coordinates"
        )


def apply_transforms(
    transforms: str | Path,
    model: str | Path,
    output: str | Path,
    *,
    member: str | int | None = None,
    base_model: str | Path | None = None,
    adapter_for_base: str | None = None,
    revision: str | None = None,
    dtype: str | None = None,
    shard_size: str | int = "5GB",
    overwrite: bool = False,
    progress: bool = True,
) -> Applied:
    """Write ``model`` moved by one of the transforms saved at ``transforms`` to ``output``.

    Every check comes before any work: the output follows the protocol every command that
    writes keeps (:func:`hf_lmc.io.outputs.check_output_folder`: apart from every input, replaced
    only with ``overwrite`` and only if ``hf-lmc apply`` wrote it), the model is one of the
    merge's (:func:`member_index`) and not already moved (:func:`refuse_moved`), and the
    transforms are symmetries (checked as they load). A moved model is checked to compute what
    its source computes on a probe batch (:data:`PROBE_TOLERANCE`) before it is moved into place.

    Args:
        transforms: a ``transforms.safetensors`` file, the folder of an aligned merge, or the
            Hub repo of one (:func:`locate_transforms`).
        model: a checkpoint (local folder or Hub id) of the architecture spec the transforms
            were made for, or a PEFT LoRA adapter folder trained on one.
        output: the folder to write: a stock checkpoint with a card, or a PEFT adapter.
        member: which of the merge's models the transform to apply is (:func:`member_index`).
        base_model: for an adapter, the model it was trained on (default: the adapter config's
            ``base_model_name_or_path``; one that names another model is refused).
        adapter_for_base: for an adapter, the base model the moved adapter records (default:
            the merge the transforms came from, whose basin it now lives in).
        revision: the Hub revision of ``model`` (or of ``base_model`` for an adapter).
        dtype: the written weights' dtype (default: the model's stored one); not for adapters,
            which keep their own.
    """
    adapter = is_lora_adapter(model)
    if adapter and dtype is not None:
        raise ParameterError("{} sets a moved model's dtype; a moved adapter keeps its own dtype", "dtype")
    out_dtype = dtype_named(dtype)
    inputs = [transforms, model, *([base_model] if base_model is not None else [])]
    local = [p for p in inputs if os.path.lexists(p)]
    check_output_folder(output, local, "output", overwrite=overwrite, kinds=("adapter",) if adapter else ("moved",))
    path, merge_reference = locate_transforms(transforms)
    check_apart(output, [path, manifest_path(path)], "output")
    manifest = read_manifest(path)
    if adapter:
        return _apply_to_adapter(
            path,
            manifest,
            merge_reference,
            Path(model),
            output,
            member,
            base_model,
            adapter_for_base,
            revision,
            overwrite,
        )
    folder = resolve_checkpoint(model, revision)
    check_apart(output, [folder], "output")
    shown = escape_controls(shown_reference(model), 120)
    logger.info("reading %s and the transforms of %s", shown, escape_controls(merge_reference, 120))
    refuse_moved(folder, shown, path)
    index = member_index(manifest, member, folder, shown)
    canonical = canonicalize(folder, dtype=torch.float64)  # float64 algebra, rounded once on writing
    transform = Transform.load(path, canonical.spec, model=index)  # another spec: refused in one line
    moved = transform.to(torch.float64).apply(canonical)
    config = canonical.config
    out_dtype = out_dtype or stored_dtype(config)
    exported = export_config(moved, dtype=out_dtype)
    label = manifest.models[index].name
    card = moved_card(
        source=ModelSource.of(model, revision, folder),
        merge=shown_reference(merge_reference),
        member_label=label,
        model_type=config.model_type,
        untied=bool(getattr(config, "tie_word_embeddings", False)) and not exported.tie_word_embeddings,
        license=inherited_license([folder]),
    )
    logger.info("writing %s moved by the transform of %s (%s)", shown, escape_controls(label, 40), merge_reference)
    written = write_checkpoint(
        hf_state_dict_groups(moved, exported, block_rows=block_rows(moved.spec)),
        exported,
        output,
        shard_size=shard_size,
        dtype=out_dtype,
        source_folder=folder,
        card=card,
        overwrite=overwrite,
        progress=progress,
        total_groups=len(moved.spec.groups()),
        kind="moved",
        moved_by=_moved_by(merge_reference, manifest, index),
        verify=lambda staged: check_same_function(folder, staged, out_dtype, shown),
    )
    return Applied(written, "model", index, label)


def _apply_to_adapter(
    path, manifest, merge_reference, folder, output, member, base_model, adapter_for_base, revision, overwrite
) -> Applied:
    """:func:`apply_transforms` for a LoRA adapter ``folder``: its base checked against the one
    given, then moved by :func:`hf_lmc.commands.apply_lora.write_moved_adapter`."""
    shown = escape_controls(shown_reference(folder), 120)
    config = read_adapter_config(folder)
    refuse_moved(folder, shown, path)
    named = config.get("base_model_name_or_path")
    if base_model is not None and named and not same_model(base_model, named, revision):
        raise ApplyError(
            f"{shown} was trained on {escape_controls(str(named), 120)} (its adapter_config.json), but --base-model "
            f"names {escape_controls(str(base_model), 120)}; pass the model it was trained on"
        )
    trained_on = base_model or named
    if not trained_on:
        raise ParameterError(f"{shown}: its adapter_config.json names no base model; say which with {{}}", "base_model")
    base_folder = resolve_checkpoint(trained_on, revision)
    index = member_index(manifest, member, base_folder, escape_controls(shown_reference(trained_on), 120))
    label = manifest.models[index].name
    logger.info(
        "moving the LoRA adapter %s (trained on %s) by the transform of %s",
        shown,
        escape_controls(shown_reference(trained_on), 120),
        escape_controls(label, 40),
    )
    written = write_moved_adapter(
        folder,
        path,
        index,
        output,
        base_folder=base_folder,
        trained_on=shown_reference(trained_on),
        recorded_base=recorded_base(adapter_for_base, merge_reference, manifest),
        transforms_reference=merge_reference,
        member_label=label,
        overwrite=overwrite,
        moved_by=_moved_by(merge_reference, manifest, index),
    )
    return Applied(written, "adapter", index, label)


def recorded_base(given: str | None, merge_reference: str, manifest: TransformsManifest) -> str:
    """The base model a moved adapter's config records, one that resolves wherever the adapter is
    loaded: ``given`` (``--moved-base``), a local path by its absolute path; else the merge the
    transforms come from: the Hub repo it was pushed to where its transforms record one
    (``org/name``), else its Hub id, or its folder's absolute path (:func:`locate_transforms`)."""
    if given is not None:
        return str(Path(given).expanduser().absolute()) if names_local_path(given) else given
    options = manifest.fitted.get("options")
    pushed = options.get("push_to_hub") if isinstance(options, dict) else None
    if names_local_path(merge_reference) and isinstance(pushed, str) and pushed.count("/") == 1:
        return pushed
    return merge_reference


def _moved_by(merge_reference: str, manifest: TransformsManifest, index: int) -> dict:
    """What a moved folder's marker records of the transform that moved it."""
    return {
        "transforms": merge_reference,
        "sha256": manifest.tensors.sha256,
        "member": index,
        "label": manifest.models[index].name,
    }


def same_model(given: str | Path, named: str | Path, revision: str | None = None) -> bool:
    """Whether ``given`` and ``named`` (an adapter config's base) are one model: the same Hub id,
    the same local folder, or local checkpoints of one content fingerprint. A local path that
    does not exist here cannot be judged and counts as the same (the adapter may have been made
    on another machine)."""
    given, named = str(given), str(named)
    if given == named:
        return True
    local_given, local_named = names_local_path(given), names_local_path(named)
    if local_named and not Path(named).exists():
        return True
    if local_given and local_named:
        a, b = Path(given), Path(named)
        if a.resolve() == b.resolve():
            return True
        try:
            return fingerprint(a) == fingerprint(b)
        except (OSError, ValueError):
            return False
    if not local_given and not local_named:
        return given.partition("@")[0] == named.partition("@")[0]
    local, hub = (given, named) if local_given else (named, given)
    try:  # a local folder and a Hub id: one model where the Hub snapshot is that folder's content
        return fingerprint(local) == fingerprint(resolve_checkpoint(hub, revision))
    except (OSError, ValueError):
        return False


def check_same_function(source: Path, moved: Path, dtype: torch.dtype, shown: str) -> None:
    """Refuse a moved checkpoint (the folder ``moved``, before it is moved into place) that does
    not compute what ``source`` computes on a probe batch, to :data:`PROBE_TOLERANCE` of the
    written ``dtype``: the stock models compared, whatever the transforms claimed."""
    logger.info("checking that the moved model computes what %s computes, on a probe batch", shown)
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    config = read_config(source)
    model_class = adapter_for(config).model_class
    inputs = sample_inputs(config, dtype=compute)
    with float64_rmsnorm(), torch.no_grad(), _quiet_transformers():
        expected = model_class.from_pretrained(source, dtype=compute).eval()(**inputs).logits
        got = model_class.from_pretrained(moved, dtype=compute).eval()(**inputs).logits
    error = relative_error(got, expected)
    tolerance = PROBE_TOLERANCE.get(dtype, PROBE_TOLERANCE[torch.bfloat16])
    if not error <= tolerance:  # NaN fails too
        raise ApplyError(
            f"{shown} moved by the transform computes another function: relative logit error {error:.3g} on a probe "
            f"batch (tolerance {tolerance:g} in {str(dtype).removeprefix('torch.')}); nothing was written"
        )


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' loading bars and notices off while the probe loads the two models."""
    from transformers.utils import logging as hf_logging

    before = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(before)
        if bars:
            hf_logging.enable_progress_bar()


# -- the command ------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    options = APPLY.build(args)
    applied = apply_transforms(
        args.transforms,
        args.model,
        options.output,
        member=options.member,
        base_model=options.base_model,
        adapter_for_base=options.moved_base,
        revision=options.revision,
        dtype=args.dtype,
        shard_size=args.shard_size,
        overwrite=args.overwrite,
    )
    moved = "LoRA adapter" if applied.kind == "adapter" else "model"
    say(f"{moved} moved by the transform of {applied.label} written to {applied.output}")
    return 0
