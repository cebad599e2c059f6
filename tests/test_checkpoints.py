"""Lazy safetensors backing, legacy (transformers 4.x) key names, and unsupported inputs."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from safetensors.torch import save_file

import hf_lmc
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.io.checkpoint import Checkpoint
from tests.models import MODEL_CLASSES, build_model, float64_rmsnorm, logits, relative_error, sample_inputs

TINY = tiny_configs()


@pytest.mark.parametrize("arch", sorted(TINY))
def test_folder_backed_canonical_matches_in_memory(arch, tmp_path):
    model = build_model(TINY[arch], dtype=torch.float64)
    model.save_pretrained(tmp_path, max_shard_size="4KB")  # several shards + index
    assert (tmp_path / "model.safetensors.index.json").is_file()

    in_memory = hf_lmc.canonicalize(model).state_dict()
    lazy = hf_lmc.canonicalize(tmp_path)
    assert set(lazy.state_dict()) == set(in_memory)
    for name, tensor in lazy.state_dict().items():
        # Same math on the same values; only BLAS summation order may differ (mmap alignment).
        torch.testing.assert_close(tensor, in_memory[name], rtol=1e-13, atol=1e-15, msg=name)

    with float64_rmsnorm():
        inputs = sample_inputs(model.config, dtype=torch.float64)
        transform = hf_lmc.random_symmetry(lazy.spec, seed=3)
        exported = hf_lmc.to_hf(transform.apply(lazy))
        assert relative_error(logits(exported, inputs), logits(model, inputs)) < 1e-9


def test_folder_backed_canonical_reads_one_layer_at_a_time(tmp_path, monkeypatch):
    model = build_model(TINY["llama"], dtype=torch.float32)
    model.save_pretrained(tmp_path)
    reads: list[str] = []
    original = Checkpoint.__getitem__
    monkeypatch.setattr(Checkpoint, "__getitem__", lambda self, key: reads.append(key) or original(self, key))

    canonical = hf_lmc.canonicalize(tmp_path)
    assert reads == []  # nothing is read up front
    layer = canonical.group(1)
    assert layer and all(key.startswith("model.layers.1.") for key in reads)
    first = list(reads)
    reads.clear()
    canonical.group(1)
    assert reads == first  # nothing is cached: memory holds the group being worked on, no more


def _resave_with_keys(model, folder, rename) -> None:
    """Write ``model`` as a checkpoint whose keys went through ``rename`` (old naming)."""
    folder.mkdir()
    tied = getattr(model.config, "tie_word_embeddings", False)
    state = {rename(k): v.clone() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(folder)


def _legacy_vit_key(key: str) -> str:
    for new, old in (
        (".layers.", ".encoder.layer."),
        (".attention.q_proj.", ".attention.attention.query."),
        (".attention.k_proj.", ".attention.attention.key."),
        (".attention.v_proj.", ".attention.attention.value."),
        (".attention.o_proj.", ".attention.output.dense."),
        (".mlp.fc1.", ".intermediate.dense."),
        (".mlp.fc2.", ".output.dense."),
    ):
        key = key.replace(new, old)
    return key


LEGACY = {
    "gpt_neox": lambda k: k.replace("lm_head.", "embed_out."),
    "vit": _legacy_vit_key,
    "gpt2": lambda k: k.removeprefix("transformer."),  # saved from GPT2Model, as the gpt2 repo is
}


@pytest.mark.parametrize("arch", sorted(LEGACY))
def test_legacy_key_names_load(arch, tmp_path):
    model = build_model(TINY[arch], dtype=torch.float32)
    folder = tmp_path / "legacy"
    _resave_with_keys(model, folder, LEGACY[arch])
    keys = json.loads((folder / "model.safetensors").read_bytes()[8:].split(b"}}", 1)[0] + b"}}").keys()
    assert any(LEGACY[arch](k) != k for k in model.state_dict()), "fixture must really use legacy names"
    assert not set(keys) <= set(model.state_dict())

    inputs = sample_inputs(model.config, dtype=torch.float32)
    expected = logits(model, inputs)
    exported = hf_lmc.to_hf(hf_lmc.canonicalize(folder))
    assert relative_error(logits(exported, inputs), expected) < 1e-5
    stock = MODEL_CLASSES[arch].from_pretrained(folder).eval()  # transformers agrees on the renames
    assert relative_error(logits(stock, inputs), expected) < 1e-6


def test_unsupported_model_type_names_supported_ones():
    bert = tf.BertForMaskedLM(
        tf.BertConfig(hidden_size=8, num_attention_heads=2, num_hidden_layers=1, intermediate_size=8)
    )
    with pytest.raises(
        hf_lmc.UnsupportedModelError, match="GPT2LMHeadModel.*LlamaForCausalLM.*ViTForImageClassification"
    ):
        hf_lmc.canonicalize(bert)


def test_headless_model_of_supported_type_is_rejected():
    with pytest.raises(hf_lmc.UnsupportedModelError, match="pass a GPT2LMHeadModel"):
        hf_lmc.canonicalize(tf.GPT2Model(TINY["gpt2"]))


def test_folder_without_weights_says_what_is_missing(tmp_path):
    TINY["llama"].save_pretrained(tmp_path)
    with pytest.raises(hf_lmc.CheckpointError, match="no weights in"):
        hf_lmc.canonicalize(tmp_path)


def test_missing_shard_is_reported(tmp_path):
    build_model(TINY["llama"], dtype=torch.float32).save_pretrained(tmp_path, max_shard_size="2KB")
    shard = max(tmp_path.glob("model-*.safetensors"))
    shard.unlink()
    with pytest.raises(hf_lmc.CheckpointError, match=shard.name):
        hf_lmc.canonicalize(tmp_path)


def test_corrupt_shard_is_reported(tmp_path):
    build_model(TINY["llama"], dtype=torch.float32).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(hf_lmc.CheckpointError, match="corrupt"):
        hf_lmc.canonicalize(tmp_path)


def test_pytorch_bin_checkpoints_load(tmp_path):
    model = build_model(TINY["gpt_neox"], dtype=torch.float32)
    model.config.save_pretrained(tmp_path)
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, tmp_path / "pytorch_model.bin")
    inputs = sample_inputs(model.config)
    exported = hf_lmc.to_hf(hf_lmc.canonicalize(tmp_path))
    assert relative_error(logits(exported, inputs), logits(model, inputs)) < 1e-5


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_weights_are_named(tmp_path, value):
    model = build_model(TINY["vit"], dtype=torch.float32)
    with torch.no_grad():
        model.vit.layers[1].mlp.fc1.weight[0, 0] = value
    with pytest.raises(hf_lmc.CheckpointError, match="fc1.weight.*NaN or Inf"):
        hf_lmc.canonicalize(model)
    model.save_pretrained(tmp_path)
    lazy = hf_lmc.canonicalize(tmp_path)
    # (transformers 5 saves ViT under its 4.x key names: the error names the stored key)
    with pytest.raises(hf_lmc.CheckpointError, match="layer.1.*NaN or Inf"):
        lazy.state_dict()


def test_row_reads_are_slices_of_the_stored_tensor(tmp_path):
    """``SafetensorsFile.get_rows`` reads a row window (any dtype, 1-D and empty tensors, windows
    past the end) exactly as slicing the whole tensor would give it."""
    from hf_lmc.io.checkpoint import SafetensorsFile

    g = torch.Generator().manual_seed(0)
    tensors = {
        "bf16": torch.randn(13, 6, generator=g).to(torch.bfloat16),
        "f32": torch.randn(13, generator=g),
        "i64": torch.randint(-9, 9, (13, 2, 3), generator=g),
        "empty": torch.zeros(0, 4),
        "scalar": torch.tensor(2.5),
    }
    save_file(tensors, tmp_path / "t.safetensors")
    file = SafetensorsFile(tmp_path / "t.safetensors")
    for name, t in tensors.items():
        assert torch.equal(file.get_tensor(name), t) and file.get_tensor(name).dtype == t.dtype, name
        if t.dim():
            for rows in (slice(3, 7), slice(None, 5), slice(10, 40), slice(7, 3), slice(None)):
                got = file.get_rows(name, rows)
                assert got.dtype == t.dtype and torch.equal(got, t[rows]), (name, rows)
    with pytest.raises(ValueError, match="contiguous"):
        file.get_rows("f32", slice(0, 10, 2))


def test_row_reads_check_only_the_rows_they_read(tmp_path):
    """A vocabulary window is read on its own: a NaN outside it is not seen, one inside is named."""
    from hf_lmc.canonical.adapters import adapter_for

    model = build_model(TINY["gpt_neox"], dtype=torch.float32)
    with torch.no_grad():
        model.gpt_neox.embed_in.weight[10, 0] = float("nan")
    model.save_pretrained(tmp_path)
    checkpoint = Checkpoint(tmp_path, adapter_for(model.config))
    key = "gpt_neox.embed_in.weight"
    assert torch.equal(checkpoint.rows(key, slice(2, 9)), model.gpt_neox.embed_in.weight.detach()[2:9])
    with pytest.raises(hf_lmc.CheckpointError, match="embed_in.weight.*NaN or Inf"):
        checkpoint.rows(key, slice(9, 12))


def test_membership_reads_nothing(tmp_path, monkeypatch):
    """``key in checkpoint`` (adapters ask it of the head) looks at the index, not the tensor:
    Mapping's default ``__contains__`` would read and check the whole tensor."""
    from hf_lmc.canonical.adapters import adapter_for
    from hf_lmc.io.checkpoint import SafetensorsFile

    model = build_model(TINY["gpt_neox"], dtype=torch.float32)
    model.save_pretrained(tmp_path)
    checkpoint = Checkpoint(tmp_path, adapter_for(model.config))
    reads = []
    monkeypatch.setattr(SafetensorsFile, "get_rows", lambda self, name, rows: reads.append(name))
    assert "lm_head.weight" in checkpoint and "gpt_neox.embed_in.weight" in checkpoint
    assert "no.such.key" not in checkpoint and 3 not in checkpoint
    assert reads == []


