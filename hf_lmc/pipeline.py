"""The merge pipeline: two checkpoints in, one stock HF checkpoint (with a model card) out.

``merged = (1 - alpha) T_A(A) + alpha T_B(B)``: alpha=0 gives A's function, alpha=1 B's.
``average`` interpolates the stored parameters as they are (the vanilla baseline); the other
methods (:mod:`hf_lmc.alignment`) interpolate canonical forms after aligning the models. Reading
and writing stream layer by layer from the checkpoints (learned and dual matching hold both
models in memory while they train), and the output is written to a temporary folder and
renamed at the end.
"""

from __future__ import annotations

import logging
import math
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig

from .adapters import adapter_for
from .alignment import DATA_METHODS, TRAINED_METHODS, LearnOptions, align, check_method
from .barriers import BarrierResult, barrier_of_loaded, plot
from .canonical import canonicalize, export_config, hf_state_dict_groups, interpolate
from .card import inherited_license, merge_card
from .checkpoint import Checkpoint
from .evaluation import EvalOptions, load_batches
from .export import write_checkpoint
from .hub import push_folder, resolve_checkpoint
from .loading import load_model
from .symmetry import Transform, resolve_kinds
from .widths import common_spec, describe, to_common_shape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeResult:
    """Where the merge went, and what was measured on the way."""

    output: Path
    method: str
    alpha: float
    barrier: BarrierResult | None = None
    url: str | None = None


_HARDENED = (
    "MLP permutations were learned as Sinkhorn soft permutations and hardened (linear assignment) "
    "before export, so the merged weights apply exact permutations of each model."
)


def _dtype(name: str | torch.dtype | None) -> torch.dtype | None:
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


def _check_same_architecture(config_a, config_b, a: str, b: str) -> list[str]:
    """Fail on models no merge covers; the card notes for models of two widths (none for one)."""
    if config_a.model_type != config_b.model_type:
        raise ValueError(f"{a} is a {config_a.model_type} model but {b} is a {config_b.model_type} model; merge needs one architecture")
    spec_a, spec_b = adapter_for(config_a).spec(config_a), adapter_for(config_b).spec(config_b)
    common = common_spec(spec_a, spec_b, a, b)  # one line naming what no width embedding covers
    return [f"{name} was {describe(spec, common)}." for name, spec in ((a, spec_a), (b, spec_b)) if spec != common]


def _average_groups(folder_a: Path, folder_b: Path, config, alpha: float) -> Iterator[dict[str, Tensor]]:
    """HF tensors of the plain average, one layer's worth at a time (keys grouped by layer)."""
    adapter = adapter_for(config)
    a, b = Checkpoint(folder_a, adapter), Checkpoint(folder_b, adapter)
    missing = set(a) ^ set(b)
    if missing:
        raise ValueError(f"the checkpoints hold different tensors (e.g. {sorted(missing)[0]!r}); merge needs one architecture")
    for keys in _by_layer(sorted(a)):
        out = {}
        for key in keys:
            ta, tb = a[key], b[key]
            if ta.shape != tb.shape:
                raise ValueError(f"{key} has shape {tuple(ta.shape)} in A but {tuple(tb.shape)} in B")
            out[key] = torch.lerp(ta.float(), tb.float(), alpha).to(ta.dtype) if ta.is_floating_point() else ta
        yield out


def _by_layer(keys: list[str]) -> Iterator[list[str]]:
    groups: dict[str, list[str]] = {}
    for key in keys:
        m = re.search(r"\.(\d+)\.", key)
        groups.setdefault(m.group(0) if m else "", []).append(key)
    yield from groups.values()


