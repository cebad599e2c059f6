"""Lazy access to the tensors of a Hugging Face checkpoint folder, one tensor at a time.

A checkpoint is exposed as a read-only ``Mapping`` from *current* (transformers 5) state-dict
keys to tensors. Nothing is read until a key is looked up, so the canonical form can
materialise one layer at a time from a billion-parameter checkpoint (docs/design.md §5). Legacy key
names (transformers 4.x) are renamed on the fly by the adapter's rename table.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import threading
import weakref
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor
from transformers import PretrainedConfig

from hf_lmc.canonical.adapters import Adapter
from hf_lmc.io.weights import (
    CheckpointError,
    weight_files,
)


def all_finite(tensor: Tensor) -> bool:
    """No NaN or Inf in ``tensor``: min and max propagate both, ~20x faster than ``isfinite``."""
    if tensor.numel() == 0:
        return True
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def current_key(key: str, adapter: Adapter) -> str | None:
    """The transformers 5 name of a stored key, or ``None`` for keys that hold no parameter."""
    if any(re.search(pattern, key) for pattern in adapter.ignored_keys):
        return None
    for pattern, replacement in adapter.legacy_renames:
        key = re.sub(pattern, replacement, key)
    return key


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
        raise CheckpointError(
            f"cannot read {path}: tensor {name!r} has a malformed header entry; download the file again"
        )
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


class FileIdentity:
    """What a file was when it was opened (device, inode, size, modification time), to tell
    whether the path still names those bytes: a file replaced (a new inode) or rewritten in place
    (a new size or time) since is detected."""

    def __init__(self, path: Path, stat: os.stat_result):
        self.path = path
        self.recorded = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def verify(self) -> None:
        """Raise :class:`CheckpointError` if the path no longer names the file as it was opened."""
        try:
            stat = os.stat(self.path)
            now = (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)
        except OSError:
            now = None
        if now != self.recorded:
            raise CheckpointError(
                f"{self.path} changed while it was read; nothing was written; run again once it stays put"
            )


class SafetensorsFile:
    """Reads single tensors from a safetensors file through one handle, opened once.

    ``safe_open`` memory-maps the whole file, and every page it touches stays resident in the
    process for as long as the file is open, so streaming a checkpoint through it costs its full
    size in RSS. Reading each tensor into its own buffer keeps memory at what is actually held.
    Every read goes through the descriptor the header was read from (``os.preadv``: no shared
    seek position between threads), so a file replaced under its path while a merge reads it is
    never mixed with the old one's offsets; :meth:`verify_unchanged` tells that it was replaced.
    The descriptor closes with :meth:`close` or when the object is collected.
    """

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        self._closer = weakref.finalize(self, os.close, self._fd)
        self._lock = threading.Lock()  # only where os.preadv is missing (Windows): seek and read as one step
        try:
            stat = os.fstat(self._fd)
            self.identity = FileIdentity(path, stat)
            self._read_header(stat.st_size)
        except BaseException:
            self.close()
            raise

    def _read_header(self, size: int) -> None:
        path = self.path
        head = self._read(0, 8) if size >= 8 else b""
        if len(head) < 8:
            raise CheckpointError(f"cannot read {path}: the file is corrupt or truncated, download it again")
        length = int.from_bytes(head, "little")
        try:
            if length > size - 8:
                raise ValueError("header longer than the file")
            header = json.loads(self._read(8, length))
        except (ValueError, UnicodeDecodeError) as err:
            raise CheckpointError(
                f"cannot read {path}: the file is corrupt or truncated, download it again ({err})"
            ) from err
        if not isinstance(header, dict):
            raise CheckpointError(
                f"cannot read {path}: its header is not a safetensors header (a JSON {type(header).__name__}); download it again"
            )
        header.pop("__metadata__", None)
        self.start = 8 + length
        self.entries = header
        for name, entry in header.items():
            _check_entry(path, name, entry, size - self.start)

    def _read(self, offset: int, length: int) -> bytes:
        buffer = bytearray(length)
        self._read_into(memoryview(buffer), offset)
        return bytes(buffer)

    def _read_into(self, view: memoryview, offset: int) -> None:
        """Fill ``view`` with the file's bytes from ``offset`` (a read may return fewer: loop)."""
        done = 0
        while done < len(view):
            if hasattr(os, "preadv"):
                count = os.preadv(self._fd, [view[done:]], offset + done)
            else:  # no positioned reads (Windows): seek and read under the lock
                with self._lock:
                    os.lseek(self._fd, offset + done, os.SEEK_SET)
                    chunk = os.read(self._fd, min(len(view) - done, 1 << 30))
                count = len(chunk)
                view[done : done + count] = chunk
            if count == 0:
                raise CheckpointError(
                    f"cannot read {self.path}: it ends early (truncated while it was read?); download it again"
                )
            done += count

    def close(self) -> None:
        self._closer()

    def verify_unchanged(self) -> None:
        self.identity.verify()

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def dtype_name(self, name: str) -> str:
        return self.entries[name]["dtype"]

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
            self._read_into(memoryview(buffer.numpy()), self.start + begin)
        return buffer.view(dtype).reshape(shape)


