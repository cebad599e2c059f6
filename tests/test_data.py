"""Text evaluation data: the token blocks of every data form, lazy tokenising, dataset
configurations, and missing files that must not be tried as Hub dataset ids.

Everything is offline: the tokenizer is a small byte-level BPE (GPT-2's kind) trained here, and
datasets are built in ``tmp_path``.
"""

from __future__ import annotations

from pathlib import Path

import datasets
import pytest
import torch
import transformers as tf

from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.config.options import EvalOptions
from hf_lmc.evaluation.batches import DataError, load_batches

#: Texts whose tokens change when they are joined or split: BPE merges across a boundary
#: ("the " + "cat" is not "the cat"), and a newline is a token of its own.
TEXTS = ["the cat sat on the mat\n", "hello world, hello there\n\n", "a dog and a cat", "the mat", "hello"]
SEQ_LEN = 4


@pytest.fixture(scope="module")
def tokenizer_folder(tmp_path_factory) -> Path:
    """A folder with a GPT-2 config and a byte-level BPE tokenizer trained on ``TEXTS``."""
    from tokenizers import ByteLevelBPETokenizer

    folder = tmp_path_factory.mktemp("model")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXTS * 10, vocab_size=300, min_frequency=1, show_progress=False)
    tf.PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer).save_pretrained(folder)
    tf.GPT2Config(n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0).save_pretrained(folder)
    return folder


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch) -> Path:
    """``datasets``' cache moved into ``tmp_path``, so that tests neither read nor fill ~/.cache."""
    cache = tmp_path / "datasets-cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    return cache


def lm_config():
    return tf.GPT2Config(n_positions=64, vocab_size=300)


