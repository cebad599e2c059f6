"""The ``average`` method's tensors: the plain weighted average of the stored checkpoints.

Models of one shape average their HF tensors as stored, with no canonical form and no
transform: the unaligned baseline every aligned merge is measured against. The tensors stream one
layer at a time, summed in float32 and kept in the first model's dtype.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import Tensor

from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.form import weighted_sum
from hf_lmc.config.options import ParameterError
from hf_lmc.io.checkpoint import Checkpoint


def open_checkpoints(folders: Sequence[Path], configs: Sequence) -> list[Checkpoint]:
    """The models' checkpoints, each opened once and checked against its own config (every
    tensor present, of its shape, stored as a float) before any work."""
    return [Checkpoint(folder, adapter_for(config), config) for folder, config in zip(folders, configs)]


def average_groups(
    checkpoints: Sequence[Checkpoint], weights: Sequence[float], dtype: torch.dtype | None = None
) -> Iterator[dict[str, Tensor]]:
    """HF tensors of the plain weighted average, one layer's worth at a time (keys grouped by layer),
    each in ``dtype`` (the written one, ``--dtype``) or else in the first model's stored dtype; a
    sum beyond that dtype's range is refused by name, never written as inf."""
    first, *rest = checkpoints
    for other in rest:
        missing = set(first) ^ set(other)
        if missing:
            raise ValueError(
                f"the checkpoints hold different tensors (e.g. {min(missing)!r}); merge needs one architecture"
            )
    for keys in _by_layer(sorted(first)):
        out = {}
        for key in keys:
            tensors = [first[key]] + [other[key] for other in rest]
            for k, t in enumerate(tensors[1:], 1):
                if t.shape != tensors[0].shape:
                    raise ValueError(
                        f"{key} has shape {tuple(tensors[0].shape)} in {model_name(0, len(tensors))} but {tuple(t.shape)} in {model_name(k, len(tensors))}"
                    )
            ta = tensors[0]
            out[key] = weighted_rows(tensors, weights, into=dtype, key=key) if ta.is_floating_point() else ta
        yield out


def model_name(k: int, count: int) -> str:
    """How messages name model ``k``: A and B for a pair, model 1..M otherwise."""
    return "AB"[k] if count == 2 else f"model {k + 1}"


def weighted_rows(
    tensors: list[Tensor], weights, block: int = 16 << 20, *, into: torch.dtype | None = None, key: str = "a tensor"
) -> Tensor:
    """``sum_k weights[k] tensors[k]`` in float32, stored in ``into`` (default: the first tensor's
    dtype), ~``block`` elements at a time (a vocabulary-sized matrix never needs float32 copies of
    itself). A sum the stored dtype cannot hold (a float32 model's large weights averaged into a
    float16 one's dtype) is refused naming ``key``, as export refuses an overflowing tensor."""
    first = tensors[0]
    dtype = into or first.dtype
    if first.dim() == 0 or first.numel() <= block:
        out = weighted_sum([t.float() for t in tensors], weights).to(dtype)
    else:
        out = torch.empty(first.shape, dtype=dtype)
        rows = max(1, block // max(1, first[0].numel()))
        for start in range(0, first.shape[0], rows):
            part = slice(start, start + rows)
            out[part] = weighted_sum([t[part].float() for t in tensors], weights)
    if dtype.itemsize < 4 and not bool(torch.isfinite(out).all()):  # finite inputs (checked on reading)
        largest = max(float(t.abs().max()) for t in tensors if t.numel())
        raise ParameterError(
            f"{key} overflows {str(dtype).removeprefix('torch.')} in the average (the models' largest magnitude "
            f"there is {largest:.3g}); write it with {{}} float32 or bfloat16",
            "dtype",
        )
    return out


def _by_layer(keys: list[str]) -> Iterator[list[str]]:
    """Keys grouped by layer; every key outside the layers (embedding, head, ...) on its own."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        m = re.search(r"\.(\d+)\.", key)
        groups.setdefault(m.group(0) if m else key, []).append(key)
    yield from groups.values()
