"""The batches a merge reads: held-out evaluation data and fitting data, from any accepted form.

Causal LMs take text (a ``.txt`` file, a folder of text files, a list of strings, or a
``datasets`` id / saved dataset with a text column), tokenised with model A's tokenizer and cut
into fixed-length blocks. ViT takes images with labels (a ``datasets`` id / saved dataset with
image and label columns, processed by model A's image processor) or tensors
(``{"pixel_values": ..., "labels": ...}``, in memory or as a ``.pt`` file).

Fitting data (activation, learned and dual matching) takes the same forms, and one more for
language models: :data:`SAMPLED`, sequences sampled from the models being merged, for a merge
without data of one's own (:func:`fitting_batches`). The loss of a model on the batches is
:mod:`hf_lmc.evaluation.loss`'s.
"""

from __future__ import annotations

import ast
import os
import re
import stat
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from transformers import PretrainedConfig, PreTrainedModel

from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.config.options import EVAL_OPTIONS, FIT_OPTIONS, EvalOptions, ParameterError
from hf_lmc.io.checkpoint import load_pickled_tensors
from hf_lmc.io.weights import CheckpointError
from hf_lmc.utils.devices import computed_on_main
from hf_lmc.utils.progress import bar

Batch = dict[str, torch.Tensor]


#: Files a tokenizer is read from; a folder with none of them has no tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


class DataError(ValueError):
    """Evaluation data that cannot be used with the model."""


class DataSettingError(ParameterError, DataError):
    """A data setting (``parameter``) that does not fit the model."""


def load_batches(
    data, config: PretrainedConfig, processor_folder: Path | None, options: EvalOptions = EVAL_OPTIONS
) -> list[Batch]:
    """Evaluation batches for ``config``'s model from any of the accepted data forms.

    ``options.name`` picks the configuration of a ``datasets`` id or folder that has several
    (the ``name`` of :func:`datasets.load_dataset`); other data forms ignore it.
    """
    if isinstance(data, (list, tuple)) and data and isinstance(data[0], dict):
        return list(data)[: options.max_batches]  # already batches
    if is_sampled(data):
        raise DataError(
            f"{SAMPLED!r} names fitting data (--data) sampled from the models; evaluation needs held-out data of its own"
        )
    if adapter_for(config).takes_images:
        batches = _image_batches(data, processor_folder, options)
        _check_images(batches, config, data)
        _check_labels(batches, config.num_labels, data)
    else:
        batches = _text_batches(data, config, processor_folder, options)
    if not batches:
        raise DataError(f"evaluation data {describe_data(data)} produced no batches")
    return batches[: options.max_batches]


def describe_data(data) -> str:
    """A data argument as messages and model cards name it: a path or id as given, else its type."""
    if is_sampled(data):
        return "sequences sampled from the models"
    return repr(str(data)) if isinstance(data, (str, Path)) else type(data).__name__


#: A file extension made of letters (``.txt``, ``.json``, ``.pt``), as ends a file name but
#: rarely a Hub dataset id (``org/name-v1.2`` ends in a digit).
_LETTER_EXTENSION = re.compile(r"\.[A-Za-z]+$")


def _names_a_local_path(reference: str) -> bool:
    """Whether ``reference``, which does not exist here, was meant as a local file or folder
    rather than a Hub dataset id.

    It then names a missing file (often a typo, ``eval.tx`` for ``eval.txt``), and reporting that
    at once beats trying it as a Hub id, which spends half a minute failing on the network. A Hub
    id is ``name`` or ``owner/name``; a reference is a path when it starts with ``./``, ``../``,
    ``/`` or ``~``, has more than one ``/``, or its last component ends in a file extension made
    of letters.
    """
    last_component = reference.rsplit("/", 1)[-1]
    return (
        reference.startswith(("./", "../", "/", "~"))
        or reference.count("/") > 1
        or bool(_LETTER_EXTENSION.search(last_component))
    )


