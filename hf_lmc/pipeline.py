"""The merge pipeline: two (or more) checkpoints in, one stock HF checkpoint (with a model card) out.

``merged = (1 - alpha) T_A(A) + alpha T_B(B)``: alpha=0 gives A's function, alpha=1 B's. With
M models (:func:`merge_models`) ``merged = sum_k w_k T_k(theta_k)`` for weights ``w`` on the
simplex; two models through :func:`merge_models` are exactly :func:`merge` with
``alpha = w[1]``.
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoConfig

from .adapters import adapter_for
from .alignment import DATA_METHODS, TRAINED_METHODS, LearnOptions, align_many, check_method
from .barriers import BarrierResult, SimplexBarrierResult, barrier_of_loaded, plot, plot_simplex, simplex_barrier_of_loaded
from .canonical import block_rows, canonicalize, combine, export_config, hf_state_dict_groups, simplex_weights, weighted_sum
from .card import inherited_license, merge_card
from .checkpoint import Checkpoint
from .devices import compute_device
from .evaluation import EvalOptions, describe_data, load_batches
from .export import write_checkpoint
from .hub import push_folder, resolve_checkpoint
from .loading import load_model, revisions_per_model
from .symmetry import Transform, resolve_kinds
from .widths import common_spec, describe, to_common_shape

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MergeResult:
    """Where the merge went, and what was measured on the way."""

    output: Path
    method: str
    alpha: float | None  # the weight of the second model when there are two; None for more
    barrier: BarrierResult | SimplexBarrierResult | None = None
    url: str | None = None
    weights: tuple[float, ...] = ()  # one per model, summing to 1


_HARDENED = (
    "MLP permutations were learned as Sinkhorn soft permutations and hardened (linear assignment) "
    "before export, so the merged weights apply exact permutations of each model."
)
_ENSEMBLE = (
    "The transforms were trained toward the models' own predictions mixed at the same weights "
    "(objective `ensemble`), not toward the training data's labels."
)


def _training_notes(method: str, learn: LearnOptions) -> list[str]:
    """Model-card notes on how a trained method's transforms were learned."""
    if method not in TRAINED_METHODS:
        return []
    notes = [_HARDENED] if learn.permutations == "sinkhorn" else []
    if learn.objective == "ensemble":
        notes.append(_ENSEMBLE)
    if learn.input_noise:
        notes.append(
            f"The transforms were trained on images with Gaussian noise of std {learn.input_noise:g} added afresh at every step."
        )
    return notes


def _training_settings(method: str, learn: LearnOptions, count: int, data, data_options: EvalOptions) -> list[tuple[str, str]] | None:
    """The card's table of how a trained method's transforms were learned: enough to run it again."""
    if method not in TRAINED_METHODS:
        return None
    shape = f"batches of {data_options.batch_size}" + (f" × {data_options.seq_len} tokens" if data_options.seq_len else "")
    if data_options.max_batches:
        shape += f", at most {data_options.max_batches} of them"
    schedule = learn.schedule + (f", {learn.warmup} warmup steps" if learn.warmup else "")
    rows = [
        ("data", f"{describe_data(data)} (split `{data_options.split}`, {shape})"),
        ("steps", f"{learn.steps} (gradient accumulation {learn.gradient_accumulation_steps}, mixed precision `{learn.mixed_precision}`)"),
        ("optimiser", f"Adam, lr {learn.lr:g}" + (f", residual maps {learn.residual_lr:g}" if learn.residual_lr else "") + f", schedule `{schedule}`"),
        ("parameterisation", f"permutations `{learn.permutations}`, residual map `{learn.orthogonal}`, frame `{learn.frame}`"),
    ]
    if count == 2:
        low, high = learn.lambda_range
        near = "the path's worst point" if learn.focus == "worst" else "the points above the line, by their excess"
        rows.append(("λ draws", f"{1 - learn.worst_fraction:g} from U({low:g}, {high:g}), {learn.worst_fraction:g} near {near}"))
    else:
        rows.append(("weight draws", f"Dirichlet({learn.concentration:g} · 1)"))
    rows.append(("objective", f"`{learn.objective}`" + (f", input noise std {learn.input_noise:g}" if learn.input_noise else "")))
    rows.append(("seed", "not set (torch's RNG as it stood)" if learn.seed is None else str(learn.seed)))
    return rows


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


