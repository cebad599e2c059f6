"""``hf-lmc align``: every model of a merge written as a stock checkpoint in the merge's
coordinates, nothing interpolated, for mergekit to merge.

On tiny models: each folder loads with the stock auto class and computes its model's function,
the folders' plain average is ``hf-lmc merge``'s merge, and the output keeps the protocol every
output keeps (refused when it exists, replaced only when hf-lmc wrote it, nothing left by a
failure). On the shipped zoo pair, with the real ``mergekit`` package: its linear merge of A and
aligned B is hf-lmc's weight-matching merge to float rounding, its SLERP of A and aligned B has a
far lower barrier than its SLERP of A and B, and every configuration docs/mergekit.md prints runs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_lmc
from hf_lmc.canonical.exactness import relative_error, sample_inputs, tiny_configs
from hf_lmc.cli import main
from hf_lmc.config.options import OutputExistsError, ParameterError
from hf_lmc.io.outputs import MARKER, read_marker
from hf_lmc.merging.aligned import member_folders
from hf_lmc.symmetry.stored import read_manifest
from tests.models import build_model, char_tokenizer_folder

ROOT = Path(__file__).resolve().parents[1]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder's weight files (not the transforms beside them)."""
    tensors = {}
    for path in sorted(folder.glob("model*.safetensors")):
        tensors |= load_file(path)
    return tensors


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny GPT-2s of different seeds, with a tokenizer each, as folders ``a`` and ``b``."""
    root = tmp_path_factory.mktemp("tiny")
    config = tiny_configs()["gpt2"]
    for seed, name in ((1, "a"), (2, "b")):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(root / name)
        char_tokenizer_folder(root / name, config.vocab_size)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def tiny_aligned(tiny_pair, tmp_path_factory) -> Path:
    """The tiny pair aligned by weight matching."""
    output = tmp_path_factory.mktemp("aligned") / "aligned"
    result = hf_lmc.align_models(tiny_pair, output, progress=False)
    assert result.output == output and [f.name for f in result.folders] == ["a", "b"]
    return output


def test_each_folder_is_a_stock_checkpoint_computing_its_models_function(tiny_pair, tiny_aligned):
    inputs = sample_inputs(tiny_configs()["gpt2"])
    for source in tiny_pair:
        written = tiny_aligned / source.name
        assert (written / "config.json").is_file() and (written / "model.safetensors").is_file()
        assert (written / "tokenizer.json").is_file() and (written / "generation_config.json").is_file()
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64)(**inputs).logits
            got = AutoModelForCausalLM.from_pretrained(written, dtype=torch.float64)(**inputs).logits
        assert relative_error(got, expected) < 1e-5, source.name  # float32 weights, one rounding
    a, b = weights(tiny_aligned / "a"), weights(tiny_aligned / "b")
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)  # one form, as mergekit needs
    assert not torch.equal(
        b["transformer.h.0.mlp.c_fc.weight"], weights(tiny_pair[1])["transformer.h.0.mlp.c_fc.weight"]
    )


def test_the_folders_plain_average_is_the_merge(tiny_pair, tiny_aligned, tmp_path):
    hf_lmc.merge(*tiny_pair, tmp_path / "merged", progress=False)
    merged = weights(tmp_path / "merged")
    a, b = weights(tiny_aligned / "a"), weights(tiny_aligned / "b")
    assert merged.keys() == a.keys()
    worst = max(float((merged[k] - (a[k] + b[k]) / 2).abs().max()) for k in merged)
    assert worst < 1e-6, worst


def test_three_models_of_another_family_average_to_their_merge_and_keep_their_functions(tmp_path):
    config, names = tiny_configs()["llama"], ("a", "b", "c")
    for seed, name in enumerate(names, start=1):
        build_model(config, seed=seed, dtype=torch.float32).save_pretrained(tmp_path / name)
        char_tokenizer_folder(tmp_path / name, config.vocab_size)
    models = [tmp_path / name for name in names]
    result = hf_lmc.align_models(models, tmp_path / "aligned", progress=False)  # universe matching
    hf_lmc.merge_models(models, tmp_path / "merged", progress=False)
    merged, written = weights(tmp_path / "merged"), [weights(folder) for folder in result.folders]
    assert max(float((merged[k] - sum(w[k] for w in written) / 3).abs().max()) for k in merged) < 1e-6
    inputs = sample_inputs(config)
    for source, folder in zip(models, result.folders):
        with torch.no_grad():
            expected = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float64)(**inputs).logits
            got = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)(**inputs).logits
        assert relative_error(got, expected) < 1e-5, source.name


def test_cards_markers_and_transforms_say_what_moved_each_model(tiny_pair, tiny_aligned, tmp_path):
    assert read_marker(tiny_aligned)["kind"] == "aligned"
    top = read_manifest(tiny_aligned / "transforms.safetensors")
    assert [m.name for m in top.models] == ["a", "b"] and top.fitted["method"] == "weight"
    for k, name in enumerate(("a", "b")):
        folder = tiny_aligned / name
        assert (folder / "transforms.safetensors").read_bytes() == (
            tiny_aligned / "transforms.safetensors"
        ).read_bytes()
        assert (folder / "transforms.json").is_file()
        marker = read_marker(folder)
        assert marker["kind"] == "moved" and marker["moved_by"]["member"] == k
        card = ModelCard.load(folder / "README.md")
        assert "aligned" in card.data.tags and card.data.base_model is None  # local models: named in the body only
        assert "transforms.safetensors" in card.text and "`weight`" in card.text
    # the folders are moved already: apply refuses to move one again, and the transforms at the top move B as align did
    assert main(["apply", str(tiny_aligned), str(tiny_aligned / "b"), "-o", str(tmp_path / "again"), "-q"]) == 1
    assert main(["apply", str(tiny_aligned), str(tiny_pair[1]), "-o", str(tmp_path / "b-moved"), "-q"]) == 0
    moved, aligned = weights(tmp_path / "b-moved"), weights(tiny_aligned / "b")
    assert max(float((moved[k] - aligned[k]).abs().max()) for k in aligned) < 1e-5


def test_an_existing_output_is_refused_replaced_only_when_align_wrote_it(tiny_pair, tmp_path, capsys):
    output = tmp_path / "out"
    output.mkdir()
    (output / "notes.txt").write_text("mine")
    argv = ["align", *map(str, tiny_pair), "-o", str(output), "-q"]
    assert main(argv) == 2 and "already exists" in capsys.readouterr().err
    assert main([*argv, "--overwrite"]) == 2 and "notes.txt" in capsys.readouterr().err
    assert (output / "notes.txt").read_text() == "mine"
    (output / "notes.txt").unlink()
    output.rmdir()
    assert main(argv) == 0
    assert main([*argv, "--overwrite"]) == 0  # a folder align wrote
    assert sorted(p.name for p in output.iterdir() if not p.name.startswith(".")) == [
        "a",
        "b",
        "transforms.json",
        "transforms.safetensors",
    ]


def test_a_failure_while_writing_leaves_nothing(tiny_pair, tmp_path, monkeypatch):
    from hf_lmc.merging import aligned

    real, calls = aligned.aligned_card, []

    def failing(**fields):
        calls.append(fields["member"])
        if fields["member"] == 1:  # the first folder is written by then
            raise OSError("disk full")
        return real(**fields)

    monkeypatch.setattr(aligned, "aligned_card", failing)
    with pytest.raises(OSError, match="disk full"):
        hf_lmc.align_models(tiny_pair, tmp_path / "out", progress=False)
    assert calls == [0, 1] and os.listdir(tmp_path) == []  # no output, no staging folder


@pytest.mark.parametrize(
    ("settings", "named"),
    [({"method": "average"}, "method"), ({"weights": [0.3, 0.7]}, "weights"), ({"eval_data": "x.txt"}, "eval_data")],
)
def test_what_align_cannot_take_is_refused_before_any_work(tiny_pair, tmp_path, settings, named):
    with pytest.raises(ParameterError) as refused:
        hf_lmc.align_models(tiny_pair, tmp_path / "out", progress=False, **settings)
    assert refused.value.parameter == named and not (tmp_path / "out").exists()
    with pytest.raises(OutputExistsError):
        hf_lmc.align_models(tiny_pair, tiny_pair[0].parent, progress=False)


def test_folders_are_named_after_the_models_or_numbered_where_names_clash():
    assert member_folders(["./runs/a", "org/model-b@v2", "c/"]) == ["a", "model-b", "c"]
    assert member_folders(["x/model", "y/model"]) == ["model-1", "model-2"]
    assert member_folders(["x/Model", "y/model"]) == ["model-1", "model-2"]  # one folder on a case-blind disk
    assert member_folders(["a", "b"], ["first", "second"]) == ["first", "second"]
    assert member_folders(["a", "transforms.json"]) == ["model-1", "model-2"]  # the transforms' own names
    assert member_folders(["a", "my model"]) == ["model-1", "model-2"]  # not a plain name


# -- with mergekit, on the shipped zoo pair -----------------------------------------------------


def run_mergekit(config: dict, output: Path) -> Path:
    """mergekit's own merge of ``config`` (a mergekit YAML as a dict) into ``output``."""
    from mergekit.config import MergeConfiguration
    from mergekit.merge import MergeOptions, run_merge

    run_merge(MergeConfiguration.model_validate(config), str(output), MergeOptions(quiet=True))
    return output


