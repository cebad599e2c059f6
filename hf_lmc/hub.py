"""The network boundary: Hub ids to local folders, and merged folders up to the Hub."""

from __future__ import annotations

from pathlib import Path

from huggingface_hub import HfApi, snapshot_download
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


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload merge made with hf-lmc",
    api: HfApi | None = None,
) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it; returns the repo URL."""
    api = api or HfApi()
    url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message=commit_message, revision=revision, repo_type="model")
    return str(url)
