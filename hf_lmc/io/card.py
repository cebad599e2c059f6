"""The model card of a merge, rendered by ``huggingface_hub.ModelCard`` from a shipped template.

Besides the rendering, the card's text about one merge request: how a trained method's transforms
were learned (notes and a settings table), how the evaluation data is named, and the settings a
merge made from Python is reproduced with.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id

from hf_lmc.canonical.adapters import ADAPTERS
from hf_lmc.config.methods import METHODS
from hf_lmc.config.options import LearnOptions, MergeRequest
from hf_lmc.evaluation.batches import describe_data, is_sampled, sampled_count
from hf_lmc.io.hub import names_local_path, shown_reference, shown_settings
from hf_lmc.utils.devices import launched_count

TEMPLATE = resources.files("hf_lmc") / "templates" / "merge.md"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """One merged model as its card names it: a Hub repo (``hub_id``, at ``revision``: the commit
    of the snapshot read, else the revision asked for) goes into the ``base_model`` metadata; a
    local folder is only described in the body, by ``label`` (its final component unless labelled),
    since the Hub cannot resolve it; ``path``, the folder as given, is never shown: a note that
    names it is rewritten to name the label."""

    label: str
    hub_id: str | None = None
    revision: str | None = None
    path: str | None = None

    @classmethod
    def of(
        cls,
        reference: str | Path,
        revision: str | None = None,
        folder: str | Path | None = None,
        label: str | None = None,
    ) -> ModelSource:
        """The source of a model given as ``reference`` (a local folder or ``org/model[@rev]``,
        told apart by :func:`hf_lmc.io.hub.names_local_path`) and read from ``folder``."""
        text = str(reference)
        if names_local_path(text):
            return cls(label or shown_reference(text), path=text)
        repo_id, _, pinned = text.partition("@")
        revision = revision or pinned or None
        if (
            folder is not None and Path(folder).parent.name == "snapshots"
        ):  # the Hub cache names a snapshot by its commit
            revision = Path(folder).name
        return cls(label or repo_id, repo_id, revision)

    def describe(self) -> str:
        """How the card's body names the model."""
        if self.hub_id is None:
            return f"`{self.label}` (a local model)"
        at = f" at revision `{self.revision}`" if self.revision else ""
        return f"[`{self.hub_id}`](https://huggingface.co/{self.hub_id}){at}"


@dataclass(frozen=True)
class DataSource:
    """The evaluation data as the card names it: a Hub dataset by its id (``hub_id``, with its
    ``config`` and ``split``), in ``model-index`` and linked in the text; anything else (a local
    file or folder, data passed as objects) as local data called ``name``, in the text alone and
    with no link, since the Hub cannot resolve it."""

    name: str
    hub_id: str | None = None
    config: str | None = None
    split: str | None = None

    @classmethod
    def of(cls, reference: str | Path, split: str | None = None, config: str | None = None) -> DataSource:
        """Data given as ``reference``: a Hub dataset id where it is one (a valid repo id that
        names no path and no file, by its suffix), else local, by its last part."""
        text = str(reference)
        try:
            validate_repo_id(text)
            hub = not (names_local_path(text) or Path(text).suffix)
        except HFValidationError:  # not a Hub id at all: a path or a description
            hub = False
        return cls(text, text, config, split) if hub else cls(shown_reference(text))

    def describe(self) -> str:
        """The data as the card's text names it: a Hub dataset with a link to its page (and its
        configuration and split), local data by its name alone, with no link."""
        if self.hub_id is None:
            return f"`{self.name}` (local data, not on the Hub)"
        details = ", ".join(
            f"{what} `{value}`" for what, value in (("configuration", self.config), ("split", self.split)) if value
        )
        link = f"[`{self.hub_id}`](https://huggingface.co/datasets/{self.hub_id})"
        return f"the Hub dataset {link}" + (f" ({details})" if details else "")


