"""What a merge inherits from model A besides its weights, copied safely and checked against B.

The merged checkpoint carries A's tokenizer (or the model's that ``tokenizer_from`` names),
image processor, label names and generation config: the merge means "B's weights read through
A's files", which holds only where B's files say the same. :func:`check_inherited` compares them
before any alignment work and refuses, by name, a difference that changes what the merged weights
mean (another token for an id, another image normalisation, permuted labels, another end-of-text
id), unless the user accepts it: ``tokenizer_from`` by naming the tokenizer to carry,
``inherit_from_a`` A's files; a harmless difference (a free-text config field, a sampling
default) proceeds with a note.

:func:`copy_model_file` is the one way a file of a model folder reaches an output: only a
regular file inside the folder is copied (a link out of it is refused by name), so nothing the
folder merely points to leaks into the merge or onto the Hub.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from transformers import PretrainedConfig

from hf_lmc.canonical.adapters import INHERITED_KEYS, adapter_for, informational_differences
from hf_lmc.config.options import ParameterError, clipped
from hf_lmc.io.hub import shown_reference

logger = logging.getLogger(__name__)

#: The files a merge copies from model A besides its config and weights: its generation config,
#: tokenizer and image processor.
GENERATION_CONFIG = "generation_config.json"
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
    "preprocessor_config.json",
)
#: Those of :data:`PROCESSOR_FILES` that make up the tokenizer, copied from the model ``tokenizer_from`` names.
TOKENIZER_COPIED = tuple(name for name in PROCESSOR_FILES if name != "preprocessor_config.json")
#: The tokenizer files a model folder may hold; two ``tokenizer.json`` are compared without loading a tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "vocab.txt",
    "tokenizer_config.json",
)
#: What two tokenizers are compared by: a difference in any of them changes which text an id means.
_TOKEN_TABLES = ("vocabulary", "merges", "added tokens", "special tokens")
#: Special-token roles a tokenizer config names.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
#: Image processor settings that change the pixels a ViT sees; the others are informational.
IMAGE_SETTINGS = (
    "image_mean",
    "image_std",
    "size",
    "resample",
    "rescale_factor",
    "do_normalize",
    "do_rescale",
    "do_resize",
    "crop_size",
    "do_center_crop",
    "crop_pct",
    "do_convert_rgb",
)
#: Generation settings that change which tokens a generated text has (start, stop, padding, bans);
#: the others (temperature, top_k, max_length, ...) are sampling defaults, informational.
GENERATION_TOKENS = (
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
)
#: Config-level token ids, which generation falls back to.
CONFIG_TOKENS = tuple(sorted(key for key in INHERITED_KEYS if key.endswith("_token_id")))
#: Generation config fields that record who wrote it, not how it generates.
_GENERATION_BOOKKEEPING = frozenset({"transformers_version", "_from_model_config"})


class InheritanceError(ParameterError):
    """Models whose tokenizer, image processor, labels or generation config differ in a way that
    changes what the merged weights mean; the parameter (``inherit_from_a``) accepts A's."""


class UnsafeFileError(ValueError):
    """A file of a model folder that is not a regular file inside it (a link out, a device, a folder)."""


# -- copying ---------------------------------------------------------------------------------


def copy_model_file(source_folder: str | Path, name: str, destination: str | Path) -> bool:
    """Copy ``source_folder/name`` to ``destination`` if the folder has it; return whether it did.

    Only a regular file inside the folder is copied (:func:`open_model_file`); its content is
    copied from the handle the checks passed, without metadata (the copy gets the umask's mode).
    """
    with open_model_file(source_folder, name) as source:
        if source is None:
            return False
        with open(destination, "wb") as out:
            shutil.copyfileobj(source, out, 16 << 20)
    return True


def check_model_files(source_folder: str | Path, names: Sequence[str] = (GENERATION_CONFIG, *PROCESSOR_FILES)) -> None:
    """Raise :class:`UnsafeFileError` now, before any long work, for a file of ``names`` that
    :func:`copy_model_file` would refuse to copy at the end."""
    for name in names:
        with open_model_file(source_folder, name):
            pass


