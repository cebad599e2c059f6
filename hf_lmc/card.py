"""The model card of a merge, rendered by ``huggingface_hub.ModelCard`` from a shipped template."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from huggingface_hub import ModelCard, ModelCardData

from .adapters import ADAPTERS
from .methods import METHODS

TEMPLATE = resources.files("hf_lmc") / "templates" / "merge.md"


def merge_card(
    *,
    base_models: list[str],
    method: str,
    symmetries: list[str] | str,
    alpha_or_weights,
    license: str | None,
    model_type: str,
    tied_embeddings_dropped: bool = False,
    barrier_table: str | None = None,
    plot_filename: str | None = None,
    notes: list[str] = (),
    training: list[tuple[str, str]] | None = None,
    repo_hint: str | None = None,
) -> ModelCard:
    """A card with Hub metadata (``base_model``, ``base_model_relation: merge``, tags, license).

    ``alpha_or_weights``: B's weight for two models, or (more than two) a list of one weight per
    base model, shown model by model. ``training``: (setting, value) rows of how trained
    transforms were learned, shown as a table.
    """
    data = ModelCardData(
        base_model=list(base_models),
        base_model_relation="merge",
        library_name="transformers",
        license=license,
        tags=["merge", "hf-lmc", "linear-mode-connectivity", model_type],
    )
    notes = list(notes)
    if tied_embeddings_dropped:
        notes.append(
            "The source models tie their input embeddings and LM head; folding norm gains and aligning "
            "the residual stream makes them differ, so this checkpoint has `tie_word_embeddings=False`."
        )
    sym = ", ".join(symmetries) if not isinstance(symmetries, str) else symmetries
    # More than two models: a weight per model; two models keep the alpha row as they always had.
    many = isinstance(alpha_or_weights, (list, tuple)) and len(base_models) > 2
    weights = list(alpha_or_weights) if many else None
    return ModelCard.from_template(
        data,
        template_path=str(TEMPLATE),
        model_name=f"Merge of {_listed([Path(m).name for m in base_models])}",
        base_models_text=_listed([f"`{m}`" for m in base_models]),
        method=method,
        how_aligned=METHODS[method].many_card if weights else METHODS[method].pair_card,
        alpha=alpha_or_weights,
        weights=[(f"`{m}`", f"{w:.4g}") for m, w in zip(base_models, weights)] if weights else None,
        symmetries=sym or "none (plain average of the stored weights)",
        model_type=model_type,
        notes=notes,
        training=training,
        barrier_table=barrier_table,
        plot_filename=plot_filename,
        repo_hint=repo_hint or "path/to/merged-model",
        auto_class=ADAPTERS[model_type].auto_class,
    )


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
    return licenses.pop() if len(licenses) == 1 else None