# -- which files hold the weights: transformers' rule ----------------------------------------------


def _write_layout(folder, layout: str, model, other) -> None:
    """``folder`` as one of the mixed weight layouts: ``model``'s weights where transformers reads
    them, ``other``'s in a file beside them (or, for ``explicit``, the other way round: the file
    ``config.json`` names holds ``model``)."""
    folder.mkdir()
    model.config.save_pretrained(folder)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    others = {k: v.detach().clone().contiguous() for k, v in other.state_dict().items()}
    if layout == "safetensors+bin":  # both formats: the safetensors file wins
        model.save_pretrained(folder)
        torch.save(others, folder / "pytorch_model.bin")
    elif layout == "bin+stray":  # a stray safetensors file is no model's
        torch.save(weights, folder / "pytorch_model.bin")
        save_file(others, folder / "extra.safetensors")
    elif layout == "index+stray":
        model.save_pretrained(folder, max_shard_size="4KB")
        save_file(others, folder / "x.safetensors")
    elif layout == "single+index":  # model.safetensors comes before the index
        other.save_pretrained(folder, max_shard_size="4KB")
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / "model.safetensors", {"format": "pt"})
    elif layout == "explicit":  # config.json's transformers_weights comes first
        other.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in weights.items()}, folder / "chosen.safetensors", {"format": "pt"})
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"transformers_weights": "chosen.safetensors"}))