@pytest.fixture(scope="module")
def zoo_aligned(tmp_path_factory):
    """The shipped gpt2 zoo pair (independent trainings) as ``model-a`` and ``model-b``, aligned by
    ``hf-lmc align`` with weight matching, and its held-out batches."""
    from hf_lmc.config.options import EvalOptions
    from hf_lmc.evaluation.batches import load_batches
    from hf_lmc.io import zoo
    from hf_lmc.io.loading import load_model

    root = tmp_path_factory.mktemp("zoo")
    pair = zoo.pair("gpt2", cache=root / "cache", progress=False)
    for folder, name in zip(pair, ("model-a", "model-b")):
        shutil.copytree(folder, root / name)
    assert main(["align", str(root / "model-a"), str(root / "model-b"), "-o", str(root / "aligned"), "-q"]) == 0
    config = load_model(root / "model-a").model.config
    batches = load_batches(zoo.held_out("gpt2", size=8192), config, root / "model-a", EvalOptions(batch_size=8))
    return root, batches


def loss(folder: Path, batches) -> float:
    from hf_lmc.evaluation.loss import evaluate

    return evaluate(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), batches).loss


@pytest.mark.slow
def test_mergekit_linear_of_the_aligned_pair_is_hf_lmcs_merge(zoo_aligned):
    root, batches = zoo_aligned
    aligned = root / "aligned"
    linear = {
        "merge_method": "linear",
        "dtype": "float32",
        "models": [{"model": str(aligned / n), "parameters": {"weight": 0.5}} for n in ("model-a", "model-b")],
    }
    merged = weights(run_mergekit(linear, root / "mergekit-linear"))
    assert main(["merge", str(root / "model-a"), str(root / "model-b"), "-o", str(root / "hf-lmc"), "-q"]) == 0
    ours = weights(root / "hf-lmc")
    assert merged.keys() == ours.keys()
    worst = max(float((merged[k] - ours[k]).abs().max()) for k in ours)
    largest = max(float(t.abs().max()) for t in ours.values())
    print(f"mergekit linear vs hf-lmc merge: max |diff| {worst:.3g} (largest weight {largest:.3g})")
    assert worst <= 1e-6 * largest  # float32 rounding of two roundings
    assert abs(loss(root / "mergekit-linear", batches) - loss(root / "hf-lmc", batches)) < 1e-5


