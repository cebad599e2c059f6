"""Lazy access to the tensors of a Hugging Face checkpoint folder, one tensor at a time.

A checkpoint is exposed as a read-only ``Mapping`` from *current* (transformers 5) state-dict
keys to tensors. Nothing is read until a key is looked up, so the canonical form can
materialise one layer at a time from a billion-parameter checkpoint (docs/design.md §5). Legacy key
names (transformers 4.x) are renamed on the fly by the adapter's rename table.
"""

from __future__ import annotations

import json
import math
import pickle
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor

from .adapters import Adapter

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
BIN_INDEX = "pytorch_model.bin.index.json"
BIN_SINGLE = "pytorch_model.bin"


def all_finite(tensor: Tensor) -> bool:
    """No NaN or Inf in ``tensor``: min and max propagate both, ~20x faster than ``isfinite``."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


class CheckpointError(ValueError):
    """A checkpoint folder is missing files or holds unreadable ones."""


def current_key(key: str, adapter: Adapter) -> str | None:
    """The transformers 5 name of a stored key, or ``None`` for keys that hold no parameter."""
    if any(re.search(pattern, key) for pattern in adapter.ignored_keys):
        return None
    for pattern, replacement in adapter.legacy_renames:
        key = re.sub(pattern, replacement, key)
    return key


def _indexed_files(folder: Path, index_name: str) -> list[Path]:
    index = folder / index_name
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"{index} is not a valid weight index ({err})") from err
    return [folder / name for name in dict.fromkeys(weight_map.values())]


def weight_files(folder: Path) -> list[Path]:
    """The weight shards of ``folder`` (safetensors preferred, else ``.bin``), checked to exist."""
    if (folder / SAFETENSORS_INDEX).is_file():
        files = _indexed_files(folder, SAFETENSORS_INDEX)
    elif (folder / SAFETENSORS_SINGLE).is_file():
        files = [folder / SAFETENSORS_SINGLE]
    elif found := sorted(folder.glob("*.safetensors")):
        files = found
    elif (folder / BIN_INDEX).is_file():
        files = _indexed_files(folder, BIN_INDEX)
    elif (folder / BIN_SINGLE).is_file():
        files = [folder / BIN_SINGLE]
    else:
        raise CheckpointError(
            f"no weights in {folder} (expected {SAFETENSORS_SINGLE}, {SAFETENSORS_INDEX}, {BIN_SINGLE} or {BIN_INDEX})"
        )
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise CheckpointError(f"{folder} is missing shard(s) listed in its index: {', '.join(missing)}")
    return files


SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def _check_entry(path: Path, name: str, entry, data_size: int) -> None:
    """One header entry, checked before anything is read: well formed, of a dtype hf_lmc reads,
    its offsets in order, inside the file and as long as its shape says."""
    try:
        dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
        well_formed = isinstance(dtype, str) and all(isinstance(n, int) and n >= 0 for n in (*shape, begin, end))
    except (TypeError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise CheckpointError(f"cannot read {path}: tensor {name!r} has a malformed header entry; download the file again")
    if dtype not in SAFETENSORS_DTYPES:
        raise CheckpointError(
            f"cannot read {path}: tensor {name!r} is stored as {dtype}, which hf_lmc does not read "
            f"(it reads {', '.join(SAFETENSORS_DTYPES)}); save the model in one of those"
        )
    expected = math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
    if not begin <= end <= data_size or end - begin != expected:
        raise CheckpointError(
            f"cannot read {path}: tensor {name!r} claims {end - begin} bytes at {begin}..{end} for shape {list(shape)} "
            f"({expected} bytes) in {data_size} bytes of data; the file is corrupt or truncated, download it again"
        )


def load_pickled_tensors(file: Path, *, mmap: bool = True):
    """A ``torch.save`` file's tensors, unpickled with ``weights_only=True`` (no code in the file
    runs), memory-mapped where the file's format allows. PyTorch's legacy (non-zip) format cannot
    be memory-mapped and is read whole; a file that holds objects other than tensors is refused
    as such, not as corrupt."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"cannot read {file}: it holds pickled objects other than tensors, which hf_lmc does not load "
            "(weights_only=True: no code from the file runs); convert it to safetensors where it was made"
        ) from err
    except RuntimeError as err:
        if mmap and "mmap can only be used" in str(err):  # the legacy format: read whole
            return load_pickled_tensors(file, mmap=False)
        raise