LAYOUTS = ["safetensors+bin", "bin+stray", "index+stray", "single+index", "explicit"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_weights_read_are_those_from_pretrained_reads(layout, tmp_path):
    """A folder with weights in several files: every tensor hf_lmc reads is the one transformers
    loads, and differs from the other file's (so a wrong pick fails)."""
    from hf_lmc.canonical.adapters import adapter_for

    model = build_model(TINY["gpt2"], seed=1, dtype=torch.float32)
    other = build_model(TINY["gpt2"], seed=2, dtype=torch.float32)
    _write_layout(tmp_path / "m", layout, model, other)
    loaded = tf.GPT2LMHeadModel.from_pretrained(tmp_path / "m").state_dict()
    with Checkpoint(tmp_path / "m", adapter_for(model.config), model.config) as checkpoint:
        assert set(checkpoint) <= set(loaded)
        for key in checkpoint:
            assert torch.equal(checkpoint[key], loaded[key]), key
            assert torch.equal(checkpoint[key], model.state_dict()[key]), key


def test_a_merge_of_a_folder_with_a_stray_file_is_the_model_transformers_loads(tmp_path):
    """``pytorch_model.bin`` beside a stray ``extra.safetensors``: the merge of the folder with a
    copy of it is the model in ``pytorch_model.bin`` (it was the stray file's, logits 1.19 off)."""
    model = build_model(TINY["gpt2"], seed=1, dtype=torch.float32)
    other = build_model(TINY["gpt2"], seed=2, dtype=torch.float32)
    _write_layout(tmp_path / "a", "bin+stray", model, other)
    _write_layout(tmp_path / "b", "bin+stray", model, other)
    out = hf_lmc.merge(tmp_path / "a", tmp_path / "b", tmp_path / "out", method="average", progress=False).output
    merged = tf.GPT2LMHeadModel.from_pretrained(out).eval()
    inputs = sample_inputs(model.config)
    assert relative_error(logits(merged, inputs), logits(model.eval(), inputs)) < 1e-5


def test_a_folder_of_stray_weights_alone_is_refused_as_transformers_refuses_it(tmp_path):
    """Only ``x.safetensors``: transformers loads nothing from it, and hf_lmc says so in one line
    naming the file it found."""
    model = build_model(TINY["gpt2"], dtype=torch.float32)
    model.config.save_pretrained(tmp_path)
    save_file(
        {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
        tmp_path / "x.safetensors",
    )
    with pytest.raises(OSError):
        tf.GPT2LMHeadModel.from_pretrained(tmp_path)
    with pytest.raises(hf_lmc.CheckpointError) as refused:
        hf_lmc.canonicalize(tmp_path)
    assert "x.safetensors" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_hub_download_fetches_the_files_the_rule_reads_and_no_other(layout, tmp_path, monkeypatch):
    """At the network boundary only: ``snapshot_download`` stands in for the Hub by copying the
    files of a repo folder that its patterns match. The snapshot holds every weight file the
    folder's rule reads, no other weight file, and reads as the repo does."""
    import fnmatch
    import shutil

    from hf_lmc.io import hub
    from hf_lmc.io.weights import weight_files

    model = build_model(TINY["gpt2"], seed=1, dtype=torch.float32)
    other = build_model(TINY["gpt2"], seed=2, dtype=torch.float32)
    repo = tmp_path / "repo"
    _write_layout(repo, layout, model, other)
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()

    def snapshot_download(repo_id, *, revision, allow_patterns, ignore_patterns):
        for file in repo.iterdir():
            wanted = any(fnmatch.fnmatch(file.name, p) for p in allow_patterns)
            if wanted and not any(fnmatch.fnmatch(file.name, p) for p in ignore_patterns):
                shutil.copy2(file, snapshot / file.name)
        return str(snapshot)

    monkeypatch.setattr(hub, "snapshot_download", snapshot_download)
    folder = hub.resolve_checkpoint("org/model")
    fetched = {p.name for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")}
    read = {p.name for p in weight_files(repo)}
    # model.safetensors comes with the config (one request), before config.json can name another file
    assert read <= fetched and fetched - read <= ({"model.safetensors"} if layout == "explicit" else set())
    assert {p.name for p in weight_files(folder)} == read