def _load_dataset(reference: str | Path, split: str, name: str | None = None):
    """Split ``split`` of the dataset saved with ``save_to_disk`` in folder ``reference``, or of
    configuration ``name`` of the ``datasets`` id or data folder ``reference``."""
    import datasets

    path = Path(reference)
    if not path.exists() and (isinstance(reference, Path) or _names_a_local_path(reference)):
        raise DataError(f"no such file or folder: {reference}")
    try:
        if path.is_dir() and (
            (path / "dataset_info.json").is_file()
            or (path / "state.json").is_file()
            or (path / "dataset_dict.json").is_file()
        ):
            ds = datasets.load_from_disk(str(path))
        else:
            ds = datasets.load_dataset(str(reference), name, split=split)
    except Exception as err:  # datasets raises many types; the user needs one clear line
        configurations = _configuration_names(err)
        if configurations and name is None:
            raise DataError(
                f"{reference} has several configurations ({', '.join(configurations)}): name one (--data-name or --eval-data-name; name: in a recipe)"
            ) from err
        if configurations:
            raise DataError(f"{reference} has no configuration {name!r} (has {', '.join(configurations)})") from err
        raise DataError(f"cannot load evaluation data {str(reference)!r}: {err}") from err
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{reference} has no split {split!r} (has {', '.join(ds)})")
        ds = ds[split]
    return ds


def _configuration_names(err: Exception) -> list[str]:
    """The configurations that ``datasets`` lists when a dataset's configuration is missing
    ("Config name is missing ... available configs: [...]") or unknown ("BuilderConfig 'x' not
    found. Available: [...]"); empty for any other error."""
    if not isinstance(err, ValueError):
        return []
    listed = re.search(r"(?:available configs|Available): (\[[^\]]*\])", str(err))
    if listed is None:
        return []
    try:
        names = ast.literal_eval(listed.group(1))
    except (ValueError, SyntaxError):
        return []
    return [str(n) for n in names]


# -- text --------------------------------------------------------------------------------------

#: Texts per tokenizer call: large enough for fast tokenizers to batch well, small enough that
#: ``max_batches`` stops tokenising soon after it has its blocks.
_TEXTS_PER_CALL = 256


def _text_rows(data, split: str, name: str | None):
    """``data``'s texts, in order, as a dataset (iterable or not) and the name of its text column.

    A ``.txt`` file is one text, a folder of them one text per file (read only when reached); a
    list of strings one text per string; a dataset (or a ``datasets`` id or folder, loaded here)
    one text per row of its ``text`` column, else of its first string column. Missing data is
    reported here, before tokenizer problems are.
    """
    import datasets

    if isinstance(data, (str, Path)):
        path = Path(data)
        if path.is_file():
            return _file_texts([path]), "text"
        if path.exists() and not path.is_dir():  # a device, a FIFO, a socket: nothing to read to its end
            raise DataError(f"{path} is not a regular file; pass a text file, a folder of them or a dataset")
        if path.is_dir() and (files := sorted(path.glob("*.txt"))):
            odd = next((f for f in files if not f.is_file()), None)
            if odd is not None:
                raise DataError(f"{odd} is not a regular file; a folder of texts holds .txt files only")
            return _file_texts(files), "text"
        data = _load_dataset(data, split, name)
    elif isinstance(data, Sequence) and all(isinstance(t, str) for t in data):
        return datasets.Dataset.from_dict(
            {"text": list(data)}, features=datasets.Features({"text": datasets.Value("string")})
        ), "text"
    columns = getattr(data, "column_names", None)
    if columns is None:
        raise DataError(f"cannot read text from {type(data).__name__}")
    features = data.features or {}
    text_columns = [c for c in columns if c == "text"] or [
        c for c in columns if getattr(features.get(c), "dtype", None) == "string"
    ]
    if not text_columns:
        raise DataError(f"dataset has no text column (columns: {', '.join(columns)})")
    rows = data.select_columns(text_columns[:1])
    return (rows.with_format(None) if isinstance(rows, datasets.Dataset) else rows), text_columns[0]


