"""Which files of a model folder hold its weights: transformers' own rule, in a module that imports
neither torch nor transformers (the Hub download reads it before torch loads).

``from_pretrained`` (transformers 5) reads the file ``config.json`` names under
``transformers_weights``, else the first of ``model.safetensors``, ``model.safetensors.index.json``,
``pytorch_model.bin`` and ``pytorch_model.bin.index.json`` (with the shards an index lists), and no
other file: a stray ``x.safetensors`` beside ``pytorch_model.bin`` is not the model. Every command
reads those files (:class:`hf_lmc.io.checkpoint.Checkpoint`) and a Hub download fetches them
(:mod:`hf_lmc.io.hub`), so what hf_lmc merges is what transformers loads.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath

from pydantic import BaseModel, ConfigDict, ValidationError

from hf_lmc.config.options import clipped

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"
#: The files transformers' ``from_pretrained`` takes a folder's weights from, in the order it
#: tries them (``modeling_utils._get_resolved_checkpoint_files``, transformers 5): the first one
#: present is read, with the shards it indexes; any other weight file beside it is not.
WEIGHT_ENTRIES = (SAFETENSORS_SINGLE, SAFETENSORS_INDEX, BIN_SINGLE, BIN_INDEX)
#: The ``config.json`` key that names the weights file outright; transformers reads it before
#: :data:`WEIGHT_ENTRIES` (a safetensors file or index of the folder).
EXPLICIT_WEIGHTS = "transformers_weights"
#: Endings of files that hold weights in some format, named when a folder has none hf_lmc reads.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack")


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or holds unreadable ones."""


class WeightIndex(BaseModel):
    """A sharded checkpoint's index (``model.safetensors.index.json``): which shard holds each
    tensor. Strict, so a ``weight_map`` that is a list, or names a shard by a number, is refused
    rather than half read; other keys (``metadata``) are allowed unchecked."""

    model_config = ConfigDict(strict=True, extra="allow")

    weight_map: dict[str, str]


def _is_file_name(name: str) -> bool:
    """Whether a shard name in an index is a plain file name: no folder part, so it cannot
    point outside the checkpoint folder (``../x``, ``/etc/x``, ``C:\\x``)."""
    return name not in ("", ".", "..") and PurePosixPath(name).name == name and PureWindowsPath(name).name == name


def indexed_files(folder: Path, index_name: str) -> list[Path]:
    """The shards an index names, checked: valid JSON, a ``weight_map`` of tensor -> file name,
    every name a file of ``folder``."""
    index = folder / index_name
    try:
        weight_map = WeightIndex.model_validate_json(index.read_bytes()).weight_map
    except ValidationError as err:
        error = err.errors()[0]
        where = ".".join(map(str, error["loc"])) or "the file"
        if error["type"] == "json_invalid":
            raise CheckpointError(f"{index} is not valid JSON; download it again") from None
        if error["type"] == "missing":
            raise CheckpointError(f"{index} has no weight_map key; download it again") from None
        raise CheckpointError(
            f"{index}: {where} must map tensor names to shard file names, got {clipped(error['input'])}; download it again"
        ) from None
    if not weight_map:
        raise CheckpointError(f"{index}: weight_map lists no tensors; download it again")
    outside = next((name for name in weight_map.values() if not _is_file_name(name)), None)
    if outside is not None:
        raise CheckpointError(
            f"{index}: weight_map names {clipped(outside)}, which is not a file name in {folder}; "
            "an index names its shards by file name alone"
        )
    return [folder / name for name in dict.fromkeys(weight_map.values())]


def explicit_weights(folder: Path) -> str | None:
    """The weights file ``folder``'s ``config.json`` names under :data:`EXPLICIT_WEIGHTS`, checked
    as transformers checks it (a safetensors file or index) and to be a file name of the folder;
    ``None`` where it names none. A ``config.json`` that cannot be read as a JSON object names
    none here (reading the config refuses it, in its own words)."""
    try:
        config = json.loads((folder / "config.json").read_bytes())
    except (OSError, ValueError):
        return None
    name = config.get(EXPLICIT_WEIGHTS) if isinstance(config, dict) else None
    if name is None:
        return None
    where = f"{folder / 'config.json'}: {EXPLICIT_WEIGHTS}"
    if not isinstance(name, str) or not name.endswith((".safetensors", ".safetensors.index.json")):
        raise CheckpointError(
            f"{where} is {clipped(name)}; transformers reads it only as a safetensors file or index (*.safetensors, "
            "*.safetensors.index.json)"
        )
    if not _is_file_name(name):
        raise CheckpointError(f"{where} is {clipped(name)}; hf_lmc reads it only as the name of a file in {folder}")
    return name


def weights_entry(folder: Path) -> str | None:
    """The name of the file that holds or indexes ``folder``'s weights, by transformers' own rule:
    the file ``config.json`` names (:func:`explicit_weights`), else the first of
    :data:`WEIGHT_ENTRIES` that is a file of the folder; ``None`` where there is none. This one rule
    says which files every command reads (:func:`weight_files`) and a Hub download fetches
    (:func:`hf_lmc.io.hub.resolve_checkpoint`)."""
    explicit = explicit_weights(folder)
    if explicit is not None:
        return explicit
    return next((name for name in WEIGHT_ENTRIES if (folder / name).is_file()), None)


def indexed(name: str) -> bool:
    """Whether the weights entry ``name`` is an index (whose shards hold the tensors)."""
    return name.endswith(".index.json")


def weight_files(folder: str | Path) -> list[Path]:
    """The weight files of ``folder`` that transformers' ``from_pretrained`` reads
    (:func:`weights_entry` and the shards it indexes), checked to exist. A folder with weights in
    no file transformers reads (a stray ``x.safetensors``, a variant's ``model.fp16.safetensors``)
    is refused in one line naming what it holds, as transformers refuses it."""
    folder = Path(folder)
    entry = weights_entry(folder)
    if entry is None:
        found = sorted(p.name for p in folder.iterdir() if p.name.endswith(_WEIGHT_SUFFIXES)) if folder.is_dir() else []
        shown = ", ".join(clipped(n) for n in found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise CheckpointError(
            f"no weights in {folder} that transformers reads: it reads {', '.join(WEIGHT_ENTRIES[:-1])} or "
            f"{WEIGHT_ENTRIES[-1]}"
            + (f", and the folder holds {shown}; rename the model's weights to one of those" if found else "")
        )
    files = indexed_files(folder, entry) if indexed(entry) else [folder / entry]
    missing = [f.name for f in files if not f.is_file()]
    if missing and indexed(entry):
        raise CheckpointError(f"{folder} is missing shard(s) listed in its index {entry}: {', '.join(missing)}")
    if missing:
        raise CheckpointError(f"{folder} is missing {entry}, which its config.json names as {EXPLICIT_WEIGHTS}")
    return files