@contextlib.contextmanager
def open_model_file(source_folder: str | Path, name: str) -> Iterator[BinaryIO | None]:
    """``source_folder/name`` opened for reading (``None`` where the folder has no such file), if
    it is a regular file inside the folder.

    A link whose target lies elsewhere (a secret beside the model, another user's file) raises
    :class:`UnsafeFileError` naming the file and where it points; so does a folder, device or
    FIFO of that name. Inside means under the folder, or for a Hub snapshot
    (``models--org--name/snapshots/REV``, whose files are links into ``../../blobs``) under its
    repo's cache folder. The target is opened without following a final link and the handle is
    checked to be what the name leads to, so a link swapped in after the checks is refused
    rather than followed.
    """
    if name in ("", ".", "..") or "/" in name or os.sep in name:
        raise ValueError(f"{name!r} is not a file name")
    folder = Path(source_folder)
    path = folder / name
    if not os.path.lexists(path):
        yield None
        return
    root = _allowed_root(folder)
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError) as err:  # a dangling or looping link
        raise UnsafeFileError(
            f"{path} is a link that leads nowhere ({_link_text(path)}); replace it with the file itself or remove it"
        ) from err
    if not target.is_relative_to(root):
        raise UnsafeFileError(
            f"{path} is a link to {_short(str(target))}, outside {_short(str(root))}; hf_lmc copies only files inside the model "
            f"folder: replace the link with the file itself or remove it"
        )
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(target, flags)  # the final component cannot be a link; a FIFO does not block
    except OSError as err:
        raise UnsafeFileError(
            f"cannot open {path} as a regular file ({err.strerror}); replace it with the file itself"
        ) from err
    with os.fdopen(fd, "rb") as source:
        opened = os.fstat(source.fileno())
        if not stat.S_ISREG(opened.st_mode):
            raise UnsafeFileError(f"{path} is not a regular file; hf_lmc copies only regular files from a model folder")
        named = os.stat(path)  # what the name leads to now: the file opened, unless it was swapped
        if (named.st_dev, named.st_ino) != (opened.st_dev, opened.st_ino):
            raise UnsafeFileError(f"{path} changed while it was being read; run the merge again")
        yield source


def _allowed_root(folder: Path) -> Path:
    """Where files of ``folder`` may lie: the folder itself, or a Hub snapshot's repo cache folder."""
    resolved = folder.resolve()
    if resolved.parent.name == "snapshots" and resolved.parent.parent.name.startswith("models--"):
        return resolved.parent.parent
    return resolved


def _link_text(path: Path) -> str:
    try:
        return f"it points to {_short(os.readlink(path))}"
    except OSError:
        return "it cannot be read"