def merge_card(
    *,
    base_models: Sequence[str | ModelSource],
    method: str,
    symmetries: list[str] | str,
    alpha_or_weights,
    license: str | None,
    model_type: str,
    tied_embeddings_dropped: bool = False,
    barrier_table: str | None = None,
    barriers: Mapping[str, float] | None = None,
    eval_data: DataSource | str | None = None,
    eval_split: str | None = None,
    plot_filename: str | None = None,
    notes: Sequence[str] = (),
    training: list[tuple[str, str]] | None = None,
    repo_hint: str | None = None,
    made_with: str | None = None,
    canonical: bool | None = None,
    transforms_file: str | None = None,
    transforms_version: int | None = None,
) -> ModelCard:
    """A card with Hub metadata (``base_model`` (Hub repos only), ``base_model_relation:
    merge``, tags, license, and the barrier as ``model-index`` results).

    ``base_models``: one :class:`ModelSource` per model (a string is read by
    :meth:`ModelSource.of`). ``alpha_or_weights``: B's weight for two models, or (more than two)
    a list of one weight per base model, shown model by model. ``barriers``: the barrier of each
    method measured on ``eval_data`` (a :class:`DataSource`; a string is read by
    :meth:`DataSource.of`, with split ``eval_split``), shown in the body as ``barrier_table``;
    ``model-index`` holds ``method``'s alone, the barrier of the path this merge lies on: the
    plain average's is the baseline it is measured against, not a result of this model (unless
    it is the plain average). ``training``: (setting, value) rows of how trained
    transforms were learned. ``made_with``: the command line or recipe that made the merge,
    shown with the hf_lmc version so that it can be run again. ``canonical``: whether the models
    were rewritten into canonical forms before they were combined (default: every method but the
    plain ``average``, which combines the stored weights as they are). ``transforms_file``: the
    file beside the weights that holds the transforms the merge applied (none saved: ``None``),
    in the manifest format ``transforms_version`` (docs/transforms.md).
    """
    sources = [m if isinstance(m, ModelSource) else ModelSource.of(m) for m in base_models]
    notes, made_with = [_without_paths(note, sources) for note in notes], _without_paths(made_with, sources)
    hub = [s.hub_id for s in sources if s.hub_id]
    data = eval_data if isinstance(eval_data, DataSource) or eval_data is None else DataSource.of(eval_data, eval_split)
    name = f"Merge of {_listed([s.label for s in sources])}"
    metadata = ModelCardData(
        base_model=hub or None,
        base_model_relation="merge" if hub else None,
        library_name="transformers",
        license=license,
        tags=["merge", "hf-lmc", "linear-mode-connectivity", model_type],
        model_name=name if barriers else None,
        eval_results=_barrier_results(barriers, method, model_type, data)
        if barriers and method in barriers and data is not None and data.hub_id
        else None,  # local data has no dataset page for the Hub to link: the body names it
    )
    notes = list(notes)
    if tied_embeddings_dropped:
        notes.append(
            "The source models tie their input embeddings and LM head; folding norm gains and aligning "
            "the residual stream makes them differ, so this checkpoint has `tie_word_embeddings=False`."
        )
    sym = ", ".join(symmetries) if not isinstance(symmetries, str) else symmetries
    # More than two models: a weight per model; two models keep the alpha row as they always had.
    many = isinstance(alpha_or_weights, (list, tuple)) and len(sources) > 2
    weights = list(alpha_or_weights) if many else None
    return ModelCard.from_template(
        metadata,
        template_path=str(TEMPLATE),
        model_name=name,
        base_models_text=_listed([s.describe() for s in sources]),
        method=method,
        canonical=method != "average" if canonical is None else canonical,
        how_aligned=METHODS[method].many_card if weights else METHODS[method].pair_card,
        alpha=alpha_or_weights,
        weights=[(f"`{s.label}`", f"{w:.4g}") for s, w in zip(sources, weights)] if weights else None,
        symmetries=sym or "none (plain average of the stored weights)",
        model_type=model_type,
        notes=notes,
        training=training,
        barrier_table=barrier_table,
        eval_data_text=data.describe() if data is not None else None,
        in_metadata=bool(barriers and method in barriers and data is not None and data.hub_id),
        plot_filename=plot_filename,
        repo_hint=repo_hint or "path/to/merged-model",
        auto_class=ADAPTERS[model_type].auto_class,
        version=_version(),
        made_with=made_with,
        transforms_file=transforms_file,
        transforms_manifest=str(Path(transforms_file).with_suffix(".json")) if transforms_file else None,
        transforms_version=transforms_version,
        model_names=[s.label for s in sources],
    )