def _average_groups(folders: Sequence[Path], config, weights: Sequence[float]) -> Iterator[dict[str, Tensor]]:
    """HF tensors of the plain weighted average, one layer's worth at a time (keys grouped by layer)."""
    adapter = adapter_for(config)
    first, *rest = (Checkpoint(folder, adapter) for folder in folders)
    for other in rest:
        missing = set(first) ^ set(other)
        if missing:
            raise ValueError(f"the checkpoints hold different tensors (e.g. {sorted(missing)[0]!r}); merge needs one architecture")
    for keys in _by_layer(sorted(first)):
        out = {}
        for key in keys:
            tensors = [first[key]] + [other[key] for other in rest]
            for k, t in enumerate(tensors[1:], 1):
                if t.shape != tensors[0].shape:
                    raise ValueError(f"{key} has shape {tuple(tensors[0].shape)} in {_model_name(0, len(tensors))} but {tuple(t.shape)} in {_model_name(k, len(tensors))}")
            ta = tensors[0]
            out[key] = _weighted_rows(tensors, weights) if ta.is_floating_point() else ta
        yield out


def _model_name(k: int, count: int) -> str:
    """How messages name model ``k``: A and B for a pair, model 1..M otherwise."""
    return "AB"[k] if count == 2 else f"model {k + 1}"


