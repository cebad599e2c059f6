"""The network boundary: turning Hub ids into local folders (uploads arrive with merging)."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

#: What a merge needs from a model repo: config, weights, tokenizer / processor files.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.bin", "*.model", "*.txt", "*.tiktoken"]


def resolve_checkpoint(reference: str | Path, revision: str | None = None) -> Path:
    """A local folder for ``reference``: the folder itself, or a Hub snapshot of that repo id."""
    path = Path(reference)
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; pass the model folder that holds config.json")
        return path
    if str(reference).startswith((".", "/", "~")) or str(reference).count("/") > 1:
        raise FileNotFoundError(f"no such model folder: {reference}")
    try:
        return Path(snapshot_download(str(reference), revision=revision, allow_patterns=CHECKPOINT_PATTERNS))
    except (RepositoryNotFoundError, RevisionNotFoundError) as err:
        raise FileNotFoundError(f"{reference} is neither a local folder nor a Hub model repo ({type(err).__name__})") from err
    except (LocalEntryNotFoundError, HfHubHTTPError) as err:
        raise FileNotFoundError(f"could not download {reference} from the Hub and it is not cached: {err}") from err