def moved_card(
    *,
    source: ModelSource,
    merge: str,
    member_label: str,
    model_type: str,
    untied: bool = False,
    license: str | None = None,
) -> ModelCard:
    """The card of a model moved by a merge's saved transform (``hf-lmc apply``): the same function
    as ``source``, rewritten into the merge's coordinates, under ``source``'s ``license``;
    ``base_model`` names ``source`` where it is a Hub repo."""
    data = ModelCardData(
        base_model=source.hub_id,
        license=license,
        library_name="transformers",
        tags=["hf-lmc", "linear-mode-connectivity", model_type],
    )
    lines = [
        f"# `{source.label}`, moved by the transforms of `{merge}`",
        "",
        (
            f"{source.describe()}, rewritten exactly by the function-preserving transform that the merge `{merge}` "
            f"found for its model `{member_label}` (`hf-lmc apply`): the same function, in the merge's coordinates, "
            "where it can be interpolated with the merge's other models or given the adapters moved the same way."
        ),
        "",
        "Norm gains and shifts are folded into the weights that read them (canonical form), so the inner norms have "
        "unit gain and zero shift."
        + (" The input embeddings and LM head are no longer tied (`tie_word_embeddings=False`)." if untied else ""),
        "",
        "```python",
        f"from transformers import {ADAPTERS[model_type].auto_class}",
        "",
        f'model = {ADAPTERS[model_type].auto_class}.from_pretrained("path/to/this-model")',
        "```",
        "",
        f"Made with `hf-lmc` {_version()}.",
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def aligned_card(
    *,
    source: ModelSource,
    member: int,
    members: Sequence[tuple[ModelSource, str]],
    method: str,
    symmetries: Sequence[str],
    model_type: str,
    transforms_file: str,
    untied: bool = False,
    license: str | None = None,
    notes: Sequence[str] = (),
    made_with: str | None = None,
) -> ModelCard:
    """The card of one model ``hf-lmc align`` wrote: ``source``, model ``member`` of ``members``
    (each a source and the folder it was written to), rewritten exactly into the coordinates of the
    merge of them all by the transform ``method`` found over ``symmetries``, with nothing
    interpolated; ``transforms_file`` is where the transforms lie beside the folder. ``base_model``
    names ``source`` where it is a Hub repo; ``source``'s ``license`` carries over."""
    sources = [s for s, _ in members]
    data = ModelCardData(
        base_model=source.hub_id,
        license=license,
        library_name="transformers",
        tags=["hf-lmc", "linear-mode-connectivity", "aligned", model_type],
    )
    letter = chr(65 + member) if len(members) <= 26 else str(member + 1)
    role = (
        "the reference of the alignment: its weights are its own, only rewritten into the canonical form "
        "every model of the set is written in"
        if member == 0
        else f"moved by the transform {method} matching found for it over {', '.join(symmetries)}"
    )
    folders = [folder for _, folder in members]
    lines = [
        f"# `{source.label}`, aligned with {_listed([f'`{s.label}`' for k, s in enumerate(sources) if k != member])}",
        "",
        (
            f"{source.describe()}, model {letter} of {len(members)}, rewritten exactly by a function-preserving "
            f"transform into the coordinates where `hf-lmc merge` would interpolate the models (`hf-lmc align`): {role}. "
            "**Nothing was interpolated**: this checkpoint computes the same function as the model it was made from, "
            "to float rounding, and any other tool can merge it with the folders written beside it."
        ),
        "",
        "| | |",
        "|---|---|",
        f"| model | {letter} of {len(members)} (`{folders[member]}`) |",
        f"| method | `{method}` (the transforms it found, applied exactly) |",
        f"| symmetries searched | {', '.join(symmetries)} |",
        (
            f"| transforms | `{transforms_file}` and `{Path(transforms_file).with_suffix('.json')}` "
            f"(model {letter}'s is number {member + 1} in them) |"
        ),
        f"| set | {', '.join(f'`{folder}`' for folder in folders)} |",
        f"| architecture | `{model_type}` |",
        "",
        "Norm gains and shifts are folded into the weights that read them (canonical form), so the inner norms have "
        "unit gain and zero shift."
        + (" The input embeddings and LM head are no longer tied (`tie_word_embeddings=False`)." if untied else ""),
        *([""] + [f"- {_without_paths(note, sources)}" for note in notes] if notes else []),
        "",
        (
            "A linear merge of the set at equal weights is, to float rounding, what `hf-lmc merge` writes for these "
            "models; a mergekit configuration over these folders merges them with mergekit's own methods "
            "(docs/mergekit.md in hf-lmc)."
        ),
        "",
        "```python",
        f"from transformers import {ADAPTERS[model_type].auto_class}",
        "",
        f'model = {ADAPTERS[model_type].auto_class}.from_pretrained("path/to/{folders[member]}")',
        "```",
        "",
        f"Made with `hf-lmc` {_version()}.",
        *(["", _without_paths(made_with, sources)] if made_with else []),
    ]
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(lines) + "\n")


def _without_paths(text: str | None, sources: Sequence[ModelSource]) -> str | None:
    """``text`` naming each local model by its label rather than by its path on this machine (a
    bare folder name says nothing of the machine and is left as it is)."""
    if text is None:
        return None
    paths = [s for s in sources if s.path and ("/" in s.path or os.sep in s.path)]
    for source in sorted(paths, key=lambda s: len(s.path), reverse=True):
        text = text.replace(source.path, source.label)
    return text