def merge(
    model_a: str | Path,
    model_b: str | Path,
    output: str | Path,
    *,
    method: str = "weight",
    alpha: float = 0.5,
    symmetries="full",
    data=None,
    data_options: EvalOptions = EvalOptions(split="train"),
    learn: LearnOptions = LearnOptions(),
    revision_a: str | None = None,
    revision_b: str | None = None,
    dtype: str | torch.dtype | None = None,
    shard_size: str | int = "5GB",
    eval_data=None,
    eval_options: EvalOptions = EvalOptions(),
    alphas: int = 11,
    push_to_hub: str | None = None,
    private: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    api=None,
) -> MergeResult:
    """Merge two checkpoints of one architecture and write a stock HF folder to ``output``.

    Args:
        model_a, model_b: local folders or Hub ids.
        method: ``"weight"`` (data-free), ``"activation"``, ``"learned"`` or ``"dual"``
            (align, then interpolate; see :mod:`hf_lmc.alignment`) or ``"average"`` (vanilla).
        alpha: interpolation weight of B in [0, 1].
        symmetries: ``"full"`` or ``"permutation"``: the group the alignment searches.
        data: calibration data (activation) or training data (learned, dual), in any form
            :func:`hf_lmc.evaluation.load_batches` reads; batched with ``data_options``.
        learn: steps, learning rate and parametrisations of learned and dual matching.
        dtype: dtype of the written weights (default: A's).
        shard_size: maximum shard size (``"5GB"``, ``"500MB"`` or bytes).
        eval_data: if given, the barrier table and a loss-along-path plot are computed on it
            and go into the model card.
        push_to_hub: repo id to upload the folder to (``private`` for a private repo).
        overwrite: replace an existing ``output`` folder.
    """
    check_method(method, data)
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"--alpha must lie in [0, 1], got {alpha}")
    kinds = resolve_kinds(symmetries)
    out_dtype = _dtype(dtype)
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")

    folder_a, folder_b = resolve_checkpoint(model_a, revision_a), resolve_checkpoint(model_b, revision_b)
    config_a, config_b = AutoConfig.from_pretrained(folder_a), AutoConfig.from_pretrained(folder_b)
    width_notes = _check_same_architecture(config_a, config_b, str(model_a), str(model_b))

    # Data problems surface before any long alignment work.
    eval_batches = load_batches(eval_data, config_a, folder_a, eval_options) if eval_data is not None else None
    measured = None
    plot_name = None
    with tempfile.TemporaryDirectory() as scratch:
        transforms = None
        if method == "average" and not width_notes:
            config, groups = config_a, _average_groups(folder_a, folder_b, config_a, alpha)
            untied = False
        else:
            a, b = canonicalize(folder_a, dtype=torch.float32), canonicalize(folder_b, dtype=torch.float32)
            a, b = to_common_shape(a, b, str(model_a), str(model_b))  # models of two widths: exactly into one shape
            batches = load_batches(data, config_a, folder_a, data_options) if method in DATA_METHODS else None
            if method == "average":  # two widths: the embedded models, interpolated as they are
                transforms = (Transform(), Transform())
            else:  # float32 copies replace the float64 transforms: their per-head blocks add up on big models.
                transforms = tuple(
                    t.to(torch.float32) for t in align(method, a, b, symmetries=kinds, batches=batches, learn=learn, progress=progress)
                )
            transform_a, transform_b = transforms
            merged = interpolate(transform_a.apply(a), transform_b.apply(b), alpha)
            config = export_config(merged)
            out_dtype = out_dtype or _dtype(getattr(config_a, "dtype", None)) or torch.float32
            groups = hf_state_dict_groups(merged, config)
            untied = bool(getattr(config_a, "tie_word_embeddings", False)) and not config.tie_word_embeddings

        if eval_batches is not None:
            loaded = [load_model(f) for f in (folder_a, folder_b)]
            measured = barrier_of_loaded(
                *loaded, eval_batches, methods=("average", method) if method != "average" else ("average",),
                alphas=alphas, symmetries=kinds, eval_options=eval_options, progress=progress,
                transforms={method: transforms} if transforms is not None else None,
            )
            del loaded
            plot_name = "loss_along_path.png"
            plot(measured, Path(scratch) / plot_name, title=f"{Path(str(model_a)).name} ↔ {Path(str(model_b)).name}")

        card = merge_card(
            base_models=[str(model_a), str(model_b)],
            method=method,
            symmetries=sorted(kinds) if method != "average" else [],
            notes=([_HARDENED] if method in TRAINED_METHODS and learn.permutations == "sinkhorn" else []) + width_notes,
            alpha_or_weights=alpha,
            license=inherited_license([folder_a, folder_b]),
            model_type=config_a.model_type,
            tied_embeddings_dropped=untied,
            barrier_table=measured.table() if measured else None,
            plot_filename=plot_name,
            repo_hint=push_to_hub or str(output),
        )
        extra = {plot_name: Path(scratch) / plot_name} if plot_name else {}
        write_checkpoint(
            groups, config, output, shard_size=shard_size, dtype=out_dtype, source_folder=folder_a,
            card=card, extra_files=extra, overwrite=overwrite, progress=progress,
        )
    url = push_folder(output, push_to_hub, private=private, api=api) if push_to_hub else None
    return MergeResult(output, method, alpha, measured, url)
