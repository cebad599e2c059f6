"""The merge pipeline: two (or more) checkpoints in, one stock HF checkpoint (with a model card) out.

``merged = (1 - alpha) T_A(A) + alpha T_B(B)``: alpha=0 gives A's function, alpha=1 B's. With
M models ``merged = sum_k w_k T_k(theta_k)`` for weights ``w`` on the simplex; two models
through :func:`merge_models` are exactly :func:`merge` with ``alpha = w[1]``.

One frozen :class:`~hf_lmc.config.options.MergeRequest` drives the stages of :func:`run`:

* :func:`resolve` checks the settings and that the push can be made, finds each model's folder and
  config, loads the evaluation data;
* :func:`align` aligns the models by the method's registry entry (``average`` of models of one
  shape interpolates the stored parameters; every other method the aligned canonical forms) and
  sets up the merged tensors, computed layer by layer as they are read;
* :func:`measure` evaluates the barrier (when there is evaluation data) for the model card;
* :func:`write` writes the card and the checkpoint to a temporary folder, renamed at the end;
* then the folder is pushed to the Hub when asked.

:func:`plan` is the dry run: every refusal of those stages that needs no merge computed (the
weights' values and range among them: :func:`check_weights`), and the cost estimated.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_lmc.canonical.adapters import adapter_for, read_config
from hf_lmc.canonical.form import (
    CanonicalModel,
    block_rows,
    canonicalize,
    combine,
    export_config,
    hf_state_dict_groups,
)
from hf_lmc.canonical.spec import ArchSpec
from hf_lmc.canonical.widths import check_mergeable, to_common_shape
from hf_lmc.config.methods import METHODS
from hf_lmc.config.options import (
    DEFAULT_ALPHA,
    PATH_POINTS,
    SIMPLEX_POINTS,
    MergeRequest,
    ParameterError,
    pair_weights,
    revisions_per_model,
    simplex_weights,
)
from hf_lmc.evaluation.barriers import (
    BarrierResult,
    SimplexBarrierResult,
    barrier_of_loaded,
    plot,
    plot_simplex,
    simplex_barrier_of_loaded,
)
from hf_lmc.evaluation.batches import describe_data, fitting_batches, is_sampled, load_batches, sampled_count
from hf_lmc.evaluation.grids import simplex_grid
from hf_lmc.io.card import (
    ModelSource,
    eval_source,
    inherited_license,
    merge_card,
    merge_settings,
    settings_markdown,
    training_notes,
    training_settings,
)
from hf_lmc.io.checkpoint import Checkpoint
from hf_lmc.io.export import check_writable, dtype_named, stored_dtype, write_checkpoint
from hf_lmc.io.fingerprint import fingerprint
from hf_lmc.io.hub import check_push, push_folder, pushed_repo, resolve_checkpoint, shown_reference
from hf_lmc.io.inherit import check_inherited, shown_names
from hf_lmc.io.loading import load_model
from hf_lmc.io.outputs import check_apart
from hf_lmc.io.weights import CheckpointError, weight_files
from hf_lmc.merging.alignment import matcher_for
from hf_lmc.merging.average import average_groups, model_name, open_checkpoints
from hf_lmc.merging.preflight import check_request, merge_request
from hf_lmc.symmetry import Transform, resolve_kinds
from hf_lmc.symmetry.stored import FORMAT as TRANSFORMS_FORMAT
from hf_lmc.symmetry.stored import TRANSFORMS_FILE, manifest_path, save_transforms
from hf_lmc.utils.devices import compute_device, launched_processes, wait_for_others
from hf_lmc.utils.progress import bar as progress_bar

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
    stopping: object | None = (
        None  # learned and dual matching: what the stopping rule reached (matching.training.Stopping)
    )
    wrote: bool = True  # False on every launched process but the main one, which writes (and reports) the merge


def _verified_at_end(groups: Iterator, sources: Sequence[Checkpoint]) -> Iterator:
    """``groups``, then a check that no input file changed while they were computed: it runs as
    the export asks for a group past the last, before the output is put in place, so an input
    replaced mid-merge fails the merge and leaves no output."""
    yield from groups
    for checkpoint in sources:
        checkpoint.verify_unchanged()


def merge(
    model_a: str | Path,
    model_b: str | Path,
    output: str | Path,
    *,
    alpha: float = DEFAULT_ALPHA,
    revision_a: str | None = None,
    revision_b: str | None = None,
    progress: bool = True,
    api=None,
    **settings,
) -> MergeResult:
    """Merge two checkpoints of one architecture into ``(1 - alpha) T_A(A) + alpha T_B(B)`` and
    write a stock HF folder to ``output``.

    Args:
        model_a, model_b: local folders or Hub ids (``revision_a``, ``revision_b``: Hub revisions).
        alpha: interpolation weight of B in [0, 1]: 0 gives A's function, 1 B's.
        progress: show progress bars.
        api: stands in for ``huggingface_hub.HfApi`` when pushing.
        settings: any field of :class:`hf_lmc.config.options.MergeRequest` but the models, weights and
            revisions: ``method`` (``"weight"``, the default; see :mod:`hf_lmc.config.methods`),
            ``symmetries``, ``device``, ``data`` and ``data_options`` (fitting data),
            ``learn`` and ``accelerate`` (learned and dual matching), ``eval_data``,
            ``eval_options`` and ``alphas`` (the barrier in the card), and the output settings
            ``dtype``, ``shard_size``, ``push_to_hub``, ``private``, ``overwrite``, and what the
            merge carries besides its weights: ``tokenizer_from`` (whose tokenizer) and
            ``inherit_from_a`` (A's files where B's differ).
    """
    return merge_models(
        [model_a, model_b],
        output,
        weights=pair_weights(alpha),
        revisions=(revision_a, revision_b),
        progress=progress,
        api=api,
        **settings,
    )


def merge_models(
    models: Sequence[str | Path], output: str | Path, *, progress: bool = True, api=None, **settings
) -> MergeResult:
    """Merge M >= 2 checkpoints of one architecture into ``sum_k w_k T_k(theta_k)``, written as a
    stock HF folder to ``output``.

    ``settings`` are the fields of :class:`hf_lmc.config.options.MergeRequest`: ``weights`` (one per
    model, >= 0, summing to 1; default uniform), ``revisions`` (one per model), ``method``
    (``"weight"`` is universe matching for more than two models; ``"learned"`` and ``"dual"``
    refine it on ``data`` at weights ``w ~ Dirichlet(learn.concentration * 1)``, ``learned``
    keeping the first model's transform fixed), and the rest as for :func:`merge`. Two models
    through here are exactly :func:`merge` with ``alpha = weights[1]``. With ``eval_data`` the
    card gets the barrier table (for more than two models: over the simplex grid, its worst point).
    """
    return run(merge_request(list(models), output, **settings), progress=progress, api=api)


def run(request: MergeRequest, *, progress: bool = True, api=None) -> MergeResult:
    """Carry out one merge: resolve → align → measure → write → push.

    Measuring comes before writing because the barrier goes into the model card, which is
    written with the weights; nothing is written until every earlier stage has succeeded.
    Under a launcher (``torchrun``, ``accelerate launch``) every process checks the inputs;
    learned and dual matching train on all of them (DDP, each fitting batch split across them),
    the other methods align on the main process alone, and the main process alone measures,
    writes and pushes while the others wait: one output, as a one-process run writes it.
    """
    processes = launched_processes()
    main = processes is None or processes.is_main_process
    inputs = resolve(request, progress=progress and main, api=api, push_check=main)
    wait_for_others(processes)  # every process has checked the output before any writes it
    aligned, measured, url = None, Measured(), None
    try:
        if main or METHODS[request.method].trained:  # learned and dual matching train on every process (DDP)
            aligned = align(request, inputs, progress=progress and main)
        if main:
            with tempfile.TemporaryDirectory() as scratch:
                measured = measure(request, inputs, aligned, Path(scratch), progress=progress)
                write(request, inputs, aligned, measured, progress=progress, scratch=Path(scratch))
            url = (
                push_folder(Path(request.output), inputs.push_to_hub, private=request.private, api=api)
                if inputs.push_to_hub
                else None
            )
    finally:  # a failure on the main process still releases the others (the launcher then reports it)
        wait_for_others(processes)
    count = len(request.models)
    return MergeResult(
        Path(request.output),
        request.method,
        inputs.weights[1] if count == 2 else None,
        measured.result,
        url,
        inputs.weights,
        aligned.stopping if aligned is not None else None,
        main,
    )


@dataclass(frozen=True)
class Inputs:
    """What :func:`resolve` found: checked settings, local folders and configs, evaluation batches."""

    weights: tuple[float, ...]
    kinds: frozenset[str]
    device: torch.device
    out_dtype: torch.dtype | None
    folders: list[Path]
    revisions: list[str | None]
    configs: list
    width_notes: list[str]
    eval_batches: list | None
    fit_batches: list | None
    #: What B's tokenizer, processor, labels or config differ in, harmlessly or accepted.
    inherited_notes: tuple[str, ...] = ()
    #: The Hub repo the merge is pushed to, with its namespace (a bare name is the token's user's).
    push_to_hub: str | None = None


def resolve(request: MergeRequest, *, progress: bool = True, api=None, push_check: bool = True) -> Inputs:
    """Check the settings, that the push can be made (with ``push_check``: the process that
    pushes; ``api`` stands in for ``HfApi``), find every model's folder and config, and load the
    evaluation data: every problem a user can fix surfaces here, before any long alignment work."""
    count = len(request.models)
    written = check_request(request)  # what the command line checked before importing this module
    push_to_hub = request.push_to_hub
    if push_to_hub and push_check:  # before any download: a merge is never computed to fail at its push
        push_to_hub = pushed_repo(push_to_hub, check_push(push_to_hub, api=api))
    weights = simplex_weights(request.weights, count)
    revisions = revisions_per_model(request.revisions, count)
    kinds = resolve_kinds(request.symmetries)
    out_dtype = dtype_named(request.dtype)
    device = compute_device(request.device)
    output = Path(request.output)
    folders, configs, width_notes, inherited_notes = _read_models(request, revisions, written)
    check_writable(output, _written_bytes(folders, configs, out_dtype))
    eval_batches = (
        load_batches(request.eval_data, configs[0], folders[0], request.eval_options)
        if request.eval_data is not None
        else None
    )
    needs_data = METHODS[request.method].needs_data
    fit_batches = None
    if needs_data:  # sampled data: each model on the compute device in turn
        models = [lambda folder=folder: load_model(folder).model.to(device) for folder in folders]
        fit_batches = fitting_batches(
            request.data, configs[0], folders[0], request.data_options, models=models, progress=progress
        )
    if eval_batches is not None:
        logger.info("evaluation data %s: %d batches", describe_data(request.eval_data), len(eval_batches))
    return Inputs(
        weights,
        kinds,
        device,
        out_dtype,
        folders,
        list(revisions),
        configs,
        width_notes,
        eval_batches,
        fit_batches,
        inherited_notes,
        push_to_hub,
    )


def _read_models(
    request: MergeRequest, revisions: Sequence[str | None], written: Sequence[tuple[Path, str]], *, weights: bool = True
) -> tuple[list[Path], list, list[str], tuple[str, ...]]:
    """Every model's folder (a Hub model downloaded, with its weights unless ``weights`` is
    false) and config, checked apart from the ``written`` folders, mergeable with the first, and
    with what the merge inherits from the first checked: ``(folders, configs, width notes,
    inherited notes)``."""
    count = len(request.models)
    folders = [resolve_checkpoint(m, r, weights=weights) for m, r in zip(request.models, revisions)]
    for path, what in written:  # and as resolved (a Hub snapshot)
        check_apart(path, folders, what)
    configs = [read_config(f) for f in folders]
    for k, (model, folder, config) in enumerate(zip(request.models, folders, configs)):
        logger.info(
            "%s: %s (%s)%s",
            model_name(k, count),
            model,
            config.model_type,
            "" if str(folder) == str(model) else f" from {folder}",
        )
    width_notes = []
    for k in range(1, count):
        width_notes += check_mergeable(configs[0], configs[k], request.models[0], request.models[k])
    if width_notes and count > 2:
        raise ValueError(f"models of different widths merge two at a time, got {count} models ({width_notes[0]})")
    names = shown_names(request.models, request.labels)
    tokenizer_from = None if request.tokenizer_from is None else request.tokenizer_model
    inherited_notes = tuple(
        check_inherited(folders, configs, names, inherit_from_a=request.inherit_from_a, tokenizer_from=tokenizer_from)
    )
    return folders, configs, width_notes, inherited_notes


#: What the dry run's estimates scale from, each measured on 2 CPU cores and recorded with its
#: derivation in docs/decisions.md#d-dry-run-estimates: seconds per billion parameters of the plain
#: average and of weight matching, the machine's FLOP/s in a forward and backward pass, the passes
#: a learned or dual step costs, and the runtime's own memory.
_SECONDS_PER_BILLION = {"average": 17.0, "weight": 100.0}
_FLOPS = 1.4e11
_STEP_PASSES = 2.65
_RUNTIME_BYTES = 0.42e9
#: The start-up every command that loads a model pays before its work, measured on 2 CPU cores
#: by ``benchmarks/startup.py`` (benchmarks/results/startup-20261207-054729.json): the
#: interpreter and the imports (5.9 s), and ``from_pretrained`` of weights loaded whole (0.27 s
#: per GB from the file cache) where the merge loads models whole (the barrier, fitting data).
_STARTUP_SECONDS = 6.0
_LOAD_SECONDS_PER_GB = 0.27


@dataclass(frozen=True)
class Plan:
    """What :func:`run` would do with a request, as :func:`plan` found it: the models, the data's
    batches and rough estimates of the output's size, the peak memory and the time."""

    request: MergeRequest
    weights: tuple[float, ...]
    models: list[tuple[str, str, int, str]]  # per model: as given, model type, parameters, stored dtype
    notes: list[str]
    eval_batches: tuple[int, int] | None  # batches and tokens in all
    fit_batches: tuple[int, int] | None
    written_bytes: int
    peak_bytes: int
    seconds: float
    unchecked: tuple[str, ...] = ()  # what the dry run did not check, as the table states it
    push_user: str | None = None  # whose token the push would use, checked with the Hub
    unread: tuple[str, ...] = ()  # the Hub models whose weights are not here, so not read

    def table(self) -> str:
        """The plan as the command line prints it."""
        request, count = self.request, len(self.models)
        read = "the weights here" if self.unread else "every weight"
        lines = [f"dry run: configs, tokenizers, tensor headers, {read} and the data read; nothing written"]
        for k, (name, model_type, parameters, dtype) in enumerate(self.models):
            lines.append(f"  {model_name(k, count)}: {name} ({model_type}, {_counted(parameters)} parameters, {dtype})")
        how = f"alpha {self.weights[1]:g}" if count == 2 else "weights " + " ".join(f"{w:g}" for w in self.weights)
        lines.append(
            f"  method: {request.method}"
            + ("" if request.method == "average" else f" (symmetries {request.symmetries})")
            + f", {how}"
        )
        for what, data, batches in (
            ("fitting data", request.data, self.fit_batches),
            ("evaluation data", request.eval_data, self.eval_batches),
        ):
            if batches is not None:
                sampled = " to be sampled" if is_sampled(data) else ""
                shown = f"{batches[0]} batches, {_counted(batches[1])} tokens{sampled}"
                lines.append(f"  {what}: {describe_data(data)} ({shown})")
            elif data is not None:
                lines.append(f"  {what}: {describe_data(data)} (not read: method {request.method} fits on no data)")
        output = Path(request.output)
        lines.append(
            f"  output: {output} ({'replaced' if output.exists() else 'new'})"
            + (f", pushed to {pushed_repo(request.push_to_hub, self.push_user)}" if request.push_to_hub else "")
            + (f" as {self.push_user}" if self.push_user else "")
        )
        lines += [f"  note: {note}" for note in self.notes]
        lines += [f"  not checked: {what}" for what in self.unchecked]
        lines.append(
            f"  estimates: ~{_gigabytes(self.written_bytes)} on disk, peak memory ~{_gigabytes(self.peak_bytes)}, "
            f"~{_duration(self.seconds)} on 2 CPU cores (a GPU is faster)"
        )
        lines.append(
            "  (size: the parameters in the written dtype; memory and time scaled from docs/decisions.md#d-dry-run-estimates)"
        )
        return "\n".join(lines)


