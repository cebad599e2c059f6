"""Writing a stock HF checkpoint folder, streamed and atomic (docs/design.md §6).

Tensors arrive group by group (one layer at a time) and stream into safetensors shards, so
memory stays at about one layer. Everything goes into a
temporary sibling folder that is renamed onto the destination only when complete: an
interrupted or failed export leaves nothing half-written.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from huggingface_hub import ModelCard
from torch import Tensor
from transformers import GenerationConfig, PretrainedConfig

from .adapters import adapter_for
from .canonical import CanonicalModel, RowBlocks, block_rows, drain, export_config, hf_state_dict_groups
from .checkpoint import SAFETENSORS_DTYPES
from .devices import full_float32_products
from .options import OutputExistsError, ParameterError, parse_size
from .progress import bar as progress_bar

_DTYPE_NAMES = {dtype: name for name, dtype in SAFETENSORS_DTYPES.items()}

#: Tokenizer and processor files copied from model A into the merge.
GENERATION_CONFIG = "generation_config.json"
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)

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
        self.entries[key] = {"dtype": _DTYPE_NAMES[dtype], "shape": shape, "data_offsets": [self.offset, self.offset + size]}
        self.total += size

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
        path, data_path, reserved = self.folder / f"shard-{len(self.shards):05d}.tmp", self._data_path(), self._reserved()
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
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
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
        writer.add_rows(key, [group.total_rows, *chunk.shape[1:]], itertools.chain([prepare(key, chunk)], (prepare(key, b[key]) for b in group.blocks)))
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
    card: ModelCard | None = None,
    extra_files: Mapping[str, Path] | None = None,
    overwrite: bool = False,
    progress: bool = True,
    total_groups: int | None = None,
) -> Path:
    """Write HF state-dict ``groups`` + ``config`` as a stock checkpoint folder, atomically.

    ``groups`` are consumed: a ``dict`` group is emptied as its tensors are written. Lazy groups
    (transforms, sums) are computed as they are read, with float32 products at full precision.
    """
    output = Path(output_dir)
    max_bytes = parse_size(shard_size)
    if output.exists() and not overwrite:
        raise OutputExistsError(f"{output} already exists; pass {{}} to replace it", "overwrite")
    staging = staging_folder(output)
    try:
        writer = _ShardWriter(staging, max_bytes)

        def prepare(key: str, tensor: Tensor) -> Tensor:
            tensor = tensor.detach()
            if dtype is not None and tensor.is_floating_point():
                cast = tensor.to(dtype)  # before the move: fewer bytes to copy off a GPU
                if not bool(torch.isfinite(cast).all()):  # finite inputs, but beyond the dtype's range
                    largest = tensor.abs().max().item()
                    raise ParameterError(
                        f"{key} overflows {str(dtype).removeprefix('torch.')} (largest magnitude {largest:.3g}); "
                        "write it with {} bfloat16 or float32", "dtype",
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
        source_generation = Path(source_folder) / GENERATION_CONFIG if source_folder is not None else None
        if source_generation is not None and source_generation.is_file():  # A's own: its eos ids and sampling settings
            shutil.copy2(source_generation, staging / GENERATION_CONFIG)
        elif adapter_for(config).model_class.can_generate():
            GenerationConfig.from_model_config(config).save_pretrained(staging)
        if source_folder is not None:
            for name in PROCESSOR_FILES:
                if (Path(source_folder) / name).is_file():
                    shutil.copy2(Path(source_folder) / name, staging / name)
        for name, path in (extra_files or {}).items():
            shutil.copy2(path, staging / name)
        if card is not None:
            card.save(staging / "README.md")
        move_into_place(staging, output, overwrite=overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return output


def _as_umask_allows(folder: Path) -> None:
    """Give a staging folder (``mkdtemp`` makes it private) the permissions a folder made by
    ``save_pretrained`` or ``mkdir`` would have under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def check_apart(output: str | Path, inputs: Iterable[str | Path]) -> None:
    """Refuse an ``output`` folder that is, contains or lies inside one of the ``inputs`` folders
    (paths resolved, links followed): replacing it would delete an input, writing into it would
    change one. Names that are not local folders (Hub ids not yet downloaded) are skipped."""
    out = Path(output).resolve()
    for given in inputs:
        folder = Path(given)
        if not folder.exists():
            continue
        folder = folder.resolve()
        if out == folder or folder.is_relative_to(out) or out.is_relative_to(folder):
            where = "is" if out == folder else "contains" if folder.is_relative_to(out) else "lies inside"
            raise ParameterError(f"{{}} {output} {where} the input {given}; write the merge to a folder of its own", "output")


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
        raise OSError(f"{output} needs about {needed_bytes / 1e9:.2f} GB but {here} has {free / 1e9:.2f} GB free; free some space or choose another output folder")


