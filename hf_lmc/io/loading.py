"""Loading stock HF models from instances, local folders or Hub ids, with a clear error."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from hf_lmc.canonical.adapters import adapter_for, read_config
from hf_lmc.io.checkpoint import Checkpoint
from hf_lmc.io.hub import resolve_checkpoint


@dataclass(frozen=True)
class LoadedModel:
    """A stock model and the folder it came from (tokenizer / processor files live there)."""

    model: PreTrainedModel
    folder: Path | None


def load_model(reference, revision: str | None = None) -> LoadedModel:
    """``reference``: a supported HF model instance, a local folder or a Hub id."""
    if isinstance(reference, PreTrainedModel):
        adapter_for(reference.config)
        source = Path(str(getattr(reference, "name_or_path", "") or ""))
        return LoadedModel(reference.eval(), source if source.is_dir() else None)
    folder = resolve_checkpoint(reference, revision)
    config = read_config(folder)
    adapter = adapter_for(config)
    Checkpoint(
        folder, adapter, config
    ).close()  # missing, corrupt, mis-shaped or integer tensors: our message, not transformers'
    model = adapter.model_class.from_pretrained(folder)
    return LoadedModel(model.eval(), folder)