def plan(request: MergeRequest, *, progress: bool = True, api=None) -> Plan:
    """Check ``request`` as :func:`run` does before it aligns, and refuse what it would refuse
    without computing the merge (settings, outputs, the push: :func:`~hf_lmc.io.hub.check_push`, with
    ``api`` standing in for ``HfApi``; every model's config, tensor headers and weights:
    :func:`check_weights`; what the merge inherits, room on disk, the data), writing nothing, and
    estimate what the merge costs (see :data:`_SECONDS_PER_BILLION`). A Hub model's config and
    tokenizer are downloaded, not its weights (those already here are checked); ``sampled`` fitting
    data is not sampled. The plan lists what was not checked."""
    count = len(request.models)
    written = check_request(request)
    push_user = check_push(request.push_to_hub, api=api) if request.push_to_hub else None
    weights = simplex_weights(request.weights, count)
    revisions = revisions_per_model(request.revisions, count)
    resolve_kinds(request.symmetries)
    out_dtype = dtype_named(request.dtype)
    compute_device(request.device)
    folders, configs, width_notes, inherited_notes = _read_models(request, revisions, written, weights=False)
    here = [_weights_here(model, folder) for model, folder in zip(request.models, folders)]
    unread = [str(model) for model, present in zip(request.models, here) if not present]
    models, stored_bytes, written_bytes = [], [], []
    for name, folder, config, present in zip(request.models, folders, configs, here):
        adapter = adapter_for(config)
        if present:  # headers alone: every tensor present, shaped and float, as the merge opens them
            Checkpoint(folder, adapter, config).close()
        with torch.device("meta"):
            parameters = sum(p.numel() for p in adapter.model_class(config).parameters())
        stored = stored_dtype(config)
        tied = (
            config.vocab_size * config.hidden_size if getattr(config, "tie_word_embeddings", False) else 0
        )  # written twice
        models.append((str(name), config.model_type, parameters, str(stored).removeprefix("torch.")))
        stored_bytes.append(parameters * stored.itemsize)
        written_bytes.append((parameters + tied) * (out_dtype or stored).itemsize)
    check_writable(Path(request.output), max(written_bytes))
    entry = METHODS[request.method]
    eval_batches = fit_batches = None
    if request.eval_data is not None:
        eval_batches = _batches_and_tokens(
            load_batches(request.eval_data, configs[0], folders[0], request.eval_options), configs[0]
        )
    if entry.needs_data and not is_sampled(request.data):
        fit_batches = _batches_and_tokens(
            load_batches(request.data, configs[0], folders[0], request.data_options), configs[0]
        )
    elif entry.needs_data:  # as many sequences as would be sampled, each of the fitting sequence length
        sequences = sampled_count(request.data_options)
        fit_batches = (
            -(-sequences // request.data_options.batch_size),
            sequences * _sequence_tokens(configs[0], request.data_options),
        )
    # Every tensor read once, as the merge reads it: the longest check, after the quick ones. The
    # merged tensors' range is estimated from every model's, so only when every model's is here.
    dtype = written_dtype(request.method, out_dtype, configs[0], width_notes) if all(here) else None
    read = [k for k, present in enumerate(here) if present]
    check_weights(
        request.method,
        [folders[k] for k in read],
        [configs[k] for k in read],
        [weights[k] for k in read],
        width_notes,
        dtype,
        every_model=all(here),
        progress=progress,
    )
    evaluation = None
    if eval_batches is not None:
        grid = request.alphas if request.alphas is not None else (PATH_POINTS if count == 2 else SIMPLEX_POINTS)
        evaluation = (len(grid) if isinstance(grid, tuple) else len(simplex_grid(count, grid)), eval_batches[1])
    seconds, peak = estimate_cost(
        request.method,
        [model[2] for model in models],
        stored_bytes,
        fit_batches=fit_batches,
        steps=request.learn.steps,
        evaluation=evaluation,
    )
    return Plan(
        request,
        weights,
        models,
        width_notes + list(inherited_notes),
        eval_batches,
        fit_batches,
        max(written_bytes),
        peak,
        seconds,
        unchecked=tuple(_unchecked(request, width_notes, unread)),
        push_user=push_user,
        unread=tuple(unread),
    )


def _weights_here(model, folder: Path) -> bool:
    """Whether the dry run reads ``model``'s weights: always for a local folder (whose missing
    weights it refuses, as the merge does), and for a Hub model only where every file the merge
    would read is already in its snapshot (a dry run downloads no weights)."""
    if Path(str(model)).exists():
        return True
    try:
        weight_files(folder)
    except CheckpointError:
        return False
    return True


def _unchecked(request: MergeRequest, width_notes: Sequence[str], remote: Sequence[str]) -> list[str]:
    """What a dry run of ``request`` did not check, as the plan states it: the merge's own numbers
    always, the weights of the Hub models in ``remote`` (not downloaded), sampled fitting data."""
    entry = METHODS[request.method]
    numbers = [] if request.method == "average" and not width_notes else ["the alignment"]
    numbers += ["the training"] if entry.trained else []
    numbers += ["the merged tensors (their range only estimated)" if not remote else "the merged tensors"]
    numbers += ["the barrier"] if request.eval_data is not None else []
    unchecked = [f"the merge's own numbers: {', '.join(numbers)}"]
    if remote:
        unchecked.append(f"the weights of {', '.join(remote)} (a dry run downloads no weights: their values and range)")
    if entry.needs_data and is_sampled(request.data):
        unchecked.append("the sampled fitting data (not sampled)")
    if request.push_to_hub:
        unchecked.append("the upload itself (the token and the namespace were checked with the Hub)")
    return unchecked


def written_dtype(
    method: str, out_dtype: torch.dtype | None, config_a, width_notes: Sequence[str]
) -> torch.dtype | None:
    """The dtype the merge casts its tensors to as it writes them (:func:`align`): ``out_dtype``
    (``--dtype``) for the plain average of models of one shape (``None``: each tensor in A's stored
    dtype, as read); for every other merge, computed in float32, ``out_dtype`` or A's config's dtype,
    else float32."""
    if method == "average" and not width_notes:
        return out_dtype
    return out_dtype or dtype_named(getattr(config_a, "dtype", None)) or torch.float32


def check_weights(
    method: str,
    folders: Sequence[Path],
    configs: Sequence,
    weights: Sequence[float],
    width_notes: Sequence[str],
    dtype: torch.dtype | None,
    *,
    every_model: bool = True,
    progress: bool = True,
) -> None:
    """Read every tensor of the models in ``folders`` once, as the merge reads it, and refuse what
    the merge refuses on its weights without the merge being computed: a NaN or Inf (the
    checkpoint's own check, in its words), and, where ``dtype`` (:func:`written_dtype`) is given,
    a merged tensor beyond its range (:func:`hf_lmc.io.export.write_checkpoint` refuses it in the
    real run); ``weights`` are the models' weights in the merge.

    The merged tensor's largest magnitude is estimated as ``sum_k w_k max|t_k|`` over the models'
    tensors as the merge combines them (:func:`_tensors_as_merged`): as stored for the plain
    average, else each model's canonical form exported alone, so that its norm gains and shifts
    are folded into the readers by the very code that folds them in the merge. The estimate is
    exact for models that agree and bounds any merge by permutations; transforms that rescale
    (``mlp_scale``, rotations) can move the merged tensors' range either way. A plain average with
    no ``dtype`` keeps each tensor in the first model's dtype, and is checked against it where
    ``every_model`` was read."""
    estimate: dict[str, float] = {}
    streamed = method != "average" or bool(width_notes)  # group by group through the canonical form
    total = sum(len(list(adapter_for(c).spec(c).groups())) for c in configs) if streamed else None
    unit = "group" if streamed else "tensor"
    with progress_bar(total=total, desc="reading weights", unit=unit, show=progress) as counter:
        as_read: dict[str, torch.dtype] = {}  # the first model's dtype per tensor: the average's, with no --dtype
        for weight, folder, config in zip(weights, folders, configs):
            largest: dict[str, float] = {}
            for key, tensor in _tensors_as_merged(method, folder, config, width_notes, counter):
                if tensor.is_floating_point():
                    as_read.setdefault(key, tensor.dtype)
                if tensor.is_floating_point() and tensor.numel():
                    low, high = torch.aminmax(tensor.detach())  # no copy of the tensor, as abs() would make
                    largest[key] = max(largest.get(key, 0.0), -float(low), float(high))
            for key, value in largest.items():
                estimate[key] = estimate.get(key, 0.0) + weight * value
    for key, value in estimate.items():
        as_read_by_a = every_model and method == "average" and not width_notes  # no --dtype: A's dtype, per tensor
        target = dtype or (as_read.get(key) if as_read_by_a else None)
        if target is not None and overflows(value, target):
            raise ParameterError(
                f"{key} would overflow {str(target).removeprefix('torch.')} in the merge (the models' largest "
                f"magnitudes there, weighted, reach {value:.3g}); write it with {{}} bfloat16 or float32",
                "dtype",
            )


def overflows(value: float, dtype: torch.dtype) -> bool:
    """Whether a float32 ``value`` cast to ``dtype`` is no longer finite: the rule
    :func:`hf_lmc.io.export.write_checkpoint` refuses a written tensor by (it rounds, so a value a
    little past the largest finite one still fits)."""
    return not bool(torch.isfinite(torch.tensor(value, dtype=torch.float32).to(dtype)))


def _tensors_as_merged(method: str, folder: Path, config, width_notes: Sequence[str], counter) -> Iterator:
    """``(key, tensor)`` of the model in ``folder`` as the merge combines it, under the key it is
    written as: the stored tensors for the plain average of models of one shape (read through
    :class:`~hf_lmc.io.checkpoint.Checkpoint`, as :func:`align` reads them), else the tensors its
    canonical form (in float32, as the merge computes) exports, the vocabulary in row blocks. A
    tied head is exported too (a merge may untie it). ``counter`` counts the groups."""
    if method == "average" and not width_notes:
        with Checkpoint(folder, adapter_for(config), config) as checkpoint:
            for key in checkpoint:
                yield key, checkpoint[key]
                counter.update(1)
        return
    canonical = canonicalize(folder, dtype=torch.float32)
    adapter, spec = canonical.adapter, canonical.spec
    exported = copy.deepcopy(canonical.config)
    if getattr(exported, "tie_word_embeddings", False):
        exported.tie_word_embeddings = False
    exported = adapter.export_config(exported, {}, {})
    rows = block_rows(spec)
    try:
        with torch.no_grad():
            for group in spec.groups():
                for part in spec.row_blocks(group, rows) or [None]:
                    yield from adapter.hf_group(canonical.group(group, part), exported, spec, group).items()
                counter.update(1)
    finally:
        canonical.source.close()


def estimate_cost(
    method: str,
    parameters: Sequence[int],
    stored_bytes: Sequence[int],
    *,
    fit_batches: tuple[int, int] | None = None,
    steps: int = 0,
    evaluation: tuple[int, int] | None = None,
    flops: float = _FLOPS,
) -> tuple[float, int]:
    """The rough ``(seconds, peak bytes)`` of merging models of these ``parameters`` (one count
    per model) stored in ``stored_bytes`` with ``method``, as :func:`plan` and ``hf-lmc inspect``
    estimate it (:data:`_SECONDS_PER_BILLION`): ``fit_batches`` is ``(batches, tokens)`` of the
    fitting data of a method that reads some, ``steps`` a trained method's steps, ``evaluation``
    ``(points of the grid, tokens)`` of the barrier measured for the card, ``flops`` the
    device's rate for the passes over data. The start-up is included: the interpreter and the
    imports (:data:`_STARTUP_SECONDS`), and loading the models whole where the merge does."""
    entry = METHODS[method]
    count, largest = len(parameters), max(parameters)
    float_bytes = [4 * p for p in parameters]  # float32 copies
    seconds = _STARTUP_SECONDS
    if entry.needs_data or evaluation is not None:  # every model loaded whole (from_pretrained)
        seconds += _LOAD_SECONDS_PER_GB * sum(stored_bytes) / 1e9
    seconds += _SECONDS_PER_BILLION["average" if method == "average" else "weight"] * largest / 1e9 * (count - 1)
    peak = max(stored_bytes)  # streamed layer by layer: under one checkpoint
    if entry.needs_data:
        batches, tokens = fit_batches
        if entry.trained:
            seconds += steps * _STEP_PASSES * 6 * largest * tokens / max(batches, 1) / flops
        else:  # one calibration forward of every model over the fitting data
            seconds += count * 2 * largest * tokens / flops
        peak = max(peak, 2 * sum(float_bytes))
    if evaluation is not None:  # every model loaded, and the path's model in float32
        points, tokens = evaluation
        seconds += (1 if method == "average" else 2) * points * 2 * largest * tokens / flops
        peak = max(peak, sum(stored_bytes) + max(float_bytes))
    return seconds, int(peak + _RUNTIME_BYTES)


def _sequence_tokens(config, options) -> int:
    """Tokens a model reads per sequence: an image's patches and class token, or the sequence
    length (``min(128, the context)`` unless set)."""
    if getattr(config, "image_size", None) and getattr(config, "patch_size", None):
        return (config.image_size // config.patch_size) ** 2 + 1
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 128
    return options.seq_len or min(128, context)


def _batches_and_tokens(batches: list, config) -> tuple[int, int]:
    """How many batches, and the tokens (image patches) in all of them."""
    tokens = 0
    for batch in batches:
        if "input_ids" in batch:
            tokens += batch["input_ids"].numel()
        else:
            tokens += len(batch["pixel_values"]) * _sequence_tokens(config, None)
    return len(batches), tokens


def _counted(number: int) -> str:
    """``1234567`` as ``1.2M``: parameters and tokens as a person reads them."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if number >= scale:
            return f"{number / scale:.1f}{unit}"
    return str(number)


def _gigabytes(size: float) -> str:
    """A size in GB, MB or kB, as a person reads it."""
    return f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB" if size >= 1e5 else f"{size / 1e3:.1f} kB"


def _duration(seconds: float) -> str:
    """A duration in seconds, minutes or hours (at least a second: the estimate is no finer)."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _written_bytes(folders: Sequence[Path], configs: Sequence, out_dtype: torch.dtype | None) -> int:
    """About how many bytes the merge writes: the largest input's weight files, rescaled from
    its stored dtype to the written one (a width merge writes the wider shape), and a tied
    embedding once more (stored once, it is written twice when the export unties it)."""
    sizes = []
    for folder, config in zip(folders, configs):
        stored = stored_dtype(config)  # a dtype name this check does not know: float32; the export will say more
        written = out_dtype or stored
        stored_bytes = sum(f.stat().st_size for f in weight_files(folder))  # the files the merge reads
        if getattr(config, "tie_word_embeddings", False):
            stored_bytes += (
                (getattr(config, "vocab_size", 0) or 0) * (getattr(config, "hidden_size", 0) or 0) * stored.itemsize
            )
        sizes.append(stored_bytes * written.itemsize // stored.itemsize)
    return max(sizes, default=0)


@dataclass(frozen=True)
class Aligned:
    """What :func:`align` made: the merged HF tensors, grouped by layer and computed as they are
    read, with the config to write them under."""

    config: object
    groups: Iterator
    total_groups: int | None
    untied: bool
    transforms: list[Transform] | None
    out_dtype: torch.dtype | None
    stopping: object | None = None  # a trained method's hf_lmc.learned.training.Stopping
    sources: tuple[
        Checkpoint, ...
    ] = ()  # the inputs' checkpoints, verified unchanged before the output is put in place
    spec: ArchSpec | None = None  # the canonical models' spec, which the transforms act on


@dataclass(frozen=True)
class Members:
    """What :func:`align_members` made: every model moved into the merge's coordinates by its
    transform, before any interpolation (``moved[k]`` is ``T_k(theta_k)`` in canonical form, lazy,
    on the compute device): what :func:`align` combines, and what ``hf-lmc align`` writes."""

    moved: list[CanonicalModel]
    transforms: list[Transform]
    spec: ArchSpec  # the canonical models' spec, which the transforms act on
    stopping: object | None = None  # a trained method's hf_lmc.learned.training.Stopping
    sources: tuple[Checkpoint, ...] = ()  # the inputs' checkpoints, verified unchanged before an output is put in place


def align_members(request: MergeRequest, inputs: Inputs, *, progress: bool = True) -> Members:
    """Find each model's transform by the method's registry entry and move every model by it
    (models of two widths first embedded exactly into one shape; the ``average`` of two widths
    moves nothing): the models as :func:`align` interpolates them. Reading streams layer by layer
    from the checkpoints (learned and dual matching hold the models in memory while they train)."""
    needs_data = METHODS[request.method].needs_data
    # Weight matching reads every layer on the device from the start; the data methods'
    # matchers place their endpoints themselves (accelerate), from the CPU.
    canonical = [
        canonicalize(f, dtype=torch.float32, device=None if needs_data else inputs.device) for f in inputs.folders
    ]
    sources = tuple(c.source for c in canonical)
    if inputs.width_notes:  # models of two widths: exactly into one shape
        canonical = list(to_common_shape(*canonical, request.models[0], request.models[1]))
    batches = inputs.fit_batches
    stopping = None
    if request.method == "average":  # two widths: the embedded models, interpolated as they are
        transforms = [Transform() for _ in canonical]
    else:  # float32 copies replace the float64 transforms: their per-head blocks add up on big models.
        matcher = matcher_for(
            request.method,
            len(canonical),
            symmetries=inputs.kinds,
            batches=batches,
            learn=request.learn,
            accelerate=request.accelerate,
            progress=progress,
            # the learned methods' start, unless asked for, runs where the launch put this process
            device=request.device if needs_data else inputs.device,
        )
        transforms = [t.to(torch.float32) for t in matcher.fit(canonical, inputs.weights)]
        stopping = getattr(matcher, "stopping", None)
    # Each layer is moved on the device (the data methods' endpoints were read on the CPU).
    device = inputs.device
    moved = [t.to(device=device).apply(c.to(device=device)) for t, c in zip(transforms, canonical)]
    return Members(moved, transforms, canonical[0].spec, stopping, sources)


def align(request: MergeRequest, inputs: Inputs, *, progress: bool = True) -> Aligned:
    """Align the models (unless the method is the plain average of models of one shape:
    :func:`align_members`) and set up the merged tensors, summed on the device layer by layer as
    they are read and written from the CPU."""
    config_a = inputs.configs[0]
    logger.info(
        "aligning %d models: %s%s",
        len(inputs.folders),
        request.method,
        "" if request.method == "average" else f", symmetries {', '.join(sorted(inputs.kinds))}",
    )
    if request.method == "average" and not inputs.width_notes:
        checkpoints = open_checkpoints(inputs.folders, inputs.configs)
        groups = average_groups(checkpoints, inputs.weights, inputs.out_dtype)
        return Aligned(config_a, groups, None, False, None, inputs.out_dtype, sources=tuple(checkpoints))
    members = align_members(request, inputs, progress=progress)
    merged = combine(members.moved, inputs.weights)
    out_dtype = written_dtype(request.method, inputs.out_dtype, config_a, inputs.width_notes)
    config = export_config(merged, dtype=out_dtype)  # known: no layer built just to read it
    groups = hf_state_dict_groups(merged, config, block_rows=block_rows(merged.spec))
    untied = bool(getattr(config_a, "tie_word_embeddings", False)) and not config.tie_word_embeddings
    return Aligned(
        config,
        groups,
        len(merged.spec.groups()),
        untied,
        members.transforms,
        out_dtype,
        members.stopping,
        members.sources,
        members.spec,
    )


@dataclass(frozen=True)
class Measured:
    """The barrier measured on the evaluation data (``None`` without it) and its plot."""

    result: BarrierResult | SimplexBarrierResult | None = None
    plot: Path | None = None


def measure(
    request: MergeRequest, inputs: Inputs, aligned: Aligned, scratch: Path, *, progress: bool = True
) -> Measured:
    """The barrier along the path (two models) or over the simplex (more), with the merge's own
    transforms, and its plot in ``scratch``; nothing without evaluation data."""
    if inputs.eval_batches is None:
        return Measured()
    logger.info("measuring the barrier on %s", describe_data(request.eval_data))
    loaded = [load_model(f) for f in inputs.folders]
    method = request.method
    options = {
        "methods": ("average", method) if method != "average" else ("average",),
        "symmetries": inputs.kinds,
        "eval_options": request.eval_options,
        "progress": progress,
        "transforms": {method: aligned.transforms} if aligned.transforms is not None else None,
    }
    names = [Path(m).name for m in request.models]
    if len(loaded) == 2:
        result = barrier_of_loaded(
            *loaded, inputs.eval_batches, alphas=PATH_POINTS if request.alphas is None else request.alphas, **options
        )
        return Measured(result, plot(result, scratch / "loss_along_path.png", title=f"{names[0]} ↔ {names[1]}"))
    result = simplex_barrier_of_loaded(
        loaded, inputs.eval_batches, points=SIMPLEX_POINTS if request.alphas is None else request.alphas, **options
    )
    if len(loaded) == 3:
        return Measured(result, plot_simplex(result, scratch / "loss_over_simplex.png", names=names))
    return Measured(result)


def write(
    request: MergeRequest,
    inputs: Inputs,
    aligned: Aligned,
    measured: Measured,
    *,
    progress: bool = True,
    scratch: Path | None = None,
) -> Path:
    """The model card and the merged checkpoint, written to a temporary folder and renamed onto
    ``request.output`` at the end; with them, for an aligned merge (unless
    ``request.save_transforms`` is off), the transforms it applied (:func:`save_merge_transforms`,
    written first into ``scratch``)."""
    count = len(request.models)
    labels = request.labels or [None] * count
    barriers = dict(measured.result.barriers) if measured.result else None
    sources = [
        ModelSource.of(m, r, f, label)
        for m, r, f, label in zip(request.models, inputs.revisions, inputs.folders, labels)
    ]
    extra = {measured.plot.name: measured.plot} if measured.plot else {}
    with contextlib.ExitStack() as stack:
        if request.save_transforms and request.method != "average" and aligned.transforms is not None:
            folder = scratch if scratch is not None else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            saved = save_merge_transforms(folder / TRANSFORMS_FILE, request, inputs, aligned, sources)
            extra |= {TRANSFORMS_FILE: saved, manifest_path(saved).name: manifest_path(saved)}
        return _write_checkpoint(request, inputs, aligned, measured, sources, barriers, extra, progress)


def save_merge_transforms(
    path: Path, request: MergeRequest, inputs: Inputs, aligned: Aligned | Members, sources: Sequence[ModelSource]
) -> Path:
    """Each model's transform, the map that carried it into the merge's basin, saved at ``path``
    with what it was fitted on: per model its reference as given (a local folder by its last
    part), the revision read and the checkpoint's content fingerprint (:mod:`hf_lmc.io.fingerprint`,
    by which ``hf-lmc apply`` knows each model), and the method, symmetries, weights and settings as JSON."""
    models = [
        {
            "reference": s.hub_id or s.label,
            "revision": s.revision,
            "local": s.hub_id is None,
            "fingerprint": fingerprint(f),
        }
        for s, f in zip(sources, inputs.folders, strict=True)
    ]
    fitted = {
        "method": request.method,
        "symmetries": sorted(inputs.kinds),
        "weights": list(inputs.weights),
        "models": models,
        "options": merge_settings(request),
    }
    return save_transforms(
        path, aligned.transforms, aligned.spec, names=[s.label for s in sources], sources=models, fitted=fitted
    )


def _write_checkpoint(request, inputs, aligned, measured, sources, barriers, extra, progress) -> Path:
    count = len(request.models)
    card = merge_card(
        base_models=sources,
        method=request.method,
        symmetries=sorted(inputs.kinds) if request.method != "average" else [],
        notes=training_notes(request.method, request.learn) + inputs.width_notes + list(inputs.inherited_notes),
        training=training_settings(request, count, aligned.stopping),
        alpha_or_weights=inputs.weights[1] if count == 2 else list(inputs.weights),
        license=inherited_license(inputs.folders),
        model_type=inputs.configs[0].model_type,
        tied_embeddings_dropped=aligned.untied,
        barrier_table=measured.result.table() if measured.result else None,
        barriers=barriers,
        eval_data=eval_source(request),
        made_with=request.made_with or settings_markdown(request),
        canonical=aligned.transforms is not None,
        plot_filename=measured.plot.name if measured.plot else None,
        repo_hint=request.repo_hint or inputs.push_to_hub or shown_reference(request.output),  # not the machine's path
        transforms_file=TRANSFORMS_FILE if TRANSFORMS_FILE in extra else None,
        transforms_version=TRANSFORMS_FORMAT,
    )
    written = str(aligned.out_dtype).removeprefix("torch.") if aligned.out_dtype else "in A's stored dtypes"  # as read
    logger.info("writing %s (%s, shards of at most %s)", request.output, written, request.shard_size)
    return write_checkpoint(
        _verified_at_end(aligned.groups, aligned.sources),
        aligned.config,
        request.output,
        shard_size=request.shard_size,
        dtype=aligned.out_dtype,
        source_folder=inputs.folders[0],
        tokenizer_folder=inputs.folders[request.tokenizer_model],
        card=card,
        extra_files=extra,
        overwrite=request.overwrite,
        progress=progress,
        total_groups=aligned.total_groups,
    )