def staging_folder(output: Path) -> Path:
    """A fresh hidden sibling of ``output`` to write into before :func:`move_into_place`.

    Its name carries this process's id (``.NAME.tmp-PID-xxxx``), so that a later run can tell the
    folders of runs that died (SIGKILL, power loss) from those of runs still writing, and removes
    the dead ones (:func:`clean_stale`)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(output)
    return Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-{os.getpid()}-", dir=output.parent))


def move_into_place(staging: Path, output: Path, *, overwrite: bool = True) -> None:
    """Rename a finished ``staging`` folder onto ``output``.

    Without ``overwrite`` the rename only succeeds while ``output`` does not exist: a concurrent
    run that got there first keeps its folder, and this one fails with :class:`OutputExistsError`
    (its staging folder is removed by the caller). With ``overwrite`` the old folder is set aside
    (``.NAME.old-PID-xxxx``) and removed only once the new one is in place; if the second rename
    fails the old folder goes back, and if the process dies between the two renames, the next run
    puts it back (:func:`clean_stale`), so ``output`` is never lost. The folder gets the
    permissions the umask gives a new folder (``mkdtemp`` made it private).
    """
    _as_umask_allows(staging)
    if not overwrite or not output.exists():
        try:
            staging.rename(output)  # POSIX: fails on a non-empty existing folder
        except OSError as err:
            if output.exists():
                raise OutputExistsError(f"{output} was written by another run meanwhile; pass {{}} to replace it", "overwrite") from err
            raise
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-{os.getpid()}-", dir=output.parent))
    output.rename(retired / output.name)
    try:
        staging.rename(output)
    except BaseException:
        (retired / output.name).rename(output)
        retired.rmdir()
        raise
    shutil.rmtree(retired, ignore_errors=True)


def clean_stale(output: Path) -> list[Path]:
    """Tidy what runs that died left beside ``output``: their staging folders are removed, and an
    old folder set aside by an interrupted ``--overwrite`` goes back to ``output`` when it is
    missing. Folders of live processes are left alone. Returns the folders it removed or restored."""
    tidied = []
    for kind in ("old", "tmp"):  # an old folder first: it may be all that is left of the output
        for folder in sorted(output.parent.glob(f".{output.name}.{kind}-*")):
            pid = folder.name.removeprefix(f".{output.name}.{kind}-").split("-")[0]
            if not folder.is_dir() or not pid.isdigit() or _alive(int(pid)):
                continue
            kept = folder / output.name
            if kind == "old" and kept.is_dir() and not output.exists():
                kept.rename(output)
            shutil.rmtree(folder, ignore_errors=True)
            tidied.append(folder)
    return tidied


def _alive(pid: int) -> bool:
    """Whether a process with this id runs (on this machine)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, under another user
        return True
    return True


def _with_dtype(config: PretrainedConfig, dtype: torch.dtype | None) -> PretrainedConfig:
    if dtype is not None:
        config = config.__class__.from_dict(config.to_dict())
        config.dtype = dtype
    return config


def save_canonical(canonical: CanonicalModel, output_dir: str | Path, **options) -> Path:
    """Export a canonical model straight to a stock HF folder, one layer at a time."""
    config = export_config(canonical)
    return write_checkpoint(
        hf_state_dict_groups(canonical, config, block_rows=block_rows(canonical.spec)), config, output_dir,
        total_groups=len(canonical.spec.groups()), **options
    )