class SafetensorsFile:
    """Reads single tensors from a safetensors file with plain ``read`` calls.

    ``safe_open`` memory-maps the whole file, and every page it touches stays resident in the
    process for as long as the file is open, so streaming a checkpoint through it costs its full
    size in RSS. Reading each tensor into its own buffer keeps memory at what is actually held.
    """

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"cannot read {path}: the file is corrupt or truncated, download it again")
            length = int.from_bytes(head, "little")
            try:
                if length > size - 8:
                    raise ValueError("header longer than the file")
                header = json.loads(f.read(length))
            except (ValueError, UnicodeDecodeError) as err:
                raise CheckpointError(
                    f"cannot read {path}: the file is corrupt or truncated, download it again ({err})"
                ) from err
        if not isinstance(header, dict):
            raise CheckpointError(f"cannot read {path}: its header is not a safetensors header (a JSON {type(header).__name__}); download it again")
        header.pop("__metadata__", None)
        self.start = 8 + length
        self.entries = header
        for name, entry in header.items():
            _check_entry(path, name, entry, size - self.start)

    def keys(self):
        return self.entries.keys()

    def get_tensor(self, name: str) -> Tensor:
        return self.get_rows(name, slice(None))

    def get_rows(self, name: str, rows: slice) -> Tensor:
        """Rows ``rows`` (a step-1 slice of the first axis) of tensor ``name``, reading only their bytes.

        The buffer is allocated uninitialised (a zero-filled ``bytearray`` would write every
        byte once more before the read does).
        """
        entry = self.entries[name]
        begin, end = entry["data_offsets"]
        shape = list(entry["shape"])
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        if shape:
            start, stop, step = rows.indices(shape[0])
            if step != 1:
                raise ValueError(f"row reads take a contiguous slice, got step {step}")
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            shape[0] = max(stop - start, 0)
            begin, end = begin + start * row_bytes, begin + start * row_bytes + shape[0] * row_bytes
        buffer = torch.empty(end - begin, dtype=torch.uint8, device="cpu")  # file bytes land in host memory
        if end > begin:
            with open(self.path, "rb") as f:
                f.seek(self.start + begin)
                f.readinto(buffer.numpy())
        return buffer.view(dtype).reshape(shape)


class Checkpoint(Mapping[str, Tensor]):
    """Tensors of a checkpoint folder under current key names, read on demand.

    Safetensors shards are read tensor by tensor (see :class:`SafetensorsFile`); ``.bin`` shards are opened with
    ``torch.load(weights_only=True, mmap=True)``. Every tensor is checked to be finite as it is
    read, so a corrupt model fails with its key and file named rather than a NaN merge.
    """

    def __init__(self, folder: str | Path, adapter: Adapter):
        self.folder = Path(folder)
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, object] = {}
        self._checked: set[str] = set()  # keys already verified finite (matching re-reads layers)
        for file in weight_files(self.folder):
            for stored in self._open(file).keys():
                key = current_key(stored, adapter)
                if key is not None:
                    self._where[key] = (file, stored)

    def _open(self, file: Path):
        if file not in self._handles:
            try:
                if file.suffix == ".safetensors":
                    self._handles[file] = SafetensorsFile(file)
                else:
                    self._handles[file] = load_pickled_tensors(file)
            except (OSError, RuntimeError, EOFError) as err:
                raise CheckpointError(
                    f"cannot read {file}: the file is corrupt or truncated, download it again ({err})"
                ) from err
        return self._handles[file]

    def __getitem__(self, key: str) -> Tensor:
        return self._read(key, None)

    def rows(self, key: str, rows: slice) -> Tensor:
        """Rows ``rows`` of tensor ``key``: from a safetensors file only their bytes are read
        (the export streams vocabulary tensors in row blocks)."""
        return self._read(key, rows)

    def _read(self, key: str, rows: slice | None) -> Tensor:
        """Tensor ``key``, or its ``rows``, checked finite until the whole tensor has been seen once."""
        file, stored = self._where[key]
        handle = self._open(file)
        whole = rows is None or file.suffix != ".safetensors"  # a .bin shard is memory-mapped: slice it
        if not whole:
            tensor = handle.get_rows(stored, rows)
        else:
            tensor = handle.get_tensor(stored) if file.suffix == ".safetensors" else handle[stored]
        if key not in self._checked and tensor.is_floating_point():
            if not all_finite(tensor):
                raise CheckpointError(
                    f"{stored!r} in {file} contains NaN or Inf values; this checkpoint cannot be merged"
                )
            if whole:
                self._checked.add(key)
        return tensor[rows] if whole and rows is not None else tensor

    def __contains__(self, key: object) -> bool:
        # Mapping's default looks the key up, which here reads (and checks) the whole tensor.
        return key in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)