def _weighted_rows(tensors: list[Tensor], weights, block: int = 16 << 20) -> Tensor:
    """``sum_k weights[k] tensors[k]`` in float32, stored in the first tensor's dtype, ~``block``
    elements at a time (a vocabulary-sized matrix never needs float32 copies of itself)."""
    first = tensors[0]
    if first.dim() == 0 or first.numel() <= block:
        return weighted_sum([t.float() for t in tensors], weights).to(first.dtype)
    out = torch.empty_like(first)
    rows = max(1, block // max(1, first[0].numel()))
    for start in range(0, first.shape[0], rows):
        part = slice(start, start + rows)
        out[part] = weighted_sum([t[part].float() for t in tensors], weights)
    return out


def _by_layer(keys: list[str]) -> Iterator[list[str]]:
    """Keys grouped by layer; every key outside the layers (embedding, head, ...) on its own."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        m = re.search(r"\.(\d+)\.", key)
        groups.setdefault(m.group(0) if m else key, []).append(key)
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
    device: str | torch.device | None = None,
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
        device: where weight matching's products and the export's transforms and sums run
            (default: the current CUDA device when there is one, else the CPU); the files are
            read and written on the CPU, one layer at a time.
    """
    if not 0.0 <= alpha <= 1.0 or math.isnan(alpha):
        raise ValueError(f"--alpha must lie in [0, 1], got {alpha}")
    return merge_models(
        [model_a, model_b], output, weights=(1 - alpha, alpha), method=method, symmetries=symmetries, data=data,
        data_options=data_options, learn=learn, revisions=(revision_a, revision_b), dtype=dtype, shard_size=shard_size,
        eval_data=eval_data, eval_options=eval_options, alphas=alphas, push_to_hub=push_to_hub, private=private,
        overwrite=overwrite, progress=progress, api=api, device=device,
    )


def merge_models(
    models: Sequence[str | Path],
    output: str | Path,
    *,
    weights: Sequence[float] | None = None,
    method: str = "weight",
    symmetries="full",
    data=None,
    data_options: EvalOptions = EvalOptions(split="train"),
    learn: LearnOptions = LearnOptions(),
    revisions: Sequence[str | None] | None = None,
    dtype: str | torch.dtype | None = None,
    shard_size: str | int = "5GB",
    eval_data=None,
    eval_options: EvalOptions = EvalOptions(),
    alphas: int | None = None,
    push_to_hub: str | None = None,
    private: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    api=None,
    device: str | torch.device | None = None,
) -> MergeResult:
    """Merge M >= 2 checkpoints of one architecture into ``sum_k w_k T_k(theta_k)``, written as a
    stock HF folder to ``output``.

    Args:
        models: local folders or Hub ids; the first one's config, tokenizer and dtype are used.
        weights: one per model, >= 0, summing to 1 (default: uniform).
        method: ``"average"`` (vanilla), ``"weight"`` (data-free; universe matching for more
            than two models), ``"learned"`` or ``"dual"`` (transforms trained on ``data`` at
            ``w ~ Dirichlet(learn.concentration * 1)``; ``learned`` keeps the first model's
            transform fixed, ``dual`` trains all), and for two models ``"activation"``.
            See :mod:`hf_lmc.alignment`.
        revisions: Hub revision per model (``None`` entries: the default branch).
        alphas: evaluation grid: points per edge of the simplex (default 11 for two models,
            the alpha grid of :func:`merge`; 5 for more).
        The other arguments are those of :func:`merge`. With ``eval_data`` the card gets the
        barrier table (for more than two models: over the simplex grid, its worst point).
    """
    models = list(models)
    count = len(models)
    if count < 2:
        raise ValueError(f"merge needs at least 2 models, got {count}")
    check_method(method, data, count=count)
    weights = simplex_weights(weights, count)
    revisions = revisions_per_model(revisions, count)
    kinds = resolve_kinds(symmetries)
    out_dtype = _dtype(dtype)
    requested_device, device = device, compute_device(device)
    output = Path(output)
    if output.exists() and not overwrite:
        raise FileExistsError(f"{output} already exists; pass --overwrite to replace it")

    folders = [resolve_checkpoint(m, r) for m, r in zip(models, revisions)]
    configs = [AutoConfig.from_pretrained(f) for f in folders]
    width_notes = []
    for k in range(1, count):
        width_notes += _check_same_architecture(configs[0], configs[k], str(models[0]), str(models[k]))
    if width_notes and count > 2:
        raise ValueError(f"models of different widths merge two at a time, got {count} models ({width_notes[0]})")
    config_a, folder_a = configs[0], folders[0]

    # Data problems surface before any long alignment work.
    eval_batches = load_batches(eval_data, config_a, folder_a, eval_options) if eval_data is not None else None
    measured = None
    plot_name = None
    with tempfile.TemporaryDirectory() as scratch:
        transforms = None
        if method == "average" and not width_notes:
            config, groups = config_a, _average_groups(folders, config_a, weights)
            untied, total_groups = False, None
        else:
            # Weight matching reads every layer on `device` from the start; the data methods'
            # matchers place their endpoints themselves (accelerate), from the CPU.
            on = device if method not in DATA_METHODS else None
            canonical = [canonicalize(f, dtype=torch.float32, device=on) for f in folders]
            if width_notes:  # models of two widths: exactly into one shape
                canonical = list(to_common_shape(*canonical, str(models[0]), str(models[1])))
            batches = load_batches(data, config_a, folder_a, data_options) if method in DATA_METHODS else None
            if method == "average":  # two widths: the embedded models, interpolated as they are
                transforms = [Transform() for _ in canonical]
            else:  # float32 copies replace the float64 transforms: their per-head blocks add up on big models.
                transforms = [
                    t.to(torch.float32)
                    for t in align_many(
                        method, canonical, weights, symmetries=kinds, batches=batches, learn=learn, progress=progress,
                        # the learned methods' start, unless asked for, runs where the launch put this process
                        device=device if method not in DATA_METHODS else requested_device,
                    )
                ]
            # Each layer is moved (the data methods' endpoints were read on the CPU), summed on `device`, and written from the CPU.
            merged = combine([t.to(device=device).apply(c.to(device=device)) for t, c in zip(transforms, canonical)], weights)
            out_dtype = out_dtype or _dtype(getattr(config_a, "dtype", None)) or torch.float32
            config = export_config(merged, dtype=out_dtype)  # known: no layer built just to read it
            groups = hf_state_dict_groups(merged, config, block_rows=block_rows(merged.spec))
            total_groups = len(merged.spec.groups())
            untied = bool(getattr(config_a, "tie_word_embeddings", False)) and not config.tie_word_embeddings

        if eval_batches is not None:
            loaded = [load_model(f) for f in folders]
            options = dict(
                methods=("average", method) if method != "average" else ("average",), symmetries=kinds,
                eval_options=eval_options, progress=progress, transforms={method: transforms} if transforms is not None else None,
            )
            if count == 2:
                measured = barrier_of_loaded(*loaded, eval_batches, alphas=alphas or 11, **options)
                plot_name = "loss_along_path.png"
                plot(measured, Path(scratch) / plot_name, title=f"{Path(str(models[0])).name} ↔ {Path(str(models[1])).name}")
            else:
                measured = simplex_barrier_of_loaded(loaded, eval_batches, points=alphas or 5, **options)
                if count == 3:
                    plot_name = "loss_over_simplex.png"
                    plot_simplex(measured, Path(scratch) / plot_name, names=[Path(str(m)).name for m in models])
            del loaded

        card = merge_card(
            base_models=[str(m) for m in models],
            method=method,
            symmetries=sorted(kinds) if method != "average" else [],
            notes=_training_notes(method, learn) + width_notes,
            training=_training_settings(method, learn, count, data, data_options),
            alpha_or_weights=weights[1] if count == 2 else list(weights),
            license=inherited_license(folders),
            model_type=config_a.model_type,
            tied_embeddings_dropped=untied,
            barrier_table=measured.table() if measured else None,
            plot_filename=plot_name,
            repo_hint=push_to_hub or str(output),
        )
        extra = {plot_name: Path(scratch) / plot_name} if plot_name else {}
        write_checkpoint(
            groups, config, output, shard_size=shard_size, dtype=out_dtype, source_folder=folder_a,
            card=card, extra_files=extra, overwrite=overwrite, progress=progress, total_groups=total_groups,
        )
    url = push_folder(output, push_to_hub, private=private, api=api) if push_to_hub else None
    return MergeResult(output, method, weights[1] if count == 2 else None, measured, url, weights)