def _short(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# -- checking ---------------------------------------------------------------------------------


class _Differences:
    """What model ``b`` differs from model ``a`` in (both by name): ``refused`` changes what the
    merged weights mean, ``noted`` does not."""

    def __init__(self, a: str, b: str) -> None:
        self.a, self.b = a, b
        self.refused: list[str] = []
        self.noted: list[str] = []

    def one_sided(self, what: str, in_a: bool) -> None:
        """Note ``what`` that only one of the two models has."""
        self.noted.append(f"{what} ({self.a if in_a else self.b} has one, {self.b if in_a else self.a} none)")


def check_inherited(
    folders: Sequence[Path],
    configs: Sequence[PretrainedConfig],
    names: Sequence[str],
    *,
    inherit_from_a: bool = False,
    tokenizer_from: int | None = None,
) -> list[str]:
    """Compare what the merge inherits (tokenizer, image processor, label maps, generation
    config, informational config fields) with every other model's, and return the model card's
    notes.

    The tokenizer is the first model's unless ``tokenizer_from`` (an index) names another; every
    other model's tokenizer is compared with the one carried. Naming it is the user's choice to
    accept a tokenizer that differs: choosing a tokenizer changes no weight, so the card then says
    which ids mix tokens of other text. Everything else is the first model's.

    A difference that changes what the merged weights mean raises :class:`InheritanceError` in one
    line naming the file, the field and both values (truncated), and the option that accepts it
    (``tokenizer_from`` for the tokenizer, ``inherit_from_a`` for the rest, which also accepts
    the first model's tokenizer); accepted, the card says what differed. Harmless differences are
    noted and logged.
    """
    carried = 0 if tokenizer_from is None else tokenizer_from
    check_model_files(folders[0])  # a link out of A's folder fails here, not after the alignment
    if carried:
        if not any((Path(folders[carried]) / n).is_file() for n in TOKENIZER_FILES):
            raise InheritanceError(
                f"{{}} names {names[carried]}, which has no tokenizer files; name a model that has one",
                "tokenizer_from",
            )
        check_model_files(folders[carried], TOKENIZER_COPIED)
        largest, rows = _largest_id(Path(folders[carried])), getattr(configs[0], "vocab_size", None)
        if largest is not None and rows is not None and largest >= rows:
            raise InheritanceError(
                f"{{}} names {names[carried]}, whose tokenizer has ids up to {largest}, but the merged model embeds "
                f"{rows} tokens (vocab_size); name a tokenizer whose ids it embeds",
                "tokenizer_from",
            )
    notes = [f"The tokenizer is {names[carried]}'s (tokenizer_from)."] if carried else []
    for k in (k for k in range(len(folders)) if k != carried):
        found = _Differences(names[carried], names[k])
        _check_tokenizer(Path(folders[carried]), Path(folders[k]), configs[carried], configs[k], found)
        if found.refused and tokenizer_from is None and not inherit_from_a:
            choices = "a or b" if len(folders) == 2 else f"a number from 1 to {len(folders)}"
            raise InheritanceError(
                f"{found.b} differs from {found.a} in {found.refused[0]}{_more(found.refused)}: the merge would read "
                f"{found.b}'s weights through {found.a}'s tokenizer; merge models that share one, or set {{}} to the model "
                f"whose tokenizer the merge should carry ({choices})",
                "tokenizer_from",
            )
        accepted = "as tokenizer_from chose" if tokenizer_from is not None else "inherit_from_a was set"
        meaning = (
            f"choosing a tokenizer changes no weight, so the merged rows of an id that means other text in "
            f"{found.b}'s tokenizer mix two tokens"
        )
        notes += _notes(found, accepted, meaning)
    for k in range(1, len(folders)):
        found = _Differences(names[0], names[k])
        for check in _CHECKS:
            check(Path(folders[0]), Path(folders[k]), configs[0], configs[k], found)
        if found.refused and not inherit_from_a:
            raise InheritanceError(
                f"{found.b} differs from {found.a} in {found.refused[0]}{_more(found.refused)}: the merge would read "
                f"{found.b}'s weights through {found.a}'s files; merge models that share them, or pass {{}} to use {found.a}'s",
                "inherit_from_a",
            )
        notes += _notes(found, "inherit_from_a was set")
    return notes


def _notes(found: _Differences, accepted: str, meaning: str | None = None) -> list[str]:
    """The card's notes (and the log's lines) on what ``found.b`` differs from ``found.a`` in:
    refused differences that were ``accepted`` (what they mean for the weights, where said), and
    harmless ones."""
    a, b, notes = found.a, found.b, []
    for what in found.refused:
        notes.append(f"{b} differs from {a} in {what}; {a}'s is used ({accepted}{f': {meaning}' if meaning else ''}).")
        logger.warning("%s differs from %s in %s; %s's is used (%s)", b, a, what, a, accepted)
    for what in found.noted:
        notes.append(f"{b} differs from {a} in {what}, which does not change what the weights mean; {a}'s is kept.")
        logger.info("%s differs from %s in %s (harmless; %s's kept)", b, a, what, a)
    return notes


def _more(items: list[str]) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def _check_config(
    folder_a: Path, folder_b: Path, config_a: PretrainedConfig, config_b: PretrainedConfig, found: _Differences
) -> None:
    """Label maps, config-level token ids, and the config fields no adapter reads."""
    adapter = adapter_for(config_a)
    a, b = config_a.to_dict(), config_b.to_dict()
    labels_a, labels_b = _labels(a), _labels(b)
    if labels_a != labels_b:
        label = next(i for i in _ordered(set(labels_a) | set(labels_b)) if labels_a.get(i) != labels_b.get(i))
        what = (
            f"config.json's id2label (label {label}: {clipped(labels_a.get(label))} vs {clipped(labels_b.get(label))})"
        )
        (found.refused if "Classification" in adapter.auto_class else found.noted).append(what)
    generates = adapter.model_class.can_generate()
    for key in CONFIG_TOKENS:
        if a.get(key) != b.get(key):
            what = f"config.json's {key} ({clipped(a.get(key))} vs {clipped(b.get(key))})"
            (found.refused if generates else found.noted).append(what)
    shown = [
        f"{key} {clipped(a.get(key))} vs {clipped(b.get(key))}" for key in informational_differences(config_a, config_b)
    ]
    if shown:
        more = f" and {len(shown) - 3} more" if len(shown) > 3 else ""
        found.noted.append(f"config.json's informational fields ({'; '.join(shown[:3])}{more})")


def _labels(config: Mapping) -> dict[int, str]:
    """``id2label`` with integer ids (a config read from JSON may key them by strings)."""
    return {int(k) if str(k).isdigit() else k: v for k, v in (config.get("id2label") or {}).items()}


def _check_generation(
    folder_a: Path, folder_b: Path, config_a: PretrainedConfig, config_b: PretrainedConfig, found: _Differences
) -> None:
    """The generation configs, where both models have one: token ids refuse, sampling defaults
    are noted. Where one has none (older checkpoints), A's is used and noted; the config-level
    token ids are compared with the config."""
    name = GENERATION_CONFIG
    a, b = _json(folder_a / name), _json(folder_b / name)
    if a is None or b is None:
        if a is not None or b is not None:
            found.one_sided(name, in_a=a is not None)
        return
    for key in GENERATION_TOKENS:  # a token id the file leaves unset is the config's
        value_a, value_b = a.get(key, getattr(config_a, key, None)), b.get(key, getattr(config_b, key, None))
        if value_a != value_b:
            found.refused.append(f"{name}'s {key} ({clipped(value_a)} vs {clipped(value_b)})")
    other = sorted(
        k
        for k in set(a) | set(b)
        if k not in GENERATION_TOKENS and k not in _GENERATION_BOOKKEEPING and a.get(k) != b.get(k)
    )
    if other:
        found.noted.append(f"{name}'s sampling defaults ({', '.join(other[:4])}{'...' if len(other) > 4 else ''})")


def _check_image_processor(folder_a: Path, folder_b: Path, config_a, config_b, found: _Differences) -> None:
    """The image processor: what changes the pixels refuses; a field only one side sets, or
    any other field, is noted."""
    name = "preprocessor_config.json"
    a, b = _json(folder_a / name), _json(folder_b / name)
    if a is None and b is None:
        return
    if a is None or b is None:
        found.one_sided(name, in_a=a is not None)
        return
    in_effect_a, in_effect_b = _processor_settings(folder_a, a), _processor_settings(folder_b, b)
    for key in IMAGE_SETTINGS:
        if in_effect_a.get(key) != in_effect_b.get(key):
            found.refused.append(f"{name}'s {key} ({clipped(in_effect_a.get(key))} vs {clipped(in_effect_b.get(key))})")
    other = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k) and k not in IMAGE_SETTINGS)
    if other:
        found.noted.append(f"{name}'s {', '.join(other[:4])}{'...' if len(other) > 4 else ''}")


