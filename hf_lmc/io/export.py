"""Writing a stock HF checkpoint folder, streamed and atomic (docs/design.md §6).

Tensors arrive group by group (one layer at a time) and stream into safetensors shards, so
memory stays at about one layer. Everything goes into a
temporary sibling folder that is renamed onto the destination only when complete: an
interrupted or failed export leaves nothing half-written, and an old folder is replaced only
when hf_lmc wrote it (the output protocol of :mod:`hf_lmc.io.outputs`).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from torch import Tensor
from transformers import GenerationConfig, PretrainedConfig

from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.form import CanonicalModel, RowBlocks, block_rows, drain, export_config, hf_state_dict_groups
from hf_lmc.config.options import OutputExistsError, ParameterError, parse_size
from hf_lmc.io.checkpoint import SAFETENSORS_DTYPES
from hf_lmc.io.inherit import GENERATION_CONFIG, PROCESSOR_FILES, TOKENIZER_COPIED, copy_model_file
from hf_lmc.io.outputs import check_replaceable, discard, is_empty_folder, move_into_place, staging_folder
from hf_lmc.utils.devices import full_float32_products
from hf_lmc.utils.progress import bar as progress_bar

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}


class _ShardWriter:
    """Streams tensors into safetensors shards, starting a new shard when one would overflow.

    Each tensor's bytes go to disk as it arrives, so memory holds one tensor rather than one
    shard. A shard's header is only known once the shard is full. Shards of ``HEADER_RESERVE_FROM``
    bytes or more leave ``HEADER_RESERVE`` bytes in front of their data and write the header
    there at the end, padded with spaces (as safetensors pads headers anyway), so each byte is
    written once; a header that does not fit, or a smaller shard, is written in front of a copy
    of the data (an in-kernel file copy).
    """

    HEADER_RESERVE = 64 << 10  # ~400 tensor entries; 0.1 % of the smallest shard that reserves it
    HEADER_RESERVE_FROM = 64 << 20

    def __init__(self, folder: Path, max_bytes: int):
        self.folder, self.max_bytes = folder, max_bytes
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0
        self.total_parameters = 0  # elements of every tensor written, as transformers' index records them
        self.entries: dict[str, dict] = {}
        self.data = None
        self.offset = 0

    def add(self, key: str, tensor: Tensor) -> None:
        self._reserve(key, tensor.dtype, list(tensor.shape))
        self._write(tensor)

    def add_rows(self, key: str, shape: list[int], chunks: Iterable[Tensor]) -> None:
        """Write a ``shape`` tensor that arrives as consecutive blocks of rows (one in memory at a time)."""
        chunks = iter(chunks)
        first = next(chunks)
        self._reserve(key, first.dtype, shape)
        for chunk in itertools.chain([first], chunks):
            self._write(chunk)
        if self.offset != self.entries[key]["data_offsets"][1]:
            raise RuntimeError(f"{key}: row blocks do not add up to shape {shape}")

    def _reserve(self, key: str, dtype: torch.dtype, shape: list[int]) -> None:
        size = _nbytes(dtype, shape)
        if self.entries and self.offset + size > self.max_bytes:
            self.flush()
        if self.data is None:
            self.data = open(self._data_path(), "wb")  # noqa: SIM115 (closed in flush)
            self.data.seek(self._reserved())
        self.entries[key] = {
            "dtype": _DTYPE_NAMES[dtype],
            "shape": shape,
            "data_offsets": [self.offset, self.offset + size],
        }
        self.total += size
        self.total_parameters += math.prod(shape)

    def _write(self, tensor: Tensor) -> None:
        if tensor.numel():
            self.data.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
        self.offset += tensor.numel() * tensor.element_size()

    def _data_path(self) -> Path:
        return self.folder / f"shard-{len(self.shards):05d}.data"

    def _reserved(self) -> int:
        return self.HEADER_RESERVE if self.max_bytes >= self.HEADER_RESERVE_FROM else 0

    def flush(self) -> None:
        if self.data is None:
            return
        header = json.dumps({"__metadata__": {"format": "pt"}, **self.entries}, separators=(",", ":")).encode()
        path, data_path, reserved = (
            self.folder / f"shard-{len(self.shards):05d}.tmp",
            self._data_path(),
            self._reserved(),
        )
        if 8 + len(header) <= reserved:  # the header fits in front of the data: write it in place
            self.data.seek(0)
            self.data.write(struct.pack("<Q", reserved - 8) + header.ljust(reserved - 8))
            self.data.close()
            data_path.rename(path)
        else:
            self.data.close()
            header += b" " * (-len(header) % 8)  # safetensors pads the header so the data is 8-byte aligned
            with open(path, "wb") as out, open(data_path, "rb") as src:
                out.write(struct.pack("<Q", len(header)) + header)
                src.seek(reserved)
                _copy_file(src, out, self.offset)
            data_path.unlink()
        self.shards.append((path, list(self.entries)))
        self.entries, self.data, self.offset = {}, None, 0

    def close(self) -> None:
        """Close a shard left open by a failed export (its folder is discarded)."""
        if self.data is not None:
            self.data.close()
            self.data = None

    def finish(self) -> None:
        """Give the shards their final transformers names and write the index."""
        self.flush()
        if len(self.shards) == 1:
            self.shards[0][0].rename(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, (path, keys) in enumerate(self.shards, start=1):
            name = f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
            path.rename(self.folder / name)
            weight_map |= dict.fromkeys(keys, name)
        metadata = {"total_parameters": self.total_parameters, "total_size": self.total}
        index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def _write_row_blocks(writer: _ShardWriter, group: RowBlocks, prepare) -> None:
    """Stream a :class:`RowBlocks` group: its shared tensors once, each row tensor block by block."""
    first = next(group.blocks)
    for key in [k for k in first if k not in group.keys]:
        writer.add(key, prepare(key, first.pop(key)))
    streamed = list(first)
    if len(streamed) == 1:
        (key,) = streamed
        chunk = first.pop(key)
        writer.add_rows(
            key,
            [group.total_rows, *chunk.shape[1:]],
            itertools.chain([prepare(key, chunk)], (prepare(key, b[key]) for b in group.blocks)),
        )
        return
    # Several row tensors would interleave in the file: gather them (no adapter has more than one).
    parts = {key: [first.pop(key)] for key in streamed}
    for block in group.blocks:
        for key in streamed:
            parts[key].append(block[key])
    for key in streamed:
        writer.add(key, prepare(key, torch.cat(parts.pop(key))))


def _copy_file(src, dst, size: int) -> None:
    """Append ``size`` bytes of ``src``, from its current position, to ``dst``: in the kernel
    where the OS can, else in Python.

    Whatever the kernel copied before stopping or failing stays; Python copies the rest.
    """
    dst.flush()
    start, copied = src.tell(), 0
    try:
        while copied < size:
            n = os.copy_file_range(src.fileno(), dst.fileno(), size - copied)
            if n == 0:
                break
            copied += n
    except (AttributeError, OSError):  # no copy_file_range (not Linux) or not across these files
        pass
    if copied < size:
        src.seek(start + copied)
        dst.seek(0, os.SEEK_END)
        shutil.copyfileobj(src, dst, 16 << 20)


def write_checkpoint(
    groups: Iterable[Mapping[str, Tensor] | RowBlocks],
    config: PretrainedConfig,
    output_dir: str | Path,
    *,
    shard_size: str | int = "5GB",
    dtype: torch.dtype | None = None,
    source_folder: str | Path | None = None,
    tokenizer_folder: str | Path | None = None,
    card: ModelCard | None = None,
    extra_files: Mapping[str, Path] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    total_groups: int | None = None,
    kind: str = "merge",
    moved_by: dict | None = None,
    verify: Callable[[Path], None] | None = None,
) -> Path:
    """Write HF state-dict ``groups`` + ``config`` as a stock checkpoint folder, atomically.

    ``groups`` are consumed: a ``dict`` group is emptied as its tensors are written. Lazy groups
    (transforms, sums) are computed as they are read, with float32 products at full precision.
    ``source_folder``'s generation config, tokenizer and processor files are copied beside the
    weights, the tokenizer's from ``tokenizer_folder`` instead where it is given. ``kind`` is what
    the folder's marker says hf_lmc wrote (:data:`hf_lmc.io.outputs.KINDS`), ``moved_by`` the transform
    that moved it, for a model ``hf-lmc apply`` wrote (:func:`hf_lmc.io.outputs.mark`). ``verify``, where
    given, is called with the finished folder before it is moved into place; what it raises leaves
    the output as it was.
    """
    output = Path(output_dir)
    max_bytes = parse_size(shard_size)
    if output.exists() and not overwrite and not is_empty_folder(output):  # an empty folder is taken as it is
        raise OutputExistsError(f"{output} already exists; pass {{}} to replace it", "overwrite")
    if overwrite:  # before the work, and again before the swap (move_into_place)
        check_replaceable(output, "output")
    staging = staging_folder(output)
    writer = _ShardWriter(staging, max_bytes)
    try:

        def prepare(key: str, tensor: Tensor) -> Tensor:
            tensor = tensor.detach()
            if dtype is not None and tensor.is_floating_point():
                cast = tensor.to(dtype)  # before the move: fewer bytes to copy off a GPU
                if not bool(torch.isfinite(cast).all()):  # finite inputs, but beyond the dtype's range
                    largest = tensor.abs().max().item()
                    raise ParameterError(
                        f"{key} overflows {str(dtype).removeprefix('torch.')} (largest magnitude {largest:.3g}); "
                        "write it with {} bfloat16 or float32",
                        "dtype",
                    )
                tensor = cast
            return tensor.cpu().contiguous()

        with full_float32_products():
            for group in progress_bar(groups, total=total_groups, desc="writing shards", unit="group", show=progress):
                if isinstance(group, RowBlocks):
                    _write_row_blocks(writer, group, prepare)
                    continue
                # A group dict is emptied as it is written, so each tensor is freed once on disk.
                for key, tensor in drain(group) if isinstance(group, dict) else group.items():
                    writer.add(key, prepare(key, tensor))
        writer.finish()
        config = _with_dtype(config, dtype)
        config.save_pretrained(staging)
        # A's own generation config (its eos ids and sampling settings), tokenizer and processor
        # files: regular files inside A's folder only (hf_lmc.io.inherit), never what a link points to.
        copied = source_folder is not None and copy_model_file(
            source_folder, GENERATION_CONFIG, staging / GENERATION_CONFIG
        )
        if not copied and adapter_for(config).model_class.can_generate():
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        _drop_context_max_length(staging / GENERATION_CONFIG, config)
        for name in PROCESSOR_FILES if source_folder is not None else ():
            tokenizer = (
                tokenizer_folder is not None and name in TOKENIZER_COPIED
            )  # the tokenizer's files from its own folder
            from_folder = tokenizer_folder if tokenizer else source_folder
            copy_model_file(from_folder, name, staging / name)
        for name, path in (extra_files or {}).items():
            shutil.copy2(path, staging / name)
        if card is not None:
            card.save(staging / "README.md")
        if verify is not None:  # the finished folder, before it takes the output's place
            verify(staging)
        move_into_place(staging, output, kind=kind, overwrite=overwrite, moved_by=moved_by)
    except BaseException:
        writer.close()
        discard(staging)
        raise
    return output


def check_writable(output: str | Path, needed_bytes: int = 0) -> None:
    """Fail before any long work if ``output`` cannot be written: its nearest existing folder is
    not writable, or the disk there has less free space than ``needed_bytes`` (an estimate of
    the merge's size; with ``--overwrite`` the old folder is removed only after the new one is
    in place, so it is not counted as free)."""
    here = Path(output).absolute()
    while not here.exists():
        here = here.parent
    if not here.is_dir():
        raise NotADirectoryError(f"cannot write {output}: {here} is a file")
    if not os.access(here, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write {output}: {here} is not writable; choose another output folder")
    free = shutil.disk_usage(here).free
    if needed_bytes > free:
        raise OSError(
            f"{output} needs about {needed_bytes / 1e9:.2f} GB but {here} has {free / 1e9:.2f} GB free; free some space or choose another output folder"
        )


def _drop_context_max_length(path: Path, config: PretrainedConfig) -> None:
    """Replace a ``max_length`` that only restates the model's context (its position embeddings)
    in the generation config at ``path`` by ``max_new_tokens`` of half the context; every other
    value stays as written.

    A ``max_length`` in the file counts as the user's own, so every call that passes
    ``max_new_tokens`` (as the text-generation pipeline's callers do) warns that both were set.
    Dropped alone, a bare pipeline call would take the pipeline's own default number of new
    tokens, which can run past a small model's context; ``max_new_tokens`` keeps a bare call of
    a prompt up to half the context in bounds, and a caller's own ``max_new_tokens`` replaces it
    without a warning. A ``max_length`` other than the context is a choice of A's author and is
    kept. The file is edited as JSON, not re-saved through ``GenerationConfig``, so A's values
    stay as written.
    """
    context = getattr(config, "max_position_embeddings", None)
    if context is None or not path.is_file():
        return
    settings = json.loads(path.read_text())
    if settings.get("max_length") == context:
        del settings["max_length"]
        settings.setdefault("max_new_tokens", max(1, context // 2))
        path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def dtype_named(name: str | torch.dtype | None) -> torch.dtype | None:
    """The floating torch dtype called ``name`` (``"float16"``, ``"torch.bfloat16"``; ``None``
    stays ``None``); a name that is no floating dtype is refused."""
    if name is None or isinstance(name, torch.dtype):
        return name
    name = str(name).removeprefix("torch.")
    try:
        dtype = getattr(torch, name)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"unknown dtype {name!r}; use float32, float16 or bfloat16")
    return dtype


def stored_dtype(config: PretrainedConfig) -> torch.dtype:
    """The dtype a model's weights are stored in, as its config says (float32 when it does not
    say, or names a dtype this check does not know)."""
    try:
        return dtype_named(getattr(config, "dtype", None)) or torch.float32
    except ValueError:
        return torch.float32


def _with_dtype(config: PretrainedConfig, dtype: torch.dtype | None) -> PretrainedConfig:
    if dtype is not None:
        config = config.__class__.from_dict(config.to_dict())
        config.dtype = dtype
    return config


def save_canonical(canonical: CanonicalModel, output_dir: str | Path, **options) -> Path:
    """Export a canonical model straight to a stock HF folder, one layer at a time."""
    config = export_config(canonical)
    return write_checkpoint(
        hf_state_dict_groups(canonical, config, block_rows=block_rows(canonical.spec)),
        config,
        output_dir,
        total_groups=len(canonical.spec.groups()),
        **options,
    )
