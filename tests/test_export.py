"""Export, model card and Hub push: the pieces that turn a canonical model into a published folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib
import torch
from huggingface_hub import ModelCard
from safetensors import safe_open
from safetensors.torch import load_file

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.canonical.form import CanonicalModel
from hf_lmc.io import export
from hf_lmc.io.card import TEMPLATE, inherited_license, merge_card
from hf_lmc.io.export import PROCESSOR_FILES, parse_size, save_canonical
from hf_lmc.io.hub import push_folder
from tests.models import (
    MODEL_CLASSES,
    build_model,
    char_tokenizer_folder,
    float64_rmsnorm,
    logits,
    relative_error,
    sample_inputs,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARD = "2KB"  # the tiny models hold 4-10 KB of float32 weights: several shards each


def _canonical(arch: str, seed: int = 0) -> CanonicalModel:
    return hf_lmc.canonicalize(build_model(tiny_configs()[arch], seed=seed, dtype=torch.float32))


def _stored(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """``key -> (file name, tensor)`` for every tensor in ``folder``'s safetensors files."""
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            assert f.metadata() == {"format": "pt"}
            out |= {key: (file.name, f.get_tensor(key)) for key in f.keys()}  # noqa: SIM118 (safe_open has no iteration)
    return out


def _no_temp_folders(parent: Path) -> bool:
    return not any(".tmp-" in p.name for p in parent.iterdir())


# -- save_canonical: what is written ----------------------------------------------------------------


@pytest.mark.parametrize(
    "arch,symmetry", [("gpt2", False), ("gpt_neox", False), ("llama", False), ("vit", False), ("llama", True)]
)
def test_saved_folder_reloads_with_the_exported_function(arch, symmetry, tmp_path):
    canonical = _canonical(arch)
    if symmetry:
        canonical = hf_lmc.random_symmetry(canonical.spec, seed=1, dtype=torch.float32).apply(canonical)
    out = save_canonical(canonical, tmp_path / "out", shard_size=SHARD, progress=False)

    assert out == tmp_path / "out" and _no_temp_folders(tmp_path)
    expected = hf_lmc.to_hf(canonical)
    reloaded, info = MODEL_CLASSES[arch].from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    inputs = sample_inputs(expected.config)
    assert relative_error(logits(reloaded.eval(), inputs), logits(expected, inputs)) < 1e-6

    # transformers' sharded layout: model-0000i-of-0000N.safetensors + an index naming every tensor
    stored = _stored(out)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n > 1 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {key: file for key, (file, _) in stored.items()}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for _, t in stored.values())
    assert index["metadata"]["total_parameters"] == reloaded.num_parameters()  # what save_pretrained records
    assert (out / "generation_config.json").is_file() == (arch != "vit")


def test_one_shard_is_a_single_model_safetensors(tmp_path):
    out = save_canonical(_canonical("gpt2"), tmp_path / "out", progress=False)  # default size: everything fits
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    assert not any(p.suffix == ".tmp" for p in out.iterdir())


def test_shards_are_flushed_as_they_fill(tmp_path, monkeypatch):
    """Streaming: a shard hits the disk before the last layer is computed, and none overflows."""
    source = build_model(tiny_configs()["llama"], dtype=torch.float32)
    source.save_pretrained(tmp_path / "src", max_shard_size="2KB")
    lazy = hf_lmc.canonicalize(tmp_path / "src")  # folder-backed: read one layer at a time
    loaded, writes = [], []

    def load(group, rows=None):
        loaded.append(group)
        return lazy.load_group(group, rows)

    real_flush = export._ShardWriter.flush

    def flush(writer):
        if writer.entries:
            writes.append((set(loaded), writer.offset, len(writer.entries)))
        real_flush(writer)

    monkeypatch.setattr(export._ShardWriter, "flush", flush)
    canonical = CanonicalModel(lazy.spec, lazy.config, load)
    out = save_canonical(canonical, tmp_path / "out", shard_size=SHARD, progress=False)

    last_layer = canonical.spec.num_layers - 1
    assert len(writes) > 2 and last_layer not in writes[0][0]  # export_config has read embed and head only
    assert all(size <= parse_size(SHARD) or count == 1 for _, size, count in writes)
    reloaded = MODEL_CLASSES["llama"].from_pretrained(out).eval()
    inputs = sample_inputs(source.config)
    assert relative_error(logits(reloaded, inputs), logits(source, inputs)) < 1e-5