def _processor_settings(folder: Path, written: dict) -> dict:
    """The settings an image processor runs with: what its file sets, and its class's defaults for
    what the file leaves out (a mean only one file writes is still two means), in one spelling
    (``size: 8`` and ``{height: 8, width: 8}`` alike), read from the processor transformers loads
    (no remote code). Where it cannot be loaded, the file as written."""
    from transformers import AutoImageProcessor

    try:
        processor = AutoImageProcessor.from_pretrained(folder, trust_remote_code=False)
        return json.loads(json.dumps(processor.to_dict(), default=_json_value))
    except Exception as err:  # noqa: BLE001 (transformers raises many types for a processor it cannot build)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.info("cannot load the image processor of %s (%s); comparing its file as written", folder, _short(reason))
        return written


def _json_value(value):
    """A processor setting JSON cannot write as it is (an enum such as ``Resampling``, a size record), as JSON can."""
    if hasattr(value, "value"):
        return value.value
    if hasattr(value, "__dict__"):
        return {k: v for k, v in vars(value).items() if v is not None}
    return str(value)


def _check_tokenizer(folder_a: Path, folder_b: Path, config_a, config_b, found: _Differences) -> None:
    """The tokenizer: every token string by id, the BPE merges, the added and special tokens.
    Read from ``tokenizer.json`` where both have one, else from the tokenizers themselves
    (loaded without running any code), so that one vocabulary in two file formats is one."""
    has_a, has_b = (any((f / n).is_file() for n in TOKENIZER_FILES) for f in (folder_a, folder_b))
    if not (has_a or has_b):
        return
    templates_a, templates_b = _chat_templates(folder_a), _chat_templates(folder_b)
    if templates_a != templates_b:  # how prompts are laid out, not what an id means: the card says whose is kept
        where = sorted(k for k in set(templates_a) | set(templates_b) if templates_a.get(k) != templates_b.get(k))
        found.noted.append(f"the chat template ({', '.join(where)})")
    if has_a != has_b:
        found.one_sided("tokenizer files", in_a=has_a)
        return
    if (folder_a / "tokenizer.json").is_file() and (folder_b / "tokenizer.json").is_file():
        a, b = _tokenizer_json(folder_a), _tokenizer_json(folder_b)
        named = {part: f"tokenizer.json's {part}" for part in _TOKEN_TABLES} | {
            "special tokens": "tokenizer_config.json's special tokens"
        }
    else:
        a, b = _loaded_tokenizer(folder_a), _loaded_tokenizer(folder_b)
        files = ", ".join(n for n in TOKENIZER_FILES if (folder_b / n).is_file())
        named = {part: f"the {part} of the tokenizer in {files}" for part in _TOKEN_TABLES}
    if a is None or b is None:
        found.noted.append("the tokenizer, which could not be read to compare it")
        return
    for part in _TOKEN_TABLES:
        difference = _first_difference(a[part], b[part])
        if difference is not None:
            found.refused.append(f"{named[part]} ({difference})")
    pipeline = sorted(
        k for k in set(a["pipeline"]) | set(b["pipeline"]) if a["pipeline"].get(k) != b["pipeline"].get(k)
    )
    if pipeline:
        found.noted.append(f"the tokenizer's {', '.join(pipeline)} settings")