def token_ids(folder: Path, texts: list[str]) -> list[int]:
    """Each text tokenised on its own, without special tokens, concatenated."""
    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    return [i for text in texts for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def blocks(ids: list[int], seq_len: int = SEQ_LEN) -> torch.Tensor:
    return torch.tensor(ids[: len(ids) // seq_len * seq_len]).reshape(-1, seq_len)


def loaded_blocks(data, folder: Path, **options) -> torch.Tensor:
    """The blocks of ``data`` as load_batches gives them, stacked back into one tensor."""
    batches = load_batches(data, lm_config(), folder, EvalOptions(batch_size=3, seq_len=SEQ_LEN, **options))
    assert all(batch["input_ids"].dtype == torch.long for batch in batches)
    return torch.cat([batch["input_ids"] for batch in batches])


def test_a_text_file_is_tokenised_as_one_text(tmp_path, tokenizer_folder):
    text = "".join(TEXTS)
    (tmp_path / "eval.txt").write_text(text)
    expected = token_ids(tokenizer_folder, [text])
    assert expected != token_ids(tokenizer_folder, text.splitlines())  # the check below tells the two apart
    assert torch.equal(loaded_blocks(str(tmp_path / "eval.txt"), tokenizer_folder), blocks(expected))
    assert torch.equal(loaded_blocks(tmp_path / "eval.txt", tokenizer_folder), blocks(expected))


def test_a_folder_of_text_files_is_one_text_per_file_in_name_order(tmp_path, tokenizer_folder):
    folder = tmp_path / "texts"
    folder.mkdir()
    for k, text in enumerate(TEXTS):
        (folder / f"{k:02d}.txt").write_text(text)
    (folder / "notes.md").write_text("not read")
    expected = token_ids(tokenizer_folder, TEXTS)
    assert expected != token_ids(tokenizer_folder, ["".join(TEXTS)])
    assert torch.equal(loaded_blocks(str(folder), tokenizer_folder), blocks(expected))


def test_a_list_of_strings_is_one_text_per_string(tokenizer_folder):
    texts = [*TEXTS[:2], "", *TEXTS[2:]]
    expected = token_ids(tokenizer_folder, texts)
    assert expected != token_ids(tokenizer_folder, ["".join(texts)])
    assert torch.equal(loaded_blocks(texts, tokenizer_folder), blocks(expected))
    assert torch.equal(loaded_blocks(tuple(texts), tokenizer_folder), blocks(expected))


def test_a_saved_dataset_is_one_text_per_row_and_writes_nothing(tmp_path, tokenizer_folder, datasets_cache):
    rows = [TEXTS[0], "", TEXTS[1], None, *TEXTS[2:]]
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"id": list(range(len(rows))), "text": rows}).save_to_disk(str(saved))
    files_before = sorted(saved.rglob("*"))
    expected = token_ids(tokenizer_folder, [text for text in rows if text])
    assert torch.equal(loaded_blocks(str(saved), tokenizer_folder), blocks(expected))
    # Dataset.map would write cache-*.arrow files next to the saved dataset (or into the cache)
    assert sorted(saved.rglob("*")) == files_before
    assert not datasets_cache.exists() or not any(datasets_cache.rglob("*.arrow"))


def test_a_dataset_without_a_text_column_uses_its_first_string_column(tokenizer_folder):
    dataset = datasets.Dataset.from_dict({"id": [1, 2, 3], "sentence": TEXTS[:3], "other": ["x y z"] * 3})
    expected = token_ids(tokenizer_folder, TEXTS[:3])
    assert torch.equal(loaded_blocks(dataset, tokenizer_folder), blocks(expected))
    with pytest.raises(DataError, match=r"dataset has no text column \(columns: id\)"):
        load_batches(datasets.Dataset.from_dict({"id": [1, 2]}), lm_config(), tokenizer_folder, EvalOptions())


def test_max_batches_tokenises_only_the_rows_it_needs(tokenizer_folder, monkeypatch):
    rows = [TEXTS[k % len(TEXTS)] for k in range(5000)]
    tokenized = []

    class CountingTokenizer:
        """model A's tokenizer, recording every text it is asked to tokenise."""

        def __init__(self, inner):
            self.inner = inner

        def __call__(self, texts, **kwargs):
            tokenized.extend([texts] if isinstance(texts, str) else texts)
            return self.inner(texts, **kwargs)

        def __getattr__(self, attribute):
            return getattr(self.inner, attribute)

        def __len__(self):  # special methods are looked up on the type, not through __getattr__
            return len(self.inner)

    expected = blocks(token_ids(tokenizer_folder, rows[:10]))[
        :2
    ]  # one batch: 2 blocks of 4 tokens, from the first few rows
    real_from_pretrained = tf.AutoTokenizer.from_pretrained
    monkeypatch.setattr(
        tf.AutoTokenizer,
        "from_pretrained",
        lambda *args, **kwargs: CountingTokenizer(real_from_pretrained(*args, **kwargs)),
    )
    batches = load_batches(
        datasets.Dataset.from_dict({"text": rows}),
        lm_config(),
        tokenizer_folder,
        EvalOptions(batch_size=2, seq_len=SEQ_LEN, max_batches=1),
    )
    assert len(batches) == 1
    assert torch.equal(batches[0]["input_ids"], expected)
    assert 0 < len(tokenized) < len(rows) // 2


def test_fewer_tokens_than_a_block_names_missing_tokenizer_files(tmp_path, tokenizer_folder):
    with pytest.raises(DataError, match="fewer than one block of 60$"):
        load_batches(["the cat"], lm_config(), tokenizer_folder, EvalOptions(seq_len=60))
    for empty in ([], datasets.Dataset.from_dict({"text": []})):
        with pytest.raises(DataError, match="gave 0 tokens .* fewer than one block of 4$"):
            load_batches(empty, lm_config(), tokenizer_folder, EvalOptions(seq_len=SEQ_LEN))
    bare = tmp_path / "bare"
    tf.GPT2Config(n_positions=64, vocab_size=300, bos_token_id=0, eos_token_id=0).save_pretrained(bare)
    with pytest.raises(DataError, match=f"gave 0 tokens .*; {bare} has no tokenizer files"):
        load_batches(TEXTS, lm_config(), bare, EvalOptions(seq_len=SEQ_LEN))


def configurations_folder(tmp_path: Path) -> Path:
    """A data folder whose README declares two configurations, each a CSV with a text column."""
    folder = tmp_path / "two-configs"
    folder.mkdir()
    (folder / "README.md").write_text(
        "---\nconfigs:\n- config_name: first\n  data_files: first.csv\n- config_name: second\n  data_files: second.csv\n---\n"
    )
    (folder / "first.csv").write_text("text\nthe cat sat\nhello world\n")
    (folder / "second.csv").write_text("text\nthe mat\nhello there\na dog and a cat\n")
    return folder


def test_a_dataset_with_several_configurations_needs_a_name(tmp_path, tokenizer_folder):
    folder = configurations_folder(tmp_path)
    options = EvalOptions(batch_size=3, seq_len=SEQ_LEN, split="train")
    with pytest.raises(DataError) as missing:
        load_batches(folder, lm_config(), tokenizer_folder, options)  # a Path: named with str(), never PosixPath(...)
    assert str(missing.value).startswith(f"{folder} has several configurations (first, second): name one")
    with pytest.raises(DataError) as unknown:
        load_batches(str(folder), lm_config(), tokenizer_folder, options.model_copy(update={"name": "third"}))
    assert str(unknown.value) == f"{folder} has no configuration 'third' (has first, second)"
    batches = load_batches(folder, lm_config(), tokenizer_folder, options.model_copy(update={"name": "second"}))
    expected = token_ids(tokenizer_folder, ["the mat", "hello there", "a dog and a cat"])
    assert torch.equal(torch.cat([batch["input_ids"] for batch in batches]), blocks(expected))


@pytest.mark.parametrize("reference", ["wikitext", "Salesforce/wikitext", "org/name-v1.2"])
def test_hub_ids_go_to_load_dataset_with_the_configuration(reference, tmp_path, tokenizer_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_load_dataset(path, name=None, *, split=None, **kwargs):
        calls.append((path, name, split))
        return datasets.Dataset.from_dict({"text": TEXTS})

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    batches = load_batches(reference, lm_config(), tokenizer_folder, EvalOptions(seq_len=SEQ_LEN, name="raw"))
    assert calls == [(reference, "raw", "test")]
    assert torch.equal(torch.cat([batch["input_ids"] for batch in batches]), blocks(token_ids(tokenizer_folder, TEXTS)))


@pytest.mark.parametrize(
    "reference",
    [
        "eval.tx",
        "eval.txt",
        "data/eval.json",
        "images.pt",
        "corpus.csv",
        "./eval",
        "../eval",
        "/no/such/eval",
        "~/eval",
        "a/b/c",
    ],
)
@pytest.mark.parametrize("model_type", ["gpt2", "vit"])
def test_a_missing_file_is_reported_without_trying_the_hub(
    reference, model_type, tmp_path, tokenizer_folder, monkeypatch
):
    monkeypatch.chdir(tmp_path)

    def no_hub(*args, **kwargs):
        pytest.fail(f"{reference!r} was tried as a Hub dataset id")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    config = lm_config() if model_type == "gpt2" else tiny_configs()["vit"]
    with pytest.raises(DataError) as missing:
        load_batches(reference, config, tokenizer_folder, EvalOptions())
    assert str(missing.value) == f"no such file or folder: {reference}"


def test_a_missing_path_object_is_reported_by_its_name(tmp_path, tokenizer_folder, monkeypatch):
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *args, **kwargs: pytest.fail("a Path was tried as a Hub dataset id")
    )
    with pytest.raises(DataError) as missing:
        load_batches(tmp_path / "corpus", lm_config(), tokenizer_folder, EvalOptions())
    assert str(missing.value) == f"no such file or folder: {tmp_path / 'corpus'}"
