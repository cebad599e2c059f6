"""The model card of a merge, rendered by ``huggingface_hub.ModelCard`` from a shipped template."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .adapters import ADAPTERS
from .hub import names_local_path, shown_reference
from .methods import METHODS

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
    def of(cls, reference: str | Path, revision: str | None = None, folder: str | Path | None = None, label: str | None = None) -> ModelSource:
        """The source of a model given as ``reference`` (a local folder or ``org/model[@rev]``,
        told apart by :func:`hf_lmc.hub.names_local_path`) and read from ``folder``."""
        text = str(reference)
        if names_local_path(text):
            return cls(label or shown_reference(text), path=text)
        repo_id, _, pinned = text.partition("@")
        revision = revision or pinned or None
        if folder is not None and Path(folder).parent.name == "snapshots":  # the Hub cache names a snapshot by its commit
            revision = Path(folder).name
        return cls(label or repo_id, repo_id, revision)

    def describe(self) -> str:
        """How the card's body names the model."""
        if self.hub_id is None:
            return f"`{self.label}` (a local model)"
        at = f" at revision `{self.revision}`" if self.revision else ""
        return f"[`{self.hub_id}`](https://huggingface.co/{self.hub_id}){at}"


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
    eval_data: str | None = None,
    eval_split: str | None = None,
    plot_filename: str | None = None,
    notes: Sequence[str] = (),
    training: list[tuple[str, str]] | None = None,
    repo_hint: str | None = None,
    made_with: str | None = None,
) -> ModelCard:
    """A card with Hub metadata (``base_model`` (Hub repos only), ``base_model_relation:
    merge``, tags, license, and the barrier as ``model-index`` results).

    ``base_models``: one :class:`ModelSource` per model (a string is read by
    :meth:`ModelSource.of`). ``alpha_or_weights``: B's weight for two models, or (more than two)
    a list of one weight per base model, shown model by model. ``barriers``: the barrier of each
    method on ``eval_data`` (split ``eval_split``), written as ``model-index`` metrics with
    ``barrier_table`` shown in the body. ``training``: (setting, value) rows of how trained
    transforms were learned. ``made_with``: the command line or recipe that made the merge,
    shown with the hf_lmc version so that it can be run again.
    """
    sources = [m if isinstance(m, ModelSource) else ModelSource.of(m) for m in base_models]
    notes, made_with = [_without_paths(note, sources) for note in notes], _without_paths(made_with, sources)
    hub = [s.hub_id for s in sources if s.hub_id]
    name = f"Merge of {_listed([s.label for s in sources])}"
    data = ModelCardData(
        base_model=hub or None,
        base_model_relation="merge" if hub else None,
        library_name="transformers",
        license=license,
        tags=["merge", "hf-lmc", "linear-mode-connectivity", model_type],
        model_name=name if barriers else None,
        eval_results=_barrier_results(barriers, model_type, eval_data, eval_split) if barriers else None,
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
        data,
        template_path=str(TEMPLATE),
        model_name=name,
        base_models_text=_listed([s.describe() for s in sources]),
        method=method,
        how_aligned=METHODS[method].many_card if weights else METHODS[method].pair_card,
        alpha=alpha_or_weights,
        weights=[(f"`{s.label}`", f"{w:.4g}") for s, w in zip(sources, weights)] if weights else None,
        symmetries=sym or "none (plain average of the stored weights)",
        model_type=model_type,
        notes=notes,
        training=training,
        barrier_table=barrier_table,
        plot_filename=plot_filename,
        repo_hint=repo_hint or "path/to/merged-model",
        auto_class=ADAPTERS[model_type].auto_class,
        version=_version(),
        made_with=made_with,
    )


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


def _barrier_results(barriers: Mapping[str, float], model_type: str, eval_data: str | None, split: str | None) -> list[EvalResult]:
    """The barrier of each method as ``model-index`` results: one metric per method, on the
    evaluation data (a Hub dataset by its id; local data as ``local``)."""
    task = "image-classification" if ADAPTERS[model_type].takes_images else "text-generation"
    data = eval_data or "evaluation data"
    hub = not (names_local_path(data) or Path(data).suffix)  # a file name's suffix marks local data too
    return [
        EvalResult(
            task_type=task, dataset_type=data if hub else "local", dataset_name=data if hub else Path(data).name, dataset_split=split if hub else None,
            metric_type="loss_barrier", metric_name=f"loss barrier, {method} (nats)", metric_value=round(float(value), 6),
        )
        for method, value in barriers.items()
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
            except Exception:  # an unparsable card just has no license to inherit
                found = None
            if found:
                licenses.add(found)
    if len(licenses) > 1:
        logger.warning("the models' licenses differ (%s): the merge's card names none; set one before sharing it", ", ".join(sorted(licenses)))
    return licenses.pop() if len(licenses) == 1 else None