def _chat_templates(folder: Path) -> dict[str, object]:
    """A folder's chat templates by where they are written: ``tokenizer_config.json``'s
    ``chat_template`` (one, or a list of named ones) and ``chat_template.jinja``."""
    found = {}
    config = _json(folder / "tokenizer_config.json") or {}
    if config.get("chat_template") is not None:
        found["tokenizer_config.json's chat_template"] = config["chat_template"]
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        found["chat_template.jinja"] = jinja.read_bytes()
    return found


def _largest_id(folder: Path) -> int | None:
    """The largest token id ``folder``'s tokenizer produces (vocabulary and added tokens), or
    ``None`` where it cannot be read."""
    tables = _tokenizer_json(folder) if (folder / "tokenizer.json").is_file() else _loaded_tokenizer(folder)
    if tables is None:
        return None
    ids = [i for i in tables["added tokens"] if isinstance(i, int)]
    return max([len(tables["vocabulary"]) - 1, *ids])


def _first_difference(a, b) -> str | None:
    """Where two token tables first differ: ``id 5: 'a' vs 'b'`` (lists by position, dicts by key)."""
    if a == b:
        return None
    if isinstance(a, dict):
        key = next(k for k in _ordered(set(a) | set(b)) if a.get(k) != b.get(k))
        return f"{key}: {clipped(a.get(key))} vs {clipped(b.get(key))}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"id {i}: {clipped(x)} vs {clipped(y)}"
    return f"{len(a)} vs {len(b)} entries"