def _version() -> str:
    """hf_lmc's installed version, read from the package metadata (importing the package itself
    from this low layer would make a cycle)."""
    try:
        return metadata.version("hf-lmc")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "(not installed)"


def _barrier_results(
    barriers: Mapping[str, float], method: str, model_type: str, data: DataSource | None
) -> list[EvalResult]:
    """``method``'s barrier as the ``model-index`` result, on a Hub dataset named by its id (the
    Hub links it to the dataset's page, so local data is named in the card's text instead)."""
    task = "image-classification" if ADAPTERS[model_type].takes_images else "text-generation"
    return [
        EvalResult(
            task_type=task,
            dataset_type=data.hub_id,
            dataset_name=data.name,
            dataset_config=data.config,
            dataset_split=data.split,
            metric_type="loss_barrier",
            metric_name=f"loss barrier, {method} (nats)",
            metric_value=round(float(barriers[method]), 6),
        )
    ]


def _listed(items: list[str]) -> str:
    """``a and b``, ``a, b and c``."""
    return " and ".join(items) if len(items) <= 2 else f"{', '.join(items[:-1])} and {items[-1]}"


def inherited_license(folders: list[Path]) -> str | None:
    """The license the source models agree on (from their cards' metadata), else ``None``."""
    licenses = set()
    for folder in folders:
        readme = Path(folder) / "README.md"
        if readme.is_file():
            try:
                found = ModelCard.load(readme).data.to_dict().get("license")
            except Exception:  # noqa: BLE001 (huggingface_hub and its YAML parser raise many types; an unparsable card just has no license to inherit)
                found = None
            if found:
                licenses.add(found)
    if len(licenses) > 1:
        logger.warning(
            "the models' licenses differ (%s): the merge's card names none; set one before sharing it",
            ", ".join(sorted(licenses)),
        )
    return licenses.pop() if len(licenses) == 1 else None


# -- the card's text about one merge request ---------------------------------------------------

_HARDENED = (
    "MLP permutations were learned as Sinkhorn soft permutations and hardened (linear assignment) "
    "before export, so the merged weights apply exact permutations of each model."
)
_ENSEMBLE = (
    "The transforms were trained toward the models' own predictions mixed at the same weights "
    "(objective `ensemble`), not toward the training data's labels."
)


def training_notes(method: str, learn: LearnOptions) -> list[str]:
    """Model-card notes on how a trained method's transforms were learned."""
    if not METHODS[method].trained:
        return []
    notes = [_HARDENED] if learn.permutations == "sinkhorn" else []
    if learn.objective == "ensemble":
        notes.append(_ENSEMBLE)
    if learn.input_noise:
        notes.append(
            f"The transforms were trained on images with Gaussian noise of std {learn.input_noise:g} added afresh at every step."
        )
    return notes


def _groups_trained(learn: LearnOptions) -> str:
    """Which symmetry groups a trained method's training moved (the rest stayed at its start)."""
    if learn.trained == "permutations":
        return "permutations alone: the residual's dimensions, the MLP units and the heads (no continuous map)"
    orders = (
        "the unit and head orders"
        if learn.permutations != "fixed"
        else "not the unit and head orders (fixed where weight matching put them)"
    )
    return f"the residual rotation, the per-head QK and OV maps and the SwiGLU scales; {orders}"