@pytest.mark.slow
def test_mergekit_slerp_of_the_aligned_pair_has_a_lower_barrier(zoo_aligned):
    root, batches = zoo_aligned
    barriers = {}
    for name, folder in (("stored", root), ("aligned", root / "aligned")):
        a, b = folder / "model-a", folder / "model-b"
        slerp = {
            "merge_method": "slerp",
            "base_model": str(a),
            "dtype": "float32",
            "parameters": {"t": 0.5},
            "models": [{"model": str(a)}, {"model": str(b)}],
        }
        middle = run_mergekit(slerp, root / f"slerp-{name}")
        barriers[name] = loss(middle, batches) - (loss(a, batches) + loss(b, batches)) / 2
    print(f"mergekit SLERP barrier (nats): A and B {barriers['stored']:.3f}, A and aligned B {barriers['aligned']:.3f}")
    assert barriers["aligned"] < barriers["stored"] / 2


@pytest.mark.slow
def test_every_mergekit_configuration_in_the_docs_runs_as_printed(zoo_aligned, monkeypatch):
    root, _ = zoo_aligned
    text = (ROOT / "docs" / "mergekit.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```yaml\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert blocks
    monkeypatch.chdir(root)  # the docs' folders: ./model-a, ./model-b, ./aligned
    for k, block in enumerate(blocks):
        output = run_mergekit(yaml.safe_load(block), root / f"docs-{k}")
        assert AutoModelForCausalLM.from_pretrained(output).config.model_type == "gpt2"
    commands = re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    assert any("hf-lmc align ./model-a ./model-b -o aligned" in c for c in commands)  # what the fixture ran
    assert any("mergekit-yaml" in c for c in commands)


@pytest.mark.slow
def test_mergekit_yaml_runs_on_the_aligned_folders(zoo_aligned, tmp_path):
    """The command line of the docs, ``mergekit-yaml CONFIG OUT``, as a user runs it."""
    root, _ = zoo_aligned
    config = tmp_path / "linear.yml"
    config.write_text(
        json.dumps(
            {
                "merge_method": "linear",
                "dtype": "float32",
                "models": [
                    {"model": str(root / "aligned" / n), "parameters": {"weight": 0.5}} for n in ("model-a", "model-b")
                ],
            }
        )
    )
    mergekit_yaml = Path(sys.executable).with_name("mergekit-yaml")
    command = [str(mergekit_yaml)] if mergekit_yaml.exists() else ["mergekit-yaml"]
    run = subprocess.run([*command, str(config), str(tmp_path / "out")], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").is_file() and not (tmp_path / "out" / MARKER).exists()