def _file_texts(files: list[Path]):
    """Text files as an iterable dataset with one whole text per file, read when its row is reached."""
    import datasets

    paths = datasets.Dataset.from_dict({"path": [str(f) for f in files]}).to_iterable_dataset()
    return paths.map(lambda row: {"text": read_text_file(Path(row["path"]))}, remove_columns=["path"])


#: The control characters text files do not hold: C0 but tab, newlines and form feed, and DEL.
#: Single bytes in UTF-8 (never part of a longer character), so they are counted on the bytes.
_NOT_TEXT_CONTROLS = bytes(b for b in [*range(0x20), 0x7F] if b not in b"\t\n\r\f\v")
#: More than this share of a file's characters being such controls means it is not text.
_MOST_CONTROL = 0.1


def read_text_file(path: Path) -> str:
    """The text of a UTF-8 file, decoded strictly: a file with NUL bytes, bytes that are not
    UTF-8, or mostly control characters (a binary file, or text in another encoding) is refused
    as :class:`DataError` naming the file and the first bad byte, rather than evaluated as
    replacement characters. Only a regular file is read (opened without blocking and checked
    by its handle), so a FIFO or a device swapped in for it is refused, never read forever."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror}") from None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise DataError(f"{path} is not a regular file; pass text files")
        data = file.read()
    offset = data.find(0)
    if offset < 0:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            offset = err.start
    if offset >= 0:
        raise DataError(
            f"{path} is not UTF-8 text (byte 0x{data[offset]:02x} at offset {offset}); pass text files saved as UTF-8"
        )
    controls = len(data) - len(data.translate(None, _NOT_TEXT_CONTROLS))
    if controls > _MOST_CONTROL * len(text):
        raise DataError(f"{path} is not text: {controls} of its {len(text)} characters are control characters")
    return text


def _token_ids(rows, column: str, tokenizer, enough: int | None) -> list[int]:
    """The token ids of the texts in ``rows[column]``, each tokenised on its own (no special
    tokens; empty texts skipped) and concatenated in order.

    Tokenising is batched and lazy: it runs on an iterable dataset, so that it stops once
    ``enough`` ids (if given) are in hand, and writes no cache files (``Dataset.map`` would write
    them next to a dataset read from disk).
    """
    import datasets

    if isinstance(rows, datasets.Dataset):
        if len(rows) == 0:  # to_iterable_dataset cannot shard an empty dataset
            return []
        rows = rows.to_iterable_dataset()

    def tokenize(batch: dict[str, list]) -> dict[str, list]:
        texts = [text for text in batch[column] if text]
        # verbose=False: texts longer than the model's context are expected here (they are cut into blocks below)
        return {"input_ids": tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"] if texts else []}

    ids: list[int] = []
    for row in rows.map(tokenize, batched=True, batch_size=_TEXTS_PER_CALL, remove_columns=[column]):
        ids.extend(row["input_ids"])
        if enough and len(ids) >= enough:
            break
    return ids


def _sequence_length(config: PretrainedConfig, options: EvalOptions) -> int:
    """Tokens per sequence: ``options.seq_len``, by default ``min(128, the model's context)``."""
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None) or 128
    seq_len = options.seq_len or min(128, context)
    if seq_len > context:
        raise DataSettingError(f"{{}} {seq_len} exceeds the model's context of {context} tokens", "seq_len")
    return seq_len