def training_settings(request: MergeRequest, count: int, stopping=None) -> list[tuple[str, str]] | None:
    """The card's table of how a trained method's transforms were learned: enough to run it again."""
    if not METHODS[request.method].trained:
        return None
    learn, accelerate, data, data_options = request.learn, request.accelerate, request.data, request.data_options
    shape = f"batches of {data_options.batch_size}" + (
        f" × {data_options.seq_len} tokens" if data_options.seq_len else ""
    )
    if is_sampled(data):
        shape += f", {sampled_count(data_options)} sequences drawn at temperature 1, an equal share from each model"
    elif data_options.max_batches:
        shape += f", at most {data_options.max_batches} of them"
    schedule = learn.schedule + (f", {learn.warmup_steps} warmup steps" if learn.warmup_steps else "")
    named = describe_data(shown_reference(data) if isinstance(data, (str, Path)) else data)  # no path of this machine
    rows = [
        ("data", f"{named} ({shape})" if is_sampled(data) else f"{named} (split `{data_options.split}`, {shape})"),
        (
            "steps",
            f"{learn.steps} (gradient accumulation {accelerate.gradient_accumulation_steps})",
        ),
        (
            "optimiser",
            f"Adam, lr {learn.lr:g}"
            + (f", residual maps {learn.residual_lr:g}" if learn.residual_lr else "")
            + f", schedule `{schedule}`",
        ),
        ("groups trained", _groups_trained(learn)),
        (
            "parameterisation",
            f"permutations `{learn.permutations}`"
            + (f", residual map `{learn.orthogonal}`, frame `{learn.frame}`" if learn.trained == "all" else ""),
        ),
    ]
    if count == 2:
        low, high = learn.lambda_range
        near = "the path's worst point" if learn.focus == "worst" else "the points above the line, by their excess"
        rows.append(
            ("λ draws", f"{1 - learn.worst_fraction:g} from U({low:g}, {high:g}), {learn.worst_fraction:g} near {near}")
        )
    else:
        rows.append(("weight draws", f"Dirichlet({learn.concentration:g} · 1)"))
    rows.append(
        (
            "objective",
            f"`{learn.objective}`" + (f", input noise std {learn.input_noise:g}" if learn.input_noise else ""),
        )
    )
    rows.append(("seed", "not set (torch's RNG as it stood)" if learn.seed is None else str(learn.seed)))
    rows.append(("launch", _launch(accelerate)))
    if stopping is not None:
        rows.append(("stopping", f"{stopping.describe()} (stopped by the {stopping.reason})"))
        if stopping.curve:
            rows.append(("barrier estimate along the run", _curve_text(stopping.curve)))
    return rows


def _curve_text(curve, shown: int = 21) -> str:
    """A run's held-out barrier estimates as ``steps (seconds): estimate`` entries, at most ``shown``
    of them (the first, the last and evenly spaced ones between)."""
    picked = curve if len(curve) <= shown else [curve[round(i * (len(curve) - 1) / (shown - 1))] for i in range(shown)]
    return ", ".join(
        f"{steps}" + (f" ({seconds:.0f} s)" if seconds is not None else "") + f": {estimate:.4f}"
        for steps, seconds, estimate in picked
    )


def _launch(accelerate) -> str:
    """How the training ran: processes, precision, what was sharded and who built the weights."""
    count = launched_count()
    text = f"{count} process{'es' if count > 1 else ''}, mixed precision `{accelerate.mixed_precision}`"
    offloaded = ", offloaded to CPU memory" if accelerate.offload_endpoints else ""
    if count == 1:
        return text + (f", endpoints' layers in FSDP2's store{offloaded}" if offloaded else "")
    if accelerate.shard_endpoints:
        gathered = f", layers gathered in `{accelerate.mixed_precision}`" if accelerate.mixed_precision != "no" else ""
        text += f", endpoints sharded across the processes (FSDP2){offloaded}{gathered}"
    else:
        text += ", endpoints whole in each process"
    if accelerate.shard_build:
        return text + (
            ", each process building 1/N of every interpolated weight's rows (all-gathered, or the layers run"
            " tensor-parallel where the launch's tokens are few)"
        )
    return text + ", every process building every interpolated weight"


def merge_settings(request: MergeRequest) -> dict:
    """A merge's settings as JSON: defaults left out, local paths by their final component (the
    card and the saved transforms are shared), data passed as objects named by their type."""
    card_only = {"data", "eval_data", "made_with", "labels", "repo_hint", "eval_data_name"}
    settings = request.model_dump(mode="json", exclude_defaults=True, exclude=card_only)
    for key in ("data", "eval_data"):
        if getattr(request, key) is not None:
            value = getattr(request, key)
            settings[key] = str(value) if isinstance(value, (str, Path)) else f"(passed as a {type(value).__name__})"
    return shown_settings(settings)


def settings_markdown(request: MergeRequest) -> str:
    """The card's Reproduce text for a merge made from Python: its settings as JSON (data given
    as objects described by type)."""
    shown = json.dumps(merge_settings(request), indent=2)
    return (
        "It was made from Python, by `hf_lmc.merging.pipeline.run(hf_lmc.MergeRequest(**settings))` with these settings "
        f"(defaults left out, local paths reduced to their last part, data passed as objects named by their type):"
        f"\n\n```json\n{shown}\n```"
    )


def eval_source(request: MergeRequest) -> DataSource | None:
    """How the card's ``model-index`` names the evaluation data: a Hub dataset id (as
    ``load_batches`` reads one) with its configuration and split, anything else as local data."""
    if request.eval_data is None:
        return None
    reference = request.eval_data_name or (request.eval_data if isinstance(request.eval_data, (str, Path)) else None)
    if reference is None:
        return DataSource(f"data passed as a {type(request.eval_data).__name__}")
    return DataSource.of(reference, request.eval_options.split, request.eval_options.name)
