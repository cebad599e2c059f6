"""Inputs are validated before use, and read once: each class of bad input is refused in one line
naming the file and the key, before any long work and without writing an output (issue 55).

Classes: a config key of the wrong type, or a config its transformers class refuses; a folder
that is not a model (empty, weights alone, a PEFT adapter); a weight index that is not a map of
file names; tensors missing, mis-shaped or not float; recipe YAML past its limits; evaluation
data that is not text or not a regular file, labelled for another model, or images of another
shape; an input replaced or rewritten while a merge reads it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_lmc.canonical.adapters import adapter_for
from hf_lmc.canonical.exactness import tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.recipe import RecipeError, load_recipe, parse_override
from hf_lmc.io.checkpoint import Checkpoint, SafetensorsFile
from hf_lmc.io.weights import CheckpointError
from tests.models import build_model, char_tokenizer_folder

TINY = tiny_configs()
#: Each family's config key for its number of layers.
LAYER_KEYS = {
    "gpt2": "n_layer",
    "gpt_neox": "num_hidden_layers",
    "llama": "num_hidden_layers",
    "vit": "num_hidden_layers",
}


def _saved(folder: Path, arch: str = "gpt2", seed: int = 0, **save) -> Path:
    build_model(TINY[arch], seed=seed, dtype=torch.float32).save_pretrained(folder, **save)
    return folder


def _refused(capsys, *names: str, argv: list[str], out: Path, code: int = 1) -> str:
    """Run ``argv``; it must fail with ``code`` and one stderr line naming every one of ``names``,
    leaving no output."""
    capsys.readouterr()
    assert main([*argv, "-o", str(out), "--device", "cpu", "--quiet"]) == code
    err = capsys.readouterr().err
    assert err.startswith("hf-lmc: error:") and err.count("\n") == 1, err
    for name in names:
        assert name in err, (name, err)
    assert not out.exists()
    return err


@pytest.mark.parametrize("arch", sorted(TINY))
@pytest.mark.parametrize("key", ["model_type", "layers"])
def test_a_config_key_of_the_wrong_type_is_refused_naming_the_file_and_the_key(arch, key, tmp_path, capsys):
    a, b = _saved(tmp_path / "a", arch), _saved(tmp_path / "b", arch, seed=1)
    config = json.loads((b / "config.json").read_text())
    key = LAYER_KEYS[arch] if key == "layers" else key
    config[key] = [arch] if key == "model_type" else str(config[key])  # a list; "2" for 2
    (b / "config.json").write_text(json.dumps(config))
    _refused(capsys, str(b / "config.json"), key, argv=["merge", str(a), str(b)], out=tmp_path / "out")


@pytest.mark.parametrize(
    ("arch", "changes", "key"),
    [
        ("gpt_neox", {"num_attention_heads": 3}, "divisible"),  # the config class's own check: 16 hidden, 3 heads
        ("gpt2", {"dtype": "int77", "torch_dtype": "int77"}, "int77"),  # a dtype torch does not have
    ],
)
def test_a_config_its_transformers_class_refuses_is_one_line_naming_the_file(arch, changes, key, tmp_path, capsys):
    a, b = _saved(tmp_path / "a", arch), _saved(tmp_path / "b", arch, seed=1)
    config = json.loads((b / "config.json").read_text())
    (b / "config.json").write_text(json.dumps(config | changes))
    _refused(capsys, str(b / "config.json"), key, argv=["merge", str(a), str(b)], out=tmp_path / "out")


@pytest.mark.parametrize("kind", ["empty", "weights only", "peft adapter", "not JSON", "config a folder"])
def test_a_folder_that_is_not_a_model_is_told_apart_in_one_line(kind, tmp_path, capsys):
    a, b = _saved(tmp_path / "a"), tmp_path / "b"
    b.mkdir()
    if kind == "weights only":
        shutil.copy(a / "model.safetensors", b)
    elif kind == "peft adapter":
        (b / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "base_model_name_or_path": str(a)}))
        save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(2, 8)}, b / "adapter_model.safetensors")
    elif kind == "not JSON":
        shutil.copy(a / "model.safetensors", b)
        (b / "config.json").write_bytes(os.urandom(64))
    elif kind == "config a folder":  # or a device, a FIFO, a dangling link: there is no file to read
        shutil.copy(a / "model.safetensors", b)
        (b / "config.json").mkdir()
    named = {
        "empty": str(b),
        "weights only": "config.json",
        "peft adapter": "adapter",
        "not JSON": str(b / "config.json"),
        "config a folder": str(b / "config.json"),
    }
    _refused(capsys, str(b), named[kind], argv=["merge", str(a), str(b)], out=tmp_path / "out")


@pytest.mark.parametrize(
    "weight_map",
    [["model-00001-of-00002.safetensors"], {"lm_head.weight": "../a/model.safetensors"}, {"x": 3}],
    ids=["a list", "a path outside", "a number"],
)
def test_a_weight_index_that_is_not_a_map_of_shard_file_names_is_refused(weight_map, tmp_path, capsys):
    a, b = _saved(tmp_path / "a"), _saved(tmp_path / "b", seed=1, max_shard_size="4KB")
    index = b / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _refused(capsys, str(index), "weight_map", argv=["merge", str(a), str(b)], out=tmp_path / "out")


KEY = "transformer.h.0.attn.c_attn.weight"  # GPT-2's fused QKV, stored (in, out) by Conv1D


@pytest.mark.parametrize("method", ["weight", "average"])
@pytest.mark.parametrize("damage", ["missing", "shape", "int8"])
def test_tensors_missing_misshaped_or_not_float_are_refused_before_any_work(damage, method, tmp_path, capsys):
    a, b = _saved(tmp_path / "a"), _saved(tmp_path / "b", seed=1)
    tensors = load_file(b / "model.safetensors")
    if damage == "missing":
        del tensors[KEY]
    elif damage == "shape":
        tensors[KEY] = tensors[KEY].T.contiguous()  # (out, in): a Linear's layout in a Conv1D model
    else:
        tensors[KEY] = tensors[KEY].to(torch.int8)
    save_file(tensors, b / "model.safetensors", metadata={"format": "pt"})
    named = str(b) if damage == "missing" else str(b / "model.safetensors")
    _refused(capsys, named, KEY, argv=["merge", str(a), str(b), "--method", method], out=tmp_path / "out")


BILLION_LAUGHS = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8)
)


@pytest.mark.parametrize(
    "text",
    [BILLION_LAUGHS, "models: " + "[" * 20_000 + "]" * 20_000, "models: &m [a, *m]\n", "output: " + "x" * 1_100_000],
    ids=["billion laughs", "nested 20000 deep", "cycle", "over 1 MB"],
)
def test_recipe_yaml_past_its_limits_is_refused_naming_the_file(text, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(text)
    with pytest.raises(RecipeError, match=str(recipe)) as refused:
        load_recipe(recipe)
    assert "\n" not in str(refused.value)
    if len(text) < 1_000_000:  # the same limits hold for --set values
        with pytest.raises(RecipeError, match="--set"):
            parse_override(f"zoo={text}")


@pytest.mark.parametrize(
    "data",
    [os.urandom(20_000), b"text\x00with a NUL", "caf\xe9 in Latin-1".encode("latin-1"), bytes(range(1, 9)) * 100],
    ids=["random bytes", "NUL", "Latin-1", "control characters"],
)
def test_evaluation_data_that_is_not_utf8_text_is_refused_naming_the_file(data, tmp_path, capsys):
    a, b = (_saved(tmp_path / name, seed=seed) for seed, name in enumerate("ab"))
    char_tokenizer_folder(a, TINY["gpt2"].vocab_size)
    text = tmp_path / "eval.txt"
    text.write_bytes(data)
    _refused(
        capsys,
        str(text),
        argv=["merge", str(a), str(b), "--eval-data", str(text), "--seq-len", "4"],
        out=tmp_path / "out",
    )


@pytest.mark.parametrize("kind", ["a FIFO", "a folder with a link to a device", "a folder with a folder named .txt"])
def test_evaluation_data_that_is_not_a_regular_file_is_refused_naming_it_unread(kind, tmp_path, capsys):
    a, b = (_saved(tmp_path / name, seed=seed) for seed, name in enumerate("ab"))
    char_tokenizer_folder(a, TINY["gpt2"].vocab_size)
    data = tmp_path / "texts"
    if kind == "a FIFO":  # read, it would block for ever
        data = tmp_path / "eval.txt"
        os.mkfifo(data)
        odd = data
    else:
        data.mkdir()
        (data / "a.txt").write_text("abc abc. " * 40)
        odd = data / "b.txt"
        if kind == "a folder with a folder named .txt":
            odd.mkdir()
        else:
            os.symlink(os.devnull, odd)  # a device: /dev/zero would be read until memory runs out
    _refused(
        capsys,
        str(odd),
        argv=["merge", str(a), str(b), "--eval-data", str(data), "--seq-len", "4"],
        out=tmp_path / "out",
    )


def test_image_labels_outside_the_models_classes_are_refused_naming_the_data_and_the_label(tmp_path, capsys):
    a, b = _saved(tmp_path / "a", "vit"), _saved(tmp_path / "b", "vit", seed=1)
    config = TINY["vit"]
    data = tmp_path / "images.pt"
    labels = torch.tensor([0, 1, config.num_labels])  # one past the classifier's last row
    torch.save(
        {"pixel_values": torch.randn(3, config.num_channels, config.image_size, config.image_size), "labels": labels},
        data,
    )
    _refused(
        capsys,
        str(data),
        str(config.num_labels),
        argv=["merge", str(a), str(b), "--eval-data", str(data)],
        out=tmp_path / "out",
    )


_IMAGE = (TINY["vit"].num_channels, TINY["vit"].image_size, TINY["vit"].image_size)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"pixel_values": torch.randn(4, _IMAGE[0], 16, 16), "labels": torch.zeros(4, dtype=torch.long)}, "16"),
        ({"pixel_values": torch.randn(4, 1, *_IMAGE[1:]), "labels": torch.zeros(4, dtype=torch.long)}, "[4, 1"),
        ({"pixel_values": torch.randn(4, *_IMAGE[1:]), "labels": torch.zeros(4, dtype=torch.long)}, "[4, 8, 8]"),
        ({"pixel_values": torch.randn(4, *_IMAGE), "labels": torch.zeros(3, dtype=torch.long)}, "labels"),
        ({"pixel_values": torch.randn(0, *_IMAGE), "labels": torch.zeros(0, dtype=torch.long)}, "no images"),
        ([torch.randn(4, *_IMAGE)], "list"),
    ],
)
def test_image_data_the_model_cannot_take_is_refused_naming_the_data(data, named, tmp_path, capsys):
    a, b = _saved(tmp_path / "a", "vit"), _saved(tmp_path / "b", "vit", seed=1)
    images = tmp_path / "images.pt"
    torch.save(data, images)
    _refused(
        capsys, str(images), named, argv=["merge", str(a), str(b), "--eval-data", str(images)], out=tmp_path / "out"
    )


@pytest.mark.parametrize("change", ["replaced", "rewritten in place"])
def test_an_input_changed_while_it_is_read_is_detected_and_never_mixed(change, tmp_path):
    a, b = _saved(tmp_path / "a"), _saved(tmp_path / "b", seed=1)
    file = a / "model.safetensors"
    before = load_file(file)
    with Checkpoint(a, adapter_for(TINY["gpt2"])) as checkpoint:
        checkpoint.verify_unchanged()
        if change == "replaced":
            os.replace(shutil.copy(b / "model.safetensors", tmp_path / "b.safetensors"), file)
            torch.testing.assert_close(checkpoint[KEY], before[KEY], rtol=0, atol=0)  # still the file as opened
        else:
            with open(file, "r+b") as f:
                f.seek(-4, os.SEEK_END)
                f.write(b"\x00\x00\x80\x7f")
        with pytest.raises(CheckpointError, match="changed while it was read"):
            checkpoint.verify_unchanged()


@pytest.mark.parametrize("method", ["weight", "average"])
def test_a_merge_whose_input_is_replaced_midway_fails_and_writes_nothing(method, tmp_path, capsys, monkeypatch):
    a, b = _saved(tmp_path / "a"), _saved(tmp_path / "b", seed=1)
    spare = shutil.copy(b / "model.safetensors", tmp_path / "other.safetensors")
    original = SafetensorsFile.get_rows

    def replace_on_first_read(self, name, rows):
        if os.path.exists(spare):
            os.replace(spare, a / "model.safetensors")  # another model's weights under A's name
        return original(self, name, rows)

    monkeypatch.setattr(SafetensorsFile, "get_rows", replace_on_first_read)
    _refused(
        capsys, str(a / "model.safetensors"), argv=["merge", str(a), str(b), "--method", method], out=tmp_path / "out"
    )
