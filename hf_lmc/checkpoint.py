"""Lazy, memory-mapped access to the tensors of a Hugging Face checkpoint folder.

A checkpoint is exposed as a read-only ``Mapping`` from *current* (transformers 5) state-dict
keys to tensors. Nothing is read until a key is looked up, so the canonical form can
materialise one layer at a time from a billion-parameter checkpoint (DESIGN §5). Legacy key
names (transformers 4.x) are renamed on the fly by the adapter's rename table.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

from safetensors import SafetensorError, safe_open
from torch import Tensor

from .adapters import Adapter

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or holds unreadable ones."""


def current_key(key: str, adapter: Adapter) -> str | None:
    """The transformers 5 name of a stored key, or ``None`` for keys that hold no parameter."""
    if any(re.search(pattern, key) for pattern in adapter.ignored_keys):
        return None
    for pattern, replacement in adapter.legacy_renames:
        key = re.sub(pattern, replacement, key)
    return key


def safetensors_files(folder: Path) -> list[Path]:
    """The safetensors shards of ``folder`` (from its index when sharded), all checked to exist."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as err:
            raise CheckpointError(f"{index} is not a valid safetensors index ({err})") from err
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
    elif (folder / SAFETENSORS_SINGLE).is_file():
        files = [folder / SAFETENSORS_SINGLE]
    else:
        found = sorted(p.name for p in folder.glob("*.safetensors"))
        if not found:
            raise CheckpointError(f"no safetensors weights in {folder} (expected {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX})")
        files = [folder / name for name in found]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} is missing shard(s) listed in its index: {', '.join(missing)}")
    return files


class SafetensorsCheckpoint(Mapping[str, Tensor]):
    """Memory-mapped tensors of a safetensors checkpoint folder, under current key names."""

    def __init__(self, folder: str | Path, adapter: Adapter):
        self.folder = Path(folder)
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, object] = {}
        for file in safetensors_files(self.folder):
            for stored in self._open(file).keys():
                key = current_key(stored, adapter)
                if key is not None:
                    self._where[key] = (file, stored)

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except (SafetensorError, OSError) as err:
                raise CheckpointError(f"cannot read {file}: {err}; the file is corrupt or truncated, download it again") from err
        return self._handles[file]

    def __getitem__(self, key: str) -> Tensor:
        file, stored = self._where[key]
        try:
            return self._open(file).get_tensor(stored)
        except SafetensorError as err:
            raise CheckpointError(f"cannot read tensor {stored!r} from {file}: {err}") from err

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