def test_dtype_casts_every_tensor_and_the_config(tmp_path):
    canonical = _canonical("gpt_neox")
    out = save_canonical(canonical, tmp_path / "out", shard_size=SHARD, dtype=torch.bfloat16, progress=False)
    assert {t.dtype for _, t in _stored(out).values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert canonical.config.dtype != torch.bfloat16  # the source config is left alone
    reloaded = MODEL_CLASSES["gpt_neox"].from_pretrained(out).eval()
    expected = hf_lmc.to_hf(canonical)
    inputs = sample_inputs(expected.config)
    assert reloaded.dtype == torch.bfloat16
    assert relative_error(logits(reloaded, inputs).float(), logits(expected, inputs)) < 0.1


def test_processor_files_and_card_are_written(tmp_path):
    config = tiny_configs()["gpt2"]
    source = char_tokenizer_folder(tmp_path / "src", config.vocab_size)
    (source / "notes.txt").write_text("not a tokenizer file")
    card = merge_card(
        base_models=["a", "b"],
        method="weight",
        symmetries="residual",
        alpha_or_weights=0.5,
        license="mit",
        model_type="gpt2",
        tied_embeddings_dropped=False,
    )
    out = save_canonical(_canonical("gpt2"), tmp_path / "out", source_folder=source, card=card, progress=False)

    present = [name for name in PROCESSOR_FILES if (source / name).is_file()]
    assert "tokenizer.json" in present
    assert all((out / name).read_bytes() == (source / name).read_bytes() for name in present)
    assert not (out / "notes.txt").exists()
    assert ModelCard.load(out / "README.md").data.to_dict()["license"] == "mit"


@pytest.mark.parametrize("max_length", ["context", 100])
def test_the_generation_config_restates_no_context_and_keeps_the_rest(tmp_path, max_length):
    """A's ``max_length`` equal to the context (as the zoo writes it) becomes ``max_new_tokens`` of
    half the context, so a stock pipeline call with ``max_new_tokens`` logs no "both were set"
    warning and a bare call stays in bounds; any other ``max_length`` and every other value of
    A's are kept."""
    import logging
    import warnings

    from transformers import GenerationConfig, pipeline

    config = tiny_configs()["llama"]
    length = config.max_position_embeddings if max_length == "context" else max_length
    source = char_tokenizer_folder(tmp_path / "src", config.vocab_size)
    GenerationConfig(eos_token_id=[0, 3], do_sample=True, top_k=5, max_length=length).save_pretrained(source)
    out = save_canonical(_canonical("llama"), tmp_path / "out", source_folder=source, progress=False)
    written = json.loads((out / "generation_config.json").read_text())
    assert (written["eos_token_id"], written["do_sample"], written["top_k"]) == ([0, 3], True, 5)
    assert written.get("max_length") == (None if max_length == "context" else max_length)
    if max_length != "context":
        return

    class Collect(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())

    messages, handler = [], Collect(logging.WARNING)
    logging.getLogger("transformers").addHandler(handler)  # transformers' loggers do not propagate to root
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipeline("text-generation", model=str(out))("abc", max_new_tokens=8)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert not messages and not caught, (messages, [str(w.message) for w in caught])
    assert written["max_new_tokens"] == config.max_position_embeddings // 2  # a bare call stays inside the context
    pipeline("text-generation", model=str(out))("abc")


def test_shard_sizes_parse():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MB") == 5 * 10**8
    assert parse_size("2GiB") == 2 * 2**30 and parse_size(1234) == 1234 and parse_size("1.5KB") == 1500
    for bad in ("five GB", "0", -1):
        with pytest.raises(ValueError, match="shard size"):
            parse_size(bad)


# -- save_canonical: atomic -------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


def _fail_on_second_shard(monkeypatch):
    real_flush, calls = export._ShardWriter.flush, []

    def flush(writer):
        if writer.entries:
            calls.append(1)
            if len(calls) == 2:
                raise Boom("disk full")
        real_flush(writer)

    monkeypatch.setattr(export._ShardWriter, "flush", flush)


def _fail_in_a_layer(canonical: CanonicalModel) -> CanonicalModel:
    def load(group, rows=None):
        if group == 1:
            raise Boom("cannot read layer 1")
        return canonical.load_group(group, rows)

    return CanonicalModel(canonical.spec, canonical.config, load)


class _FailingCard:
    def save(self, path):
        raise KeyboardInterrupt  # even an interrupt after every shard is written leaves nothing


@pytest.mark.parametrize("where", ["shard", "layer", "card"])
def test_a_failure_mid_write_leaves_nothing(where, tmp_path, monkeypatch):
    canonical, card = _canonical("llama"), None
    if where == "shard":
        _fail_on_second_shard(monkeypatch)
    elif where == "layer":
        canonical = _fail_in_a_layer(canonical)
    else:
        card = _FailingCard()
    with pytest.raises(KeyboardInterrupt if where == "card" else Boom):
        save_canonical(canonical, tmp_path / "out", shard_size=SHARD, card=card, progress=False)
    assert list(tmp_path.iterdir()) == []


def test_existing_output_needs_overwrite_and_is_replaced_only_when_complete(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite") as err:  # the library names its parameter; the CLI, its flag
        save_canonical(_canonical("gpt2"), out, progress=False)
    assert "\n" not in str(err.value) and err.value.parameter == "overwrite"
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and _no_temp_folders(tmp_path)

    from hf_lmc.io.outputs import MARKER, mark

    mark(out, "merge")  # as an earlier merge leaves it: hf_lmc's, so --overwrite may replace it
    _fail_on_second_shard(monkeypatch)  # a failed overwrite keeps the old folder
    with pytest.raises(Boom):
        save_canonical(_canonical("gpt2"), out, shard_size=SHARD, overwrite=True, progress=False)
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "keep.txt"] and _no_temp_folders(tmp_path)

    monkeypatch.undo()
    save_canonical(_canonical("gpt2"), out, shard_size=SHARD, overwrite=True, progress=False)
    assert not (out / "keep.txt").exists() and (out / "config.json").is_file() and _no_temp_folders(tmp_path)


# -- model card -------------------------------------------------------------------------------------

TABLE = "| method | barrier |\n|---|---|\n| average | 1.234 |\n| weight | 0.012 |"


def _card(**overrides) -> ModelCard:
    options = {
        "base_models": ["org/model-a", "./local/model-b"],
        "method": "weight",
        "symmetries": ["heads", "mlp", "residual"],
        "alpha_or_weights": 0.3,
        "license": "apache-2.0",
        "model_type": "llama",
        "tied_embeddings_dropped": True,
        "barrier_table": TABLE,
        "plot_filename": "loss_along_path.png",
        "notes": ["Trained on different seeds."],
    }
    return merge_card(**options | overrides)


def test_card_metadata():
    assert _card().data.to_dict() == {
        "base_model": ["org/model-a"],  # a Hub id; the local model is described in the body
        "base_model_relation": "merge",
        "library_name": "transformers",
        "license": "apache-2.0",
        "tags": ["merge", "hf-lmc", "linear-mode-connectivity", "llama"],
    }
    assert "license" not in _card(license=None).data.to_dict()


def test_card_body():
    text = _card().text
    assert "linear mode connectivity" in text and "`weight`" in text and "weight matching" in text
    assert "heads, mlp, residual" in text and "| 0.3 |" in text
    assert "[`org/model-a`](https://huggingface.co/org/model-a) and `model-b` (a local model)" in text
    assert TABLE in text and "![loss along the path](loss_along_path.png)" in text
    assert "tie_word_embeddings=False" in text and "- Trained on different seeds." in text
    assert 'AutoModelForCausalLM.from_pretrained("' in text  # the task class, not the bare backbone
    assert "AutoModelForImageClassification.from_pretrained(" in _card(model_type="vit").text

    plain = _card(
        method="average",
        symmetries=[],
        alpha_or_weights=[0.5, 0.5],
        barrier_table=None,
        plot_filename=None,
        tied_embeddings_dropped=False,
        notes=(),
    ).text
    assert "[0.5, 0.5]" in plain and "none (plain average" in plain and "weight matching" not in plain
    assert "Loss barrier" not in plain and "![" not in plain and "tie_word_embeddings" not in plain


def test_card_round_trips_through_readme(tmp_path):
    card = _card()
    card.save(tmp_path / "README.md")
    loaded = ModelCard.load(tmp_path / "README.md")
    assert loaded.data.to_dict() == card.data.to_dict() and TABLE in loaded.text


def _readme(folder: Path, front_matter: str | None) -> Path:
    folder.mkdir()
    text = f"---\n{front_matter}\n---\n\n# A model\n" if front_matter is not None else "# No metadata\n"
    (folder / "README.md").write_text(text)
    return folder


def test_inherited_license(tmp_path):
    mit_a, mit_b = _readme(tmp_path / "a", "license: mit"), _readme(tmp_path / "b", "license: mit\ntags: [x]")
    apache = _readme(tmp_path / "c", "license: apache-2.0")
    bare, plain = _readme(tmp_path / "d", None), _readme(tmp_path / "e", "tags: [x]")
    (no_card := tmp_path / "f").mkdir()
    assert inherited_license([mit_a, mit_b]) == "mit"
    assert inherited_license([mit_a, bare, plain, no_card]) == "mit"  # only cards that name one vote
    assert inherited_license([mit_a, apache]) is None
    assert inherited_license([bare, no_card]) is None


def test_card_template_ships_inside_the_package():
    package = Path(hf_lmc.__file__).parent
    assert Path(str(TEMPLATE)) == package / "templates" / "merge.md" and Path(str(TEMPLATE)).is_file()
    link = REPO_ROOT / "model_cards" / "merge.md"
    pyproject = REPO_ROOT / "pyproject.toml"
    if not pyproject.is_file():
        pytest.skip("not a source checkout")
    assert link.is_symlink() and link.resolve() == (package / "templates" / "merge.md").resolve()
    package_data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["hf_lmc"]
    assert "templates/*.md" in package_data


# -- push to the Hub --------------------------------------------------------------------------------


class RecordingApi:
    """Stands in for ``HfApi``: records calls, touches no network."""

    def __init__(self):
        self.calls: list[tuple[str, tuple, dict]] = []

    def create_repo(self, *args, **kwargs):
        self.calls.append(("create_repo", args, kwargs))
        return f"https://huggingface.co/{args[0] if args else kwargs['repo_id']}"

    def upload_folder(self, *args, **kwargs):
        self.calls.append(("upload_folder", args, kwargs))


def _repo_id(args: tuple, kwargs: dict) -> str:
    return args[0] if args else kwargs["repo_id"]


def test_push_folder_creates_the_repo_then_uploads(tmp_path):
    api = RecordingApi()
    url = push_folder(tmp_path, "user/merged", private=True, revision="dev", commit_message="merge v2", api=api)
    assert url == "https://huggingface.co/user/merged"
    (create, c_args, c_kwargs), (upload, u_args, u_kwargs) = api.calls
    assert (create, _repo_id(c_args, c_kwargs)) == ("create_repo", "user/merged")
    assert c_kwargs["private"] is True and c_kwargs["exist_ok"] is True
    assert c_kwargs.get("repo_type", "model") == "model"
    assert (upload, _repo_id(u_args, u_kwargs)) == ("upload_folder", "user/merged")
    assert Path(u_kwargs["folder_path"]) == tmp_path
    assert u_kwargs["commit_message"] == "merge v2" and u_kwargs["revision"] == "dev"


def test_push_folder_defaults(tmp_path):
    api = RecordingApi()
    push_folder(tmp_path, "user/merged", api=api)
    (_, _, c_kwargs), (_, _, u_kwargs) = api.calls
    assert c_kwargs["private"] is False and u_kwargs["revision"] is None
    assert u_kwargs["commit_message"] == "Upload merge made with hf-lmc"


@pytest.mark.parametrize(
    "reserve, reserve_from",
    [(64 << 10, 1 << 62), (64 << 10, 0), (128, 0)],
    ids=["header-then-copy", "header-in-place", "reserve-too-small"],
)
def test_streamed_shards_are_standard_safetensors(tmp_path, monkeypatch, reserve, reserve_from):
    """Every way a shard gets its header (written in front of a copy of the data, in a reserved
    space in front of it, or copied after all when it outgrows that space) gives a shard that
    safetensors reads back bit for bit."""
    monkeypatch.setattr(export._ShardWriter, "HEADER_RESERVE", reserve)
    monkeypatch.setattr(export._ShardWriter, "HEADER_RESERVE_FROM", reserve_from)
    copies = []
    real_copy = export._copy_file
    monkeypatch.setattr(export, "_copy_file", lambda src, dst, size: copies.append(size) or real_copy(src, dst, size))
    tensors = {
        "a": torch.randn(3, 4),
        "b": torch.randn(5).bfloat16(),
        "c": torch.tensor(2.5, dtype=torch.float16),
        "d": torch.arange(6).reshape(2, 3),
        "e": torch.tensor([True, False]),
        "f": torch.empty(0, 3),
        "g": torch.randn(2, 2, dtype=torch.float64).T,  # not contiguous
    }
    writer = export._ShardWriter(tmp_path, max_bytes=40)
    for key, tensor in tensors.items():
        writer.add(key, tensor)
    writer.finish()
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and not list(tmp_path.glob("*.data"))
    loaded = {}
    for file in files:
        loaded |= load_file(file)
        with safe_open(file, "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
    for key, tensor in tensors.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(tensors)
    assert (not copies) == (reserve_from == 0 and reserve > 128)  # in place: each byte written once


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_vocabulary_groups_stream_in_row_blocks(tmp_path, arch, tied):
    """Embed and head in blocks of token rows (canonicalise -> transform -> lerp -> export) write
    the checkpoint whole groups write, and a folder's row window is a slice of the whole (both to
    float32 rounding: BLAS may order a short block's sums differently)."""
    from safetensors.torch import load_file

    from hf_lmc.canonical.form import hf_state_dict_groups, interpolate
    from hf_lmc.io.export import write_checkpoint

    config = tiny_configs()[arch]
    config.tie_word_embeddings = tied
    for seed in (1, 2):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(tmp_path / f"m{seed}")
    a, b = (
        hf_lmc.canonicalize(tmp_path / "m1", dtype=torch.float32),
        hf_lmc.canonicalize(tmp_path / "m2", dtype=torch.float32),
    )
    moved = hf_lmc.random_symmetry(b.spec, seed=4, dtype=torch.float32).apply(b)
    for group in ("embed", "head"):
        whole = moved.group(group)
        window = moved.group(group, slice(3, 11))
        for name, t in whole.items():
            expected = t[3:11] if name in a.spec.token_row_names() else t
            torch.testing.assert_close(window[name], expected, rtol=1e-6, atol=1e-7, msg=name)

    merged = interpolate(a, moved, 0.3)
    config_out = hf_lmc.canonical.form.export_config(merged)
    for rows, name in ((None, "whole"), (5, "blocks")):  # 17 tokens: blocks of 5, 5, 5, 2
        write_checkpoint(
            hf_state_dict_groups(merged, config_out, block_rows=rows), config_out, tmp_path / name, progress=False
        )
    whole, blocked = (
        load_file(tmp_path / "whole" / "model.safetensors"),
        load_file(tmp_path / "blocks" / "model.safetensors"),
    )
    assert whole.keys() == blocked.keys()
    for key in whole:
        torch.testing.assert_close(blocked[key], whole[key], rtol=1e-6, atol=1e-7, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "llama"])
@pytest.mark.parametrize("tied", [False, True])
def test_row_block_export_of_a_moved_model_computes_the_stock_model(tmp_path, arch, tied):
    """End to end, in float64: a model read from its folder in row windows, moved by a random
    symmetry and exported in blocks of 5 token rows, loads in the stock class as the function it
    was made from."""
    from hf_lmc.canonical.form import export_config, hf_state_dict_groups
    from hf_lmc.io.export import write_checkpoint

    config = tiny_configs()[arch]
    config.tie_word_embeddings = tied
    source = build_model(config, seed=1, dtype=torch.float64).eval()
    source.save_pretrained(tmp_path / "source")
    canonical = hf_lmc.canonicalize(tmp_path / "source", dtype=torch.float64)
    moved = hf_lmc.random_symmetry(canonical.spec, seed=3, dtype=torch.float64).apply(canonical)
    out_config = export_config(moved)
    assert out_config.vocab_size > 5  # several blocks, the last one short
    write_checkpoint(
        hf_state_dict_groups(moved, out_config, block_rows=5), out_config, tmp_path / "out", progress=False
    )
    reloaded = MODEL_CLASSES[arch].from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    inputs = sample_inputs(source.config)
    with float64_rmsnorm():  # stock LlamaRMSNorm rounds to float32 inside
        assert relative_error(logits(reloaded, inputs), logits(source, inputs)) < 1e-10


def test_row_block_export_reads_each_vocabulary_row_once(tmp_path, monkeypatch):
    """Streaming the embedding and head in row blocks reads each block's rows from the file, not
    the whole vocabulary tensor per block (at Pythia-1B that was 7 whole reads of each)."""
    from hf_lmc.canonical.form import hf_state_dict_groups
    from hf_lmc.io.checkpoint import SafetensorsFile
    from hf_lmc.io.export import write_checkpoint

    config = tiny_configs()["gpt_neox"]
    build_model(config, seed=1, dtype=torch.float32).save_pretrained(tmp_path / "m")
    model = hf_lmc.canonicalize(tmp_path / "m", dtype=torch.float32)
    rows_read: dict[str, int] = {}
    original = SafetensorsFile.get_rows

    def counting(self, name, rows):
        tensor = original(self, name, rows)
        rows_read[name] = rows_read.get(name, 0) + (tensor.shape[0] if tensor.dim() else 1)
        return tensor

    monkeypatch.setattr(SafetensorsFile, "get_rows", counting)
    config_out = hf_lmc.canonical.form.export_config(model, dtype=torch.float32)
    rows_read.clear()
    write_checkpoint(
        hf_state_dict_groups(model, config_out, block_rows=5), config_out, tmp_path / "out", progress=False
    )
    vocab = config.vocab_size
    assert vocab > 5  # several blocks
    for key in ("gpt_neox.embed_in.weight", "embed_out.weight"):
        assert rows_read[key] == vocab, (key, rows_read[key])