def _text_batches(data, config: PretrainedConfig, tokenizer_folder: Path | None, options: EvalOptions) -> list[Batch]:
    from transformers import AutoTokenizer

    if tokenizer_folder is None:
        raise DataError("text evaluation needs a tokenizer: pass models as folders or Hub ids that include one")
    rows, column = _text_rows(data, options.split, options.name)  # missing data is reported before tokenizer problems
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, trust_remote_code=False)
    except (OSError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise DataError(f"model A ({tokenizer_folder}) has no usable tokenizer for text data: {reason}") from err
    _check_vocabulary(tokenizer, config, tokenizer_folder)
    seq_len = _sequence_length(config, options)
    enough = options.max_batches * options.batch_size * seq_len if options.max_batches else None
    ids = _token_ids(rows, column, tokenizer, enough)
    if (
        len(ids) < seq_len
    ):  # no whole block; transformers 5 gives a folder without tokenizer files a tokenizer that yields nothing
        files = any((Path(tokenizer_folder) / file_name).is_file() for file_name in TOKENIZER_FILES)
        hint = "" if files else f"; {tokenizer_folder} has no tokenizer files: copy model A's tokenizer into it"
        raise DataError(
            f"the text gave {len(ids)} tokens with model A's tokenizer, fewer than one block of {seq_len}{hint}"
        )
    blocks = torch.tensor(ids[: len(ids) // seq_len * seq_len], dtype=torch.long).reshape(-1, seq_len)
    if blocks.numel() and int(blocks.max()) >= config.vocab_size:  # a tokenizer whose size understates its ids
        raise DataError(
            f"model A's tokenizer ({tokenizer_folder}) gave token id {int(blocks.max())}, but the model's vocab_size is "
            f"{config.vocab_size} (ids 0..{config.vocab_size - 1}); pass models whose tokenizer fits their embeddings"
        )
    return [{"input_ids": chunk} for chunk in blocks.split(options.batch_size)]


def _check_vocabulary(tokenizer, config: PretrainedConfig, tokenizer_folder: Path) -> None:
    """Refuse a tokenizer with more tokens (``len(tokenizer)``, added tokens counted) than the
    model has embedding rows (``vocab_size``): an id past the rows fails inside the model's
    embedding, after the alignment, where it is refused here before any work, by the merge and
    its dry run alike. A vocabulary padded beyond the tokenizer (Pythia's 50304 rows for 50277
    tokens) is the common, harmless case."""
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        raise DataError(
            f"model A's tokenizer ({tokenizer_folder}) has {len(tokenizer)} tokens, but the model's vocab_size is "
            f"{vocab_size}: ids {vocab_size}..{len(tokenizer) - 1} have no embedding; pass models whose tokenizer fits "
            "their embeddings (or resize the embeddings where they were trained)"
        )


# -- sequences sampled from the models ---------------------------------------------------------

#: The fitting data (``--data sampled``) that is sequences drawn from the models being merged
#: (language models only): a merge that needs no data of the user's own.
SAMPLED = "sampled"
#: How many sequences are sampled when ``max_batches`` does not say (256 batches of the fitting
#: default of 32, the number learned matching was measured on: docs/decisions.md#d-fit-sampled).
SAMPLED_SEQUENCES = 8192
#: Sequences drawn together, one forward per token for all of them.
_SAMPLING_BATCH = 256


def is_sampled(data) -> bool:
    """Whether ``data`` asks for sequences sampled from the models (:data:`SAMPLED`)."""
    return isinstance(data, str) and data == SAMPLED


def sampled_count(options: EvalOptions) -> int:
    """How many sequences :func:`sample_batches` draws: ``options.max_batches`` batches of
    ``options.batch_size``, else :data:`SAMPLED_SEQUENCES`."""
    return options.max_batches * options.batch_size if options.max_batches else SAMPLED_SEQUENCES


def fitting_batches(
    data,
    config: PretrainedConfig,
    processor_folder: Path | None,
    options: EvalOptions,
    *,
    models: Sequence[PreTrainedModel | Callable[[], PreTrainedModel]] = (),
    progress: bool = True,
) -> list[Batch]:
    """The fitting batches of ``data``: :func:`sample_batches` from ``models`` when ``data`` is
    :data:`SAMPLED` (under a launch the main process samples and sends them to the others), else
    :func:`load_batches` with ``config``'s model and ``processor_folder``'s tokenizer."""
    if not is_sampled(data):
        return load_batches(data, config, processor_folder, options)
    if adapter_for(config).takes_images:
        raise DataError(
            f"{SAMPLED!r} fitting data samples text from language models; an image model needs images (--data)"
        )
    if Path(SAMPLED).exists():
        raise DataError(
            f"{SAMPLED!r} names sequences sampled from the models, and ./{SAMPLED} exists too: write ./{SAMPLED} to fit on it"
        )
    return computed_on_main(
        lambda: sample_batches(models, _sequence_length(config, options), options, progress=progress)
    )


def sample_batches(
    models: Sequence[PreTrainedModel | Callable[[], PreTrainedModel]],
    seq_len: int,
    options: EvalOptions = FIT_OPTIONS,
    *,
    seed: int = 0,
    progress: bool = True,
) -> list[Batch]:
    """Batches of token sequences drawn from ``models`` at temperature 1, an equal share from each,
    shuffled together: ``options.max_batches`` batches of ``options.batch_size`` (by default
    :data:`SAMPLED_SEQUENCES` sequences), each ``seq_len`` tokens.

    Each sequence starts at the model's BOS token (a uniformly drawn token when it has none) and
    continues with tokens drawn from the model's next-token distribution as it is, with no top-k,
    top-p or end-of-sequence rule: the text the model itself puts its probability on. A model
    given as a callable is loaded when its turn comes, so that one model at a time is in memory.
    The same ``seed``, models and device give the same batches; the caller's RNG is not touched.
    """
    total = sampled_count(options)
    shares = [total // len(models) + (k < total % len(models)) for k in range(len(models))]
    rows = []
    with bar(total=total, desc="sampling fitting data", unit="seq", show=progress) as counter:
        for k, (model, share) in enumerate(zip(models, shares)):
            model = model() if callable(model) and not isinstance(model, torch.nn.Module) else model
            rows.append(_sample_sequences(model, share, seq_len, seed + k, counter).cpu())
            del model
    sequences = torch.cat(rows)[torch.randperm(total, generator=torch.Generator().manual_seed(seed))]
    return [{"input_ids": chunk} for chunk in sequences.split(options.batch_size)]


@torch.no_grad()
def _sample_sequences(model: PreTrainedModel, count: int, seq_len: int, seed: int, counter) -> torch.Tensor:
    """``count`` sequences of ``seq_len`` tokens drawn from ``model``, one token at a time with
    its key-value cache. A loop of its own rather than ``generate``, which folds in the
    checkpoint's generation config (a top-k, an end-of-sequence token that stops or is
    suppressed) and so would not draw from the model's distribution as it is."""
    model.eval()
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    vocab = model.config.vocab_size
    bos = getattr(model.config, "bos_token_id", None)
    out = []
    for start in range(0, count, _SAMPLING_BATCH):
        n = min(_SAMPLING_BATCH, count - start)
        if isinstance(bos, int) and 0 <= bos < vocab:
            ids = torch.full((n, 1), bos, dtype=torch.long, device=device)
        else:
            ids = torch.randint(0, vocab, (n, 1), generator=generator, device=device)
        past = None
        for _ in range(seq_len - 1):
            output = model(input_ids=ids if past is None else ids[:, -1:], past_key_values=past, use_cache=True)
            past = output.past_key_values
            probabilities = output.logits[:, -1, :vocab].float().softmax(-1)
            ids = torch.cat([ids, torch.multinomial(probabilities, 1, generator=generator)], dim=1)
        out.append(ids)
        counter.update(n)
    return torch.cat(out)


# -- images ------------------------------------------------------------------------------------


def _check_labels(batches: list[Batch], num_labels: int, data) -> None:
    """Labels that name one of the model's ``num_labels`` classes, as integers: data labelled for
    another model (labels past the classifier's rows) is refused naming the data and the label,
    rather than failing inside the loss or, for float labels, being read as class probabilities."""
    for batch in batches:
        labels = batch["labels"]
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            dtype = str(labels.dtype).removeprefix("torch.")
            raise DataError(f"{describe_data(data)}: labels must be class indices (integers), got {dtype}")
        if labels.numel() and not 0 <= int(labels.min()) <= int(labels.max()) < num_labels:
            bad = int(labels.min()) if int(labels.min()) < 0 else int(labels.max())
            raise DataError(
                f"{describe_data(data)}: label {bad} is not one of the model's {num_labels} classes (0..{num_labels - 1}); "
                "evaluate on data labelled for this model"
            )


def _check_images(batches: list[Batch], config: PretrainedConfig, data) -> None:
    """Image batches the model takes: ``pixel_values`` tensors of ``[images, channels, height,
    width]`` as ``config.json`` sets them (ViT does not resize), at least one image, and one label
    per image; anything else is refused naming the data and the shapes, before any alignment,
    rather than failing inside the model's forward."""
    size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
    expected = (config.num_channels, *size)
    for batch in batches:
        pixels, labels = batch.get("pixel_values"), batch.get("labels")
        if not isinstance(pixels, torch.Tensor) or not isinstance(labels, torch.Tensor):
            found = f"{type(pixels).__name__} and {type(labels).__name__}"
            raise DataError(f"{describe_data(data)}: pixel_values and labels must be tensors, got {found}")
        if pixels.dim() != 4 or tuple(pixels.shape[1:]) != expected:
            raise DataError(
                f"{describe_data(data)}: pixel_values has shape {list(pixels.shape)}, but the model takes images of "
                f"[N, {', '.join(map(str, expected))}] (num_channels, image_size); prepare them with model A's image processor"
            )
        if pixels.shape[0] == 0:
            raise DataError(f"{describe_data(data)}: holds no images")
        if tuple(labels.shape) != (pixels.shape[0],):
            raise DataError(
                f"{describe_data(data)}: labels has shape {list(labels.shape)} for {pixels.shape[0]} images; give one class index per image"
            )


def _image_batches(data, processor_folder: Path | None, options: EvalOptions) -> list[Batch]:
    if isinstance(data, (str, Path)) and str(data).endswith(".pt"):
        if not Path(data).exists():
            raise DataError(f"no such file or folder: {data}")
        source = data
        try:
            data = load_pickled_tensors(Path(data), mmap=False)
        except CheckpointError as err:
            raise DataError(str(err)) from None
        except (OSError, RuntimeError, EOFError) as err:
            raise DataError(
                f"cannot read {data} as a .pt file of image tensors ({type(err).__name__}: {str(err).strip()[:200]})"
            ) from None
        if not isinstance(data, dict):
            raise DataError(
                f"{describe_data(source)} holds a {type(data).__name__}; a .pt file of images holds a dict of 'pixel_values' and 'labels'"
            )
    if isinstance(data, dict):
        if "pixel_values" not in data or "labels" not in data:
            raise DataError("image tensors must be a dict with 'pixel_values' and 'labels'")
        pixels, labels = data["pixel_values"], data["labels"]
        return [
            {"pixel_values": p, "labels": y}
            for p, y in zip(pixels.split(options.batch_size), labels.split(options.batch_size))
        ]
    dataset = _load_dataset(data, options.split, options.name) if isinstance(data, (str, Path)) else data
    columns = dataset.column_names
    label = next((c for c in ("label", "labels", "target") if c in columns), None)
    image = next((c for c in ("pixel_values", "image", "img") if c in columns), None)
    if label is None or image is None:
        raise DataError(f"image dataset needs image and label columns (has {', '.join(columns)})")
    processor = None
    if image != "pixel_values":
        from transformers import AutoImageProcessor

        if processor_folder is None:
            raise DataError("image evaluation needs model A's image processor (preprocessor_config.json)")
        processor = AutoImageProcessor.from_pretrained(processor_folder, trust_remote_code=False)
    batches = []
    n = len(dataset) if options.max_batches is None else min(len(dataset), options.max_batches * options.batch_size)
    for start in range(0, n, options.batch_size):
        rows = dataset[start : min(start + options.batch_size, n)]
        pixels = (
            torch.as_tensor(processor(rows[image], return_tensors="pt")["pixel_values"])
            if processor
            else torch.as_tensor(rows[image])
        )
        batches.append({"pixel_values": pixels.float(), "labels": torch.as_tensor(rows[label])})
    return batches
