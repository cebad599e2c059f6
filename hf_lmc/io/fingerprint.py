"""What a checkpoint is, by its content rather than by its folder's name.

A merge records, per model, a fingerprint of the checkpoint it read (in the saved transforms'
manifest); ``hf-lmc apply`` fingerprints the model it is given and moves it by the transform of
the one model whose fingerprint it matches. Folder names say nothing: two runs save
``runs/seed0/model`` and ``runs/seed1/model``, and one model is saved under many names.

The fingerprint is the SHA-256 of the config (the JSON as saved, less the keys that say who saved
it rather than what it computes) and, per tensor in name order, its name, dtype, shape and the
bytes of its first row (at most :data:`_SAMPLED` elements). Headers alone cannot tell two seeds of
one architecture apart; a row of every tensor can, and costs a read of a few kilobytes per tensor
(the safetensors header gives each row's offset), never the whole checkpoint. Checkpoints that
differ only outside the sampled rows share a fingerprint; two independently trained or two
permuted models never do.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import safe_open

from hf_lmc.io.checkpoint import load_pickled_tensors
from hf_lmc.io.weights import weight_files

#: Config keys that record how a checkpoint was saved, not what it computes.
_UNSAVED_KEYS = frozenset({"_name_or_path", "transformers_version"})
#: How many elements of each tensor's first row enter the fingerprint.
_SAMPLED = 256


def fingerprint(folder: str | Path) -> str:
    """The content fingerprint (``sha256:`` and 64 hex digits) of the checkpoint in ``folder``:
    its ``config.json`` and the weights that :func:`~hf_lmc.io.checkpoint.weight_files` reads."""
    folder = Path(folder)
    digest = hashlib.sha256()
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if isinstance(config, dict):
        config = {key: value for key, value in config.items() if key not in _UNSAVED_KEYS}
    digest.update(json.dumps(config, sort_keys=True).encode())
    with torch.device("cpu"):  # read as stored, whatever device a caller made the default (meta, under a build)
        samples = sorted(_samples(folder))
    for name, dtype, shape, sample in samples:
        digest.update(f"\0{name}\0{dtype}\0{shape}\0".encode())
        digest.update(sample)
    return "sha256:" + digest.hexdigest()


def _samples(folder: Path):
    """``(name, dtype, shape, bytes of the first row)`` of every tensor of the checkpoint."""
    for file in weight_files(folder):
        if file.suffix == ".safetensors":
            with safe_open(str(file), framework="pt") as opened:
                for name in opened.keys():  # noqa: SIM118 - safe_open has no __iter__
                    part = opened.get_slice(name)
                    shape = tuple(part.get_shape())
                    first = part[:1] if shape else part[...]
                    yield name, str(first.dtype), shape, _row_bytes(first)
        else:
            for name, tensor in load_pickled_tensors(file).items():
                first = tensor[:1] if tensor.dim() else tensor
                yield name, str(tensor.dtype), tuple(tensor.shape), _row_bytes(first)


def _row_bytes(tensor: torch.Tensor) -> bytes:
    flat = tensor.reshape(-1)[:_SAMPLED].contiguous()
    return flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