class Checkpoint(Mapping[str, Tensor]):
    """Tensors of a checkpoint folder under current key names, read on demand.

    Safetensors shards are read tensor by tensor (see :class:`SafetensorsFile`); ``.bin`` shards are opened with
    ``torch.load(weights_only=True, mmap=True)``. Every shard is opened once, when the checkpoint
    is, and read through that handle; :meth:`verify_unchanged` tells whether any was replaced or
    rewritten since. Given ``config``, every tensor of the model it describes is checked, from the
    headers alone, to be present, of its shape and of a float dtype (:meth:`check_tensors`).
    Every tensor is checked to be finite as it is read, so a corrupt model fails with its key and
    file named rather than a NaN merge. Close it (or use it as a context manager) to release the
    files at once; they are released when it is collected otherwise.
    """

    def __init__(self, folder: str | Path, adapter: Adapter, config: PretrainedConfig | None = None):
        self.folder = Path(folder)
        self._where: dict[str, tuple[Path, str]] = {}
        self._handles: dict[Path, object] = {}
        self._identities: list[FileIdentity] = []
        self._closed = False
        self._checked: set[str] = set()  # keys already verified finite (matching re-reads layers)
        try:
            config_file = self.folder / "config.json"  # read by path elsewhere: its change is detected too
            if config_file.is_file():
                self._identities.append(FileIdentity(config_file, os.stat(config_file)))
            for file in weight_files(self.folder):
                for stored in self._open(file).keys():  # noqa: SIM118 (a SafetensorsFile has keys() but no iteration)
                    key = current_key(stored, adapter)
                    if key is not None:
                        self._where[key] = (file, stored)
            if config is not None:
                self.check_tensors(adapter, config)
        except BaseException:
            self.close()
            raise

    def _open(self, file: Path):
        if file not in self._handles:
            if self._closed:  # never reopened by path: that could be another file by now
                raise ValueError(f"{self.folder}: the checkpoint was closed; open it again to read it")
            try:
                if file.suffix == ".safetensors":
                    handle = SafetensorsFile(file)
                    self._identities.append(handle.identity)
                else:
                    identity = FileIdentity(file, os.stat(file))  # before the read: a change during it shows too
                    handle = load_pickled_tensors(file)
                    self._identities.append(identity)
                self._handles[file] = handle
            except (OSError, RuntimeError, EOFError) as err:
                raise CheckpointError(
                    f"cannot read {file}: the file is corrupt or truncated, download it again ({err})"
                ) from err
        return self._handles[file]

    def check_tensors(self, adapter: Adapter, config: PretrainedConfig) -> None:
        """Every tensor of the stock model ``config`` describes is here, of the shape the config
        implies and stored as a float: checked on the headers (nothing is read), so weights
        that do not match their config, are incomplete or are quantised are refused in one line
        naming the file and the tensor before any long work. The expected tensors are those of
        ``adapter.model_class(config)`` built on the meta device (exact for every family,
        GPT-2's Conv1D layout and biases the config switches on included; buffers that are not
        saved are not expected); of a tied pair (the LM head tied to the embedding) one suffices.
        """
        with torch.device("meta"):
            model = adapter.model_class(config)
        expected: dict[int, list[tuple[str, Tensor]]] = {}  # tied tensors share one Parameter
        for key, tensor in model.state_dict(keep_vars=True).items():
            expected.setdefault(id(tensor), []).append((key, tensor))
        missing = [names[0][0] for names in expected.values() if not any(key in self._where for key, _ in names)]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(
                f"{self.folder}: tensor {missing[0]!r} is missing{more}; its config.json describes a "
                f"{adapter.model_class.__name__} with it: the weights are incomplete or belong to another model"
            )
        for key, tensor in (pair for names in expected.values() for pair in names):
            if key not in self._where:
                continue
            file, stored = self._where[key]
            handle = self._handles[file]
            if isinstance(handle, SafetensorsFile):
                shape, dtype_name = handle.shape(stored), handle.dtype_name(stored)
                dtype = SAFETENSORS_DTYPES[dtype_name]
            else:
                shape, dtype = tuple(handle[stored].shape), handle[stored].dtype
                dtype_name = str(dtype).removeprefix("torch.")
            if tensor.is_floating_point() and not dtype.is_floating_point:
                raise CheckpointError(
                    f"{file}: tensor {stored!r} is stored as {dtype_name}; hf_lmc merges float weights (F16, BF16, F32, F64); "
                    "dequantise the model first"
                )
            if shape != tuple(tensor.shape):
                raise CheckpointError(
                    f"{file}: tensor {stored!r} has shape {list(shape)}, but {self.folder / 'config.json'} implies "
                    f"{list(tensor.shape)}: the weights and the config do not belong together"
                )

    def verify_unchanged(self) -> None:
        """Raise :class:`CheckpointError` if a shard (or ``config.json``) was replaced or rewritten
        since the checkpoint was opened (its path names another inode, or its size or modification
        time moved): called before an output made from it is put in place, so a merge never mixes
        two versions of a model."""
        for identity in self._identities:
            identity.verify()

    def close(self) -> None:
        """Release the shards' files (safetensors descriptors, ``.bin`` maps) now."""
        for handle in self._handles.values():
            if isinstance(handle, SafetensorsFile):
                handle.close()
        self._handles.clear()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