def _ordered(keys) -> list:
    """``keys`` in order: ids by number, names (or a mix) by their text."""
    try:
        return sorted(keys)
    except TypeError:
        return sorted(keys, key=str)


def _tokenizer_json(folder: Path) -> dict | None:
    data = _json(folder / "tokenizer.json")
    return None if data is None else _tables(data, _special_tokens(folder))


def _tables(data: dict, special: dict[str, str]) -> dict:
    """What two tokenizers are compared by, from a ``tokenizers`` serialisation (``tokenizer.json``)."""
    model = data.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: token -> id
        by_id = dict(sorted((i, t) for t, i in vocab.items()))
        tokens = [by_id.get(i) for i in range(max(by_id, default=-1) + 1)]
    else:  # Unigram: [token, score] by id
        tokens = [entry[0] if isinstance(entry, list) else entry for entry in vocab]
    merges = [" ".join(m) if isinstance(m, list) else m for m in model.get("merges") or []]
    added = {
        entry.get("id"): (entry.get("content"), bool(entry.get("special"))) for entry in data.get("added_tokens") or []
    }
    pipeline = {k: data.get(k) for k in ("normalizer", "pre_tokenizer", "post_processor", "decoder")}
    pipeline["model"] = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
    return {
        "vocabulary": tokens,
        "merges": merges,
        "added tokens": added,
        "special tokens": special,
        "pipeline": pipeline,
    }


def _special_tokens(folder: Path) -> dict[str, str]:
    """The special tokens a folder's tokenizer config and special-tokens map name, by role."""
    found = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = _json(folder / name) or {}
        for role in SPECIAL_TOKENS:
            value = data.get(role)
            if isinstance(value, dict):
                value = value.get("content")
            if value is not None:
                found[role] = value
    return found


def _loaded_tokenizer(folder: Path) -> dict | None:
    """The tables of a tokenizer without a ``tokenizer.json``, loaded by transformers (no remote code)."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except Exception as err:  # noqa: BLE001 (transformers raises many types, and tokenizers a bare Exception)
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning("cannot load the tokenizer of %s to compare it: %s", folder, _short(reason))
        return None
    special = {
        role: str(getattr(tokenizer, role)) for role in SPECIAL_TOKENS if getattr(tokenizer, role, None) is not None
    }
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the same serialisation a tokenizer.json holds
        return _tables(json.loads(backend.to_str()), special)
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens = [by_id.get(i) for i in range(max(by_id, default=-1) + 1)]
    added = {i: (str(t), bool(getattr(t, "special", False))) for i, t in tokenizer.added_tokens_decoder.items()}
    return {"vocabulary": tokens, "merges": [], "added tokens": added, "special tokens": special, "pipeline": {}}


def _json(path: Path) -> dict | None:
    """A JSON file of a model folder, or ``None`` where there is none; one line naming the file where it is not JSON."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({_short(str(err), 80)}); fix or remove it") from None
    return data if isinstance(data, dict) else None


#: What every other model is compared with the first model in (the tokenizer is compared with the one carried).
_CHECKS: tuple[Callable[..., None], ...] = (_check_image_processor, _check_config, _check_generation)


def shown_names(models: Sequence[str], labels: Sequence[str | None] | None = None) -> list[str]:
    """How notes and errors name each model: its label, else a Hub id as given and a local path by
    its final component (:func:`hf_lmc.io.hub.shown_reference`)."""
    labels = list(labels or [None] * len(models))
    return [label or shown_reference(model) for model, label in zip(models, labels)]
