"""Saved transforms applied to a model, or to a PEFT LoRA adapter (``hf-lmc apply``).

A merge saves the function-preserving maps that carried each model into its basin
(:mod:`hf_lmc.symmetry.stored`). Applying one to a checkpoint of the same architecture spec writes
a stock checkpoint of that model moved into the basin: the same function (it is a symmetry), in
the merge's coordinates; on the model the transform was fitted on, that is the model the merge
averaged. Applying it to a LoRA adapter trained on that model writes the adapter of the moved
model (:mod:`hf_lmc.lora`), which also serves the merge itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import HFValidationError

from .canonical import block_rows, canonicalize, export_config, hf_state_dict_groups
from .card import ModelSource, moved_card
from .export import dtype_named, stored_dtype, write_checkpoint
from .hub import names_local_path, resolve_checkpoint, resolve_transforms, shown_reference
from .lora import is_lora_adapter, read_adapter_config, write_moved_adapter
from .options import ParameterError
from .symmetry.engine import Transform
from .symmetry.stored import TRANSFORMS_FILE, TransformsManifest, read_manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_transforms` wrote: the folder, whether it holds a model or an adapter,
    and which of the merge's models the transform was (its place and label)."""

    output: Path
    kind: str  # "model" or "adapter"
    member: int
    label: str


def locate_transforms(reference: str | Path, revision: str | None = None) -> tuple[Path, str]:
    """The tensors file of the transforms ``reference`` names, and how to name their merge: a
    ``transforms.safetensors`` file, a folder holding one (a merge's output), or the Hub repo of
    a merge (only its two transforms files are downloaded)."""
    path = Path(reference)
    if path.is_file():
        return path, shown_reference(path.parent)
    if path.is_dir():
        if not (path / TRANSFORMS_FILE).is_file():
            raise FileNotFoundError(
                f"{path} holds no {TRANSFORMS_FILE}; pass the folder of an aligned merge or the transforms file itself"
            )
        return path / TRANSFORMS_FILE, shown_reference(path)
    if names_local_path(reference):
        raise FileNotFoundError(f"no such transforms file or merge folder: {reference}")
    try:
        return resolve_transforms(str(reference), revision) / TRANSFORMS_FILE, str(reference)
    except HFValidationError as err:
        raise FileNotFoundError(f"{reference} is neither a transforms file, a merge folder nor a Hub repo id") from err


def member_index(manifest: TransformsManifest, member: str | int | None, reference: str) -> int:
    """Which of the merge's models ``member`` names: a letter (``A``, ``b``), a number from 1 or a
    model's label; by default the model whose reference ``reference`` is, else, where exactly one
    model's transform moves it at all, that one."""
    count, labels = len(manifest.models), [m.name for m in manifest.models]
    if member is None:
        shown = shown_reference(reference)
        named = [k for k, m in enumerate(manifest.models) if shown in (m.name, m.source.get("reference"))]
        if len(named) == 1:
            return named[0]
        moved = [k for k, m in enumerate(manifest.models) if m.elements]
        if len(moved) == 1:
            return moved[0]
        raise ParameterError(
            f"say which of the merge's models {shown} is with {{}} (one of {', '.join(labels)}, or a letter)", "member"
        )
    text = str(member).strip()
    if text in labels and labels.count(text) == 1:
        return labels.index(text)
    if len(text) == 1 and text.isalpha() and ord(text.lower()) - ord("a") < count:
        return ord(text.lower()) - ord("a")
    if text.isdigit() and 1 <= int(text) <= count:
        return int(text) - 1
    raise ParameterError(
        f"{{}} {text!r} names none of the merge's {count} models ({', '.join(labels)}; or A..{chr(64 + count)})",
        "member",
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

    Args:
        transforms: a ``transforms.safetensors`` file, the folder of an aligned merge, or the
            Hub repo of one (:func:`locate_transforms`).
        model: a checkpoint (local folder or Hub id) of the architecture spec the transforms
            were made for, or a PEFT LoRA adapter folder trained on one.
        output: the folder to write: a stock checkpoint with a card, or a PEFT adapter.
        member: which of the merge's models the transform to apply is (:func:`member_index`).
        base_model: for an adapter, the model it was trained on (default: the adapter config's
            ``base_model_name_or_path``).
        adapter_for_base: for an adapter, the base model the moved adapter records (default:
            the merge the transforms came from, whose basin it now lives in).
        revision: the Hub revision of ``model`` (or of ``base_model`` for an adapter).
        dtype: the written weights' dtype (default: the model's stored one; an adapter keeps its own).
    """
    path, merge_reference = locate_transforms(transforms)
    manifest = read_manifest(path)
    if is_lora_adapter(model):
        folder = Path(model)
        trained_on = base_model or read_adapter_config(folder).get("base_model_name_or_path") or folder
        index = member_index(manifest, member, str(trained_on))
        written = write_moved_adapter(
            folder,
            path,
            index,
            output,
            base_model=base_model,
            revision=revision,
            recorded_base=adapter_for_base or merge_reference,
            transforms_reference=merge_reference,
            member_label=manifest.models[index].name,
            overwrite=overwrite,
        )
        return Applied(written, "adapter", index, manifest.models[index].name)
    folder = resolve_checkpoint(model, revision)
    canonical = canonicalize(folder, dtype=torch.float64)  # float64 algebra, rounded once on writing
    index = member_index(manifest, member, str(model))
    transform = Transform.load(path, canonical.spec, model=index)  # another spec: refused in one line
    moved = transform.to(torch.float64).apply(canonical)
    config = canonical.config
    out_dtype = dtype_named(dtype) or stored_dtype(config)
    exported = export_config(moved, dtype=out_dtype)
    label = manifest.models[index].name
    card = moved_card(
        source=ModelSource.of(model, revision, folder),
        merge=merge_reference,
        member_label=label,
        model_type=config.model_type,
        untied=bool(getattr(config, "tie_word_embeddings", False)) and not exported.tie_word_embeddings,
    )
    logger.info("writing %s moved by the transform of %s (%s)", shown_reference(model), label, merge_reference)
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
    )
    return Applied(written, "model", index, label)
