"""The network boundary: Hub ids to local folders, and merged folders up to the Hub."""

from __future__ import annotations

import contextlib
import glob
import logging
import re
import shlex
from collections.abc import Iterator, Sequence
from pathlib import Path

from huggingface_hub import HfApi, get_token, snapshot_download
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import (
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from hf_lmc.config.options import UsageError
from hf_lmc.io.outputs import MARKER
from hf_lmc.io.weights import BIN_INDEX, BIN_SINGLE, SAFETENSORS_SINGLE, indexed, indexed_files, weights_entry

logger = logging.getLogger(__name__)

#: What a merge needs from a model repo besides its weights: config and tokenizer / processor
#: files (the weights' indexes among the JSON) and the model card (its license is inherited). The
#: weights are the files transformers reads (:func:`hf_lmc.merging.preflight.weights_entry`), fetched by
#: name: :func:`_download_weights`.
CHECKPOINT_PATTERNS = ["*.json", "*.model", "*.txt", "*.tiktoken", "README.md"]
#: Training leftovers some repos carry beside the model.
IGNORED = ["trainer_state.json", "training_args.bin", "optimizer.*", "scheduler.*", "rng_state*"]


def names_local_path(reference: str | Path) -> bool:
    """Whether ``reference`` is read as a local path rather than a Hub repo id: it exists here,
    starts with ``.``, ``/`` or ``~``, or has more than one ``/`` (a repo id is ``name`` or
    ``org/name``, optionally ``@rev``)."""
    text = str(reference)
    return Path(text).exists() or text.startswith((".", "/", "~")) or text.count("/") > 1


def shown_reference(reference: str | Path) -> str:
    """How a shared file (a model card, its Reproduce section) names a model, data set or folder:
    a local path by its final component, since the machine's folders are nobody else's business
    and mean nothing elsewhere; a Hub id (``org/name[@rev]``) as given."""
    text = str(reference)
    try:
        local = names_local_path(text)
    except OSError:  # a name the OS cannot even look up (too long): not a Hub id either
        local = True
    return (Path(text).name or text) if local else text


def shown_settings(value, free_text: frozenset[str] = frozenset({"name", "push_to_hub"})):
    """``value`` (settings as JSON-like dicts, lists and strings) with every local path reduced by
    :func:`shown_reference`; strings under a key in ``free_text`` (titles, dataset configuration
    names, Hub targets) are left as written."""
    if isinstance(value, dict):
        return {
            key: item if key in free_text and isinstance(item, str) else shown_settings(item, free_text)
            for key, item in value.items()
        }
    if isinstance(value, (list, tuple)):
        return [shown_settings(item, free_text) for item in value]
    return shown_reference(value) if isinstance(value, str) else value


def shown_command(words: Sequence[str]) -> str:
    """A command line as a model card's Reproduce section shows it, quoted for a shell: each
    local path reduced by :func:`shown_reference` (a bare word, ``--flag=PATH`` or ``-oPATH``);
    flags and Hub ids stay as typed."""

    def shown(word: str) -> str:
        if word.startswith("--"):  # a flag, or --flag=value
            flag, equals, value = word.partition("=")
            return f"{flag}={shown_reference(value)}" if equals else word
        if word.startswith("-"):  # -q, or a short flag with its value attached: -o/path/to/out
            return word[:2] + shown_reference(word[2:]) if len(word) > 2 else word
        return shown_reference(word)

    return shlex.join(map(shown, words))


def command_markdown(words: Sequence[str]) -> str:
    """The Reproduce text of a merge made by the command line ``words``: one sentence, then the command."""
    return (
        f"It was made by this command (local paths reduced to their last part):\n\n```bash\n{shown_command(words)}\n```"
    )


def resolve_checkpoint(reference: str | Path, revision: str | None = None, *, weights: bool = True) -> Path:
    """A local folder for ``reference``: the folder itself, or a Hub snapshot of that repo id
    (``org/model`` at ``revision``, or ``org/model@rev``); with ``weights`` false the snapshot
    holds the config, tokenizer and card alone (what a dry run reads)."""
    path = Path(reference)
    if path.exists():
        if not path.is_dir():
            raise FileNotFoundError(f"{path} is a file; pass the model folder that holds config.json")
        return path
    if names_local_path(reference):
        raise FileNotFoundError(f"no such model folder: {reference}")
    repo_id, at, pinned = str(reference).partition("@")  # org/model@rev, as mergekit writes a revision
    if at:
        if not pinned or (revision is not None and revision != pinned):
            raise UsageError(f"{reference} names revision {pinned!r} but {revision!r} was also given; give one")
        revision = pinned
    with _hub_errors(str(reference), "folder", revision=revision):
        if not weights:
            return check_holds_model(repo_id, revision, Path(_download(repo_id, revision, CHECKPOINT_PATTERNS)))
        return _download_weights(repo_id, revision)


def _download_weights(repo_id: str, revision: str | None) -> Path:
    """A snapshot of ``repo_id`` with the config, tokenizer and card, and the weight files
    transformers reads from it, no others. The small files come first, and a revision without
    ``config.json`` is refused (:func:`check_holds_model`) before any weight is fetched; then
    ``model.safetensors`` where the repo has it, else the rule
    (:func:`hf_lmc.io.weights.weights_entry`) picks among what they brought (``config.json``'s
    named file, the safetensors index), then ``pytorch_model.bin`` and its index, and an index's
    shards are fetched by the names it lists. A revision with a config but no weights is refused
    alike."""
    folder = check_holds_model(repo_id, revision, Path(_download(repo_id, revision, CHECKPOINT_PATTERNS)))
    folder = Path(_download(repo_id, revision, [SAFETENSORS_SINGLE]))
    entry = weights_entry(folder)
    if entry is None or entry == BIN_INDEX:  # the PyTorch pickle comes before its index
        folder = Path(_download(repo_id, revision, [BIN_SINGLE]))
        entry = weights_entry(folder)
    if entry is None:
        raise NoModelAtRevisionError(no_model_message(repo_id, revision, "no weights"))
    if indexed(entry):
        names = [path.name for path in indexed_files(folder, entry)]
        folder = Path(_download(repo_id, revision, [glob.escape(name) for name in names]))
    elif not (folder / entry).is_file():  # the file config.json names
        folder = Path(_download(repo_id, revision, [glob.escape(entry)]))
    return folder


class NoModelAtRevisionError(FileNotFoundError):
    """A Hub repo that holds no model at the revision asked for (PolyPythia's ``main`` holds only
    ``.gitattributes``; its checkpoints are on ``step…`` branches). The message names the repo and
    revision and lists the revisions that hold one."""


#: How a revision is chosen, as every message that asks for one says it.
REVISION_HINT = (
    "choose one as ORG/NAME@REV, with --revision-a/--revision-b/--revisions (apply: --revision-model) or a "
    "recipe's revision key"
)


def check_holds_model(repo_id: str, revision: str | None, folder: Path) -> Path:
    """``folder`` (a snapshot of ``repo_id`` at ``revision``) if it holds ``config.json``; else a
    :class:`NoModelAtRevisionError` listing the revisions that do."""
    if not (folder / "config.json").is_file():
        raise NoModelAtRevisionError(no_model_message(repo_id, revision, "no config.json"))
    return folder


def no_model_message(repo_id: str, revision: str | None, missing: str, *, api: HfApi | None = None) -> str:
    """One line: ``repo_id`` has ``missing`` at ``revision``, the revisions that hold a model
    (:func:`model_revisions`), and how to choose one."""
    shown, count, source = model_revisions(repo_id, exclude=revision or hub_constants.DEFAULT_REVISION, api=api)
    at = f"revision {revision}" if revision else f"its default revision ({hub_constants.DEFAULT_REVISION})"
    if not shown:
        where = "the Hub cache" if source == "cache" else "the Hub"
        found = (
            f"no other revision of it in {where} holds a config.json" if source else "its revisions could not be listed"
        )
        return f"{repo_id} has {missing} at {at}, and {found}"
    more = f" ({count} in all, those shown checked)" if count > len([name for name in shown if name != "…"]) else ""
    where = " (from the Hub cache: offline)" if source == "cache" else ""
    return f"{repo_id} has {missing} at {at}; revisions that hold a model{where}: {', '.join(shown)}{more}; {REVISION_HINT}"


def model_revisions(
    repo_id: str, *, exclude: str | None = None, shown: int = 6, api: HfApi | None = None
) -> tuple[list[str], int, str | None]:
    """The branches and tags of ``repo_id`` that hold a model (a ``config.json``), in natural order
    (``step2`` before ``step10``): ``(names, count, source)``. Online (``source`` ``"hub"``) the
    refs come from ``list_repo_refs``; a repo may have hundreds (PolyPythia: one branch per saved
    step), so at most ``shown`` are checked, the first and last ones, and ``count`` is how many
    refs there are. Offline, or where the Hub cannot be reached, the cache's ``refs/`` are read
    (``source`` ``"cache"``), each checked by its cached snapshot. ``source`` is ``None`` where
    neither could be read."""
    if not hub_constants.is_offline_mode():
        api = api or HfApi()
        try:
            refs = api.list_repo_refs(repo_id)
        except Exception as err:  # noqa: BLE001 (connection errors come in many types: the cache may still tell)
            logger.info("could not list the revisions of %s (%s); reading the cache", repo_id, _first_line(err))
        else:
            names = _natural([ref.name for ref in [*refs.branches, *refs.tags] if ref.name != exclude])
            picked = names if len(names) <= shown else names[: shown // 2] + names[-(shown - shown // 2) :]
            held = [name for name in picked if _holds_config(api, repo_id, name)]
            return (held if len(names) <= shown else _with_gap(held, names)), len(names), "hub"
    return _cached_model_revisions(repo_id, exclude)


def _holds_config(api: HfApi, repo_id: str, revision: str) -> bool:
    try:
        return bool(api.file_exists(repo_id, "config.json", revision=revision))
    except Exception:  # noqa: BLE001 (a ref that cannot be read, for whatever reason, is not offered)
        return False


def _with_gap(held: list[str], names: list[str]) -> list[str]:
    """``held`` (the first and last of ``names``, checked) with an ellipsis where names lie between."""
    first = [name for name in held if names.index(name) < len(names) // 2]
    last = [name for name in held if names.index(name) >= len(names) // 2]
    return [*first, "…", *last] if first and last else held


def _cached_model_revisions(repo_id: str, exclude: str | None) -> tuple[list[str], int, str | None]:
    """What the Hub cache knows of ``repo_id``'s revisions: each ref under ``refs/`` whose cached
    snapshot holds a ``config.json``. Read here rather than with ``huggingface_hub``'s
    ``scan_cache_dir``, which reports a repo whose ref names a commit with no snapshot (PolyPythia's
    ``main`` once a download found nothing there) as corrupted and leaves the whole repo out."""
    repo = Path(hub_constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}"
    refs = repo / "refs"
    if not refs.is_dir():
        return [], 0, None
    names = []
    for ref in sorted(path for path in refs.rglob("*") if path.is_file()):
        name = ref.relative_to(refs).as_posix()
        commit = ref.read_text(encoding="utf-8").strip()
        if name != exclude and (repo / "snapshots" / commit / "config.json").is_file():
            names.append(name)
    names = _natural(names)
    return names, len(names), "cache"


def _natural(names: list[str]) -> list[str]:
    """``names`` sorted with their digit runs read as numbers: step2 before step10."""
    return sorted(names, key=lambda name: [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)])


def resolve_transforms(repo_id: str, revision: str | None = None) -> Path:
    """A local snapshot of the saved transforms of the merge at Hub repo ``repo_id`` (its
    ``transforms.safetensors`` and manifest alone, not its weights)."""
    with _hub_errors(repo_id, "path", what="'s transforms", revision=revision):
        folder = Path(_download(repo_id, revision, ["transforms.safetensors", "transforms.json"]))
    if not (folder / "transforms.safetensors").is_file():
        raise FileNotFoundError(
            f"{repo_id} holds no transforms.safetensors (a merge saves it unless --no-save-transforms)"
        )
    return folder


@contextlib.contextmanager
def _hub_errors(reference: str, local: str, what: str = "", revision: str | None = None) -> Iterator[None]:
    """The Hub's errors on reading ``reference`` (``what`` of it) as one ``FileNotFoundError``
    line: no such repo (it was no ``local`` path either), no such revision (with the revisions
    that hold a model), or no network and no cache (with the cached revisions that hold one)."""
    repo_id = reference.partition("@")[0]
    try:
        yield
    except (RevisionNotFoundError, RepositoryNotFoundError) as err:
        raise not_found_error(reference, local, revision, err) from err
    except (LocalEntryNotFoundError, HfHubHTTPError) as err:
        cached, _, _ = _cached_model_revisions(repo_id, revision or hub_constants.DEFAULT_REVISION)
        if isinstance(err, LocalEntryNotFoundError) and cached and not what:
            at = f"revision {revision}" if revision else f"its default revision ({hub_constants.DEFAULT_REVISION})"
            raise NoModelAtRevisionError(
                f"{repo_id} at {at} could not be downloaded and is not in the Hub cache; cached revisions that hold "
                f"a model: {', '.join(cached)}; {REVISION_HINT}"
            ) from err
        raise FileNotFoundError(
            f"could not download {reference}{what} from the Hub and it is not cached: {_first_line(err)}"
        ) from err


def not_found_error(reference: str, local: str, revision: str | None, err: Exception) -> FileNotFoundError:
    """The one line for a Hub 404 on ``reference`` (it was no ``local`` path either): no such
    revision, or no model at it where the repo's revisions can be listed (a mirror may answer a
    missing file as a missing repo), else no such repo."""
    repo_id = reference.partition("@")[0]
    if isinstance(err, RevisionNotFoundError):
        return NoModelAtRevisionError(no_model_message(repo_id, revision, "no such revision"))
    if not hub_constants.is_offline_mode():
        try:
            HfApi().list_repo_refs(repo_id)
        except Exception as listed:  # noqa: BLE001 (the repo cannot be listed either: it is not one)
            logger.debug("%s has no refs either: %s", repo_id, _first_line(listed))
        else:
            return NoModelAtRevisionError(no_model_message(repo_id, revision, "no config.json"))
    return FileNotFoundError(f"{reference} is neither a local {local} nor a Hub model repo ({type(err).__name__})")


def _download(repo_id: str, revision: str | None, patterns: list[str]) -> str:
    logger.info("downloading %s%s (%s)", repo_id, f"@{revision}" if revision else "", ", ".join(patterns))
    return snapshot_download(repo_id, revision=revision, allow_patterns=patterns, ignore_patterns=IGNORED)


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    commit_message: str = "Upload merge made with hf-lmc",
    api: HfApi | None = None,
) -> str:
    """Create ``repo_id`` if needed and upload ``folder`` to it (all but hf_lmc's marker file,
    :data:`hf_lmc.io.outputs.MARKER`); returns the repo URL.

    A failed push (no network, no token, no rights) raises :class:`PushError` in one line that
    says the folder is kept and how to push it without merging again."""
    api = api or HfApi()
    logger.info("pushing %s to %s%s", folder, repo_id, " (private)" if private else "")
    try:
        url = api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            commit_message=commit_message,
            revision=revision,
            repo_type="model",
            ignore_patterns=[MARKER, f"{MARKER}.*"],  # hf_lmc's record of its own files, not part of the model
        )
    except (
        Exception
    ) as err:  # the Hub client raises HTTP, connection and auth errors of many types; the user needs one line
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise PushError(
            f"{folder} is written, but pushing it to {repo_id} failed ({type(err).__name__}: {reason}); "
            f"push it without merging again: hf upload {repo_id} {folder} --exclude {MARKER}"
            + (" --private" if private else "")
        ) from err
    return str(url)


class PushError(OSError):
    """The merge is written but could not be pushed; the message says how to push it."""


class PushRefusedError(PermissionError):
    """A push that cannot be made, found before any work: no token, the Hub out of reach, or a
    namespace the token cannot write to."""


def check_push(repo_id: str, *, api: HfApi | None = None) -> str:
    """Check, before any work, that ``repo_id`` can be pushed to: a token is here, the Hub answers
    ``whoami`` with it (so it is reachable and the token valid), the token may write, and the repo's
    namespace is its user's or one of their organisations' (not as a reader). Returns the user's
    name. Anything else is a :class:`PushRefusedError` in one line naming the repo, so a merge is
    never computed to fail at its push. ``api`` stands in for ``HfApi`` (the network boundary)."""
    api = api or HfApi()
    where = f"cannot push to {repo_id}"
    if not (getattr(api, "token", None) or get_token()):
        raise PushRefusedError(
            f"{where}: no Hugging Face token here; log in with `hf auth login` or set HF_TOKEN, or drop the push"
        )
    if hub_constants.is_offline_mode():
        raise PushRefusedError(
            f"{where}: HF_HUB_OFFLINE is set, so the Hub cannot be reached; unset it or drop the push"
        )
    try:
        account = api.whoami()
    except HfHubHTTPError as err:
        status = getattr(err.response, "status_code", None)
        what = "refused the token" if status in (401, 403) else "could not check the token"
        raise PushRefusedError(f"{where}: the Hub {what} ({_first_line(err)})") from err
    except Exception as err:  # connection, proxy and TLS errors come in many types; the user needs one line
        raise PushRefusedError(
            f"{where}: the Hub could not be reached to check the token ({type(err).__name__}: {_first_line(err)})"
        ) from err
    user = str(account.get("name", ""))
    role = ((account.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise PushRefusedError(f"{where}: {user}'s token is read-only; use a token with write access")
    namespace = repo_id.partition("/")[0] if "/" in repo_id else user
    orgs = {str(org.get("name")): org.get("roleInOrg") for org in account.get("orgs") or [] if isinstance(org, dict)}
    roles = {name.lower(): role for name, role in orgs.items()}  # the Hub's names ignore case
    if namespace.lower() != user.lower() and namespace.lower() not in roles:
        writable = ", ".join([user, *sorted(orgs)])
        raise PushRefusedError(
            f"{where}: the token is {user}'s, which cannot write to {namespace} (it writes to {writable})"
        )
    if namespace.lower() != user.lower() and roles[namespace.lower()] == "read":
        raise PushRefusedError(
            f"{where}: {user} is a reader of {namespace}, not a writer; push to a namespace of yours"
        )
    return user


def pushed_repo(repo_id: str, user: str | None) -> str:
    """The repo a push to ``repo_id`` creates: a bare name is under the token's ``user``'s
    namespace, as ``create_repo`` and transformers' ``push_to_hub`` place it."""
    return repo_id if "/" in repo_id or not user else f"{user}/{repo_id}"


def _first_line(err: BaseException) -> str:
    """The first line of ``err``'s message, or its type's name where it has none."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
